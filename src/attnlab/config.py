"""Architecture configs, validated on construction.

Configs describe the architecture only; runtime sizes (batch, cache length, dtype) are arguments of the
functions that need them. Derived values (``n_rep``, ``variant``, ...) are properties. The only values filled in
by ``__post_init__`` are documented ``None`` defaults (``n_kv_heads = n_heads``, ``head_dim = d_model // n_heads``);
a value the caller gives is never replaced.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BACKENDS = (
    *("auto", "reference", "sdpa", "grouped", "fused", "flex", "triton_mla"),
    *("flashinfer", "flashinfer_mla"),  # FlashInfer's kernels, run when named (not yet measured on a GPU)
)
MLA_MODES = ("auto", "naive", "absorbed")
# MLPs: gated ``w2(act(w1 x) * w3 x)`` with SiLU (SwiGLU, Llama) or tanh-GELU (GeGLU, Gemma); plain ``w2(act(w1 x))``
# with exact GELU (GPT-NeoX, BERT) or tanh-GELU (GPT-2).
MLP_KINDS = ("swiglu", "geglu", "gelu", "gelu_tanh")
GATED_MLPS = ("swiglu", "geglu")
NORM_KINDS = ("rmsnorm", "layernorm")  # LayerNorm has a bias as well as a gain
# Where a block's norms sit: before each sublayer (Llama), after it on its output before the residual sum (OLMo 2),
# or both (Gemma 2/3, GLM-4).
NORM_PLACEMENTS = ("pre", "post", "sandwich")
QK_NORMS = (
    "none",
    "head",
    "full",
)  # RMSNorm of each head's q and k (Qwen3, Gemma 3) or of all heads at once (OLMo 2)
LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' names
# Scaled RoPE (``AttentionConfig.rope_scaling``) and MLA, whose RoPE is plain (``MLAConfig.rope_theta``: the one
# rotary setting every engine computes alike for a DeepSeek config). "llama3" and "yarn" leave their fastest planes
# at plain RoPE's frequencies, which an MLA conversion therefore keeps exactly (``attnlab.convert.mla``); the
# others leave none, for the reason given.
ROPE_KEEPING_FAST_PLANES = ("llama3", "yarn")
# The scaled rope_types attnlab computes, each with the parameters that transformers' ROPE_INIT_FUNCTIONS read
# without a default (longrope's: a factor per rotary plane).
ROPE_NEEDS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
ROPE_WITHOUT_PLAIN_PLANES = {
    "dynamic": "its frequencies change with the sequence length, and a DeepSeek export turns by fixed ones",
    "longrope": "per-plane factor lists that switch with the sequence length, and a DeepSeek export turns by "
    "fixed frequencies",
    "linear": "every frequency is divided by its factor, so no plane turns at a plain RoPE frequency "
    "(DeepSeek's first is 1), and vLLM serves any rope_type of a DeepSeek config as DeepSeek YaRN",
}


SEED_LIMIT = 2**64  # torch.manual_seed takes 0 .. 2**64 - 1 (a negative seed is wrapped to one of those)


def check_seed(seed: object, flag: str = "--seed") -> int:
    """``seed`` checked: an int in [0, 2**64), the range torch seeds a generator with. One rule for every command
    (``generate`` took -5, and 10**23 met the user as "Overflow when unpacking long long", after the load)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{flag} must be an int, got {seed!r}")
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"{flag} must be in [0, 2**64), got {seed}")
    return seed


