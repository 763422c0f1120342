"""GPT-NeoX and Pythia: transformers' ``GPTNeoXForCausalLM``.

The block (``modeling_gpt_neox.py``): LayerNorm with a bias before attention and before the MLP, a plain GELU MLP
(``dense_4h_to_h(act(dense_h_to_4h x))``, both with biases), and the residual either parallel
(``use_parallel_residual``, the default: ``x + attn(ln1 x) + mlp(ln2 x)``) or sequential. Attention has biases on
the fused ``query_key_value`` and on ``dense`` (``attention_bias``, default true), the softmax scale
``head_dim ** -0.5`` with ``head_dim = hidden_size // num_attention_heads``, and RoPE on the first
``int(head_dim * rotary_pct)`` dims of each head in half-split pairs (``rotate_half`` over the rotary dims only).

RoPE fields, as ``GPTNeoXConfig.convert_rope_params_to_dict`` reads them: ``rope_parameters`` (or the older
``rope_scaling``) first; what they lack of ``rope_theta`` and ``partial_rotary_factor`` comes from the legacy
``rotary_emb_base`` (default 10000) and ``rotary_pct`` (default 0.25) that Pythia's config.json carries. A top-level
``rope_theta`` or ``partial_rotary_factor`` is not read by transformers, so not here either.

Activations: "gelu" is exact GELU (``F.gelu``). "gelu_pytorch_tanh" is ``F.gelu(approximate="tanh")`` itself;
"gelu_new" and "gelu_fast" write the same tanh formula out in tensor ops with the same constants (gelu_fast's
0.7978845608 is sqrt(2/pi) in float32), so they are that function up to the rounding of the order of operations
(2.4e-7 at most in float32). Every other activation is refused.

Fewer KV heads: ``GPTNeoXConfig`` has no KV-head field, and ``query_key_value`` interleaves q, k and v head by head
(``QKV_PER_HEAD``), which needs as many KV heads as query heads. ``attnlab convert --kv-heads`` therefore writes the
MHA layout with each KV head repeated for the query heads of its group (``Family.gqa == "repeated"``): the same
config.json, and the GQA model's values exactly.

Tensor names (N = layer index):

    gpt_neox.embed_in.weight                          tok_embeddings.weight
    gpt_neox.layers.N.input_layernorm                 layers.N.attention_norm            (.weight, .bias)
    gpt_neox.layers.N.post_attention_layernorm        layers.N.ffn_norm
    gpt_neox.layers.N.attention.query_key_value       layers.N.attention.{wq,wk,wv}      (QKV_PER_HEAD)
    gpt_neox.layers.N.attention.dense                 layers.N.attention.wo
    gpt_neox.layers.N.mlp.dense_h_to_4h               layers.N.feed_forward.w1
    gpt_neox.layers.N.mlp.dense_4h_to_h               layers.N.feed_forward.w2
    gpt_neox.final_layer_norm                         norm
    embed_out.weight                                  output.weight   (absent when tie_word_embeddings)

Older checkpoints also hold the buffers ``attention.bias`` and ``attention.masked_bias`` (a causal mask and its fill
value, which transformers ignores on load) and ``rotary_emb.inv_freq``: skipped, and copied as they are on export.
"""

from __future__ import annotations

import math
from typing import Any

from ..config import AttentionConfig, ModelConfig
from .base import QKV_PER_HEAD, Family, Fields, MLASupport, Rule, TensorMap, check_heads, put, rope_parameters

ARCHITECTURE = "GPTNeoXForCausalLM"
DEFAULT_THETA = 10000.0  # GPTNeoXConfig: rotary_emb_base
DEFAULT_ROTARY_PCT = 0.25  # GPTNeoXConfig: rotary_pct
# hidden_act -> attnlab's MLP kind (see the module docstring for why the tanh forms are one function)
ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
}
WRITTEN_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}

LAYER_RULES = (
    ("input_layernorm", "attention_norm"),
    ("post_attention_layernorm", "ffn_norm"),
    ("attention.dense", "attention.wo"),
    ("mlp.dense_h_to_4h", "feed_forward.w1"),
    ("mlp.dense_4h_to_h", "feed_forward.w2"),
)
TENSORS = TensorMap(
    (
        Rule(
            "gpt_neox.layers.{i}.attention.query_key_value.{p}",
            tuple(f"layers.{{i}}.attention.{w}.{{p}}" for w in ("wq", "wk", "wv")),
            QKV_PER_HEAD,
        ),
        *(
            Rule(f"gpt_neox.layers.{{i}}.{theirs}.{{p}}", (f"layers.{{i}}.{ours}.{{p}}",))
            for theirs, ours in LAYER_RULES
        ),
        Rule("gpt_neox.embed_in.{p}", ("tok_embeddings.{p}",)),
        Rule("gpt_neox.final_layer_norm.{p}", ("norm.{p}",)),
        Rule("embed_out.{p}", ("output.{p}",)),
    ),
    "GPT-NeoX",
    ignored=(r"(^|\.)rotary_emb\.inv_freq$", r"\.attention\.(bias|masked_bias)$"),
)


