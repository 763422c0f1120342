"""Phi-3, Phi-3.5 and Phi-4-mini: transformers' ``Phi3ForCausalLM`` (model_type "phi3").

The block is Llama's (pre RMSNorm with gain w, SwiGLU, no biases anywhere) with three differences, each read as
transformers' ``Phi3Config`` and ``modeling_phi3.py`` (5.x) decide it:

- Fused projections: ``qkv_proj`` stacks q, k and v along its output rows ([q; k; v], the ``QKV_CONCAT`` transform,
  at any number of KV heads) and ``gate_up_proj`` stacks the gate and up projections ([gate; up]: the first half
  goes through SiLU, ``GATE_UP_CONCAT``).
- RoPE: on the first ``int(head_dim * partial_rotary_factor)`` dims of each head (Phi-4-mini: 0.75), paired in
  halves of those dims as ``rotate_half`` pairs them (i, i + rotary_dim/2); the rest pass. The factor is read from
  ``rope_parameters`` first, then the top level, else 1. Frequencies are plain or "longrope" (Phi-3-128k, Phi-3.5,
  Phi-4-mini: ``short_factor`` while a forward's length is at most ``original_max_position_embeddings``,
  ``long_factor`` past it, cos and sin times an attention factor from ``max_position_embeddings /
  original_max_position_embeddings``). The older type names "su" and "yarn" mean longrope here, and the top-level
  ``original_max_position_embeddings`` (default 4096) wins over one inside the RoPE parameters, as in
  ``Phi3Config``. Any other type is refused: transformers' Phi3Config refuses it too. A sequence generated past
  the switch is prefilled again at that step (``attnlab.generate``), as ``Phi3ForCausalLM`` drops its cache there.
- ``sliding_window``: when set, every layer slides (``Phi3Model`` builds one sliding mask for all of them); absent
  or null, none does.

Tensor names (N = layer index):

    model.embed_tokens.weight                  tok_embeddings.weight
    model.layers.N.self_attn.qkv_proj          layers.N.attention.{wq,wk,wv}        (QKV_CONCAT)
    model.layers.N.self_attn.o_proj            layers.N.attention.wo
    model.layers.N.mlp.gate_up_proj            layers.N.feed_forward.{w1,w3}        (GATE_UP_CONCAT)
    model.layers.N.mlp.down_proj               layers.N.feed_forward.w2
    model.layers.N.input_layernorm             layers.N.attention_norm
    model.layers.N.post_attention_layernorm    layers.N.ffn_norm
    model.norm / lm_head                       norm / output   (lm_head absent when embeddings are tied: Phi-4-mini)

Fewer KV heads are native (``num_key_value_heads``): ``convert --kv-heads`` rewrites ``qkv_proj`` at its new
width. MLA: a DeepSeek export turns by plain RoPE over the whole context, so longrope and a window shorter than the
positions are refused (each one named); otherwise a Phi-3 converts as a Llama does: the fused layout is split on
load, and under partial rotary the dims RoPE never turns become DeepSeek's no-RoPE part, exactly.
"""

from __future__ import annotations

from typing import Any

from ..config import AttentionConfig, ModelConfig
from .base import (
    GATE_UP_CONCAT,
    QKV_CONCAT,
    Family,
    Fields,
    MLASupport,
    Rule,
    TensorMap,
    check_heads,
    freeze,
    put,
    rope_parameters,
    rotary_layout_note,
)
from .llama import decoder_rules

ARCHITECTURE = "Phi3ForCausalLM"
LAYER_RULES = (
    ("self_attn.o_proj", "attention.wo"),
    ("input_layernorm", "attention_norm"),
    ("post_attention_layernorm", "ffn_norm"),
    ("mlp.down_proj", "feed_forward.w2"),
)
FUSED_RULES = (
    Rule(
        "model.layers.{i}.self_attn.qkv_proj.{p}",
        ("layers.{i}.attention.wq.{p}", "layers.{i}.attention.wk.{p}", "layers.{i}.attention.wv.{p}"),
        QKV_CONCAT,
    ),
    Rule(
        "model.layers.{i}.mlp.gate_up_proj.{p}",
        ("layers.{i}.feed_forward.w1.{p}", "layers.{i}.feed_forward.w3.{p}"),
        GATE_UP_CONCAT,
    ),
)
TENSORS = TensorMap((*decoder_rules(LAYER_RULES), *FUSED_RULES), "Phi-3")

DEFAULT_POSITIONS = 4096  # Phi3Config's max_position_embeddings and original_max_position_embeddings
LONGROPE_NAMES = ("longrope", "su", "yarn")  # Phi3Config reads the older "su" and "yarn" as longrope
# The longrope parameters attnlab passes on to transformers' ROPE_INIT_FUNCTIONS (besides the factor lists).
LONGROPE_OPTIONAL = ("factor", "attention_factor")


