"""GLM and GLM-4 (GLM-4-9B, GLM-4-0414): transformers' ``GlmForCausalLM`` and ``Glm4ForCausalLM``.

The decoder is Llama's (RMSNorm, SwiGLU, GQA) with these differences, all from transformers' ``modeling_glm.py`` /
``modeling_glm4.py``:

- RoPE turns only the first ``partial_rotary_factor`` of each head (0.5 unless config.json says otherwise: GlmConfig's
  default) and pairs dims (2i, 2i + 1), interleaved, not Llama's (i, i + d/2). The factor is read with transformers'
  precedence: inside ``rope_parameters`` (or ``rope_scaling``), else at the top level, else 0.5.
- ``attention_bias`` (default true) puts biases on q, k and v; o_proj and the MLP never have one.
- The MLP's gate and up projections are one tensor, ``gate_up_proj`` = [gate; up] (``GATE_UP_CONCAT``).
- GLM-4 adds a norm on the attention output and one on the MLP output before each residual sum (attnlab's
  "sandwich" placement). Its names cross attnlab's: GLM-4's ``post_attention_layernorm`` is the norm *before* the
  MLP (attnlab's ``ffn_norm``); the norm after attention is ``post_self_attn_layernorm``.
- Missing fields take GlmConfig's defaults, which are GLM-4-9B's, not Llama's: 2 KV heads, ``head_dim`` 128,
  ``rms_norm_eps`` 1.5625e-07, 131072 positions.

Tensor names (N = layer index):

    model.embed_tokens.weight                    tok_embeddings.weight
    model.layers.N.self_attn.{q,k,v}_proj        layers.N.attention.{wq,wk,wv}       (.weight, .bias)
    model.layers.N.self_attn.o_proj              layers.N.attention.wo
    model.layers.N.mlp.gate_up_proj              layers.N.feed_forward.{w1,w3}       (GATE_UP_CONCAT)
    model.layers.N.mlp.down_proj                 layers.N.feed_forward.w2
    model.layers.N.input_layernorm               layers.N.attention_norm
    model.layers.N.post_attention_layernorm      layers.N.ffn_norm
    model.layers.N.post_self_attn_layernorm      layers.N.post_attention_norm        (GLM-4)
    model.layers.N.post_mlp_layernorm            layers.N.post_ffn_norm              (GLM-4)
    model.norm / lm_head                         norm / output   (lm_head absent when embeddings are tied)

MLA (``mla``): approximate, as a Llama with one more exact step: the dims RoPE never turns go to DeepSeek's no-RoPE
part as they are, and the interleaved pairs are reordered into DeepSeek's rotary layout. Refused, each named, with a
query bias (``attention_bias``, the default: GLM-4-9B has one), with GLM-4's sandwich norms, and with a rope_type
whose frequencies a DeepSeek export cannot turn.
"""

from __future__ import annotations

from typing import Any

from ..config import ROPE_WITHOUT_PLAIN_PLANES, AttentionConfig, ModelConfig
from .base import (
    GATE_UP_CONCAT,
    Family,
    Fields,
    MLASupport,
    Rule,
    TensorMap,
    check_heads,
    put,
    rope_fields,
    rope_parameters,
    rotary_layout_note,
)

ARCHITECTURES = {"glm": "GlmForCausalLM", "glm4": "Glm4ForCausalLM"}
PLACEMENT = {"glm": "pre", "glm4": "sandwich"}

# GlmConfig / Glm4Config defaults (transformers 5), for fields a config.json leaves out
DEFAULT_KV_HEADS = 2
DEFAULT_HEAD_DIM = 128
DEFAULT_EPS = 1.5625e-07
DEFAULT_POSITIONS = 131072
DEFAULT_ROTARY_FACTOR = 0.5


def _rules(model_type: str) -> tuple[Rule, ...]:
    layer = "model.layers.{i}."
    renames = [
        ("self_attn.q_proj", "attention.wq"),
        ("self_attn.k_proj", "attention.wk"),
        ("self_attn.v_proj", "attention.wv"),
        ("self_attn.o_proj", "attention.wo"),
        ("mlp.down_proj", "feed_forward.w2"),
        ("input_layernorm", "attention_norm"),
        ("post_attention_layernorm", "ffn_norm"),
    ]
    if model_type == "glm4":
        renames += [
            ("post_self_attn_layernorm", "post_attention_norm"),
            ("post_mlp_layernorm", "post_ffn_norm"),
        ]
    rules = [Rule(f"{layer}{theirs}.{{p}}", (f"layers.{{i}}.{ours}.{{p}}",)) for theirs, ours in renames]
    rules.append(
        Rule(
            f"{layer}mlp.gate_up_proj.{{p}}",
            ("layers.{i}.feed_forward.w1.{p}", "layers.{i}.feed_forward.w3.{p}"),
            GATE_UP_CONCAT,
        )
    )
    rules += [
        Rule("model.embed_tokens.{p}", ("tok_embeddings.{p}",)),
        Rule("model.norm.{p}", ("norm.{p}",)),
        Rule("lm_head.{p}", ("output.{p}",)),
    ]
    return tuple(rules)


