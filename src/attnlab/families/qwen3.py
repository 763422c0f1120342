"""Qwen3 (dense): transformers' ``Qwen3ForCausalLM``.

Llama's block (pre RMSNorm, SwiGLU, half-split RoPE on every head dim) with, in the attention:

- q/k norms: an RMSNorm of each head's query and key before RoPE, one gain of ``head_dim`` values shared by every
  head (``qk_norm="head"``), with the model's ``rms_norm_eps``;
- ``head_dim`` given on its own (Qwen3-0.6B: 16 heads of 128 on a width of 1024); a config.json without it means
  128, ``Qwen3Config``'s default, not ``hidden_size / num_attention_heads``;
- ``attention_bias`` on q, k, v and o alike (false in every released model; Qwen2 had q/k/v biases);
- sliding windows as Qwen2's: only with ``use_sliding_window``, on the layers ``layer_types`` names (by default those
  from ``max_window_layers`` on), as ``Qwen3Config`` decides. No released Qwen3 uses them.

Tensor names (N = layer index):

    model.embed_tokens.weight                  tok_embeddings.weight
    model.layers.N.self_attn.{q,k,v,o}_proj    layers.N.attention.{wq,wk,wv,wo}      (.weight, .bias)
    model.layers.N.self_attn.{q,k}_norm        layers.N.attention.{q,k}_norm          (head_dim gains)
    model.layers.N.input_layernorm             layers.N.attention_norm
    model.layers.N.mlp.{gate,down,up}_proj     layers.N.feed_forward.{w1,w2,w3}
    model.layers.N.post_attention_layernorm    layers.N.ffn_norm
    model.norm / lm_head                       norm / output   (lm_head absent when embeddings are tied)

Fewer KV heads are written natively (``num_key_value_heads``); the k_norm gain is shared by all heads, so it is kept
as it is. MLA: refused (``mla``).
"""

from __future__ import annotations

from typing import Any

from ..config import AttentionConfig, ModelConfig
from .base import (
    Family,
    Fields,
    MLASupport,
    TensorMap,
    check_heads,
    put,
    rope_fields,
    sliding_layer_types,
)
from .llama import LAYER_RULES, decoder_rules, qwen_windows

ARCHITECTURE = "Qwen3ForCausalLM"
# Qwen3Config's defaults for fields a config.json may leave out (transformers/models/qwen3/configuration_qwen3.py)
HEAD_DIM = 128
KV_HEADS = 32
MAX_POSITIONS = 32768

QK_NORM_RULES = (("self_attn.q_norm", "attention.q_norm"), ("self_attn.k_norm", "attention.k_norm"))
TENSORS = TensorMap(decoder_rules(LAYER_RULES + QK_NORM_RULES), "Qwen3")


def read(f: Fields) -> ModelConfig:
    """A Qwen3 config.json."""
    d, n_heads = f.int("hidden_size"), f.int("num_attention_heads")
    # absent: Qwen3Config's 32; null: as many as the query heads (Qwen3Config.__post_init__)
    n_kv = f.int("num_key_value_heads", KV_HEADS, null=n_heads)
    head_dim = f.int("head_dim", HEAD_DIM)
    check_heads(f, d, n_heads, n_kv, head_dim, "num_key_value_heads")
    if f.raw.get("hidden_act", "silu") != "silu":
        f.unsupported("hidden_act", "the MLP is SwiGLU: only 'silu'")
    eps = f.eps("rms_norm_eps", 1e-6)
    theta, scaling = f.rope()
    attention = AttentionConfig(
        d_model=d,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        bias=f.bool("attention_bias", False),  # q, k, v and o alike
        rope_theta=theta,
        rope_scaling=scaling,
        qk_norm="head",
        norm_eps=eps,
    )
    n_layers = f.layers("num_hidden_layers")
    window, layer_types = qwen_windows(f, n_layers)
    return ModelConfig(
        vocab_size=f.int("vocab_size"),
        n_layers=n_layers,
        attention=attention,
        ffn_dim=f.int("intermediate_size"),
        max_seq_len=f.int("max_position_embeddings", MAX_POSITIONS),
        norm_eps=eps,
        tie_embeddings=f.bool("tie_word_embeddings", False),
        sliding=None if window is None else attention.replace(window=window),
        layer_types=layer_types,
    )