def _rotary_dim(f: Fields, params: dict[str, Any], head_dim: int) -> int:
    """``int(head_dim * partial_rotary_factor)``, the factor from the RoPE parameters, else the top level, else 1."""
    inner = f.within(params).opt_float("partial_rotary_factor")
    outer = f.opt_float("partial_rotary_factor")
    factor = inner if inner is not None else 1.0 if outer is None else outer
    dim = int(head_dim * factor)
    if not 0 < factor <= 1 or dim < 2 or dim % 2:
        f.fail(
            f"partial_rotary_factor={factor} turns {dim} of head_dim={head_dim} dims; RoPE needs an even number "
            "of them, at least 2 and at most head_dim"
        )
    return dim


def _factors(f: Fields, params: dict[str, Any], key: str, rotary_dim: int) -> tuple[float, ...]:
    value = params.get(key)
    if (
        not isinstance(value, list)
        or len(value) != rotary_dim // 2
        or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)
    ):
        f.fail(
            f"rope_parameters {key} must list {rotary_dim // 2} numbers (one per rotary pair), got {value!r}"
        )
    return tuple(float(x) for x in value)


def _rope(f: Fields, head_dim: int) -> tuple[float, tuple[tuple[str, Any], ...], int]:
    """(rope_theta, rope_scaling, rotary dim) as transformers' Phi3Config reads them (see the module docstring)."""
    params = rope_parameters(f.raw, f.model_type)
    theta = f.within(params).float("rope_theta", above=0)
    rotary_dim = _rotary_dim(f, params, head_dim)
    kind = params["rope_type"]
    if kind == "default":
        return theta, (), rotary_dim
    if kind not in LONGROPE_NAMES:
        f.fail(
            f"rope_type={kind!r} is not supported (Phi-3 computes 'default' and 'longrope', as transformers' "
            "Phi3Config)"
        )
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "short_factor": _factors(f, params, "short_factor", rotary_dim),
        "long_factor": _factors(f, params, "long_factor", rotary_dim),
        # the top-level field wins, and has a default, even when the parameters hold their own (Phi3Config)
        "original_max_position_embeddings": f.int("original_max_position_embeddings", DEFAULT_POSITIONS),
        "max_position_embeddings": f.int("max_position_embeddings", DEFAULT_POSITIONS),
    }
    for key in LONGROPE_OPTIONAL:
        if params.get(key) is not None:
            scaling[key] = f.within(params).float(key)
    return theta, freeze(scaling), rotary_dim


def read(f: Fields) -> ModelConfig:
    """A Phi-3 / Phi-3.5 / Phi-4-mini config.json."""
    d, n_heads = f.int("hidden_size"), f.int("num_attention_heads")
    n_kv = f.int("num_key_value_heads", n_heads, null=n_heads)
    head_dim = f.opt_int("head_dim")
    check_heads(f, d, n_heads, n_kv, head_dim, "num_key_value_heads")
    if f.raw.get("hidden_act", "silu") != "silu":
        f.unsupported("hidden_act", "Phi-3's MLP is SwiGLU: only 'silu'")
    head_dim = head_dim or d // n_heads
    theta, scaling, rotary_dim = _rope(f, head_dim)
    attention = AttentionConfig(
        d_model=d,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=scaling,
        rope_dim=None if rotary_dim == head_dim else rotary_dim,
    )
    window = f.opt_int("sliding_window")  # absent or null: no layer slides (Phi3Config's default)
    return ModelConfig(
        vocab_size=f.int("vocab_size"),
        n_layers=f.layers("num_hidden_layers"),
        attention=attention,
        ffn_dim=f.int("intermediate_size"),
        max_seq_len=f.int("max_position_embeddings", DEFAULT_POSITIONS),
        norm_eps=f.eps("rms_norm_eps", 1e-5),
        tie_embeddings=f.bool("tie_word_embeddings", False),
        sliding=None if window is None else attention.replace(window=window),
    )


def _unwritable(cfg: ModelConfig) -> str | None:
    """Why ``cfg`` is not a Phi-3 (None if it is one)."""
    attn = cfg.attention
    if not isinstance(attn, AttentionConfig):
        return "only GQA/MHA/MQA attention"
    if attn.bias or attn.has_out_bias or cfg.mlp_bias:
        return "Phi-3 has no biases; AttentionConfig.bias, out_bias and ModelConfig.mlp_bias must be False"
    block = (cfg.norm, cfg.norm_offset, cfg.norm_placement, cfg.parallel_residual, cfg.mlp, cfg.embed_scale)
    if block != ("rmsnorm", 0.0, "pre", False, "swiglu", 1.0) or cfg.final_softcap is not None:
        return "Phi-3's block is Llama's: pre RMSNorm with gain w, SwiGLU, unscaled embeddings and logits"
    for a in cfg.layer_attentions:
        if not a.rope or a.rope_interleaved or a.qk_norm != "none" or a.softcap is not None:
            return "Phi-3's attention has RoPE in half-split pairs, no q/k norm and no soft-capping"
        if a.scale is not None and a.scale != a.head_dim**-0.5:
            return f"Phi-3's softmax scale is head_dim ** -0.5, not {a.scale}"
        kind = dict(a.rope_scaling).get("rope_type", "default")
        if kind not in ("default", "longrope"):
            return f"Phi-3 computes 'default' and 'longrope' RoPE, not {kind!r}"
    if "full_attention" in cfg.layer_types and cfg.sliding is not None:
        return "Phi-3 slides every layer or none (sliding_window)"
    return None


