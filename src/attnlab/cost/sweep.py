"""One model under every attention variant, side by side: what ``attnlab compare`` prints (``attnlab.bench.compare``
prints it, draws it and times it; here only the figures).

The variants keep the model's width, query heads and everything outside attention, and change only how
keys and values are kept:

- MHA, GQA-g for every g dividing n_heads, and MQA, all with the model's head_dim (for an MLA model, its
  ``v_head_dim``, the d_h of DeepSeek-V2's comparison);
- MLA with DeepSeek-V2's rule (arXiv 2405.04434, Sec. 2.1 and 3.1.2): kv_lora_rank = 4 * d_h,
  qk_rope_head_dim = d_h / 2, qk_nope_head_dim = v_head_dim = d_h, queries uncompressed, unless given.
  Its cache holds 4.5 d_h values per token per layer: GQA with 2.25 groups.

The model's own configuration is marked ``native``. With tensor parallelism (``tp`` > 1) every variant is costed
per rank (``attnlab.cost.parallel``); a variant whose KV heads cannot be split over tp ranks is left out and
named in ``skipped``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..config import AttentionConfig, MLAConfig, ModelConfig
from .hardware import Hardware, get_hardware
from .memory import dtype_name, kv_cache_bytes, kv_elements_per_token
from .parallel import (
    allreduce_bytes_per_token_per_layer,
    check_tp,
    kv_heads_per_rank,
    kv_replicas,
    rank_config,
    tp_comm,
)
from .params import model_param_count, param_count
from .roofline import roofline


@dataclass(frozen=True)
class Variant:
    label: str  # "mha", "gqa-8", "mqa", "mla"
    kind: str  # "mha" | "gqa" | "mqa" | "mla"
    model: ModelConfig
    native: bool

    @property
    def n_kv_heads(self) -> int:
        """KV heads cached per layer; MLA caches one latent row shared by all heads: 1."""
        attn = self.model.attention
        return attn.n_kv_heads if isinstance(attn, AttentionConfig) else 1


def base_head_dim(model_cfg: ModelConfig) -> int:
    attn = model_cfg.attention
    return attn.head_dim if isinstance(attn, AttentionConfig) else attn.v_head_dim


def mla_alternative(
    model_cfg: ModelConfig, *, kv_lora_rank: int | None = None, qk_rope_head_dim: int | None = None
) -> MLAConfig:
    """DeepSeek-V2's MLA shape for this model's width and heads (see the module docstring)."""
    attn, hd = model_cfg.attention, base_head_dim(model_cfg)
    rope_dim = qk_rope_head_dim if qk_rope_head_dim is not None else max(2, hd // 2 // 2 * 2)  # even for RoPE
    return MLAConfig(
        d_model=attn.d_model,
        n_heads=attn.n_heads,
        kv_lora_rank=kv_lora_rank if kv_lora_rank is not None else 4 * hd,
        qk_nope_head_dim=hd,
        qk_rope_head_dim=rope_dim,
        v_head_dim=hd,
        rope_theta=attn.rope_theta,
    )


def variants(
    model_cfg: ModelConfig, *, kv_lora_rank: int | None = None, qk_rope_head_dim: int | None = None
) -> list[Variant]:
    """MHA, GQA-g (g | n_heads, most KV heads first), MQA, then MLA; the model's own one marked native."""
    if not isinstance(model_cfg, ModelConfig):
        raise TypeError(f"model_cfg must be a ModelConfig, got {type(model_cfg).__name__}")
    attn, hd, h = model_cfg.attention, base_head_dim(model_cfg), model_cfg.n_heads
    out = []
    for g in sorted((g for g in range(1, h + 1) if h % g == 0), reverse=True):
        if isinstance(attn, AttentionConfig):
            cfg = attn.replace(n_kv_heads=g)
            native = g == attn.n_kv_heads
        else:
            cfg = AttentionConfig(
                d_model=attn.d_model, n_heads=h, n_kv_heads=g, head_dim=hd, rope_theta=attn.rope_theta
            )
            native = False
        kind = cfg.variant
        out.append(
            Variant(kind if kind != "gqa" else f"gqa-{g}", kind, model_cfg.with_attention(cfg), native)
        )
    if isinstance(attn, MLAConfig):
        out.append(Variant("mla", "mla", model_cfg, True))
    else:
        mla = mla_alternative(model_cfg, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim)
        out.append(Variant("mla", "mla", model_cfg.with_attention(mla), False))
    return out