def env_switch(name: str, default: bool) -> bool:
    """An on/off environment variable: unset or empty is ``default``, else "1" or "0". Anything else ("false",
    "off") once left the switch as it was, silently (or, for ATTNLAB_BACKENDS, turned it on): a ValueError naming
    the variable."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name}={os.environ[name]!r}: expected 1 (on) or 0 (off)")
    return default if not value else value == "1"


def check_int(name: str, value: Any, *, minimum: int = 1) -> int:
    """``value`` if it is an int >= ``minimum``; else a TypeError or ValueError naming ``name`` and the value.

    The one integer validator of the package (configs, caches, the cost model's sizes).
    """
    # bool is an int subclass; n_heads=True is a bug, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_int(owner: str, name: str, value: Any, *, minimum: int = 1) -> None:
    check_int(f"{owner}.{name}", value, minimum=minimum)


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def rope_parameter_problem(rope_type: str, params: dict[str, Any], sequence: type = tuple) -> str | None:
    """What ``params`` lacks of ``ROPE_NEEDS[rope_type]`` ("needs KEY, a number; got VALUE"; longrope's factors are a
    ``sequence`` of numbers: a tuple in ``AttentionConfig``, a list in config.json), or None."""
    for key in ROPE_NEEDS[rope_type]:
        value, listed = params.get(key), rope_type == "longrope"  # longrope: a factor per rotary plane
        if not (isinstance(value, sequence) and all(map(is_number, value)) if listed else is_number(value)):
            need = f"a {sequence.__name__} of numbers" if listed else "a number"
            return f"rope_type {rope_type!r} needs {key}, {need}; got {value!r}"
        # a factor of 0 divided the frequencies by zero (every logit NaN, exit 0); a negative one reversed them
        if key.endswith("factor") and not all(
            v > 0 and math.isfinite(v) for v in (value if listed else [value])
        ):
            return f"rope_type {rope_type!r} needs {key} > 0 (finite); got {value!r}"
    return None


def _check_float(owner: str, name: str, value: Any) -> None:
    if not is_number(value):
        raise TypeError(f"{owner}.{name} must be a number, got {value!r} ({type(value).__name__})")


def _check_finite(owner: str, name: str, value: Any, *, zero: bool) -> None:
    """A finite number > 0 (>= 0 with ``zero``): a norm's epsilon, a scale."""
    _check_float(owner, name, value)
    if not (value >= 0 if zero else value > 0) or not math.isfinite(value):
        raise ValueError(f"{owner}.{name} must be a finite number {'>=' if zero else '>'} 0, got {value}")


def _check_bool(owner: str, *names_values: tuple[str, Any]) -> None:
    for name, value in names_values:
        if not isinstance(value, bool):
            raise TypeError(f"{owner}.{name} must be True or False, got {value!r} ({type(value).__name__})")


def _check_choice(owner: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{owner}.{name} must be one of {', '.join(choices)}; got {value!r}")


@dataclass(frozen=True)
class AttentionConfig:
    """Multi-head attention with ``n_kv_heads`` shared key/value heads (MHA, GQA or MQA).

    Query head ``i`` reads KV head ``i // n_rep``: consecutive query heads share a KV head, the layout of
    Hugging Face's ``repeat_kv`` and of every public GQA checkpoint.
    """

    d_model: int
    n_heads: int
    n_kv_heads: int | None = None  # None: n_heads (MHA)
    head_dim: int | None = None  # None: d_model // n_heads
    bias: bool = False
    rope: bool = True
    rope_theta: float = 10000.0
    dropout: float = 0.0
    backend: str = "auto"
    out_bias: bool | None = None  # bias on wo; None: same as ``bias`` (Qwen2: bias=True, out_bias=False)
    # RoPE on the first ``rope_dim`` dims of each head (None: all of them; Phi-4-mini, GPT-NeoX, GLM rotate part),
    # as pairs (i, i + rope_dim/2) or, ``rope_interleaved``, as pairs (2i, 2i + 1) (GLM, ChatGLM).
    rope_dim: int | None = None
    rope_interleaved: bool = False
    # Scaled RoPE: transformers' ``rope_parameters`` of a type other than "default" as sorted (key, value) pairs
    # (lists as tuples), e.g. (("factor", 8.0), ("rope_type", "llama3"), ...); the angles come from transformers'
    # own ROPE_INIT_FUNCTIONS (``attnlab.attention.rope``). Empty: plain RoPE.
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    qk_norm: str = "none"  # RMSNorm of q and k before RoPE: per head ("head") or over all heads ("full")
    norm_eps: float = 1e-6  # of the q/k norms
    norm_offset: float = 0.0  # the q/k norms' gain is offset + weight (Gemma 3: 1)
    norm_gain_float32: bool = False  # the q/k norms apply their gain before the cast back (OLMo 2; RMSNorm)
    scale: float | None = (
        None  # softmax scale; None: head_dim ** -0.5 (Gemma 2/3: query_pre_attn_scalar ** -0.5)
    )
    softcap: float | None = None  # attention logits become softcap * tanh(logits / softcap) (Gemma 2)
    window: int | None = None  # sliding window: a query sees the last ``window`` positions, its own included

    def __post_init__(self) -> None:
        owner = "AttentionConfig"
        _check_int(owner, "d_model", self.d_model)
        _check_int(owner, "n_heads", self.n_heads)
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        _check_int(owner, "n_kv_heads", self.n_kv_heads)
        if self.n_kv_heads > self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"AttentionConfig.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}"
            )
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"AttentionConfig.d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "give head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        _check_int(owner, "head_dim", self.head_dim)
        if self.rope and self.head_dim % 2:
            raise ValueError(f"AttentionConfig.head_dim={self.head_dim} must be even when rope=True")
        _check_float(owner, "rope_theta", self.rope_theta)
        if not 0 < self.rope_theta < math.inf:  # also refuses NaN
            raise ValueError(f"AttentionConfig.rope_theta must be a finite number > 0, got {self.rope_theta}")
        _check_float(owner, "dropout", self.dropout)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"AttentionConfig.dropout must be in [0, 1), got {self.dropout}")
        _check_choice(owner, "backend", self.backend, BACKENDS)
        _check_bool(
            owner, ("bias", self.bias), ("rope", self.rope), ("rope_interleaved", self.rope_interleaved)
        )
        if self.out_bias is not None:
            _check_bool(owner, ("out_bias", self.out_bias))
        if self.rope_dim is not None:
            _check_int(owner, "rope_dim", self.rope_dim, minimum=2)
            if self.rope_dim % 2 or self.rope_dim > self.head_dim:
                raise ValueError(
                    f"AttentionConfig.rope_dim={self.rope_dim} must be even and at most head_dim={self.head_dim}"
                )
        if not isinstance(self.rope_scaling, tuple) or not all(
            isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], str) for kv in self.rope_scaling
        ):
            raise TypeError(
                f"AttentionConfig.rope_scaling must be a tuple of (name, value) pairs, got {self.rope_scaling!r}"
            )
        if self.rope_type != "default":
            if self.rope_type not in ROPE_NEEDS:
                raise ValueError(
                    f"AttentionConfig.rope_scaling: rope_type {self.rope_type!r} is not one of "
                    f"{', '.join(('default', *ROPE_NEEDS))}"
                )
            problem = rope_parameter_problem(self.rope_type, dict(self.rope_scaling))
            if problem:
                raise ValueError(f"AttentionConfig.rope_scaling: {problem}")
        _check_choice(owner, "qk_norm", self.qk_norm, QK_NORMS)
        _check_finite(owner, "norm_eps", self.norm_eps, zero=True)
        _check_float(owner, "norm_offset", self.norm_offset)
        _check_bool(owner, ("norm_gain_float32", self.norm_gain_float32))
        for name in ("scale", "softcap"):
            value = getattr(self, name)
            if value is not None:
                _check_float(owner, name, value)
                if not 0 < value < math.inf:
                    raise ValueError(
                        f"AttentionConfig.{name} must be a finite number > 0 or None, got {value}"
                    )
        if self.window is not None:
            _check_int(owner, "window", self.window)

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE turns (``rope_dim``, or all of them)."""
        return self.head_dim if self.rope_dim is None else self.rope_dim

    @property
    def rope_parameters(self) -> dict[str, Any]:
        """``rope_scaling`` as the dict transformers reads (empty for plain RoPE)."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.rope_scaling}

    @property
    def rope_type(self) -> str:
        """transformers' ``rope_parameters.rope_type`` of ``rope_scaling`` ("default": plain RoPE)."""
        params = dict(self.rope_scaling)
        return params.get("rope_type", params.get("type", "default"))

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_dim**-0.5

    @property
    def has_out_bias(self) -> bool:
        """Whether ``wo`` has a bias: ``out_bias`` if given, else ``bias``."""
        return self.bias if self.out_bias is None else self.out_bias

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (the group size)."""
        return self.n_heads // self.n_kv_heads

    @property
    def variant(self) -> str:
        if self.n_kv_heads == self.n_heads:
            return "mha"
        return "mqa" if self.n_kv_heads == 1 else "gqa"

    def replace(self, **changes: Any) -> AttentionConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek-V2/V3 multi-head latent attention.

    Each token is cached as a normalised latent of ``kv_lora_rank`` values plus one rotary key of
    ``qk_rope_head_dim`` values shared by all heads. ``mode`` picks how attention is computed from that cache:
    "naive" decompresses per-head keys and values; "absorbed" folds ``wkv_b`` into the query and the output;
    "auto" (the default) picks per call, by FLOPs (``mode_for``): absorbed for decode steps, naive for prefill.
    """

    d_model: int
    n_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0: queries are not compressed
    rope_theta: float = 10000.0
    bias: bool = False  # bias on wq / wq_a / wkv_a / wo (DeepSeek's attention_bias)
    dropout: float = 0.0
    backend: str = "auto"
    mode: str = "auto"
    kv_norm: bool = True  # RMSNorm on the latent (DeepSeek); False keeps K/V linear in x (attnlab.convert)

    def __post_init__(self) -> None:
        owner = "MLAConfig"
        for name in ("d_model", "n_heads", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            _check_int(owner, name, getattr(self, name))
        _check_int(owner, "qk_nope_head_dim", self.qk_nope_head_dim, minimum=0)
        _check_int(owner, "q_lora_rank", self.q_lora_rank, minimum=0)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLAConfig.qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        _check_float(owner, "rope_theta", self.rope_theta)
        if not 0 < self.rope_theta < math.inf:  # also refuses NaN
            raise ValueError(f"MLAConfig.rope_theta must be a finite number > 0, got {self.rope_theta}")
        _check_float(owner, "dropout", self.dropout)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"MLAConfig.dropout must be in [0, 1), got {self.dropout}")
        _check_choice(owner, "backend", self.backend, BACKENDS)
        _check_choice(owner, "mode", self.mode, MLA_MODES)
        _check_bool(owner, ("bias", self.bias), ("kv_norm", self.kv_norm))

    def mode_for(
        self,
        t_q: int,
        paged: bool = False,
        mode: str | None = None,
        *,
        kv_len: int | None = None,
        pairs: int | None = None,
    ) -> str:
        """The mode ("naive" or "absorbed") a call of ``t_q`` new tokens per row over ``kv_len`` keys (default
        ``t_q``: no cache) runs in: ``mode`` (default: the config's) unless it is "auto". ``pairs``: the (query,
        key) pairs scored per row and head (default: those under the causal mask).

        "auto": absorbed over a paged cache (naive needs a contiguous latent), else whichever costs fewer FLOPs
        (absorbed where they tie), counted as ``attnlab.cost.attention_flops`` counts them. Per head, naive
        decompresses every key's latent, ``2 r (d_nope + d_v)`` per key; absorbed moves every query into the
        latent and its output back, the same ``2 r (d_nope + d_v)`` per query, and its products are
        ``2 (2 r - d_nope - d_v)`` wider per pair (scores over ``r + d_rope`` instead of ``d_nope + d_rope``,
        values over ``r`` instead of ``d_v``). So naive wins once ``(kv_len - t_q) r (d_nope + d_v) < pairs
        (2 r - d_nope - d_v)``: without a cache always (when ``2 r > d_nope + d_v``); over a long cache from
        about ``t_q > r (d_nope + d_v) / (2 r - d_nope - d_v)`` new tokens, 171 at DeepSeek-V3's 512 and
        128 + 128; a decode step (one query) over a cache is absorbed."""
        mode = self.mode if mode is None else mode
        if mode != "auto":
            return mode
        r, dims = self.kv_lora_rank, self.qk_nope_head_dim + self.v_head_dim
        kv = t_q if kv_len is None else kv_len
        scored = t_q * kv - t_q * (t_q - 1) // 2 if pairs is None else pairs
        return "naive" if not paged and (kv - t_q) * r * dims < scored * (2 * r - dims) else "absorbed"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5

    @property
    def variant(self) -> str:
        return "mla"

    @property
    def cache_dim(self) -> int:
        """Values cached per token per layer: the latent plus the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def replace(self, **changes: Any) -> MLAConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ModelConfig:
    """A decoder (or, for cost only, encoder) stack whose attention is any variant.

    ``attention`` carries ``d_model`` and the attention architecture. The MLP is SwiGLU (Llama) or GELU
    (GPT-2/BERT); mixture-of-experts fields exist so the cost model can describe DeepSeek models, but
    ``attnlab.model.Transformer`` builds dense models only.
    """

    vocab_size: int
    n_layers: int
    attention: AttentionConfig | MLAConfig
    ffn_dim: int
    max_seq_len: int = 4096
    norm_eps: float = 1e-5
    mlp: str = "swiglu"
    mlp_bias: bool = False
    tie_embeddings: bool = False
    # Mixture of experts (cost model only). Layers [0, n_dense_layers) use the dense MLP of width ffn_dim.
    n_experts: int = 0
    n_shared_experts: int = 0
    n_active_experts: int = 0
    moe_ffn_dim: int = 0
    n_dense_layers: int = 0
    # Cost model only (GPT-2/BERT): LayerNorm has a bias as well as a gain; learned absolute position and
    # token-type (segment) embeddings; BERT's pooler (a d_model x d_model dense layer with bias).
    norm: str = "rmsnorm"
    n_positions: int = 0
    n_token_types: int = 0
    pooler: bool = False
    name: str = ""
    # The decoder's options (defaults: Llama). See ``attnlab.model`` for how each is computed.
    norm_offset: float = 0.0  # a norm's gain is offset + weight (Gemma: RMSNorm with 1 + w)
    # The norms apply their gain in float32 before casting back to the activations' dtype (OLMo 2), not after
    # (Llama); Gemma's offset norms always do. The same in float32; in bfloat16 they round differently.
    norm_gain_float32: bool = False
    norm_placement: str = "pre"  # NORM_PLACEMENTS
    parallel_residual: bool = False  # x + attention(norm1 x) + mlp(norm2 x) (GPT-NeoX)
    embed_scale: float = 1.0  # token embeddings times this, in their dtype (Gemma: sqrt(d_model))
    final_softcap: float | None = None  # logits become cap * tanh(logits / cap) (Gemma 2)
    # Layers of two kinds (``LAYER_TYPES``): "sliding_attention" layers use ``sliding`` (its ``window`` set), the
    # others ``attention``. Empty: every layer is ``sliding``'s when it is given (Mistral), else ``attention``'s.
    layer_types: tuple[str, ...] = ()
    sliding: AttentionConfig | None = None

    def __post_init__(self) -> None:
        owner = "ModelConfig"
        _check_int(owner, "vocab_size", self.vocab_size)
        _check_int(owner, "n_layers", self.n_layers)
        _check_int(owner, "ffn_dim", self.ffn_dim)
        _check_int(owner, "max_seq_len", self.max_seq_len)
        if not isinstance(self.attention, (AttentionConfig, MLAConfig)):
            raise TypeError(
                "ModelConfig.attention must be an AttentionConfig or MLAConfig, "
                f"got {type(self.attention).__name__}"
            )
        _check_choice(owner, "mlp", self.mlp, MLP_KINDS)
        _check_bool(
            owner,
            ("mlp_bias", self.mlp_bias),
            ("tie_embeddings", self.tie_embeddings),
            ("pooler", self.pooler),
        )
        _check_choice(owner, "norm", self.norm, NORM_KINDS)
        for name in ("n_positions", "n_token_types"):
            _check_int(owner, name, getattr(self, name), minimum=0)
        _check_finite(owner, "norm_eps", self.norm_eps, zero=True)
        _check_float(owner, "norm_offset", self.norm_offset)
        _check_bool(owner, ("norm_gain_float32", self.norm_gain_float32))
        _check_choice(owner, "norm_placement", self.norm_placement, NORM_PLACEMENTS)
        _check_bool(owner, ("parallel_residual", self.parallel_residual))
        _check_finite(owner, "embed_scale", self.embed_scale, zero=False)
        if self.final_softcap is not None:
            _check_float(owner, "final_softcap", self.final_softcap)
            if not 0 < self.final_softcap < math.inf:
                raise ValueError(
                    f"ModelConfig.final_softcap must be a finite number > 0, got {self.final_softcap}"
                )
        if not isinstance(self.layer_types, tuple):
            raise TypeError(f"ModelConfig.layer_types must be a tuple, got {type(self.layer_types).__name__}")
        if self.layer_types:
            if len(self.layer_types) != self.n_layers:
                raise ValueError(
                    f"ModelConfig.layer_types has {len(self.layer_types)} entries for n_layers={self.n_layers}"
                )
            for kind in self.layer_types:
                _check_choice(owner, "layer_types", kind, LAYER_TYPES)
        if self.sliding is not None:
            if not isinstance(self.sliding, AttentionConfig) or not isinstance(
                self.attention, AttentionConfig
            ):
                raise TypeError(
                    "ModelConfig.sliding must be an AttentionConfig, beside an AttentionConfig attention"
                )
            if self.sliding.window is None:
                raise ValueError("ModelConfig.sliding needs its window (AttentionConfig.window)")
            if self.sliding.d_model != self.d_model:
                raise ValueError(
                    f"ModelConfig.sliding.d_model={self.sliding.d_model} is not d_model={self.d_model}"
                )
        elif "sliding_attention" in self.layer_types:
            raise ValueError("ModelConfig.layer_types names sliding_attention layers but sliding is None")
        for name in ("n_experts", "n_shared_experts", "n_active_experts", "moe_ffn_dim", "n_dense_layers"):
            _check_int(owner, name, getattr(self, name), minimum=0)
        if self.n_experts:
            if not 1 <= self.n_active_experts <= self.n_experts:
                raise ValueError(
                    f"ModelConfig.n_active_experts={self.n_active_experts} must be in [1, n_experts="
                    f"{self.n_experts}]"
                )
            if self.moe_ffn_dim < 1:
                raise ValueError("ModelConfig.moe_ffn_dim must be >= 1 when n_experts > 0")
            if self.n_dense_layers > self.n_layers:
                raise ValueError(
                    f"ModelConfig.n_dense_layers={self.n_dense_layers} exceeds n_layers={self.n_layers}"
                )

    @property
    def d_model(self) -> int:
        return self.attention.d_model

    @property
    def n_heads(self) -> int:
        return self.attention.n_heads

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def with_attention(self, attention: AttentionConfig | MLAConfig) -> ModelConfig:
        """Every layer's attention made ``attention`` (sliding layers keep their window when it is a GQA config; an MLA
        config, which has none, replaces them too)."""
        if attention.d_model != self.d_model:
            raise ValueError(
                f"attention.d_model={attention.d_model} does not match the model's d_model={self.d_model}"
            )
        sliding, layer_types = self.sliding, self.layer_types
        if sliding is not None and isinstance(attention, AttentionConfig):
            sliding = attention.replace(window=sliding.window)
        elif sliding is not None:  # MLA has no window: every layer becomes this attention
            sliding, layer_types = None, ()
        return dataclasses.replace(self, attention=attention, sliding=sliding, layer_types=layer_types)

    def map_attention(
        self, change: Callable[[AttentionConfig | MLAConfig], AttentionConfig | MLAConfig]
    ) -> ModelConfig:
        """``change`` applied to the attention of both kinds of layers (e.g. fewer KV heads everywhere)."""
        sliding = None if self.sliding is None else change(self.sliding)
        return dataclasses.replace(self, attention=change(self.attention), sliding=sliding)

    def attention_of(self, layer: int) -> AttentionConfig | MLAConfig:
        """The attention config of layer ``layer``."""
        if self.sliding is not None and (
            not self.layer_types or self.layer_types[layer] == "sliding_attention"
        ):
            return self.sliding
        return self.attention

    @property
    def layer_attentions(self) -> tuple[AttentionConfig | MLAConfig, ...]:
        """Every layer's attention config, in order."""
        return tuple(self.attention_of(i) for i in range(self.n_layers))
