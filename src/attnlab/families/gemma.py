"""Gemma, Gemma 2 and Gemma 3 (text): transformers' ``GemmaForCausalLM``, ``Gemma2ForCausalLM`` and
``Gemma3ForCausalLM`` (model_type ``gemma3_text``; the multimodal ``gemma3`` wraps it and is not read).

What the three share (transformers' ``modeling_gemma*.py``):

- RMSNorm with the gain ``1 + w`` (weights stored as w), applied in float32 before the cast back
  (``ModelConfig.norm_offset`` 1);
- a GeGLU MLP: ``down(gelu_tanh(gate x) * up x)``;
- token embeddings times sqrt(hidden_size), that factor first rounded to the activations' dtype
  (``ModelConfig.embed_scale``);
- ``head_dim`` a field of its own, 256 when absent whatever hidden_size / num_attention_heads is;
- the LM head tied to the token table unless ``tie_word_embeddings`` is false.

Gemma 2 adds sandwich norms (each sublayer's output normed again before the residual sum), tanh soft-capping of the
attention logits (``attn_logit_softcapping``, default 50) and of the final logits (``final_logit_softcapping``,
default 30), the softmax scale ``query_pre_attn_scalar ** -0.5`` (default 256), and sliding-window layers
(``layer_types``; by default every other layer from the first, window ``sliding_window``, default 4096).

Gemma 3 keeps the sandwich norms, the scale and the sliding layers (by default five of every six:
``sliding_window_pattern`` 6), has no final soft-capping by default, adds q/k RMSNorms per head with the ``1 + w``
gain (before RoPE), and gives sliding and full layers a RoPE each: ``rope_parameters`` keyed by layer type, or in
older configs ``rope_theta`` (full layers, default 1e6), ``rope_local_base_freq`` (sliding layers, default 1e4) and a
``rope_scaling`` that applies to the full layers only (Gemma 3 4B and up: linear, factor 8). Its
``attn_logit_softcapping`` is read and ignored, as transformers' ``Gemma3Attention`` never passes it on.

A missing field means what transformers' config class defaults it to (``DEFAULTS``; the size fields are required).
Gemma's ``hidden_act`` may be the legacy "gelu", which transformers reads as the tanh GELU; Gemma 2 and 3 read
``hidden_activation`` and take it as written, so there only "gelu_pytorch_tanh" is the model attnlab computes.

Tensor names (N = layer index):

    model.embed_tokens.weight                                 tok_embeddings.weight
    model.layers.N.self_attn.{q,k,v,o}_proj                   layers.N.attention.{wq,wk,wv,wo}  (.weight, .bias)
    model.layers.N.self_attn.{q,k}_norm          (Gemma 3)    layers.N.attention.{q,k}_norm
    model.layers.N.input_layernorm                            layers.N.attention_norm
    model.layers.N.post_attention_layernorm      (Gemma)      layers.N.ffn_norm
    model.layers.N.post_attention_layernorm      (Gemma 2/3)  layers.N.post_attention_norm
    model.layers.N.pre_feedforward_layernorm     (Gemma 2/3)  layers.N.ffn_norm
    model.layers.N.post_feedforward_layernorm    (Gemma 2/3)  layers.N.post_ffn_norm
    model.layers.N.mlp.{gate,down,up}_proj                    layers.N.feed_forward.{w1,w2,w3}
    model.norm / lm_head                                      norm / output   (lm_head absent when tied)

Fewer KV heads are written natively (``num_key_value_heads``). MLA conversion is refused for all three (``mla``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..config import LAYER_TYPES, AttentionConfig, ModelConfig
from .base import (
    Family,
    Fields,
    MLASupport,
    TensorMap,
    check_heads,
    check_layer_types,
    put,
    rope_fields,
    sliding_layer_types,
)
from .llama import LAYER_RULES, decoder_rules

ARCHITECTURES = {
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}

# transformers' defaults (GemmaConfig, Gemma2Config, Gemma3TextConfig) for the fields a config.json may leave out
DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma": dict(num_key_value_heads=16, max_position_embeddings=8192),
    "gemma2": dict(
        num_key_value_heads=4,
        max_position_embeddings=8192,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    "gemma3_text": dict(
        num_key_value_heads=4,
        max_position_embeddings=131_072,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
    ),
}
# The same in all three: head_dim, query_pre_attn_scalar (Gemma 2/3), sliding_window (Gemma 2/3), rms_norm_eps
HEAD_DIM, SCALAR, WINDOW, EPS = 256, 256, 4096, 1e-6
# Gemma 3: layer type -> the older config.json field holding its RoPE base, and that base's default
GEMMA3_THETAS = {
    "full_attention": ("rope_theta", 1_000_000.0),
    "sliding_attention": ("rope_local_base_freq", 10_000.0),
}

TENSORS = TensorMap(decoder_rules(LAYER_RULES), "Gemma")  # Llama's names
# Gemma 2/3: post_attention_layernorm norms the attention's output; the MLP's input norm is pre_feedforward_layernorm.
SANDWICH_RULES = (
    ("self_attn.q_proj", "attention.wq"),
    ("self_attn.k_proj", "attention.wk"),
    ("self_attn.v_proj", "attention.wv"),
    ("self_attn.o_proj", "attention.wo"),
    ("input_layernorm", "attention_norm"),
    ("post_attention_layernorm", "post_attention_norm"),
    ("pre_feedforward_layernorm", "ffn_norm"),
    ("post_feedforward_layernorm", "post_ffn_norm"),
    ("mlp.gate_proj", "feed_forward.w1"),
    ("mlp.down_proj", "feed_forward.w2"),
    ("mlp.up_proj", "feed_forward.w3"),
)
QK_NORM_RULES = (("self_attn.q_norm", "attention.q_norm"), ("self_attn.k_norm", "attention.k_norm"))
TENSORS_2 = TensorMap(decoder_rules(SANDWICH_RULES), "Gemma 2")
TENSORS_3 = TensorMap(decoder_rules((*SANDWICH_RULES, *QK_NORM_RULES)), "Gemma 3")


# ---- reading ---------------------------------------------------------------------------------------------------


def _activation(f: Fields) -> None:
    if f.model_type == "gemma":  # GemmaConfig turns the legacy "gelu" into the tanh GELU
        key, accepted = "hidden_act", ("gelu_pytorch_tanh", "gelu")
    else:
        key, accepted = "hidden_activation", ("gelu_pytorch_tanh",)
    if f.raw.get(key, "gelu_pytorch_tanh") not in accepted:
        f.unsupported(key, f"the MLP is GeGLU with the tanh GELU: only {' or '.join(map(repr, accepted))}")


def _positive(f: Fields, key: str, default: float | None) -> float | None:
    """A float field that must be > 0, or null (None); ``default`` when absent."""
    value = f.opt_float(key) if key in f.raw else default
    if value is not None and value <= 0:
        f.fail(f"field {key!r} must be > 0 or null, got {value}")
    return value


def _layer_types(f: Fields, n_layers: int) -> list[str]:
    """Every layer's type, as Gemma2Config / Gemma3TextConfig decide them."""
    types = f.raw.get("layer_types")
    if types is None:
        period = 2 if f.model_type == "gemma2" else f.int("sliding_window_pattern", 6)
        return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(n_layers)]
    return check_layer_types(f, types, n_layers)


