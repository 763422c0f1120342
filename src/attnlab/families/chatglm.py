"""ChatGLM2 and ChatGLM3 checkpoints in THUDM's own layout (``model_type: chatglm``, the remote code
``modeling_chatglm.py``; transformers has no class for them).

The model is GLM's (``attnlab.families.glm``; transformers' ``convert_glm_weights_to_hf.py`` turns these checkpoints
into ``GlmForCausalLM`` ones): RMSNorm, SwiGLU with [gate; up] fused in ``dense_h_to_4h``, RoPE on the first half of
each head in interleaved pairs (2i, 2i + 1) at theta ``10000 * rope_ratio`` (ChatGLM3-6B-32k: 50), and a separate
output layer. Fields:

- ``multi_query_attention`` with ``multi_query_group_num`` KV heads (else MHA), each ``kv_channels`` wide.
  ``query_key_value`` holds [q; k; v] stacked (``QKV_CONCAT``) with multi-query attention, and head by head
  [q_0; k_0; v_0; q_1; ...] (``QKV_PER_HEAD``) without it, as THUDM's ``SelfAttention`` splits it.
- ``add_qkv_bias`` puts a bias on ``query_key_value``; ``add_bias_linear`` on every linear layer (the fused QKV too,
  ``dense`` and both MLP layers).
- ``apply_query_key_layer_scaling`` and ``attention_softmax_in_fp32`` only change where float16 rounds (the scores are
  divided by the layer number, then multiplied back in float32): accepted, the same softmax; dropouts are for training.

Refused, each naming its field: a LayerNorm ChatGLM (``rmsnorm`` false), residuals taken after the norm
(``apply_residual_connection_post_layernorm``), no final norm (``post_layer_norm`` false), prefix tuning
(``pre_seq_len``), a RoPE other than the original (``original_rope`` false: THUDM's code ignores the flag, but ports
that read it compute another), the first ChatGLM-6B (``position_encoding_2d``); and on loading, a float32 residual
stream (``fp32_residual_connection``) and weights quantized on load (``quantization_bit``). Missing fields take
``ChatGLMConfig``'s defaults (``kv_channels`` 128, ``seq_length`` 2048, ``layernorm_epsilon`` 1e-5, MHA).

Tensor names (N = layer index; ``transformer.rotary_pos_emb.inv_freq``, a buffer THUDM's forward never reads, is
skipped on loading and copied as it is on conversion):

    transformer.embedding.word_embeddings                      tok_embeddings
    transformer.encoder.layers.N.input_layernorm                layers.N.attention_norm
    transformer.encoder.layers.N.self_attention.query_key_value layers.N.attention.{wq,wk,wv}  (QKV_*)
    transformer.encoder.layers.N.self_attention.dense           layers.N.attention.wo
    transformer.encoder.layers.N.post_attention_layernorm       layers.N.ffn_norm
    transformer.encoder.layers.N.mlp.dense_h_to_4h              layers.N.feed_forward.{w1,w3}  (GATE_UP_CONCAT)
    transformer.encoder.layers.N.mlp.dense_4h_to_h              layers.N.feed_forward.w2
    transformer.encoder.final_layernorm / transformer.output_layer   norm / output

MLA (``mla``): approximate, as GLM (``glm.mla``); refused, each named, with a query bias (``add_qkv_bias``: chatglm2-6b
and chatglm3-6b have one) or ``add_bias_linear`` (biases on the MLP too).
"""

from __future__ import annotations

from typing import Any

from ..config import AttentionConfig, ModelConfig
from . import glm
from .base import (
    GATE_UP_CONCAT,
    QKV_CONCAT,
    QKV_PER_HEAD,
    Family,
    Fields,
    MLASupport,
    Rule,
    TensorMap,
    Transform,
    check_heads,
    put,
    rotary_layout_note,
)

BASE_THETA = 10000.0  # THUDM's RotaryEmbedding base, multiplied by rope_ratio
# ChatGLMConfig defaults
DEFAULT_KV_CHANNELS = 128
DEFAULT_SEQ_LENGTH = 2048
DEFAULT_EPS = 1e-5
ARCHITECTURE = (
    "ChatGLMModel"  # the class THUDM's config.json files name (its remote code; transformers has none)
)