def _rope(f: Fields, head_dim: int) -> tuple[float, tuple[tuple[str, Any], ...], int]:
    """(theta, scaling, rotary dims per head) with ``GPTNeoXConfig``'s precedence (module docstring)."""
    theta = f.float("rotary_emb_base", DEFAULT_THETA)
    # Fields.rope fills a missing rope_theta from the top level: GPT-NeoX's is rotary_emb_base
    theta, scaling = f.within(dict(f.raw, rope_theta=theta)).rope()
    params = rope_parameters(f.raw, f.model_type)
    if "partial_rotary_factor" in params:
        key, pct = "partial_rotary_factor", f.within(params).float("partial_rotary_factor")
    else:
        key, pct = "rotary_pct", f.float("rotary_pct", DEFAULT_ROTARY_PCT)
    if not 0.0 <= pct <= 1.0:
        f.fail(f"{key}={pct} must be in [0, 1] (the fraction of each head's dims that RoPE turns)")
    rotary = int(head_dim * pct)  # as GPTNeoXAttention.rotary_ndims and the rotary embedding compute it
    if rotary % 2:
        f.fail(
            f"{key}={pct} gives {rotary} rotary dims of head_dim={head_dim}: transformers then turns "
            f"{rotary + 1} dims at frequencies of {rotary}, which attnlab does not model"
        )
    return theta, scaling, rotary