def rotary_factor(raw: dict[str, Any], model_type: str) -> Any:
    """``partial_rotary_factor`` as transformers resolves it: from the RoPE parameters, else the top level, else 0.5."""
    params = rope_parameters(raw, model_type)
    return params.get("partial_rotary_factor", raw.get("partial_rotary_factor", DEFAULT_ROTARY_FACTOR))


def _rope(f: Fields) -> tuple[float, tuple[tuple[str, Any], ...]]:
    """(theta, scaling) of a config.json: yarn and longrope read max_position_embeddings, whose default is GLM's."""
    positions = f.int("max_position_embeddings", DEFAULT_POSITIONS)
    return f.within(f.raw | {"max_position_embeddings": positions}).rope()


def read(f: Fields) -> ModelConfig:
    """A GLM or GLM-4 config.json."""
    d, n_heads = f.int("hidden_size"), f.int("num_attention_heads")
    n_kv = f.int("num_key_value_heads", DEFAULT_KV_HEADS)
    head_dim = f.int("head_dim", DEFAULT_HEAD_DIM)  # null would break GlmAttention too: an int is required
    check_heads(f, d, n_heads, n_kv, head_dim, "num_key_value_heads")
    if f.raw.get("hidden_act", "silu") != "silu":
        f.unsupported("hidden_act", "the MLP is SwiGLU: only 'silu'")
    factor = f.within({"partial_rotary_factor": rotary_factor(f.raw, f.model_type)}).float(
        "partial_rotary_factor"
    )
    rope_dim = int(head_dim * factor)  # transformers' int(), as GlmRotaryEmbedding computes it
    if not 0 < factor <= 1 or rope_dim < 2 or rope_dim % 2:
        f.fail(
            f"partial_rotary_factor={factor} turns {rope_dim} of head_dim={head_dim} dims: it must turn an even "
            "number of them, at least 2"
        )
    positions = f.int("max_position_embeddings", DEFAULT_POSITIONS)
    theta, scaling = _rope(f)
    attention = AttentionConfig(
        d_model=d,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        bias=f.bool("attention_bias", True),
        out_bias=False,
        rope_theta=theta,
        rope_scaling=scaling,
        rope_dim=rope_dim,
        rope_interleaved=True,
    )
    return ModelConfig(
        vocab_size=f.int("vocab_size"),
        n_layers=f.layers("num_hidden_layers"),
        attention=attention,
        ffn_dim=f.int("intermediate_size"),
        max_seq_len=positions,
        norm_eps=f.eps("rms_norm_eps", DEFAULT_EPS),
        tie_embeddings=f.bool("tie_word_embeddings", False),
        norm_placement=PLACEMENT[f.model_type],
    )


def _unwritable(cfg: ModelConfig, model_type: str) -> str | None:
    """What of ``cfg`` a checkpoint of ``model_type`` cannot say, or None."""
    attn = cfg.attention
    if not isinstance(attn, AttentionConfig):
        return "only GQA/MHA/MQA attention"
    if cfg.sliding is not None or attn.window is not None:
        return "no sliding window"
    if not attn.rope or not attn.rope_interleaved:
        return "RoPE in interleaved pairs only"
    if attn.has_out_bias or cfg.mlp_bias:
        return "no bias on o_proj or the MLP"
    if attn.qk_norm != "none" or attn.scale is not None or attn.softcap is not None:
        return "no q/k norm, softmax scale or soft-capping"
    if cfg.mlp != "swiglu" or cfg.norm != "rmsnorm" or cfg.norm_offset or cfg.parallel_residual:
        return "a SwiGLU MLP and RMSNorms with gain w only"
    if cfg.embed_scale != 1.0 or cfg.final_softcap is not None:
        return "no embedding scale or logit soft-capping"
    if cfg.norm_placement != PLACEMENT[model_type]:
        return f"norm_placement {PLACEMENT[model_type]!r}"
    return None