def _gemma3_rope(f: Fields) -> dict[str, tuple[float, tuple]]:
    """Layer type -> (rope_theta, rope_scaling) of a Gemma 3 config, as Gemma3TextConfig reads them: from
    ``rope_parameters`` keyed by layer type, the older ``rope_scaling`` applied over the full layers' entry, missing
    thetas from ``rope_theta`` / ``rope_local_base_freq`` or their defaults."""
    params = f.raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        f.fail(f"field 'rope_parameters' must be an object, got {params!r}")
    flat = sorted(set(params) - set(LAYER_TYPES))
    if flat:
        f.unsupported(
            "rope_parameters",
            f"Gemma 3 keys RoPE by layer type ({', '.join(LAYER_TYPES)}); transformers ignores {flat}",
        )
    scaling = f.raw.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        f.fail(f"field 'rope_scaling' must be an object, got {scaling!r}")
    out = {}
    for kind, (theta_key, theta) in GEMMA3_THETAS.items():
        entry = params.get(kind) or {"rope_type": "default"}
        if not isinstance(entry, dict):
            f.fail(f"field 'rope_parameters' entry {kind!r} must be an object, got {entry!r}")
        entry = dict(entry)
        if kind == "full_attention" and scaling:
            entry.update(scaling)
        entry.setdefault("rope_theta", f.raw.get(theta_key, theta))
        raw = {"rope_parameters": entry, "max_position_embeddings": _max_positions(f)}
        out[kind] = Fields(raw, f.model_type, f"{f.label} ({kind})").rope()
    return out


