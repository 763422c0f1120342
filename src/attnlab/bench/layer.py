"""Predicted against measured: one decode step of one attention layer of each variant, on this machine.

The prediction is the roofline of that layer on ``local`` hardware (``measure_local``): FLOPs of one new token
per sequence attending to ``seq_len`` keys, bytes = the layer's weights plus its KV cache. The measurement
builds the layer with random weights, a cache holding ``seq_len - 1`` tokens, and times the step that adds
the ``seq_len``-th (best of several runs after a warm-up, as the local bandwidth and matmul rates are), through the
module's default backend, over a ring of such layers (``_time_step``) so that each step reads from memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..attention import GroupedQueryAttention, MultiHeadLatentAttention, fused
from ..cache import KVCache
from ..config import AttentionConfig, MLAConfig
from ..cost import Hardware, Variant, attention_flops, dtype_bits, dtype_name, kv_cache_bytes, param_count
from ..cost.memory import TORCH_DTYPES
from ..cost.roofline import step_seconds
from .decode import ring_size
from .machine import MEASURED_DTYPES, measure_local, memory_bytes


@dataclass(frozen=True)
class LayerTiming:
    label: str
    flops: int
    bytes: int
    predicted_seconds: float
    measured_seconds: float
    layer: str = "full attention"  # which of the model's layers was timed (timed_layer)
    tokens: int = 0  # the cached tokens its decode step read

    @property
    def ratio(self) -> float:
        """measured / predicted: how far from the roofline this layer runs."""
        return self.measured_seconds / self.predicted_seconds


def _common_layer(variant: Variant) -> AttentionConfig | MLAConfig:
    """The attention most of ``variant``'s layers have (ties: the first)."""
    kinds = variant.model.layer_attentions
    return max(kinds, key=kinds.count)


def timed_layer(variant: Variant, seq_len: int) -> tuple[AttentionConfig | MLAConfig, int]:
    """The layer timed for ``variant``: the attention most of its layers have (ties: the first), and the tokens a
    decode step of it reads. A sliding-window layer reads at most its window, and is timed and priced as a layer
    without one over that many (its ring cannot be cropped back after each timed step); Mistral's layers were
    timed and priced as full attention over every token."""
    cfg = _common_layer(variant)
    window = getattr(cfg, "window", None)
    if window is None:
        return cfg, seq_len
    return cfg.replace(window=None), min(seq_len, window)


def layer_kind(variant: Variant, seq_len: int) -> tuple[str, int]:
    """What ``timed_layer`` times, in words ("sliding window 1024", "full attention", "latent"), and the tokens
    its decode step reads."""
    cfg = _common_layer(variant)
    _, tokens = timed_layer(variant, seq_len)
    if isinstance(cfg, MLAConfig):
        return "latent", tokens
    return ("full attention" if cfg.window is None else f"sliding window {cfg.window}"), tokens


def predict_layer(
    variant: Variant, batch: int, seq_len: int, dtype: str, hw: Hardware
) -> tuple[int, int, float]:
    cfg, seq_len = timed_layer(variant, seq_len)
    flops = attention_flops(cfg, batch, 1, seq_len).total
    nbytes = _layer_bytes(cfg, batch, seq_len, dtype)
    return flops, nbytes, step_seconds(hw, flops, nbytes, dtype)


def _filled_layer(cfg: AttentionConfig | MLAConfig, batch: int, held: int, dtype: torch.dtype):
    """A layer of ``cfg`` with random weights and a cache holding ``held`` tokens (zeros: their values do not change
    the work)."""
    cls = GroupedQueryAttention if isinstance(cfg, AttentionConfig) else MultiHeadLatentAttention
    with torch.device("meta"):
        layer = cls(cfg)
    layer = layer.to_empty(device="cpu").to(dtype)
    layer.init_weights()
    cache = layer.new_cache(batch, held + 1)
    if isinstance(cache, KVCache):
        blank = torch.zeros(batch, cache.n_kv_heads, held, cache.head_dim, dtype=dtype)
        cache.update(blank, blank)
    else:
        cache.update(torch.zeros(batch, held, cache.kv.shape[-1], dtype=dtype))
    return layer, cache