def write(cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
    """The config.json of ``cfg`` as a checkpoint of ``base``'s model_type (default glm), changed from ``base`` only
    where ``cfg`` differs from it."""
    model_type = base.get("model_type", "glm")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"the GLM writer writes glm or glm4 checkpoints, not {model_type!r}")
    why = _unwritable(cfg, model_type)
    if why is not None:
        raise ValueError(f"a {model_type} checkpoint has {why}")
    attn = cfg.attention
    hf = dict(base, model_type=model_type, architectures=[ARCHITECTURES[model_type]])
    put(hf, "hidden_size", attn.d_model)
    put(hf, "num_attention_heads", attn.n_heads)
    put(hf, "num_key_value_heads", attn.n_kv_heads, DEFAULT_KV_HEADS)
    put(hf, "head_dim", attn.head_dim, DEFAULT_HEAD_DIM)
    put(hf, "num_hidden_layers", cfg.n_layers)
    put(hf, "intermediate_size", cfg.ffn_dim)
    put(hf, "vocab_size", cfg.vocab_size)
    put(hf, "max_position_embeddings", cfg.max_seq_len, DEFAULT_POSITIONS)
    put(hf, "rms_norm_eps", cfg.norm_eps, DEFAULT_EPS)
    put(hf, "hidden_act", "silu", "silu")
    put(hf, "attention_bias", attn.bias, True)
    put(hf, "tie_word_embeddings", cfg.tie_embeddings, False)
    if _rope(Fields(hf, model_type)) != (attn.rope_theta, attn.rope_scaling):
        rope_fields(hf, attn, model_type)
    factor = attn.rotary_dim / attn.head_dim
    if rotary_factor(hf, model_type) != factor:
        key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
        params = hf.get(key)
        if isinstance(params, dict) and "partial_rotary_factor" in params:  # it overrides the top level
            hf[key] = params | {"partial_rotary_factor": factor}
        else:
            hf["partial_rotary_factor"] = factor
    return hf


APPROXIMATE_NOTE = (
    "RoPE-aware: exact with one KV head keeping every rotary plane, at full rank; otherwise the rotary planes kept "
    "and the latent rank bound the error (docs/mla_conversion.md)"
)
QUERY_BIAS = (
    "DeepSeek-V3's q_proj has none, and the per-key logit it adds (the bias times each key) cannot be folded into "
    "MLA's weights"
)


def rope_obstacle(attn: AttentionConfig) -> str | None:
    """Why a DeepSeek export cannot turn ``attn``'s scaled RoPE (transformers' rope_type), or None."""
    kind = attn.rope_type
    if kind in ROPE_WITHOUT_PLAIN_PLANES:
        return f"rope_parameters.rope_type={kind!r}: {ROPE_WITHOUT_PLAIN_PLANES[kind]}"
    return None


def mla(cfg: ModelConfig) -> MLASupport:
    """What ``convert --to mla`` makes of a GLM or GLM-4 model. Its partial, interleaved rotary is no obstacle (the
    dims RoPE never turns are DeepSeek's no-RoPE part, the pairs a fixed reordering of rows); a query bias (GLM's
    ``attention_bias``, on by default) and GLM-4's sandwich norms are, and a refusal names every one present."""
    attn, obstacles = cfg.attention, []
    if cfg.norm_placement == "sandwich":
        obstacles.append(
            "sandwich norms (post_self_attn_layernorm and post_mlp_layernorm on each sublayer's output): "
            "DeepSeek-V3's block normalises before each sublayer only"
        )
    if attn.bias:
        obstacles.append(f"a query bias (attention_bias: q, k and v biases): {QUERY_BIAS}")
    rope = rope_obstacle(attn)
    if rope:
        obstacles.append(rope)
    if obstacles:
        return MLASupport("refused", "; ".join(obstacles))
    return MLASupport("approximate", f"{rotary_layout_note(attn)}; {APPROXIMATE_NOTE}")


_SMALL = dict(
    vocab_size=320, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0,
)  # fmt: skip

GLM = Family(
    "glm",
    ("glm",),
    read,
    write,
    TensorMap(_rules("glm"), "GLM"),
    {"glm": ARCHITECTURES["glm"]},
    mla=mla,
    covers="GLM-4-9B (transformers' layout)",
    example=dict(_SMALL, model_type="glm"),  # q/k/v biases, rotary on half of each head in interleaved pairs
)
GLM4 = Family(
    "glm4",
    ("glm4",),
    read,
    write,
    TensorMap(_rules("glm4"), "GLM-4"),
    {"glm4": ARCHITECTURES["glm4"]},
    mla=mla,
    covers="GLM-4-0414, GLM-Z1",
    example=dict(_SMALL, model_type="glm4"),  # GLM's attention with sandwich norms
)