def _max_positions(f: Fields) -> int:
    return f.int("max_position_embeddings", DEFAULTS[f.model_type]["max_position_embeddings"])


def _scale(f: Fields) -> float | None:
    """The softmax scale: Gemma's head_dim ** -0.5 (None: the default), Gemma 2/3's query_pre_attn_scalar ** -0.5."""
    if f.model_type == "gemma":
        return None
    scalar = f.float("query_pre_attn_scalar", SCALAR)
    if scalar <= 0:
        f.fail(f"field 'query_pre_attn_scalar' must be > 0, got {scalar}")
    return scalar**-0.5


def read(f: Fields) -> ModelConfig:
    """A Gemma, Gemma 2 or Gemma 3 (text) config.json."""
    kind, defaults = f.model_type, DEFAULTS[f.model_type]
    d, n_heads = f.int("hidden_size"), f.int("num_attention_heads")
    n_kv = f.int("num_key_value_heads", defaults["num_key_value_heads"])
    head_dim = f.int("head_dim", HEAD_DIM)
    check_heads(f, d, n_heads, n_kv, head_dim, "num_key_value_heads")
    _activation(f)
    if f.raw.get("use_bidirectional_attention"):
        f.unsupported("use_bidirectional_attention", "attnlab's decoder is causal")
    eps = f.eps("rms_norm_eps", EPS)
    if kind == "gemma3_text":
        rope = _gemma3_rope(f)
    else:  # one RoPE for every layer
        rope = dict.fromkeys(
            LAYER_TYPES, f.within({"max_position_embeddings": _max_positions(f)} | f.raw).rope()
        )
    theta, scaling = rope["full_attention"]
    # Gemma 3 has an attn_logit_softcapping field but Gemma3Attention never applies it
    softcap = (
        _positive(f, "attn_logit_softcapping", defaults["attn_logit_softcapping"])
        if kind == "gemma2"
        else None
    )
    qk_norm = kind == "gemma3_text"
    attention = AttentionConfig(
        d_model=d,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        bias=f.bool("attention_bias", False),  # on q, k, v and o alike
        rope_theta=theta,
        rope_scaling=scaling,
        qk_norm="head" if qk_norm else "none",
        norm_eps=eps,
        norm_offset=1.0 if qk_norm else 0.0,
        scale=_scale(f),
        softcap=softcap,
    )
    n_layers = f.layers("num_hidden_layers")
    layer_types, sliding = (), None
    if kind != "gemma" and "sliding_attention" in (types := _layer_types(f, n_layers)):
        window = f.opt_int("sliding_window") if "sliding_window" in f.raw else WINDOW
        if window is None:
            f.fail("sliding_window is null but layer_types names sliding_attention layers")
        local_theta, local_scaling = rope["sliding_attention"]
        sliding = attention.replace(window=window, rope_theta=local_theta, rope_scaling=local_scaling)
        layer_types = tuple(types)
    final_softcap = None
    if kind != "gemma":
        final_softcap = _positive(f, "final_logit_softcapping", defaults["final_logit_softcapping"])
    return ModelConfig(
        vocab_size=f.int("vocab_size"),
        n_layers=n_layers,
        attention=attention,
        ffn_dim=f.int("intermediate_size"),
        max_seq_len=_max_positions(f),
        norm_eps=eps,
        mlp="geglu",
        tie_embeddings=f.bool("tie_word_embeddings", True),
        norm_offset=1.0,
        norm_placement="pre" if kind == "gemma" else "sandwich",
        embed_scale=d**0.5,
        final_softcap=final_softcap,
        layer_types=layer_types,
        sliding=sliding,
    )


