"""OLMo 2: transformers' ``Olmo2ForCausalLM``.

A SwiGLU decoder with half-split RoPE on every head dim, and two departures from Llama:

- post-norm blocks (``norm_placement="post"``): the RMSNorm sits on each sublayer's output, before the residual sum,
  and the sublayers read the residual stream unnormalised: ``h = x + post_attention_layernorm(attn(x))``,
  ``out = h + post_feedforward_layernorm(mlp(h))``;
- q/k norms over all heads at once (``qk_norm="full"``): one RMSNorm of the whole query projection (num_heads x
  head_dim values, one gain each) and one of the whole key projection (num_key_value_heads x head_dim), taken
  before the heads are split and before RoPE, with the model's ``rms_norm_eps``.

Every norm applies its gain in float32 before casting back (``Olmo2RMSNorm``: ``(w * n(x)).to(dtype)``;
``norm_gain_float32``), where Llama's casts first: the same in float32, bfloat16 logits equal to the bit.

``attention_bias`` puts biases on q, k, v and o alike; the MLP has none. ``Olmo2Config`` has no ``head_dim`` field,
but its attention reads one when config.json gives it (else ``hidden_size / num_attention_heads``); no sliding
window (OLMo 3, ``olmo3``, added them).

Tensor names (N = layer index):

    model.embed_tokens.weight                     tok_embeddings.weight
    model.layers.N.self_attn.{q,k,v,o}_proj       layers.N.attention.{wq,wk,wv,wo}      (.weight, .bias)
    model.layers.N.self_attn.{q,k}_norm           layers.N.attention.{q,k}_norm          (one gain per value)
    model.layers.N.post_attention_layernorm       layers.N.post_attention_norm
    model.layers.N.mlp.{gate,down,up}_proj        layers.N.feed_forward.{w1,w2,w3}
    model.layers.N.post_feedforward_layernorm     layers.N.post_ffn_norm
    model.norm / lm_head                          norm / output   (lm_head absent when embeddings are tied)

Fewer KV heads are written natively (``num_key_value_heads``); k_norm then has one gain per value of the new KV
heads, pooled over each group as the keys are (``attnlab.convert.gqa.mha_to_gqa``). MLA: refused (``mla``).
"""

from __future__ import annotations

from typing import Any

from ..config import AttentionConfig, ModelConfig
from .base import Family, Fields, MLASupport, TensorMap, check_heads, put, rope_fields
from .llama import decoder_rules
from .qwen3 import QK_NORM_RULES, check_writable

ARCHITECTURE = "Olmo2ForCausalLM"
# Olmo2Config's defaults for fields a config.json may leave out (transformers/models/olmo2/configuration_olmo2.py)
MAX_POSITIONS = 2048
EPS = 1e-5

LAYER_RULES = (
    ("self_attn.q_proj", "attention.wq"),
    ("self_attn.k_proj", "attention.wk"),
    ("self_attn.v_proj", "attention.wv"),
    ("self_attn.o_proj", "attention.wo"),
    *QK_NORM_RULES,
    ("post_attention_layernorm", "post_attention_norm"),
    ("mlp.gate_proj", "feed_forward.w1"),
    ("mlp.down_proj", "feed_forward.w2"),
    ("mlp.up_proj", "feed_forward.w3"),
    ("post_feedforward_layernorm", "post_ffn_norm"),
)
TENSORS = TensorMap(decoder_rules(LAYER_RULES), "OLMo 2")


def read(f: Fields) -> ModelConfig:
    """An OLMo 2 config.json."""
    d, n_heads = f.int("hidden_size"), f.int("num_attention_heads")
    n_kv = f.opt_int("num_key_value_heads") or n_heads  # absent or null: MHA (Olmo2Config.__post_init__)
    head_dim = f.opt_int("head_dim")
    check_heads(f, d, n_heads, n_kv, head_dim, "num_key_value_heads")
    if f.raw.get("hidden_act", "silu") != "silu":
        f.unsupported("hidden_act", "the MLP is SwiGLU: only 'silu'")
    eps = f.eps("rms_norm_eps", EPS)
    theta, scaling = f.rope()
    attention = AttentionConfig(
        d_model=d,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        bias=f.bool("attention_bias", False),  # q, k, v and o alike
        rope_theta=theta,
        rope_scaling=scaling,
        qk_norm="full",
        norm_eps=eps,
        norm_gain_float32=True,
    )
    return ModelConfig(
        vocab_size=f.int("vocab_size"),
        n_layers=f.layers("num_hidden_layers"),
        attention=attention,
        ffn_dim=f.int("intermediate_size"),
        max_seq_len=f.int("max_position_embeddings", MAX_POSITIONS),
        norm_eps=eps,
        tie_embeddings=f.bool("tie_word_embeddings", False),
        norm_placement="post",
        norm_gain_float32=True,
    )


def write(cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
    """The config.json of ``cfg`` as an OLMo 2 checkpoint, changed from ``base`` only where ``cfg`` differs."""
    attn = check_writable(cfg, "olmo2", qk_norm="full", placement="post", gain_float32=True)
    if cfg.sliding is not None:
        raise ValueError("olmo2 has no sliding window")
    hf = dict(base, model_type="olmo2", architectures=[ARCHITECTURE])
    put(hf, "hidden_size", attn.d_model)
    put(hf, "num_attention_heads", attn.n_heads)
    put(hf, "num_key_value_heads", attn.n_kv_heads, hf.get("num_attention_heads"))
    put(hf, "head_dim", attn.head_dim, attn.d_model // attn.n_heads)
    put(hf, "num_hidden_layers", cfg.n_layers)
    put(hf, "intermediate_size", cfg.ffn_dim)
    put(hf, "vocab_size", cfg.vocab_size)
    put(hf, "max_position_embeddings", cfg.max_seq_len, MAX_POSITIONS)
    put(hf, "rms_norm_eps", cfg.norm_eps, EPS)
    put(hf, "hidden_act", "silu", "silu")
    put(hf, "tie_word_embeddings", cfg.tie_embeddings, False)
    put(hf, "attention_bias", attn.bias, False)
    rope_fields(hf, attn, "olmo2")
    return hf


def mla(cfg: ModelConfig) -> MLASupport:
    """Refused: the key norm cannot be carried by DeepSeek's attention (note), and ignoring it is another model."""
    return MLASupport(
        "refused",
        "its k_norm divides the keys, rotary dims included, by their RMS before RoPE; DeepSeek's shared rotary "
        "key is never normalised, and a norm on its latent would scale the values too",
    )


OLMO2 = Family(
    "olmo2",
    ("olmo2",),
    read,
    write,
    TENSORS,
    {"olmo2": ARCHITECTURE},
    mla=mla,
    covers="OLMo 2",
    # post-norm blocks, q/k norms over all heads
    example=dict(
        model_type="olmo2",
        vocab_size=320,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=500000.0,
    ),
)
