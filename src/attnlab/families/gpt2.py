"""GPT-2: read for the cost model (learned positions, LayerNorm, tanh-GELU MLP, biases everywhere, the LM head tied
to the token table). attnlab does not load its weights (no rotary embeddings)."""

from __future__ import annotations

from ..config import AttentionConfig, ModelConfig
from .base import Family, Fields, check_heads


def read(f: Fields) -> ModelConfig:
    d, n_heads = f.int("n_embd"), f.int("n_head")
    check_heads(f, d, n_heads, n_heads, None, "n_head")
    n_positions = f.int("n_positions")
    inner = f.opt_int("n_inner")
    return ModelConfig(
        vocab_size=f.int("vocab_size"),
        n_layers=f.layers("n_layer"),
        attention=AttentionConfig(d_model=d, n_heads=n_heads, bias=True, rope=False),
        ffn_dim=inner or 4 * d,
        max_seq_len=n_positions,
        norm_eps=f.eps("layer_norm_epsilon", 1e-5),
        mlp="gelu_tanh",
        mlp_bias=True,
        tie_embeddings=f.bool("tie_word_embeddings", True),
        norm="layernorm",
        n_positions=n_positions,
    )


GPT2 = Family(
    "gpt2",
    ("gpt2",),
    read,
    gqa=None,
    covers="GPT-2 (for the cost model)",
    example=dict(model_type="gpt2", vocab_size=320, n_positions=64, n_embd=48, n_layer=2, n_head=6),
)