def _time_step(variant: Variant, batch: int, seq_len: int, dtype: torch.dtype, min_seconds: float) -> float:
    """The best time of one layer's decode step, over a ring of distinct layers and caches (``ring_size``), as a
    model's layers run one after another: a layer whose weights and cache fit in the last-level cache, timed
    again and again alone, read nothing from memory and ran faster than the roofline it is compared with."""
    cfg, seq_len = timed_layer(variant, seq_len)
    held = seq_len - 1  # the step adds the seq_len-th token
    ring = [
        _filled_layer(cfg, batch, held, dtype)
        for _ in range(ring_size(_layer_bytes(cfg, batch, seq_len, dtype)))
    ]
    x = torch.randn(batch, 1, cfg.d_model, dtype=dtype)
    times: list[float] = []
    with torch.inference_mode():
        for i in range(200):
            for _, cache in ring:
                cache.crop(held)  # drop the previous step's token
            start = time.perf_counter()
            for layer, cache in ring:
                layer(x, cache=cache)
            elapsed = (time.perf_counter() - start) / len(ring)
            if i >= 2:  # two warm-up passes
                times.append(elapsed)
            if len(times) >= 5 and sum(times) * len(ring) >= min_seconds:
                break
    return min(times)  # best of, like the bandwidth and matmul figures it is compared with


def _layer_bytes(cfg: AttentionConfig | MLAConfig, batch: int, tokens: int, dtype: str | torch.dtype) -> int:
    """What one decode step of the layer reads: its weights and its cache of ``tokens``."""
    name = dtype_name(dtype)
    return param_count(cfg) * dtype_bits(name) // 8 + kv_cache_bytes(cfg, batch, tokens, name)


def check_fits(chosen: list[Variant], batch: int, seq_len: int, dtype: str) -> None:
    """Refuse, before measuring anything, a layer that this machine could not hold: the ring of copies it is timed
    over (weights and cache each), and room to work."""
    memory = memory_bytes()
    for v in chosen:
        cfg, tokens = timed_layer(v, seq_len)
        nbytes = _layer_bytes(cfg, batch, tokens, dtype)
        # the ring of layers it is timed over (_time_step), and room to work
        if memory and (ring_size(nbytes) + 1) * nbytes > memory:
            raise ValueError(
                f"one {v.label} layer at batch {batch} x {tokens} tokens needs {nbytes / 2**30:.1f} GiB; "
                f"too large to time on this machine ({memory / 2**30:.1f} GiB)"
            )


def measure_variants(
    chosen: list[Variant],
    *,
    batch: int = 1,
    seq_len: int = 4096,
    dtype: str = "bf16",
    min_seconds: float = 0.5,
    progress: Callable[[str], None] | None = None,
    hw: Hardware | None = None,
) -> tuple[Hardware, list[LayerTiming]]:
    """Time one layer per variant on this machine next to its ``local`` roofline prediction.

    ``hw``: this machine as measured by the caller in the same run; None measures it now.
    """
    dtype = dtype_name(dtype)
    if dtype not in MEASURED_DTYPES:  # timed here and predicted on this machine, measured in these
        raise ValueError(f"--measure runs in {', '.join(MEASURED_DTYPES)}; got dtype {dtype!r}")
    check_fits(chosen, batch, seq_len, dtype)
    fused.ensure_built()  # a first-use build before any clock starts
    if hw is None:  # timings are read against the machine as it is now, not earlier this boot
        hw = measure_local(fresh=True)
    out = []
    for v in chosen:
        flops, nbytes, predicted = predict_layer(v, batch, seq_len, dtype, hw)
        if progress is not None:
            progress(v.label)
        measured = _time_step(v, batch, seq_len, TORCH_DTYPES[dtype], min_seconds)
        out.append(LayerTiming(v.label, flops, nbytes, predicted, measured, *layer_kind(v, seq_len)))
    return hw, out