@dataclass(frozen=True)
class CompareRow:
    variant: str
    label: str
    n_kv_heads: int
    native: bool
    equivalent_gqa_groups: float  # KV values per token per layer / (2 * d_h)
    # The whole model's sizes (one rank's: the *_per_rank fields below):
    kv_cache_bytes_per_token: int  # all layers
    kv_cache_bytes: int  # at batch x seq_len
    attention_params: int  # all layers
    model_params: int
    # One rank's steps (the whole model's when tp = 1):
    prefill_flops: int  # all layers, causal mask skipped (the roofline's count)
    prefill_seconds: float
    decode_step_flops: int
    decode_step_bytes: int
    decode_step_seconds: float
    decode_bound: str
    max_batch: int  # per rank: sequences of seq_len tokens that fit next to its weights
    max_context: int | None  # None: every layer slides, memory sets no limit
    # One of the tp ranks (the same as the figures above when tp = 1):
    kv_heads_per_rank: int  # KV heads a rank caches (MLA: 1, the latent)
    kv_replicas: int  # ranks caching each KV head (1: split, tp / n_kv_heads: replicated, MLA: tp)
    kv_cache_bytes_per_token_per_rank: int  # all layers
    kv_cache_bytes_per_rank: int  # at batch x seq_len
    weight_bytes_per_rank: int
    allreduce_bytes_per_token_per_layer: int  # forward, attention and MLP outputs; 0 when tp = 1
    decode_comm_seconds: float  # the decode step's share of waiting for the interconnect


@dataclass(frozen=True)
class Comparison:
    model: str
    hardware: str
    dtype: str
    batch: int
    seq_len: int
    tp: int
    memory_bytes: int  # of one device
    weight_bytes: int  # the native variant's, per rank
    rows: list[CompareRow]
    skipped: dict[str, str]  # variant label -> why it cannot be split over tp ranks
    link_bandwidth: float | None = None  # bytes/s per direction on the slowest hop of the tp ring (tp > 1)
    collectives_per_step: int = 0  # all-reduces and all-gathers per forward; each adds a latency not modelled
    # Sliding-window layers of the model (every GQA/MHA/MQA variant keeps them; MLA, as DeepSeek-V3, has none):
    # each caches min(window, seq_len) tokens, which kv_cache_bytes counts (kv_cache_bytes_per_token: every layer)
    n_layers: int = 0
    sliding_layers: int = 0
    window: int | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def native(self) -> CompareRow:
        return next(r for r in self.rows if r.native)

    def verdict(self) -> str:
        """One line: the native variant's cache and decode step against the best alternatives (per rank when
        tp > 1: what one GPU holds, replicas included); ties go to the native variant."""
        native = self.native
        fastest = min(
            self.rows, key=lambda r: (r.decode_step_seconds, r.kv_cache_bytes_per_rank, not r.native)
        )
        smallest = min(
            self.rows, key=lambda r: (r.kv_cache_bytes_per_rank, r.decode_step_seconds, not r.native)
        )
        where = f"{self.batch} x {self.seq_len} tokens on {self.hardware} ({self.dtype})"
        per_rank = f" per rank of tp={self.tp}" if self.tp > 1 else ""
        text = (
            f"{self.model}, {where}: native {native.label} needs {format_bytes(native.kv_cache_bytes_per_rank)} of KV cache"
            f"{per_rank} and {format_seconds(native.decode_step_seconds)} per decode step"
        )
        if smallest.kv_cache_bytes_per_rank < native.kv_cache_bytes_per_rank:
            ratio = native.kv_cache_bytes_per_rank / smallest.kv_cache_bytes_per_rank
            text += f"; {smallest.label} would shrink the cache {ratio:.1f}x"
        if fastest.decode_step_seconds < native.decode_step_seconds:
            ratio = native.decode_step_seconds / fastest.decode_step_seconds
            text += f", {fastest.label} would decode {ratio:.2f}x faster"
        else:
            text += ", no variant decodes faster"
        if self.weight_bytes > self.memory_bytes:
            return (
                text
                + f"; the weights ({format_bytes(self.weight_bytes)}{per_rank}) alone exceed the {format_bytes(self.memory_bytes)} of memory (try --tp)."
            )
        best = max(self.rows, key=lambda r: (r.max_batch, r.native))
        return (
            text
            + f"; max batch {native.max_batch} ({best.label}: {best.max_batch}). Quality is not modelled."
        )