# ---- writing ---------------------------------------------------------------------------------------------------


def _rope_dict(theta: float, scaling: tuple) -> dict[str, Any]:
    params = {
        k: (list(v) if isinstance(v, tuple) else v) for k, v in scaling if k != "max_position_embeddings"
    }
    return {"rope_type": "default"} | params | {"rope_theta": theta}


def _write_gemma3_rope(hf: dict[str, Any], cfg: ModelConfig) -> None:
    """``cfg``'s two RoPEs into ``hf`` as ``rope_parameters`` keyed by layer type, unless ``hf`` reads as them."""
    have = _gemma3_rope(Fields(hf, "gemma3_text"))
    local = cfg.sliding
    want = {
        "full_attention": (cfg.attention.rope_theta, cfg.attention.rope_scaling),
        "sliding_attention": have["sliding_attention"]
        if local is None
        else (local.rope_theta, local.rope_scaling),
    }
    if have == want:
        return
    for key in ("rope_scaling", "rope_theta", "rope_local_base_freq"):
        hf.pop(key, None)
    hf["rope_parameters"] = {kind: _rope_dict(*want[kind]) for kind in LAYER_TYPES}


def _comparable(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` without what a config.json does not hold (its name, the attention backend, dropout)."""
    runtime = dict(backend="auto", dropout=0.0)
    return cfg.replace(name="").map_attention(lambda a: a.replace(**runtime))


def _differences(ours: Any, theirs: Any, prefix: str = "") -> list[str]:
    out = []
    for fld in dataclasses.fields(ours):
        a, b = getattr(ours, fld.name), getattr(theirs, fld.name)
        if a == b:
            continue
        if dataclasses.is_dataclass(a) and type(a) is type(b):
            out += _differences(a, b, f"{prefix}{fld.name}.")
        else:
            out.append(f"{prefix}{fld.name}={a!r} (the checkpoint would hold {b!r})")
    return out


def write(cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
    """The config.json of ``cfg`` as a checkpoint of ``base``'s model_type (default gemma), changed from ``base`` only
    where ``cfg`` differs from it; a ValueError naming what that model_type cannot hold (read back to check)."""
    kind = base.get("model_type", "gemma")
    attn = cfg.attention
    if kind not in ARCHITECTURES:
        raise ValueError(f"model_type {kind!r} is not one of the Gemma family's: {', '.join(ARCHITECTURES)}")
    if not isinstance(attn, AttentionConfig):
        raise ValueError(f"only GQA/MHA/MQA attention can be written as a {kind} checkpoint")
    defaults = DEFAULTS[kind]
    hf = dict(base, model_type=kind, architectures=[ARCHITECTURES[kind]])
    put(hf, "hidden_size", attn.d_model)
    put(hf, "num_attention_heads", attn.n_heads)
    put(hf, "num_key_value_heads", attn.n_kv_heads, defaults["num_key_value_heads"])
    put(hf, "head_dim", attn.head_dim, HEAD_DIM)
    put(hf, "num_hidden_layers", cfg.n_layers)
    put(hf, "intermediate_size", cfg.ffn_dim)
    put(hf, "vocab_size", cfg.vocab_size)
    put(hf, "max_position_embeddings", cfg.max_seq_len, defaults["max_position_embeddings"])
    put(hf, "rms_norm_eps", cfg.norm_eps, EPS)
    put(hf, "tie_word_embeddings", cfg.tie_embeddings, True)
    put(hf, "attention_bias", attn.bias, False)
    if kind == "gemma3_text":
        _write_gemma3_rope(hf, cfg)
    else:
        rope_fields(hf, attn, kind)
    if kind != "gemma":
        if Fields(hf, kind).float("query_pre_attn_scalar", SCALAR) ** -0.5 != attn.softmax_scale:
            scalar = attn.softmax_scale**-2
            hf["query_pre_attn_scalar"] = (
                round(scalar) if round(scalar) ** -0.5 == attn.softmax_scale else scalar
            )
        put(hf, "final_logit_softcapping", cfg.final_softcap, defaults["final_logit_softcapping"])
        if kind == "gemma2":
            put(hf, "attn_logit_softcapping", attn.softcap, defaults["attn_logit_softcapping"])
        types = sliding_layer_types(cfg)
        put(hf, "layer_types", types, hf.get("layer_types") or _layer_types(Fields(hf, kind), cfg.n_layers))
        if cfg.sliding is not None:
            put(hf, "sliding_window", cfg.sliding.window, WINDOW)
    wrong = _differences(_comparable(cfg), _comparable(read(Fields(hf, kind))))
    if wrong:
        raise ValueError(f"a {kind} checkpoint cannot hold this model: {'; '.join(wrong)}")
    return hf


# ---- conversions -----------------------------------------------------------------------------------------------


def mla(cfg: ModelConfig) -> MLASupport:
    """``convert --to mla`` writes DeepSeek-V3, whose decoder has a SwiGLU MLP, RMSNorm before each sublayer only and
    unscaled embeddings, and whose attention has none of Gemma 2/3's extras: refused, with what this model has.
    (A head_dim other than hidden_size / num_attention_heads would be no obstacle: MLA's head sizes are free.)"""
    reasons = ["a GeGLU MLP and embeddings scaled by sqrt(hidden_size) (DeepSeek-V3: SwiGLU, unscaled)"]
    if cfg.norm_placement == "sandwich":
        reasons.append("sandwich norms")
    attentions = cfg.layer_attentions
    if any(a.softcap is not None for a in attentions):
        reasons.append(f"attention-logit soft-capping at {cfg.attention.softcap}")
    if cfg.final_softcap is not None:
        reasons.append(f"final-logit soft-capping at {cfg.final_softcap}")
    if any(a.qk_norm != "none" for a in attentions):
        reasons.append("q/k norms before RoPE")
    if cfg.sliding is not None and cfg.sliding.window < cfg.max_seq_len:
        reasons.append(f"sliding windows of {cfg.sliding.window} tokens")
    if len({(a.rope_theta, a.rope_scaling) for a in attentions}) > 1:
        reasons.append("a RoPE per layer type")
    if any(a.rope_scaling for a in attentions):
        reasons.append("scaled RoPE")
    return MLASupport("refused", "; ".join(reasons))


_SMALL = dict(
    vocab_size=320, hidden_size=48, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=64,
)  # fmt: skip

GEMMA = Family(
    "gemma",
    ("gemma",),
    read,
    write,
    TENSORS,
    {"gemma": ARCHITECTURES["gemma"]},
    mla=mla,
    covers="Gemma, CodeGemma",
    # (1 + w) norms, GeGLU, scaled embeddings, head_dim apart from hidden_size / heads, tied embeddings
    example=dict(_SMALL, model_type="gemma", num_hidden_layers=2),
)
GEMMA2 = Family(
    "gemma2",
    ("gemma2",),
    read,
    write,
    TENSORS_2,
    {"gemma2": ARCHITECTURES["gemma2"]},
    mla=mla,
    covers="Gemma 2",
    # sandwich norms, attention and final soft-capping, a window on alternate layers
    example=dict(
        _SMALL,
        model_type="gemma2",
        num_hidden_layers=2,
        sliding_window=8,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
)
GEMMA3 = Family(
    "gemma3_text",
    ("gemma3_text",),
    read,
    write,
    TENSORS_3,
    {"gemma3_text": ARCHITECTURES["gemma3_text"]},
    mla=mla,
    covers="Gemma 3 text models (gemma-3-1b; the text config of the larger multimodal ones)",
    # q/k norms, five sliding layers in six (here: the first of two), a RoPE per layer type
    example=dict(
        _SMALL,
        model_type="gemma3_text",
        num_hidden_layers=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
)