def _rules(qkv: Transform) -> tuple[Rule, ...]:
    layer = "transformer.encoder.layers.{i}."
    renames = [
        ("input_layernorm", "attention_norm"),
        ("self_attention.dense", "attention.wo"),
        ("post_attention_layernorm", "ffn_norm"),
        ("mlp.dense_4h_to_h", "feed_forward.w2"),
    ]
    rules = [Rule(f"{layer}{theirs}.{{p}}", (f"layers.{{i}}.{ours}.{{p}}",)) for theirs, ours in renames]
    rules += [
        Rule(
            f"{layer}self_attention.query_key_value.{{p}}",
            tuple(f"layers.{{i}}.attention.{w}.{{p}}" for w in ("wq", "wk", "wv")),
            qkv,
        ),
        Rule(
            f"{layer}mlp.dense_h_to_4h.{{p}}",
            ("layers.{i}.feed_forward.w1.{p}", "layers.{i}.feed_forward.w3.{p}"),
            GATE_UP_CONCAT,
        ),
        Rule("transformer.embedding.word_embeddings.{p}", ("tok_embeddings.{p}",)),
        Rule("transformer.encoder.final_layernorm.{p}", ("norm.{p}",)),
        Rule("transformer.output_layer.{p}", ("output.{p}",)),
    ]
    return tuple(rules)


_IGNORED = (r"^transformer\.rotary_pos_emb\.inv_freq$",)
MULTI_QUERY_TENSORS = TensorMap(_rules(QKV_CONCAT), "ChatGLM", _IGNORED)
MHA_TENSORS = TensorMap(_rules(QKV_PER_HEAD), "ChatGLM", _IGNORED)


def tensors(hf: dict[str, Any]) -> TensorMap:
    """The tensor map of a ChatGLM checkpoint: the fused QKV's layout follows ``multi_query_attention``."""
    return MULTI_QUERY_TENSORS if hf.get("multi_query_attention", False) else MHA_TENSORS


def read(f: Fields) -> ModelConfig:
    """A ChatGLM2/3 config.json."""
    if "position_encoding_2d" in f.raw:
        f.unsupported("position_encoding_2d", "the first ChatGLM-6B: 2D positions, LayerNorm, GELU")
    if not f.bool("rmsnorm", True):
        f.unsupported("rmsnorm", "a LayerNorm ChatGLM")
    if f.bool("apply_residual_connection_post_layernorm", False):
        f.unsupported("apply_residual_connection_post_layernorm", "residuals taken after the norm")
    if not f.bool("post_layer_norm", True):
        f.unsupported("post_layer_norm", "a ChatGLM without its final norm")
    if not f.bool("original_rope", True):
        f.unsupported("original_rope", "attnlab computes THUDM's original rotary embedding only")
    if f.raw.get("pre_seq_len") is not None:
        f.unsupported("pre_seq_len", "prefix tuning: learned keys and values before every sequence")
    d, n_heads = f.int("hidden_size"), f.int("num_attention_heads")
    n_kv = f.int("multi_query_group_num", 1) if f.bool("multi_query_attention", False) else n_heads
    head_dim = f.int("kv_channels", DEFAULT_KV_CHANNELS)
    check_heads(f, d, n_heads, n_kv, head_dim, "multi_query_group_num", "kv_channels")
    if head_dim % 4:
        f.fail(f"kv_channels={head_dim} must be a multiple of 4: RoPE turns its first half in pairs")
    ratio = f.float("rope_ratio", 1)
    if ratio <= 0:
        f.fail(f"rope_ratio={ratio} must be > 0")
    linear_bias = f.bool("add_bias_linear", False)
    attention = AttentionConfig(
        d_model=d,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        bias=f.bool("add_qkv_bias", False) or linear_bias,  # THUDM: bias=add_bias_linear or add_qkv_bias
        out_bias=linear_bias,
        rope_theta=BASE_THETA * ratio,
        rope_dim=head_dim // 2,
        rope_interleaved=True,
    )
    return ModelConfig(
        vocab_size=f.int("padded_vocab_size"),
        n_layers=f.layers("num_layers"),
        attention=attention,
        ffn_dim=f.int("ffn_hidden_size"),
        max_seq_len=f.int("seq_length", DEFAULT_SEQ_LENGTH),
        norm_eps=f.eps("layernorm_epsilon", DEFAULT_EPS),
        mlp_bias=linear_bias,
        tie_embeddings=False,  # THUDM's class has no output embeddings to tie: output_layer is its own
    )


def check_load(f: Fields) -> None:
    """What the cost model reads but attnlab.model does not compute."""
    if f.bool("fp32_residual_connection", False):
        f.unsupported("fp32_residual_connection", "a float32 residual stream beside lower-precision weights")
    if f.int("quantization_bit", 0, minimum=0):
        f.unsupported("quantization_bit", "weights quantized when loaded")


