"""Llama, Mistral and Qwen2 (Llama 1/2/3.x, Mistral, Qwen2/2.5; DeepSeek-67B is a Llama): transformers'
``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``.

The decoder is attnlab's default one (pre RMSNorm, SwiGLU, RoPE in half-split pairs on every head dim). What differs:

- RoPE frequencies: any ``rope_parameters`` type transformers computes (Llama 3.x "llama3", Qwen2.5's "yarn",
  "linear", "dynamic", "longrope"); see ``attnlab.attention.rope``.
- Biases: Llama's ``attention_bias`` is on q, k, v and o, ``mlp_bias`` on the MLP; Qwen2 has q/k/v biases and
  none on o; Mistral none. Only Llama's config reads the two flags (transformers' Mistral and Qwen2 classes ignore
  them, and so does attnlab).
- Sliding windows: Mistral's ``sliding_window`` applies to every layer (transformers' default 4096 when the field
  is absent), Ministral's (``model_type`` ministral, or mistral with ``layer_types``, which transformers loads as
  Ministral) to the layers its ``layer_types`` name; Qwen2's only with ``use_sliding_window``, to the layers its
  ``layer_types`` name (by default those from ``max_window_layers`` on), as transformers' ``Qwen2Config`` decides.

Tensor names (N = layer index):

    model.embed_tokens.weight                  tok_embeddings.weight
    model.layers.N.self_attn.{q,k,v,o}_proj    layers.N.attention.{wq,wk,wv,wo}      (.weight, .bias)
    model.layers.N.input_layernorm             layers.N.attention_norm
    model.layers.N.mlp.{gate,down,up}_proj     layers.N.feed_forward.{w1,w2,w3}
    model.layers.N.post_attention_layernorm    layers.N.ffn_norm
    model.norm / lm_head                       norm / output   (lm_head absent when embeddings are tied)

Meta's original checkpoints pair RoPE dims (2i, 2i + 1): ``attnlab.hf.llama`` permutes their rows on import.
"""

from __future__ import annotations

from typing import Any

from ..config import ROPE_KEEPING_FAST_PLANES, ROPE_WITHOUT_PLAIN_PLANES, AttentionConfig, ModelConfig
from .base import (
    Family,
    Fields,
    MLASupport,
    Rule,
    TensorMap,
    check_heads,
    check_layer_types,
    mlp_obstacle,
    put,
    rope_fields,
    sliding_layer_types,
)

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "ministral": "MinistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# What a missing num_key_value_heads and max_position_embeddings mean to transformers' LlamaConfig, MistralConfig
# and Qwen2Config; another model_type read by these functions: the head count and 4096. An explicit null KV count
# is the head count (LlamaConfig and Qwen2Config; MistralConfig before transformers 5, whose validation refuses it).
_KV_HEADS = {"mistral": 8, "ministral": 8, "qwen2": 32}
_POSITIONS = {"llama": 2048, "mistral": 4096 * 32, "ministral": 4096 * 32, "qwen2": 32768}
_MISTRAL = ("mistral", "ministral")  # Ministral: Mistral with a layer_types list (which full, which sliding)

LAYER_RULES = (
    ("self_attn.q_proj", "attention.wq"),
    ("self_attn.k_proj", "attention.wk"),
    ("self_attn.v_proj", "attention.wv"),
    ("self_attn.o_proj", "attention.wo"),
    ("input_layernorm", "attention_norm"),
    ("post_attention_layernorm", "ffn_norm"),
    ("mlp.gate_proj", "feed_forward.w1"),
    ("mlp.down_proj", "feed_forward.w2"),
    ("mlp.up_proj", "feed_forward.w3"),
)
TOP_RULES = (("model.embed_tokens", "tok_embeddings"), ("model.norm", "norm"), ("lm_head", "output"))


