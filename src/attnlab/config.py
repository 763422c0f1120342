"""Architecture configs, validated on construction.

Configs describe the architecture only; runtime sizes (batch, cache length, dtype) are arguments of the
functions that need them. Derived values (``n_rep``, ``variant``, ...) are properties. The only values filled in
by ``__post_init__`` are documented ``None`` defaults (``n_kv_heads = n_heads``, ``head_dim = d_model // n_heads``);
a value the caller gives is never replaced.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

BACKENDS = ("auto", "reference", "sdpa", "grouped", "fused")
MLA_MODES = ("auto", "naive", "absorbed")
MLP_KINDS = ("swiglu", "gelu")
NORM_KINDS = ("rmsnorm", "layernorm")


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


def _check_float(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}.{name} must be a number, got {value!r} ({type(value).__name__})")


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
        _check_bool(owner, ("bias", self.bias), ("rope", self.rope))
        if self.out_bias is not None:
            _check_bool(owner, ("out_bias", self.out_bias))

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

    def mode_for(self, t_q: int, paged: bool = False, mode: str | None = None) -> str:
        """The mode ("naive" or "absorbed") a call of ``t_q`` new tokens per row runs in: ``mode`` (default: the
        config's) unless it is "auto".

        "auto": absorbed over a paged cache (naive needs a contiguous latent) and wherever it costs no more FLOPs.
        Per head and cached token, naive pays the decompression once, ``2 r (d_nope + d_v)``, whatever ``t_q``;
        absorbed pays for each query the wider dot products, ``2 (2 r - d_nope - d_v)`` more (scores over
        ``r + d_rope`` instead of ``d_nope + d_rope``, values over ``r`` instead of ``d_v``). So naive wins once
        ``t_q (2 r - d_nope - d_v) > r (d_nope + d_v)``: from 81 queries at rank 320 and 64 + 64 dims, from 171
        at DeepSeek-V3's 512 and 128 + 128; a decode step (one query) is absorbed."""
        mode = self.mode if mode is None else mode
        if mode != "auto":
            return mode
        r, dims = self.kv_lora_rank, self.qk_nope_head_dim + self.v_head_dim
        return "naive" if not paged and t_q * (2 * r - dims) > r * dims else "absorbed"

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
        _check_float(owner, "norm_eps", self.norm_eps)
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
        if attention.d_model != self.d_model:
            raise ValueError(
                f"attention.d_model={attention.d_model} does not match the model's d_model={self.d_model}"
            )
        return dataclasses.replace(self, attention=attention)
