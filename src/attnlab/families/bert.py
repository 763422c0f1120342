"""BERT encoders: read for the cost model; loaded into ``attnlab.hf.bert.BertEncoder`` (post-norm LayerNorm blocks,
learned positions: not the decoder of ``attnlab.model``) and converted to fewer KV heads, written in the MHA layout
with each KV head repeated for its group (``BertModel`` has no GQA; that checkpoint computes the GQA model exactly).

Tensor names (N = layer index; a BertFor... checkpoint puts "bert." before each):

    embeddings.{word,position,token_type}_embeddings    {word,position,token_type}_embeddings
    embeddings.LayerNorm                                embeddings_norm
    encoder.layer.N.attention.self.{query,key,value}    layers.N.attention.{wq,wk,wv}     (.weight, .bias)
    encoder.layer.N.attention.output.dense              layers.N.attention.wo
    encoder.layer.N.attention.output.LayerNorm          layers.N.attention_norm
    encoder.layer.N.intermediate.dense / output.dense   layers.N.ffn_in / ffn_out
    encoder.layer.N.output.LayerNorm                    layers.N.ffn_norm
    pooler.dense                                        (not the encoder's: carried along as it is)
"""

from __future__ import annotations

from ..config import AttentionConfig, ModelConfig
from .base import Family, Fields, Rule, TensorMap, check_heads

_LAYER = (
    ("attention.self.query", "attention.wq"),
    ("attention.self.key", "attention.wk"),
    ("attention.self.value", "attention.wv"),
    ("attention.output.dense", "attention.wo"),
    ("attention.output.LayerNorm", "attention_norm"),
    ("intermediate.dense", "ffn_in"),
    ("output.dense", "ffn_out"),
    ("output.LayerNorm", "ffn_norm"),
)
_TOP = (
    ("embeddings.word_embeddings", "word_embeddings"),
    ("embeddings.position_embeddings", "position_embeddings"),
    ("embeddings.token_type_embeddings", "token_type_embeddings"),
    ("embeddings.LayerNorm", "embeddings_norm"),
)
TENSORS = TensorMap(
    tuple(
        Rule(f"encoder.layer.{{i}}.{theirs}.{{p}}", (f"layers.{{i}}.{ours}.{{p}}",))
        for theirs, ours in _LAYER
    )
    + tuple(Rule(f"{theirs}.{{p}}", (f"{ours}.{{p}}",)) for theirs, ours in _TOP),
    "BERT",
    # the pooler (BertModel's, not the encoder's) and the index buffers BertModel recomputes
    ignored=(r"^pooler\.", r"(^|\.)position_ids$", r"(^|\.)token_type_ids$"),
    prefix="bert.",
)


def read(f: Fields) -> ModelConfig:
    """BERT encoder (BertModel with its pooler; no MLM head, hence ``tie_embeddings``)."""
    d, n_heads = f.int("hidden_size"), f.int("num_attention_heads")
    check_heads(f, d, n_heads, n_heads, None, "num_attention_heads")
    if f.raw.get("position_embedding_type", "absolute") != "absolute":
        f.unsupported("position_embedding_type", "only 'absolute'")
    n_positions = f.int("max_position_embeddings")
    return ModelConfig(
        vocab_size=f.int("vocab_size"),
        n_layers=f.layers("num_hidden_layers"),
        attention=AttentionConfig(d_model=d, n_heads=n_heads, bias=True, rope=False),
        ffn_dim=f.int("intermediate_size"),
        max_seq_len=n_positions,
        norm_eps=f.eps("layer_norm_eps", 1e-12),
        mlp="gelu",
        mlp_bias=True,
        tie_embeddings=True,
        norm="layernorm",
        n_positions=n_positions,
        n_token_types=f.int("type_vocab_size", 2),
        pooler=True,
    )


BERT = Family(
    "bert",
    ("bert",),
    read,
    tensors=TENSORS,
    architectures={"bert": "BertModel"},
    gqa="repeated",
    causal_lm=False,
    covers="BERT encoders (all-MiniLM-L6-v2, bert-base): converted to fewer KV heads, written in the MHA layout",
    example=dict(
        model_type="bert",
        vocab_size=320,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=6,
        intermediate_size=80,
        max_position_embeddings=64,
        type_vocab_size=2,
    ),
)