def _rope_parameters(attn: AttentionConfig) -> dict[str, Any]:
    """``attn``'s RoPE as Phi-3's ``rope_parameters``."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": attn.rope_theta}
    params |= {k: v for k, v in attn.rope_parameters.items() if k != "max_position_embeddings"}
    params.pop("original_max_position_embeddings", None)  # Phi-3 keeps it at the top level
    if attn.rotary_dim != attn.head_dim:
        params["partial_rotary_factor"] = attn.rotary_dim / attn.head_dim
    return params


def write(cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
    """The config.json of ``cfg`` as a Phi-3 checkpoint built from ``base`` (the source's), changed only where
    ``cfg`` differs from it; checked to read back as ``cfg``'s architecture."""
    why = _unwritable(cfg)
    if why is not None:
        raise ValueError(f"cannot write a phi3 checkpoint: {why}")
    attn = cfg.attention
    hf = dict(base, model_type="phi3", architectures=[ARCHITECTURE])
    put(hf, "hidden_size", attn.d_model)
    put(hf, "num_attention_heads", attn.n_heads)
    put(hf, "num_key_value_heads", attn.n_kv_heads, hf.get("num_attention_heads"))
    put(hf, "head_dim", attn.head_dim, attn.d_model // attn.n_heads)
    put(hf, "num_hidden_layers", cfg.n_layers)
    put(hf, "intermediate_size", cfg.ffn_dim)
    put(hf, "vocab_size", cfg.vocab_size)
    put(hf, "max_position_embeddings", cfg.max_seq_len, DEFAULT_POSITIONS)
    put(hf, "rms_norm_eps", cfg.norm_eps, 1e-5)
    put(hf, "hidden_act", "silu", "silu")
    put(hf, "tie_word_embeddings", cfg.tie_embeddings, False)
    put(hf, "sliding_window", None if cfg.sliding is None else cfg.sliding.window)
    f = Fields(hf, "phi3")
    if _rope(f, attn.head_dim) != (attn.rope_theta, attn.rope_scaling, attn.rotary_dim):
        for stale in ("rope_scaling", "rope_theta", "partial_rotary_factor"):
            hf.pop(stale, None)
        hf["rope_parameters"] = _rope_parameters(attn)
        scaling = dict(attn.rope_scaling)
        if "original_max_position_embeddings" in scaling:
            hf["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    back = read(Fields(hf, "phi3"))
    if _architecture(back) != _architecture(cfg):
        raise ValueError("cannot write a phi3 checkpoint: its config.json would not read back as this model")
    return hf


def _architecture(cfg: ModelConfig) -> tuple:
    """What a Phi-3 config.json says of a model: sizes, and each layer's attention apart from runtime options."""
    layers = tuple(
        (a.d_model, a.n_heads, a.n_kv_heads, a.head_dim, a.rotary_dim, a.rope_theta, a.rope_scaling, a.window)
        for a in cfg.layer_attentions
    )
    sizes = (cfg.vocab_size, cfg.n_layers, cfg.ffn_dim, cfg.max_seq_len, cfg.norm_eps, cfg.tie_embeddings)
    return sizes, layers


def mla(cfg: ModelConfig) -> MLASupport:
    """What ``convert --to mla`` makes of a Phi-3 model; every obstacle is named. Partial rotary (Phi-4-mini) is
    none: the dims RoPE never turns are DeepSeek's no-RoPE part."""
    attn = cfg.attention
    obstacles = []
    if attn.rope_scaling:
        obstacles.append(
            f"rope_type {dict(attn.rope_scaling).get('rope_type')!r} (its frequencies switch with the sequence "
            "length; a DeepSeek export turns every position by fixed ones)"
        )
    if cfg.sliding is not None and cfg.sliding.window < cfg.max_seq_len:
        obstacles.append(
            f"a sliding window of {cfg.sliding.window} tokens, shorter than its {cfg.max_seq_len} positions "
            "(DeepSeek-V3 attends to the whole context; a config without one, sliding_window null, converts)"
        )
    if obstacles:
        return MLASupport("refused", "; ".join(obstacles))
    layout = rotary_layout_note(attn)
    return MLASupport(
        "approximate",
        f"as a Llama: the fused qkv_proj is split on load{'; ' + layout if layout else ''}; RoPE-aware, exact with "
        "one KV head keeping every rotary plane, at full rank; otherwise the rotary planes kept and the latent "
        "rank bound the error (docs/mla_conversion.md)",
    )


PHI3 = Family(
    "phi3",
    ("phi3",),
    read,
    write,
    TENSORS,
    {"phi3": ARCHITECTURE},
    mla=mla,
    covers="Phi-3, Phi-3.5, Phi-4-mini",
    # Phi-4-mini's shape: fused qkv and gate/up, rotary on 3/4 of each head, GQA, tied embeddings
    example=dict(
        model_type="phi3",
        vocab_size=320,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        partial_rotary_factor=0.75,
        tie_word_embeddings=True,
        pad_token_id=0,
    ),
)
