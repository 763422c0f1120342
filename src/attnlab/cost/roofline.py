"""Roofline latency of prefill and of one decode step, and what fits in the device's memory.

A phase takes ``max(FLOPs / peak FLOP/s, bytes / bandwidth)`` (Williams, Waterman and Patterson, "Roofline",
CACM 2009): the ideal time if compute and memory traffic overlap perfectly; real kernels reach a fraction of it.
The peak of a dtype narrower than float32 is the faster of its own and float32's (``compute_peak`` says why).

- Prefill of ``seq_len`` tokens per sequence: FLOPs with the causal mask skipped (``causal=True``, as flash
  kernels do); bytes = the weights read once (every expert: a long prompt routes to all of them) plus the KV
  cache written.
- One decode step at a context of ``seq_len``: FLOPs of one new token per sequence attending to ``seq_len``
  keys; bytes = ``decode_step_bytes`` (the weights and the whole KV cache).
- MLA runs each phase in whichever mode is faster (DeepSeek's own inference decompresses for prefill and
  absorbs for decode); the mode is reported.
- Memory: the weights plus the KV cache at ``seq_len`` tokens must fit in ``memory_bytes`` (activations and
  allocator slack are not counted, so these maxima are upper bounds).
- Tensor parallelism (``tp`` > 1): every figure is one rank's, computed on its share of the model
  (``attnlab.cost.parallel.rank_config``: a KV head replicated on several ranks is cached on each, MLA's latent on
  all), and each phase also waits for its all-reduces over the hardware's interconnect (``tp_comm``), which a
  tensor-parallel step cannot overlap with the layers that need their result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import MLAConfig, ModelConfig, check_int
from .flops import model_flops
from .hardware import Hardware, get_hardware
from .memory import decode_step_bytes, dtype_bits, dtype_name, kv_cache_bytes, weight_bytes_read
from .parallel import rank_config, tp_comm
from .params import model_param_count


@dataclass(frozen=True)
class PhaseCost:
    flops: int
    bytes: int
    compute_seconds: float
    memory_seconds: float
    mla_mode: str | None = None  # the MLA mode the figures are for; None for MHA/GQA/MQA
    comm_bytes: int = 0  # tensor parallelism: payload of the step's all-reduces and all-gathers
    comm_seconds: float = 0.0  # ... and the time the ring takes on the interconnect

    @property
    def seconds(self) -> float:
        return max(self.compute_seconds, self.memory_seconds) + self.comm_seconds

    @property
    def bound(self) -> str:
        if self.comm_seconds > max(self.compute_seconds, self.memory_seconds):
            return "interconnect"
        return "compute" if self.compute_seconds >= self.memory_seconds else "memory"

    @property
    def arithmetic_intensity(self) -> float:
        return self.flops / self.bytes


@dataclass(frozen=True)
class Roofline:
    model: str
    hardware: str
    dtype: str
    batch: int
    seq_len: int
    tp: int  # ranks that split every layer by heads; the byte figures below are one rank's
    prefill: PhaseCost
    decode: PhaseCost
    weight_bytes: int
    kv_cache_bytes: int
    memory_bytes: int
    max_batch: int  # sequences of seq_len tokens that fit next to the weights (0: the weights alone do not)
    max_context: int | None  # tokens per sequence that fit at this batch (None: every layer slides, no limit)

    @property
    def fits(self) -> bool:
        return self.weight_bytes + self.kv_cache_bytes <= self.memory_bytes


def weight_bytes(model_cfg: ModelConfig, dtype: str | torch.dtype = "bf16") -> int:
    """Bytes of all the weights (every expert, every embedding table)."""
    return -(-model_param_count(model_cfg) * dtype_bits(dtype) // 8)


def compute_peak(hw: Hardware, dtype: str | torch.dtype) -> float:
    """The best rate at which products of ``dtype`` can be computed on ``hw``: for any dtype but float64, the
    faster of its own peak and float32's.

    A value of a narrower dtype widens to float32 exactly, so its products can always run at float32's rate (the
    fused CPU kernel widens bfloat16 in registers). On a CPU without fast native bfloat16 arithmetic, the measured
    bfloat16 peak (PyTorch's bfloat16 matmul there) is far below float32's, and taken alone it predicted a 7B
    decode step of 11-34 s, "compute bound"; on GPUs float32 is the slower rate, so the rule changes nothing.
    Weights stored narrower than the table's dtypes (int8, int4, fp6) are computed in bf16 after dequantising.
    """
    dtype = dtype_name(dtype)
    if dtype == "fp64" and dtype not in hw.peak_flops:  # no faster rate may stand in for it
        raise ValueError(
            f"hardware {hw.name!r} has no float64 peak FLOP/s ({hw.source}); choose a device the table gives one "
            "(h100, h200, a100-80gb) or another --dtype"
        )
    compute = dtype if dtype in hw.peak_flops else "bf16"
    if compute not in hw.peak_flops:
        raise ValueError(
            f"hardware {hw.name!r} has no peak FLOP/s for dtype {dtype!r}; it has {', '.join(hw.peak_flops)}"
        )
    peak = hw.peak_flops[compute]
    if dtype != "fp64":
        peak = max(peak, hw.peak_flops.get("fp32", 0.0))
    return peak


def step_seconds(hw: Hardware, flops: float, n_bytes: float, dtype: str | torch.dtype) -> float:
    """The roofline time of ``flops`` and ``n_bytes`` of memory traffic on one ``hw`` device, nothing to communicate
    (``PhaseCost.seconds``); what a benchmark compares a measured step with."""
    return PhaseCost(flops, n_bytes, flops / compute_peak(hw, dtype), n_bytes / hw.bandwidth).seconds


def _phase(model_cfg: ModelConfig, fn, peak: float, bandwidth: float, comm) -> PhaseCost:
    """The phase cost of ``model_cfg``; for MLA the faster of its two modes."""
    extra = {"comm_bytes": comm.allreduce_bytes + comm.allgather_bytes, "comm_seconds": comm.seconds}
    attn = model_cfg.attention
    if not isinstance(attn, MLAConfig):
        flops, nbytes = fn(model_cfg)
        return PhaseCost(flops, nbytes, flops / peak, nbytes / bandwidth, **extra)
    costs = []
    for mode in ("naive", "absorbed"):
        flops, nbytes = fn(model_cfg.with_attention(attn.replace(mode=mode)))
        costs.append(PhaseCost(flops, nbytes, flops / peak, nbytes / bandwidth, mla_mode=mode, **extra))
    return min(costs, key=lambda c: (c.seconds, c.flops))


def roofline(
    model_cfg: ModelConfig,
    hardware: Hardware | str = "h100",
    *,
    batch: int = 1,
    seq_len: int = 4096,
    dtype: str | torch.dtype = "bf16",
    kv_dtype: str | torch.dtype | None = None,
    tp: int = 1,
) -> Roofline:
    """Prefill and decode time on ``hardware`` and the largest batch / context that fit, for one of ``tp``
    tensor-parallel ranks; see the module docstring."""
    if not isinstance(model_cfg, ModelConfig):
        raise TypeError(f"model_cfg must be a ModelConfig, got {type(model_cfg).__name__}")
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    if not isinstance(hw, Hardware):
        raise TypeError(f"hardware must be a Hardware or a name of the table, got {hardware!r}")
    for name, value in (("batch", batch), ("seq_len", seq_len), ("tp", tp)):
        check_int(name, value)
    dtype = dtype_name(dtype)
    kv_dtype = dtype if kv_dtype is None else dtype_name(kv_dtype)
    peak, bandwidth, memory = compute_peak(hw, dtype), hw.bandwidth, hw.memory_bytes
    whole, model_cfg = model_cfg, rank_config(model_cfg, tp)
    prefill_comm = tp_comm(whole, hw, tp, tokens=batch * seq_len, sampled=batch, dtype=dtype)
    decode_comm = tp_comm(whole, hw, tp, tokens=batch, sampled=batch, dtype=dtype)

    def prefill(cfg: ModelConfig) -> tuple[int, int]:
        flops = model_flops(cfg, batch, seq_len, seq_len, causal=True).total
        nbytes = weight_bytes_read(cfg, batch * seq_len, dtype) + kv_cache_bytes(
            cfg, batch, seq_len, kv_dtype
        )
        return flops, nbytes

    def decode(cfg: ModelConfig) -> tuple[int, int]:
        flops = model_flops(cfg, batch, 1, seq_len).total
        return flops, decode_step_bytes(cfg, batch, seq_len, dtype, kv_dtype)

    weights = weight_bytes(model_cfg, dtype)
    kv = kv_cache_bytes(model_cfg, batch, seq_len, kv_dtype)
    free = memory - weights
    per_sequence = kv_cache_bytes(model_cfg, 1, seq_len, kv_dtype)
    return Roofline(
        model=whole.name,
        hardware=hw.name,
        dtype=dtype,
        batch=batch,
        seq_len=seq_len,
        tp=tp,
        prefill=_phase(model_cfg, prefill, peak, bandwidth, prefill_comm),
        decode=_phase(model_cfg, decode, peak, bandwidth, decode_comm),
        weight_bytes=weights,
        kv_cache_bytes=kv,
        memory_bytes=memory,
        max_batch=max(free // per_sequence, 0),
        max_context=longest_context(model_cfg, batch, free, kv_dtype),
    )


def longest_context(
    cfg: ModelConfig, batch: int, free: int, kv_dtype: str | torch.dtype = "bf16"
) -> int | None:
    """The most tokens per sequence whose cache for ``batch`` sequences fits in ``free`` bytes, each sliding layer
    holding at most its window (``kv_cache_bytes``); None where every layer slides and the windows fit: the cache
    stops growing, and memory sets no limit."""

    def fits(t: int) -> bool:
        return kv_cache_bytes(cfg, batch, t, kv_dtype) <= free

    if not fits(1):
        return 0
    windows = [getattr(a, "window", None) for a in cfg.layer_attentions]
    if None not in windows and fits(max(windows)):
        return None
    lo, hi = 1, 2  # fits(lo), and then not fits(hi)
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