def format_bytes(n: float) -> str:
    """A byte count as compare's table and sentence print it: two decimals in the largest binary unit it fills."""
    for scale, name in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return f"{n / scale:.2f} {name}"
    return f"{n:.0f} B"


def format_seconds(s: float) -> str:
    """A duration in the unit that shows its digits (a tiny model's decode step is microseconds, not 0.000 ms)."""
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.3g} µs"


def compare(
    model_cfg: ModelConfig,
    *,
    batch: int = 1,
    seq_len: int = 4096,
    dtype: str | torch.dtype = "bf16",
    hardware: Hardware | str = "h100",
    tp: int = 1,
    kv_lora_rank: int | None = None,
    qk_rope_head_dim: int | None = None,
) -> Comparison:
    """Every variant of ``model_cfg`` at ``batch`` x ``seq_len`` tokens on ``hardware``, per rank of ``tp``."""
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    if not isinstance(hw, Hardware):
        raise TypeError(f"hardware must be a Hardware or a name of the table, got {hardware!r}")
    dtype = dtype_name(dtype)
    check_tp(model_cfg, tp)  # the native variant must split: it is what the verdict is about
    rows = []
    skipped: dict[str, str] = {}
    weights = 0
    for v in variants(model_cfg, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim):
        try:
            check_tp(v.model, tp)
        except ValueError as err:
            skipped[v.label] = str(err)
            continue
        r = roofline(v.model, hw, batch=batch, seq_len=seq_len, dtype=dtype, tp=tp)
        per_layer = kv_elements_per_token(v.model.attention)
        local = rank_config(v.model, tp)
        if v.native:
            weights = r.weight_bytes
        rows.append(
            CompareRow(
                variant=v.kind,
                label=v.label,
                n_kv_heads=v.n_kv_heads,
                native=v.native,
                equivalent_gqa_groups=per_layer / (2 * base_head_dim(model_cfg)),
                kv_cache_bytes_per_token=kv_cache_bytes(v.model, 1, 1, dtype),
                kv_cache_bytes=kv_cache_bytes(v.model, batch, seq_len, dtype),
                attention_params=v.model.n_layers * param_count(v.model.attention),
                model_params=model_param_count(v.model),
                prefill_flops=r.prefill.flops,
                prefill_seconds=r.prefill.seconds,
                decode_step_flops=r.decode.flops,
                decode_step_bytes=r.decode.bytes,
                decode_step_seconds=r.decode.seconds,
                decode_bound=r.decode.bound,
                max_batch=r.max_batch,
                max_context=r.max_context,
                kv_heads_per_rank=kv_heads_per_rank(v.model.attention, tp),
                kv_replicas=kv_replicas(v.model.attention, tp),
                kv_cache_bytes_per_token_per_rank=kv_cache_bytes(local, 1, 1, dtype),
                kv_cache_bytes_per_rank=r.kv_cache_bytes,
                weight_bytes_per_rank=r.weight_bytes,
                allreduce_bytes_per_token_per_layer=allreduce_bytes_per_token_per_layer(v.model, dtype, hw)
                if tp > 1
                else 0,
                decode_comm_seconds=r.decode.comm_seconds,
            )
        )
    comm = tp_comm(model_cfg, hw, tp, tokens=1, sampled=1)
    windows = [getattr(a, "window", None) for a in model_cfg.layer_attentions]
    sliding = [w for w in windows if w is not None]
    return Comparison(
        model=model_cfg.name or "model",
        hardware=hw.name,
        dtype=dtype,
        batch=batch,
        seq_len=seq_len,
        tp=tp,
        memory_bytes=hw.memory_bytes,
        weight_bytes=weights,
        rows=rows,
        skipped=skipped,
        link_bandwidth=comm.link_bandwidth if tp > 1 else None,
        collectives_per_step=comm.collectives,
        n_layers=model_cfg.n_layers,
        sliding_layers=len(sliding),
        window=min(sliding) if sliding else None,
    )