def _unwritable(cfg: ModelConfig) -> str | None:
    """What of ``cfg`` a ChatGLM checkpoint cannot say, or None."""
    attn = cfg.attention
    if not isinstance(attn, AttentionConfig):
        return "only GQA/MHA/MQA attention"
    if cfg.sliding is not None or attn.window is not None:
        return "no sliding window"
    if (
        not (attn.rope and attn.rope_interleaved and attn.rotary_dim == attn.head_dim // 2)
        or attn.rope_scaling
    ):
        return "plain RoPE on the first half of each head in interleaved pairs only"
    if attn.has_out_bias != cfg.mlp_bias or (cfg.mlp_bias and not attn.bias):
        return "add_bias_linear: a bias on dense, the MLP and query_key_value together, or on none"
    if attn.qk_norm != "none" or attn.scale is not None or attn.softcap is not None:
        return "no q/k norm, softmax scale or soft-capping"
    if cfg.mlp != "swiglu" or cfg.norm != "rmsnorm" or cfg.norm_offset or cfg.norm_placement != "pre":
        return "a SwiGLU MLP and pre-RMSNorms with gain w only"
    if cfg.parallel_residual or cfg.embed_scale != 1.0 or cfg.final_softcap is not None or cfg.tie_embeddings:
        return "sequential residuals, no embedding scale, soft-capping or tied embeddings"
    return None


def write(cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
    """The config.json of ``cfg`` as a ChatGLM checkpoint, changed from ``base`` only where ``cfg`` differs from it.
    Fewer KV heads than query heads turn ``multi_query_attention`` on (and the fused QKV's layout with it)."""
    why = _unwritable(cfg)
    if why is not None:
        raise ValueError(f"a chatglm checkpoint has {why}")
    attn = cfg.attention
    hf = dict(base, model_type="chatglm")
    # THUDM's config.json files name their class (chatglm2/3-6b, glm-4-9b-chat: ChatGLMModel); llama.cpp's converter
    # picks its converter by architectures[0] alone (conversion/base.py, get_model_architecture: "Failed to detect
    # model architecture" without it). A source's own name is kept.
    hf.setdefault("architectures", [ARCHITECTURE])
    put(hf, "hidden_size", attn.d_model)
    put(hf, "num_attention_heads", attn.n_heads)
    put(hf, "kv_channels", attn.head_dim, DEFAULT_KV_CHANNELS)
    multi_query = bool(hf.get("multi_query_attention", False)) or attn.n_kv_heads != attn.n_heads
    put(hf, "multi_query_attention", multi_query, False)
    if multi_query:
        put(hf, "multi_query_group_num", attn.n_kv_heads, 1)
    put(hf, "num_layers", cfg.n_layers)
    put(hf, "ffn_hidden_size", cfg.ffn_dim)
    put(hf, "padded_vocab_size", cfg.vocab_size)
    if "vocab_size" in hf:  # ChatGLMConfig copies padded_vocab_size there; some config.json files keep it
        put(hf, "vocab_size", cfg.vocab_size)
    put(hf, "seq_length", cfg.max_seq_len, DEFAULT_SEQ_LENGTH)
    put(hf, "layernorm_epsilon", cfg.norm_eps, DEFAULT_EPS)
    put(hf, "add_bias_linear", cfg.mlp_bias, False)
    if not cfg.mlp_bias:  # (with add_bias_linear the fused QKV has its bias whatever add_qkv_bias says)
        put(hf, "add_qkv_bias", attn.bias, False)
    put(hf, "rope_ratio", attn.rope_theta / BASE_THETA, 1)
    return hf


def mla(cfg: ModelConfig) -> MLASupport:
    """What ``convert --to mla`` makes of a ChatGLM model: GLM's attention (``glm.mla``), with THUDM's field names
    for the biases that refuse it."""
    attn, obstacles = cfg.attention, []
    if attn.bias:
        field = "add_bias_linear" if cfg.mlp_bias else "add_qkv_bias"
        obstacles.append(f"a query bias ({field}: a bias on query_key_value): {glm.QUERY_BIAS}")
    if cfg.mlp_bias:
        obstacles.append("biases on the MLP (add_bias_linear): DeepSeek-V3's MLP has none")
    if obstacles:
        return MLASupport("refused", "; ".join(obstacles))
    return MLASupport(
        "approximate",
        f"as GLM: {rotary_layout_note(attn)}; the fused query_key_value is split on load; "
        f"{glm.APPROXIMATE_NOTE}",
    )


CHATGLM = Family(
    "chatglm",
    ("chatglm",),
    read,
    write,
    tensors,
    mla=mla,
    check_load=check_load,
    covers="ChatGLM2-6B, ChatGLM3-6B (THUDM's layout and config.json)",
    # chatglm2-6b's fields at a small size: 2 query groups, fused query_key_value with bias, half rotary
    example=dict(
        model_type="chatglm",
        padded_vocab_size=320,
        hidden_size=48,
        num_layers=2,
        num_attention_heads=6,
        multi_query_attention=True,
        multi_query_group_num=2,
        kv_channels=8,
        ffn_hidden_size=80,
        add_qkv_bias=True,
        add_bias_linear=False,
        seq_length=64,
        layernorm_epsilon=1e-5,
        rmsnorm=True,
        post_layer_norm=True,
        original_rope=True,
        apply_residual_connection_post_layernorm=False,
        tie_word_embeddings=False,
    ),
)