def read(f: Fields) -> ModelConfig:
    """A GPT-NeoX / Pythia config.json."""
    d, n_heads = f.int("hidden_size"), f.int("num_attention_heads")
    check_heads(f, d, n_heads, n_heads, None, "num_attention_heads")
    head_dim = d // n_heads
    # GPTNeoXAttention's heads are hidden_size // heads wide whatever head_dim says; its rotary embedding reads head_dim
    if f.raw.get("head_dim") not in (None, head_dim):
        f.unsupported("head_dim", f"the heads are hidden_size // num_attention_heads = {head_dim} wide")
    act = f.str("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        f.unsupported("hidden_act", f"the MLP is GELU: one of {', '.join(map(repr, ACTIVATIONS))}")
    theta, scaling, rotary = _rope(f, head_dim)
    attention = AttentionConfig(
        d_model=d,
        n_heads=n_heads,
        bias=f.bool("attention_bias", True),
        rope=rotary > 0,  # rotary_pct 0: no dims turn
        rope_theta=theta,
        rope_dim=None if rotary in (0, head_dim) else rotary,
        rope_scaling=scaling if rotary else (),
    )
    return ModelConfig(
        vocab_size=f.int("vocab_size"),
        n_layers=f.layers("num_hidden_layers"),
        attention=attention,
        ffn_dim=f.int("intermediate_size"),
        max_seq_len=f.int("max_position_embeddings", 2048),
        norm_eps=f.eps("layer_norm_eps", 1e-5),
        mlp=ACTIVATIONS[act],
        mlp_bias=True,  # GPTNeoXMLP's nn.Linear layers always have biases
        tie_embeddings=f.bool("tie_word_embeddings", False),
        norm="layernorm",
        parallel_residual=f.bool("use_parallel_residual", True),
    )


def _check_writable(cfg: ModelConfig) -> AttentionConfig:
    """``cfg``'s attention if ``GPTNeoXForCausalLM`` computes ``cfg``; a ValueError naming what it cannot."""
    attn = cfg.attention
    if not isinstance(attn, AttentionConfig):
        raise ValueError("only GQA/MHA/MQA attention can be written as a GPT-NeoX checkpoint")
    problems = []
    if attn.n_kv_heads != attn.n_heads:
        problems.append(
            f"n_kv_heads={attn.n_kv_heads} of n_heads={attn.n_heads} (GPTNeoXConfig has no KV-head field; "
            "attnlab convert writes fewer KV heads repeated in the MHA layout)"
        )
    if attn.head_dim * attn.n_heads != attn.d_model:
        problems.append(f"head_dim={attn.head_dim} (GPT-NeoX's is d_model // n_heads)")
    if cfg.norm != "layernorm" or cfg.norm_placement != "pre" or cfg.embed_scale != 1.0:
        problems.append("a block other than pre-LayerNorm (norm, norm_placement, embed_scale)")
    if cfg.mlp not in WRITTEN_ACTIVATION or not cfg.mlp_bias:
        problems.append(f"mlp={cfg.mlp!r}, mlp_bias={cfg.mlp_bias} (a GELU MLP with biases)")
    if attn.has_out_bias != attn.bias:
        problems.append("out_bias != bias (attention_bias is on query_key_value and dense alike)")
    if attn.rope_interleaved or attn.qk_norm != "none" or attn.softcap is not None:
        problems.append("interleaved RoPE, q/k norms or soft-capping")
    if attn.scale is not None and attn.scale != attn.head_dim**-0.5:
        problems.append(f"scale={attn.scale} (GPT-NeoX's is head_dim ** -0.5)")
    if cfg.sliding is not None or attn.window is not None or cfg.final_softcap is not None or cfg.is_moe:
        problems.append("sliding windows, logit soft-capping or experts")
    if problems:
        raise ValueError(f"GPTNeoXForCausalLM cannot compute this model: {'; '.join(problems)}")
    return attn


def _rotary_pct(rotary: int, head_dim: int) -> float:
    """A fraction whose ``int(head_dim * pct)`` is ``rotary``, as transformers computes the rotary dims."""
    pct = rotary / head_dim
    return pct if int(head_dim * pct) == rotary else math.nextafter(pct, 1.0)


def write(cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
    """The config.json of ``cfg`` as a GPT-NeoX checkpoint, changed from ``base`` only where ``cfg`` differs."""
    attn = _check_writable(cfg)
    hf = dict(base, model_type="gpt_neox", architectures=[ARCHITECTURE])
    put(hf, "hidden_size", attn.d_model)
    put(hf, "num_attention_heads", attn.n_heads)
    put(hf, "num_hidden_layers", cfg.n_layers)
    put(hf, "intermediate_size", cfg.ffn_dim)
    put(hf, "vocab_size", cfg.vocab_size)
    put(hf, "max_position_embeddings", cfg.max_seq_len, 2048)
    put(hf, "layer_norm_eps", cfg.norm_eps, 1e-5)
    if ACTIVATIONS.get(hf.get("hidden_act", "gelu")) != cfg.mlp:
        hf["hidden_act"] = WRITTEN_ACTIVATION[cfg.mlp]
    put(hf, "use_parallel_residual", cfg.parallel_residual, True)
    put(hf, "attention_bias", attn.bias, True)
    put(hf, "tie_word_embeddings", cfg.tie_embeddings, False)
    rotary = attn.rotary_dim if attn.rope else 0
    scaling = attn.rope_scaling if attn.rope else ()
    try:
        same = _rope(Fields(hf, "gpt_neox"), attn.head_dim) == (attn.rope_theta, scaling, rotary)
    except ValueError:  # the base's RoPE fields do not read: written anew
        same = False
    if not same:
        for key in ("rope_scaling", "rotary_emb_base", "rotary_pct", "rope_theta", "partial_rotary_factor"):
            hf.pop(key, None)
        params = {k: (list(v) if isinstance(v, tuple) else v) for k, v in scaling}
        params.pop("max_position_embeddings", None)
        pct = _rotary_pct(rotary, attn.head_dim)
        hf["rope_parameters"] = {"rope_type": "default", **params, "rope_theta": attn.rope_theta}
        hf["rope_parameters"]["partial_rotary_factor"] = pct
    return hf


def mla(cfg: ModelConfig) -> MLASupport:
    """``convert --to mla`` writes a DeepSeek-V3 checkpoint, whose block GPT-NeoX's is not."""
    attn = cfg.attention
    reasons = [
        "LayerNorm with a bias (DeepSeek-V3 has RMSNorm)",
        "a GELU MLP with biases (DeepSeek-V3's is SwiGLU without bias)",
    ]
    if cfg.parallel_residual:
        reasons.append("parallel residuals (DeepSeek-V3's block is sequential)")
    if isinstance(attn, AttentionConfig) and attn.bias:
        reasons.append(
            "a query bias (attention_bias, on query_key_value): DeepSeek-V3's q_proj has none, and the per-key "
            "logit it adds cannot be folded into MLA's weights"
        )
    # Its partial rotary is no obstacle (the converter keeps the dims RoPE never turns as DeepSeek's no-RoPE
    # part), nor is the per-head fused QKV (split on load): the block and the query bias are.
    return MLASupport("refused", "; ".join(reasons))


GPT_NEOX = Family(
    "gpt_neox",
    ("gpt_neox",),
    read,
    write,
    TENSORS,
    {"gpt_neox": ARCHITECTURE},
    gqa="repeated",
    mla=mla,
    covers="GPT-NeoX-20B, Pythia",
    # Pythia's shape: LayerNorm, GELU, parallel residual, rotary on a quarter of each head
    example=dict(
        model_type="gpt_neox",
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        rotary_pct=0.25,
        use_parallel_residual=True,
    ),
)