def decoder_rules(
    layer: tuple[tuple[str, str], ...], top: tuple[tuple[str, str], ...] = TOP_RULES
) -> tuple[Rule, ...]:
    """Renames of a decoder's tensors: ``model.layers.{i}.<theirs>.{p}`` <-> ``layers.{i}.<ours>.{p}``, and the
    top-level ``<theirs>.{p}`` <-> ``<ours>.{p}``."""
    rules = [
        Rule(f"model.layers.{{i}}.{theirs}.{{p}}", (f"layers.{{i}}.{ours}.{{p}}",)) for theirs, ours in layer
    ]
    rules += [Rule(f"{theirs}.{{p}}", (f"{ours}.{{p}}",)) for theirs, ours in top]
    return tuple(rules)


TENSORS = TensorMap(decoder_rules(LAYER_RULES), "Llama-family")


def _windows(f: Fields, n_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(sliding window, layer types) as transformers' Mistral, Ministral and Qwen2 configs decide them."""
    if f.model_type in _MISTRAL:
        window = f.opt_int("sliding_window") if "sliding_window" in f.raw else 4096  # MistralConfig's default
        types = f.raw.get("layer_types")
        if types is None:  # every layer slides
            return window, ()
        return _sliding_types(f, check_layer_types(f, types, n_layers), window)
    if f.model_type == "qwen2":
        return qwen_windows(f, n_layers)
    return None, ()


def qwen_windows(f: Fields, n_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(sliding window, layer types) as ``Qwen2Config`` and ``Qwen3Config`` decide them: ``sliding_window`` (default
    4096) counts only with ``use_sliding_window``; ``layer_types``, when absent, slides the layers from
    ``max_window_layers`` (default 28) on; sliding layers without a window are refused, as transformers cannot
    build their mask."""
    use = f.bool("use_sliding_window", False)
    window = (f.opt_int("sliding_window") if "sliding_window" in f.raw else 4096) if use else None
    types = f.raw.get("layer_types")
    if types is None:
        first = f.int("max_window_layers", 28, minimum=0)
        types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(n_layers)]  # fmt: skip
    return _sliding_types(f, check_layer_types(f, types, n_layers), window, "use_sliding_window, ")


def _sliding_types(
    f: Fields, types: list[str], window: int | None, fields: str = ""
) -> tuple[int | None, tuple[str, ...]]:
    """(window, layer types) of checked ``layer_types``: sliding layers without a window are refused, as
    transformers cannot build their mask; a window no layer uses is none (``convert --to mla`` refused a Ministral
    whose layers all attend to everything, for its window)."""
    if "sliding_attention" not in types:
        return None, ()
    if window is None:
        f.fail(f"layer_types names sliding_attention layers but no window is set ({fields}sliding_window)")
    return window, tuple(types)


def read(f: Fields) -> ModelConfig:
    """A Llama, Mistral or Qwen2 config.json."""
    d, n_heads = f.int("hidden_size"), f.int("num_attention_heads")
    n_kv = f.int("num_key_value_heads", _KV_HEADS.get(f.model_type, n_heads), null=n_heads)
    head_dim = f.opt_int("head_dim")
    check_heads(f, d, n_heads, n_kv, head_dim, "num_key_value_heads")
    if f.raw.get("hidden_act", "silu") != "silu":
        f.unsupported("hidden_act", "the MLP is SwiGLU: only 'silu'")
    # pretraining_tp (Llama 2's configs: 1 or 2) only sliced the projections' products in transformers 4.x, summed
    # back to the same model; transformers 5 ignores it, and so does attnlab (it stays in a written config.json)
    llama = f.model_type not in (*_MISTRAL, "qwen2")  # (or another model_type read as a Llama)
    if f.model_type == "qwen2":
        bias, out_bias = True, False  # Qwen2 puts biases on q/k/v only (modeling_qwen2.py)
    else:
        bias, out_bias = f.bool("attention_bias", False) if llama else False, None
    theta, scaling = f.rope()
    attention = AttentionConfig(
        d_model=d,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        bias=bias,
        out_bias=out_bias,
        rope_theta=theta,
        rope_scaling=scaling,
    )
    n_layers = f.layers("num_hidden_layers")
    window, layer_types = _windows(f, n_layers)
    return ModelConfig(
        vocab_size=f.int("vocab_size"),
        n_layers=n_layers,
        attention=attention,
        ffn_dim=f.int("intermediate_size"),
        max_seq_len=f.int("max_position_embeddings", _POSITIONS.get(f.model_type, 4096)),
        norm_eps=f.eps("rms_norm_eps", 1e-6),
        mlp_bias=f.bool("mlp_bias", False) if llama else False,
        tie_embeddings=f.bool("tie_word_embeddings", False),
        sliding=None if window is None else attention.replace(window=window),
        layer_types=layer_types if window is not None else (),
    )


def write(cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
    """The config.json of ``cfg`` as a checkpoint of ``base``'s model_type (default llama), changed from ``base``
    only where ``cfg`` differs from it."""
    model_type = base.get("model_type", "llama")
    attn = cfg.attention
    if not isinstance(attn, AttentionConfig):
        raise ValueError("only GQA/MHA/MQA attention can be written as a Llama-family checkpoint")
    if model_type == "qwen2" and not (attn.bias and not attn.has_out_bias):
        raise ValueError("qwen2 needs AttentionConfig(bias=True, out_bias=False)")
    if model_type in _MISTRAL and (attn.bias or attn.has_out_bias or cfg.mlp_bias):
        raise ValueError("mistral has no biases; AttentionConfig.bias and ModelConfig.mlp_bias must be False")
    if model_type == "llama" and attn.has_out_bias != attn.bias:
        raise ValueError("llama puts attention_bias on q, k, v and o alike; out_bias must equal bias")
    hf = dict(base, model_type=model_type)
    if model_type in ARCHITECTURES:  # (a family registered with these readers keeps its own class name)
        hf["architectures"] = [ARCHITECTURES[model_type]]
    put(hf, "hidden_size", attn.d_model)
    put(hf, "num_attention_heads", attn.n_heads)
    put(hf, "num_key_value_heads", attn.n_kv_heads, _KV_HEADS.get(model_type, hf.get("num_attention_heads")))
    put(hf, "head_dim", attn.head_dim, attn.d_model // attn.n_heads)
    put(hf, "num_hidden_layers", cfg.n_layers)
    put(hf, "intermediate_size", cfg.ffn_dim)
    put(hf, "vocab_size", cfg.vocab_size)
    put(hf, "max_position_embeddings", cfg.max_seq_len, _POSITIONS.get(model_type, 4096))
    put(hf, "rms_norm_eps", cfg.norm_eps, 1e-6)
    put(hf, "hidden_act", "silu", "silu")
    put(hf, "tie_word_embeddings", cfg.tie_embeddings, False)
    if model_type == "llama":
        put(hf, "attention_bias", attn.bias, False)
        put(hf, "mlp_bias", cfg.mlp_bias, False)
    rope_fields(hf, attn, model_type)
    window = None if cfg.sliding is None else cfg.sliding.window
    if model_type in _MISTRAL:
        put(hf, "sliding_window", window, 4096)
        if cfg.layer_types or "layer_types" in hf:  # (Ministral's: which layers slide)
            hf["layer_types"] = sliding_layer_types(cfg)
    elif model_type == "qwen2" and (window is not None or hf.get("use_sliding_window")):
        hf.update(use_sliding_window=window is not None, sliding_window=window)
        hf["layer_types"] = sliding_layer_types(cfg)
    elif window is not None:
        raise ValueError("llama has no sliding window; write the model as mistral or qwen2")
    return hf


def mla(cfg: ModelConfig) -> MLASupport:
    """What ``convert --to mla`` makes of a Llama-family model: DeepSeek-V3 has plain RoPE (kept planes at a new
    theta), no sliding window and no query bias; of the scaled RoPEs only llama3 and yarn, which leave their fastest
    planes at plain RoPE frequencies, can keep any plane (``attnlab.config.ROPE_KEEPING_FAST_PLANES``). A refusal
    names every obstacle present."""
    attn, obstacles = cfg.attention, []
    kind = attn.rope_type if attn.rope else "default"
    if kind in ROPE_WITHOUT_PLAIN_PLANES:
        obstacles.append(f"rope_parameters.rope_type={kind!r}: {ROPE_WITHOUT_PLAIN_PLANES[kind]}")
    if cfg.sliding is not None and cfg.sliding.window < cfg.max_seq_len:
        obstacles.append(
            f"a sliding window of {cfg.sliding.window} tokens: DeepSeek-V3 attends to the whole context (a config "
            "without one, sliding_window null as Mistral NeMo's, or one past every position, converts)"
        )
    if attn.bias:
        obstacles.append(
            "a query bias (attention_bias, or Qwen2's q/k/v biases): DeepSeek-V3's q_proj has none, and the "
            "per-key logit it adds cannot be folded into MLA's weights"
        )
    if mlp := mlp_obstacle(cfg):  # mlp_bias: the MLPs are kept as they are, and DeepSeek-V3's have no bias
        obstacles.append(mlp)
    if obstacles:
        return MLASupport("refused", "; ".join(obstacles))
    if kind in ROPE_KEEPING_FAST_PLANES:
        folded = (
            "; yarn's attention factor on cos and sin is folded into the queries, exactly (source_attention_factor)"
            if kind == "yarn"
            else ""
        )
        return MLASupport(
            "approximate",
            f"rope_type {kind!r}: only the planes it leaves at plain RoPE frequencies, its fastest "
            "(source_plain_planes; --rope-dim at most twice their number), keep RoPE, exported as plain RoPE at a "
            "new theta, exactly; the scaled planes lose RoPE and keep their mean rotation at their scaled "
            f"frequencies{folded}; the rotary planes kept and the latent rank bound the error "
            "(docs/mla_conversion.md)",
        )
    return MLASupport(
        "approximate",
        "RoPE-aware: exact without RoPE, or with one KV head keeping every rotary plane, at full rank; otherwise the "
        "rotary planes kept and the latent rank bound the error (docs/mla_conversion.md)",
    )


_SMALL = dict(
    vocab_size=320, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
)  # fmt: skip

LLAMA = Family(
    "llama",
    ("llama",),
    read,
    write,
    TENSORS,
    {"llama": ARCHITECTURES["llama"]},
    mla=mla,
    covers="Llama 2, Llama 3 / 3.1 / 3.2 / 3.3, DeepSeek LLM, SmolLM2, TinyLlama",
    # Llama 3.2's shape: GQA, tied embeddings, llama3 RoPE
    example=dict(
        _SMALL,
        model_type="llama",
        tie_word_embeddings=True,
        rope_parameters=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
            rope_theta=500000.0,
        ),
    ),
)
MISTRAL = Family(
    "mistral",
    _MISTRAL,
    read,
    write,
    TENSORS,
    {t: ARCHITECTURES[t] for t in _MISTRAL},
    mla=mla,
    covers="Mistral 7B (its sliding window), Mistral NeMo, Ministral",
    example=dict(_SMALL, model_type="mistral", sliding_window=8),
)
QWEN2 = Family(
    "qwen2",
    ("qwen2",),
    read,
    write,
    TENSORS,
    {"qwen2": ARCHITECTURES["qwen2"]},
    mla=mla,
    covers="Qwen2, Qwen2.5 (yarn long-context configs, sliding layers)",
    # Qwen2.5's shape: q/k/v biases, tied embeddings, theta 1e6
    example=dict(_SMALL, model_type="qwen2", tie_word_embeddings=True, rope_theta=1000000.0),
)