def check_writable(
    cfg: ModelConfig, model_type: str, qk_norm: str, placement: str, gain_float32: bool = False
) -> AttentionConfig:
    """``cfg``'s attention, after checking that ``cfg`` is a decoder of this kind: RMSNorms with gain w placed
    ``placement`` (applied in float32 or not, ``gain_float32``), SwiGLU without biases, q/k norms ``qk_norm`` with the model's epsilon, biases on q, k, v and o
    alike, full half-split RoPE at the default scale, no soft-capping (ValueError naming what differs)."""
    attn = cfg.attention
    if not isinstance(attn, AttentionConfig):
        raise ValueError(f"only GQA/MHA/MQA attention can be written as a {model_type} checkpoint")
    wrong = {
        "norm": (cfg.norm, "rmsnorm"),
        "norm_offset": (cfg.norm_offset, 0.0),
        "norm_gain_float32": (cfg.norm_gain_float32, gain_float32),
        "norm_placement": (cfg.norm_placement, placement),
        "parallel_residual": (cfg.parallel_residual, False),
        "mlp": (cfg.mlp, "swiglu"),
        "mlp_bias": (cfg.mlp_bias, False),
        "embed_scale": (cfg.embed_scale, 1.0),
        "final_softcap": (cfg.final_softcap, None),
        "attention.qk_norm": (attn.qk_norm, qk_norm),
        "attention.norm_eps": (attn.norm_eps, cfg.norm_eps),
        "attention.norm_offset": (attn.norm_offset, 0.0),
        "attention.norm_gain_float32": (attn.norm_gain_float32, gain_float32),
        "attention.out_bias": (attn.has_out_bias, attn.bias),
        "attention.rope": (attn.rope, True),
        "attention.rope_dim": (attn.rotary_dim, attn.head_dim),
        "attention.rope_interleaved": (attn.rope_interleaved, False),
        "attention.scale": (attn.softmax_scale, attn.head_dim**-0.5),
        "attention.softcap": (attn.softcap, None),
    }
    for name, (value, want) in wrong.items():
        if value != want:
            raise ValueError(f"{model_type} cannot express ModelConfig {name}={value!r} (it has {want!r})")
    if cfg.sliding is not None and cfg.sliding.replace(window=None) != attn:
        raise ValueError(f"{model_type}'s sliding layers differ from the others by their window only")
    return attn


def write(cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
    """The config.json of ``cfg`` as a Qwen3 checkpoint, changed from ``base`` only where ``cfg`` differs from it."""
    attn = check_writable(cfg, "qwen3", qk_norm="head", placement="pre")
    hf = dict(base, model_type="qwen3", architectures=[ARCHITECTURE])
    put(hf, "hidden_size", attn.d_model)
    put(hf, "num_attention_heads", attn.n_heads)
    put(hf, "num_key_value_heads", attn.n_kv_heads, KV_HEADS)
    put(hf, "head_dim", attn.head_dim, HEAD_DIM)
    put(hf, "num_hidden_layers", cfg.n_layers)
    put(hf, "intermediate_size", cfg.ffn_dim)
    put(hf, "vocab_size", cfg.vocab_size)
    put(hf, "max_position_embeddings", cfg.max_seq_len, MAX_POSITIONS)
    put(hf, "rms_norm_eps", cfg.norm_eps, 1e-6)
    put(hf, "hidden_act", "silu", "silu")
    put(hf, "tie_word_embeddings", cfg.tie_embeddings, False)
    put(hf, "attention_bias", attn.bias, False)
    rope_fields(hf, attn, "qwen3")
    window = None if cfg.sliding is None else cfg.sliding.window
    if window is not None or hf.get("use_sliding_window"):
        hf.update(use_sliding_window=window is not None, sliding_window=window)
        hf["layer_types"] = sliding_layer_types(cfg)
    return hf


def mla(cfg: ModelConfig) -> MLASupport:
    """Refused: a published MLA converter that ignored these norms made of Qwen3 a model of perplexity ~50,000."""
    return MLASupport(
        "refused",
        "its k_norm divides each head's key by that head's own RMS before RoPE; keys decompressed from DeepSeek's "
        "shared latent have one norm for all heads and its shared rotary key none",
    )


QWEN3 = Family(
    "qwen3",
    ("qwen3",),
    read,
    write,
    TENSORS,
    {"qwen3": ARCHITECTURE},
    mla=mla,
    covers="Qwen3 (dense)",
    # Qwen3-0.6B's shape: per-head q/k norms, head_dim apart from hidden_size / heads, tied embeddings
    example=dict(
        model_type="qwen3",
        vocab_size=320,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    ),
)
