"""The decode benchmark: one decode step over a filled cache, against its baselines and the roofline.

Every row times its contenders round-robin in one run (``timing.interleaved``) and records median milliseconds,
so speedups are ratios measured side by side. Rows by ``kind``:

    attention  ``attend`` alone, q (B, n_heads, 1, D) over the live prefix of a ``KVCache``: "fused" (ours: the
               C++ kernel, or the grouped kernel where it could not be built, see ``machine.decode_path``), the
               PyTorch "grouped" kernel, SDPA with ``enable_gqa=True`` on the same tensors, the repeat-KV
               "reference", and "fused" again over a cache with 4x the ``max_seq_len`` (cost must follow the
               live length, not the buffer). Each contender's timed call attends over a ring of distinct caches
               (``ring_size``), as a model's layers would, and the time per cache is kept; the reference, which
               writes copies of the KV, is timed after the others' round.
    layer      a whole ``GroupedQueryAttention`` decode step vs Hugging Face ``LlamaAttention`` (sdpa), same
               weights, same cache contents.
    mla        ``MultiHeadLatentAttention`` naive vs absorbed vs Hugging Face ``DeepseekV3Attention`` (DeepSeek-V2-Lite
               attention dims by default).
    paged      ``attend`` ("fused") over a contiguous cache vs over the views of a ``PagedKVCache`` holding the
               same keys/values (rows prefilled, then grown in lockstep), and over one whose blocks are placed
               scattered (``placement="scattered"``: the worst case, one run, hence one chunk, per block).
    e2e        tokens/s of decode steps of a small ``attnlab.model.Transformer`` per attention variant, batch 1
               (contiguous caches) and a ragged batch of 4 (paged caches; MLA pages its latent rows).

Roofline: bytes = KV read for the live length (``cost.kv_cache_bytes``) + queries + outputs (+ weights for
layer/mla rows); FLOPs from ``cost.attention_flops``; time = max(bytes / bandwidth, FLOPs / peak) with the
machine's measured bandwidth and matmul peaks (``bench.machine.measure_local``), by ``cost.step_seconds``: the
cost model's one rule, which ``attnlab compare`` follows too (``cost.compute_peak``: for bfloat16 the faster of
its own and float32's peak).
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..attention import fused
from ..attention.gqa import GroupedQueryAttention
from ..attention.kernels import attend
from ..attention.mla import MultiHeadLatentAttention
from ..cache import KVCache, PagedKVCache
from ..config import AttentionConfig, MLAConfig, ModelConfig, check_int
from ..cost import Hardware, attention_flops, kv_cache_bytes, step_seconds, torch_dtype
from . import baselines
from .machine import available_memory_bytes, measure_local
from .timing import interleaved

DTYPES = ("fp32", "bf16")

# DeepSeek-V2-Lite's attention (arXiv 2405.04434, its config.json): no query compression.
V2_LITE_MLA = MLAConfig(
    d_model=2048, n_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
)


# "stream": a streaming read of as many bytes as the ring holds and library matmuls in float32 and bfloat16, timed in
# the same rounds as the kernels; the row's roofline then takes its bandwidth and peaks from those rather than from
# the ones measured at the start of the run (on a shared machine they move: 25-49 GB/s and a float32 peak of 102-188
# GFLOP/s within an hour on the 2-core AMD EPYC of docs/performance_isa.md).
ATTENTION_BASELINES = ("fused_4x_buffer", "grouped", "sdpa", "reference", "stream")
DEFAULT_BASELINES = ("fused_4x_buffer", "grouped", "sdpa", "reference")  # docs/performance.md's run
PEAK_N = 768  # the square matmuls "stream" times for the peaks
PEAK_MATMULS = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class DecodeGrid:
    """What to run. Sizes follow the issue: n_heads 32, head_dim 128; MLA with DeepSeek-V2-Lite dims."""

    kv_heads: tuple[int, ...] = (32, 8, 1)
    batches: tuple[int, ...] = (1,)
    contexts: tuple[int, ...] = (2048,)
    dtypes: tuple[str, ...] = ("fp32",)
    n_heads: int = 32
    head_dim: int = 128
    repeats: int = 5
    layer: bool = True
    mla: bool = True
    paged: bool = True
    e2e: bool = False
    e2e_context: int = 2048
    e2e_steps: int = 8
    block_size: int = 256
    fresh_hardware: bool = True  # measure bandwidth/peak in this run (False: reuse this boot's measurement)
    # what the attention rows time beside "fused" (benchmarks/decode_isa.py: SDPA only, the quick same-run baseline)
    attention_baselines: tuple[str, ...] = DEFAULT_BASELINES
    mla_cfg: MLAConfig = field(default=V2_LITE_MLA)

    def __post_init__(self) -> None:
        # Messages name the options of `attnlab bench decode`, which builds this grid from them; the fields it
        # has no option for, by their names.
        for name in ("n_heads", "head_dim", "block_size", "e2e_context", "e2e_steps"):
            check_int(name, getattr(self, name))
        lists = (("kv_heads", "--kv-heads"), ("batches", "--batch"), ("contexts", "--context"),
                 ("dtypes", "--dtype"), ("attention_baselines", "attention_baselines"))  # fmt: skip
        for name, flag in lists:  # a bare int or str (kv_heads=8, dtypes="bf16") failed or split into letters
            values = getattr(self, name)
            if not isinstance(values, (tuple, list)):
                raise TypeError(f"{flag} must be a tuple or list, got {values!r}")
            if twice := sorted({x for x in values if values.count(x) > 1}, key=str):  # every row ran twice
                raise ValueError(f"{flag} lists {', '.join(map(str, twice))} more than once")
        for name, flag in lists[:3]:
            values = getattr(self, name)
            if not values or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in values):
                raise ValueError(f"{flag} must list integers >= 1, got {values!r}")
        for n_kv in self.kv_heads:
            if self.n_heads % n_kv:
                raise ValueError(f"--kv-heads {n_kv} does not divide the {self.n_heads} query heads")
        if not self.dtypes:  # ran nothing, silently
            raise ValueError(f"--dtype must list one or more of {', '.join(DTYPES)}, got none")
        for dt in self.dtypes:
            if dt not in DTYPES:
                raise ValueError(f"--dtype {dt!r} is not one of {', '.join(DTYPES)}")
        if not isinstance(self.mla_cfg, MLAConfig):  # None failed at the MLA rows, after the others had run
            raise TypeError(f"mla_cfg must be an MLAConfig, got {self.mla_cfg!r}")
        if self.mla and not self.mla_cfg.kv_norm:  # an AttributeError in the DeepSeek baseline, which has one
            raise ValueError(
                "mla_cfg: the MLA rows time DeepseekV3Attention, whose latent has its norm: kv_norm=True"
            )
        check_int("--repeats", self.repeats)
        if bad := [b for b in self.attention_baselines if b not in ATTENTION_BASELINES]:
            raise ValueError(f"attention_baselines: {bad} not among {', '.join(ATTENTION_BASELINES)}")


def _sig(x: float) -> float:
    """Four significant digits: enough for noisy timings, readable in JSON."""
    return float(f"{x:.4g}")


def _ms(seconds: dict[str, float]) -> dict[str, float]:
    return {k: _sig(v * 1e3) for k, v in seconds.items()}


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _errors(outputs: list[torch.Tensor], want: torch.Tensor) -> tuple[float, float]:
    """The largest difference of any of ``outputs`` from ``want``: absolute, and relative to want's largest
    magnitude (what AGREE holds a row to: an output's size depends on the context and the dtype)."""
    err = max(_max_err(out, want) for out in outputs)
    return err, err / max(float(want.float().abs().max()), torch.finfo(torch.float32).tiny)


def _filled_kv_cache(b: int, n_kv: int, d: int, context: int, max_len: int, dtype, gen) -> KVCache:
    cache = KVCache(b, n_kv, max_len, d, dtype=dtype)
    cache.update(
        torch.randn(b, n_kv, context, d, generator=gen).to(dtype),
        torch.randn(b, n_kv, context, d, generator=gen).to(dtype),
    )
    return cache


RING_MAX = 64  # caches per ring at most: smaller KV than 2 x LLC / 64 stays in cache however many there are


def ring_size(kv_bytes: int) -> int:
    """How many distinct caches an attention row's contenders cycle through: enough to fill twice the last-level
    cache (at least 2, at most ``RING_MAX``), so that every call reads its KV from memory, as a model's layers
    read theirs one after another."""
    return min(RING_MAX, max(2, -(-2 * _llc_bytes() // max(1, kv_bytes))))


def attention_row(grid: DecodeGrid, hw: Hardware, dtype: str, b: int, context: int, n_kv: int) -> dict:
    dt, h, d = torch_dtype(dtype), grid.n_heads, grid.head_dim
    gen = torch.Generator().manual_seed(0)
    first = _filled_kv_cache(b, n_kv, d, context, 2 * context, dt, gen)
    k0, v0 = first.k[:, :, :context], first.v[:, :, :context]  # the live view update() returns
    # Each contender attends over a ring of caches holding the same rows in distinct memory, one call per cache
    # in turn, the time per call reported (a model's layers, each with its cache): KV from memory, the cores
    # busy, and no contender measured right after another's output in the caches.
    n_ring = ring_size(2 * k0.nbytes)
    ring = [(k0, v0)] + [KVCache(b, n_kv, 2 * context, d, dtype=dt).update(k0, v0) for _ in range(n_ring - 1)]
    big = "fused_4x_buffer" in grid.attention_baselines
    big_ring = [
        KVCache(b, n_kv, 4 * context, d, dtype=dt).update(k0, v0) for _ in range(n_ring if big else 0)
    ]
    q = torch.randn(b, h, 1, d, generator=gen).to(dt)
    scale = d**-0.5

    def over(fn, caches):
        return lambda: [fn(k, v) for k, v in caches]

    def fused_step(k, v):
        return attend(q, k, v, scale=scale, backend="fused")

    contenders = {
        "fused": over(fused_step, ring),
        "fused_4x_buffer": over(fused_step, big_ring),
        "grouped": over(lambda k, v: attend(q, k, v, scale=scale, backend="grouped"), ring),
        "sdpa": over(
            lambda k, v: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True), ring
        ),
        "reference": over(lambda k, v: attend(q, k, v, scale=scale, backend="reference"), ring),
    }
    contenders = {n: f for n, f in contenders.items() if n == "fused" or n in grid.attention_baselines}
    if "stream" in grid.attention_baselines:  # float32 ones: a sum reads them at the memory's pace
        flat = torch.ones(n_ring * (k0.nbytes + v0.nbytes) // 4)
        contenders["stream"] = flat.sum
        for name, mdt in PEAK_MATMULS.items():  # ~5-15 ms each
            a = torch.randn(PEAK_N, PEAK_N, generator=gen).to(mdt)
            contenders[f"peak_{name}"] = lambda a=a: a @ a
    # every output a time is reported for, against the reference, on the first cache of its ring
    outputs = {
        "fused": lambda: fused_step(k0, v0),
        "fused_4x_buffer": lambda: fused_step(*big_ring[0]),
        "grouped": lambda: attend(q, k0, v0, scale=scale, backend="grouped"),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k0, v0, scale=scale, enable_gqa=True),
    }
    with torch.inference_mode():
        want = attend(q, k0, v0, scale=scale, backend="reference")
        err = _errors([fn() for name, fn in outputs.items() if name in contenders], want)
        # The repeat-KV reference writes n_heads / n_kv copies of the KV (up to ~0.5 GB): timed in the round, the
        # contender after it paid for writing them back to memory (the fused kernel 1.2-1.6x slower, measured).
        # So it is timed after the round, alone: every timed contender follows another's pass over the ring.
        reference = contenders.pop("reference", None)
        times = interleaved(contenders, repeats=grid.repeats)
        if reference is not None:
            times |= interleaved({"reference": reference}, repeats=grid.repeats)
        times = {name: t / n_ring for name, t in times.items()}
    cfg = AttentionConfig(d_model=h * d, n_heads=h, n_kv_heads=n_kv, head_dim=d)
    fl = attention_flops(cfg, b, 1, context)
    flops = fl.scores + fl.values
    elem = torch.finfo(dt).bits // 8
    n_bytes = kv_cache_bytes(cfg, b, context, dtype) + 2 * b * h * d * elem  # + queries and outputs
    row = dict(
        kind="attention", dtype=dtype, batch=b, context=context, n_heads=h, n_kv_heads=n_kv, head_dim=d
    )
    if "stream" in times:  # the bandwidth and peaks of this row's rounds (times are per cache of the ring)
        row["bandwidth"] = _sig((k0.nbytes + v0.nbytes) / times.pop("stream"))
        row["peak_flops"] = {
            name: _sig(2 * PEAK_N**3 / (times.pop(f"peak_{name}") * n_ring)) for name in PEAK_MATMULS
        }
    return _finish_row(
        row,
        hw,
        times,
        n_bytes,
        flops,
        ours="fused",
        err=err,
        baselines=tuple(b for b in ("grouped", "sdpa", "reference") if b in grid.attention_baselines),
    )


OURS = {
    "attention": "fused",
    "layer": "ours",
    "mla": "absorbed",
    "paged": "paged",
}  # the timed column per kind


def row_hardware(hw: Hardware, row: dict) -> Hardware:
    """``hw`` with the bandwidth and peaks measured in the row's own rounds ("stream"), where it has them."""
    if not row.get("bandwidth"):
        return hw
    return dataclasses.replace(
        hw, bandwidth=row["bandwidth"], peak_flops={**hw.peak_flops, **row.get("peak_flops", {})}
    )


def _score(row: dict, hw: Hardware, ours: str) -> None:
    """Set a timed row's roofline (``cost.step_seconds`` of its bytes and FLOPs) and the fraction of it that its
    saved (rounded) time for ``ours`` reaches: one definition for fresh rows and rescored ones alike."""
    hw = row_hardware(hw, row)
    roof = step_seconds(hw, row["flops"], row["bytes"], row["dtype"])  # the fastest this step could run
    row.update(roofline_ms=_sig(roof * 1e3), roofline_fraction=_sig(roof / (row["ms"][ours] / 1e3)))


def rescore(rows: list[dict], hw: Hardware) -> None:
    """Recompute every timed row's roofline (``cost.step_seconds``) from its stored bytes, FLOPs and times, so that
    saved results follow the current definition."""
    for row in rows:
        if row.get("kind") in OURS and {"bytes", "flops", "ms"} <= row.keys():
            _score(row, hw, OURS[row["kind"]])


# The largest difference between the outputs a row times (every one, against a reference) that still times the
# same computation, relative to the reference's largest magnitude: measured, float32 rows agree to ~5e-6 and
# bfloat16 ones to ~5e-3 (its rounding is 2^-8 = 4e-3). An absolute 0.1 for bfloat16 let a kernel returning
# zeros pass where the outputs are smaller than that (4096 tokens and more, MLA), and float32's absolute 1e-3 let
# one dropping a key of 16384 pass (6e-4 off); relative, zeros are 1.0 off and that dropped key 1.2e-2.
AGREE = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-2}


def _finish_row(row, hw, times, n_bytes, flops, *, ours, err, baselines) -> dict:
    err, relative = err
    if not relative <= AGREE[row["dtype"]]:
        shape = ", ".join(f"{k} {v}" for k, v in row.items() if k != "kind")
        raise RuntimeError(
            f"{row['kind']} row ({shape}): the outputs compared differ by {err:.3g}, {relative:.3g} of the "
            f"reference's largest value (over {AGREE[row['dtype']]}), so its times would compare different "
            "computations"
        )
    row.update(
        ms=_ms(times),
        bytes=int(n_bytes),
        flops=int(flops),
        achieved_gbps=_sig(n_bytes / times[ours] / 1e9),
        speedup={name: _sig(times[name] / times[ours]) for name in baselines},
        max_abs_err=err,
    )
    _score(row, hw, ours)
    return row


def layer_row(grid: DecodeGrid, hw: Hardware, dtype: str, b: int, context: int, n_kv: int) -> dict:
    dt, h, d = torch_dtype(dtype), grid.n_heads, grid.head_dim
    torch.manual_seed(0)
    cfg = AttentionConfig(d_model=h * d, n_heads=h, n_kv_heads=n_kv, head_dim=d, backend="auto")
    attn = GroupedQueryAttention(cfg)
    attn.init_weights()
    attn = attn.to(dt).eval()
    gen = torch.Generator().manual_seed(1)
    cache = _filled_kv_cache(b, n_kv, d, context, context + 8, dt, gen)
    hf_step, hf_crop = baselines.llama_attention(attn, cache.k[:, :, :context], cache.v[:, :, :context])
    x = torch.randn(b, 1, h * d, generator=gen).to(dt)

    def reset() -> None:
        cache.crop(context)
        hf_crop()

    contenders = {"ours": lambda: attn(x, cache=cache), "hf_llama_sdpa": lambda: hf_step(x)}
    with torch.inference_mode():
        err = _errors([contenders["ours"]()], contenders["hf_llama_sdpa"]())
        reset()
        times = interleaved(contenders, repeats=grid.repeats, reset=reset)
    read = context + 1  # the step appends its token to the cache and attends over it too
    fl = attention_flops(cfg, b, 1, read)
    elem = torch.finfo(dt).bits // 8
    weights = sum(p.numel() for p in attn.parameters()) * elem
    n_bytes = kv_cache_bytes(cfg, b, read, dtype) + weights + 2 * b * h * d * elem
    return _finish_row(
        dict(kind="layer", dtype=dtype, batch=b, context=context, n_heads=h, n_kv_heads=n_kv, head_dim=d),
        hw,
        times,
        n_bytes,
        fl.total,
        ours="ours",
        err=err,
        baselines=("hf_llama_sdpa",),
    )


def mla_row(grid: DecodeGrid, hw: Hardware, dtype: str, b: int, context: int) -> dict:
    dt, cfg = torch_dtype(dtype), grid.mla_cfg
    torch.manual_seed(0)
    mla = MultiHeadLatentAttention(cfg)
    mla.init_weights()
    mla = mla.to(dt).eval()
    gen = torch.Generator().manual_seed(1)
    cache = mla.new_cache(b, context + 8)
    rows = torch.randn(b, context, cfg.cache_dim, generator=gen).to(dt)
    cache.update(rows)
    hf_step, hf_crop = baselines.deepseek_attention(mla, rows)
    x = torch.randn(b, 1, cfg.d_model, generator=gen).to(dt)

    def reset() -> None:
        cache.crop(context)
        hf_crop()

    contenders = {
        "absorbed": lambda: mla(x, cache=cache, mode="absorbed"),
        "naive": lambda: mla(x, cache=cache, mode="naive"),
        "hf_deepseek_v3": lambda: hf_step(x),
    }
    with torch.inference_mode():
        ours = contenders["absorbed"]()
        reset()
        naive = contenders["naive"]()
        reset()
        err = _errors([ours, naive], contenders["hf_deepseek_v3"]())
        reset()
        times = interleaved(contenders, repeats=grid.repeats, reset=reset)
    fl = attention_flops(cfg.replace(mode="absorbed"), b, 1, context)
    elem = torch.finfo(dt).bits // 8
    weights = sum(p.numel() for p in mla.parameters()) * elem
    n_bytes = kv_cache_bytes(cfg, b, context, dtype) + weights
    return _finish_row(
        dict(
            kind="mla",
            dtype=dtype,
            batch=b,
            context=context,
            n_heads=cfg.n_heads,
            n_kv_heads=1,
            head_dim=None,  # no K/V heads: one latent row per token, of latent_dim values (it read as a 0)
            latent_dim=cfg.kv_lora_rank + cfg.qk_rope_head_dim,
        ),
        hw,
        times,
        n_bytes,
        fl.total,
        ours="absorbed",
        err=err,
        baselines=("naive", "hf_deepseek_v3"),
    )


def _paged_copy(placement: str, k, v, bs: int, n_blocks: int) -> PagedKVCache:
    """``k``, ``v`` (B, n_kv, S, D) in a paged cache: most of each row prefilled, the tail grown in lockstep."""
    b, n_kv, s, d = k.shape
    paged = PagedKVCache(n_blocks, bs, n_kv, d, batch_size=b, dtype=k.dtype, placement=placement)
    head = max(0, s - 4 * bs)
    for row in range(b):
        paged.select([row]).update(k[row : row + 1, :, :head], v[row : row + 1, :, :head])
    paged.select(list(range(b)))
    for t in range(head, s, 64):  # rows grow together, as in batched decoding
        paged.update(k[:, :, t : t + 64], v[:, :, t : t + 64])
    return paged


def paged_row(grid: DecodeGrid, hw: Hardware, dtype: str, b: int, context: int, n_kv: int) -> dict:
    """Same keys/values in a contiguous cache, a paged one, and a paged one with every block scattered."""
    dt, h, d, bs = torch_dtype(dtype), grid.n_heads, grid.head_dim, grid.block_size
    gen = torch.Generator().manual_seed(0)
    cache = _filled_kv_cache(b, n_kv, d, context, context, dt, gen)
    k, v = cache.k, cache.v
    n_blocks = b * math.ceil(context / bs) + 2  # almost no slack: rows must share the pool tightly
    paged = _paged_copy("contiguous", k, v, bs, n_blocks)
    scattered = _paged_copy("scattered", k, v, bs, n_blocks)
    q = torch.randn(b, h, 1, d, generator=gen).to(dt)
    scale = d**-0.5
    paged_kv, scattered_kv = paged.views(), scattered.views()
    contenders = {
        "paged": lambda: attend(q, *paged_kv, scale=scale, backend="fused"),
        "contiguous": lambda: attend(q, k, v, scale=scale, backend="fused"),
        "paged_scattered": lambda: attend(q, *scattered_kv, scale=scale, backend="fused"),
    }
    with torch.inference_mode():
        err = _errors([contenders["paged"](), contenders["paged_scattered"]()], contenders["contiguous"]())
        times = interleaved(contenders, repeats=grid.repeats)
    cfg = AttentionConfig(d_model=h * d, n_heads=h, n_kv_heads=n_kv, head_dim=d)
    fl = attention_flops(cfg, b, 1, context)
    elem = torch.finfo(dt).bits // 8
    n_bytes = kv_cache_bytes(cfg, b, context, dtype) + 2 * b * h * d * elem
    row = _finish_row(
        dict(kind="paged", dtype=dtype, batch=b, context=context, n_heads=h, n_kv_heads=n_kv, head_dim=d),
        hw,
        times,
        n_bytes,
        fl.scores + fl.values,
        ours="paged",
        err=err,
        baselines=("contiguous", "paged_scattered"),
    )
    row["runs_per_row"] = [len(paged.runs(r)) for r in range(b)]
    row["runs_per_row_scattered"] = [len(scattered.runs(r)) for r in range(b)]
    row["block_size"] = bs
    return row


def e2e_model_configs(n_heads: int = 16, d_model: int = 1024) -> dict[str, ModelConfig]:
    """One small Llama-style model with MHA, GQA-8, MQA and MLA attention."""
    head_dim = d_model // n_heads
    attn = {
        "mha": AttentionConfig(d_model=d_model, n_heads=n_heads),
        "gqa8": AttentionConfig(d_model=d_model, n_heads=n_heads, n_kv_heads=8),
        "mqa": AttentionConfig(d_model=d_model, n_heads=n_heads, n_kv_heads=1),
        "mla": MLAConfig(
            d_model=d_model,
            n_heads=n_heads,
            kv_lora_rank=4 * head_dim,
            qk_nope_head_dim=head_dim,
            qk_rope_head_dim=head_dim // 2,
            v_head_dim=head_dim,
        ),
    }
    return {
        name: ModelConfig(
            vocab_size=8192, n_layers=4, attention=a, ffn_dim=2816, max_seq_len=32768, name=name
        )
        for name, a in attn.items()
    }


def _step_seconds(model, batch: int, caches, steps: int) -> float:
    """Median seconds of ``steps`` decode steps (one warm-up) that extend ``caches`` by one token each."""
    tokens = torch.zeros(batch, 1, dtype=torch.long)
    return interleaved({"step": lambda: model(tokens, caches=caches)}, repeats=steps, warmup=1)["step"]


def e2e_rows(grid: DecodeGrid, dtype: str) -> list[dict]:
    """Decode tokens/s of each variant: batch 1 (contiguous caches), and a ragged batch of 4 (paged caches)."""
    from ..model import Transformer

    dt, context, steps = torch_dtype(dtype), grid.e2e_context, grid.e2e_steps
    out = []
    for name, cfg in e2e_model_configs().items():
        torch.manual_seed(0)
        model = Transformer(cfg)
        model.init_weights(seed=0)
        model = model.to(dt).eval()
        gen = torch.Generator().manual_seed(0)
        # at least one token a row (a context of 3 gave a row of none)
        lengths = [max(1, n) for n in (context, (3 * context) // 4, context // 2, context // 4)]
        prompts = [torch.randint(0, cfg.vocab_size, (1, n), generator=gen) for n in lengths]
        with torch.inference_mode():
            single = model.new_caches(1, context + steps + 1)
            model(prompts[0], caches=single)
            bs = grid.block_size
            n_blocks = sum(math.ceil((n + steps + 1) / bs) for n in lengths) + 4
            batched = [layer.attention.new_paged_cache(n_blocks, bs, 4, dt) for layer in model.layers]
            for row, p in enumerate(prompts):
                model(p, caches=[c.select([row]) for c in batched])
            for c in batched:
                c.select([0, 1, 2, 3])
            batch_note = f"paged, ragged lengths {lengths}"
            s1 = _step_seconds(model, 1, single, steps)
            s4 = _step_seconds(model, 4, batched, steps)
        out.append(
            dict(
                kind="e2e",
                dtype=dtype,
                variant=name,
                context=context,
                n_layers=cfg.n_layers,
                d_model=cfg.d_model,
                tokens_per_s_batch1=round(1 / s1, 2),
                tokens_per_s_batch4=round(4 / s4, 2),
                batch4_cache=batch_note,
                kv_bytes_per_token=kv_cache_bytes(cfg, 1, 1, dtype),
            )
        )
    return out


def _l3_bytes() -> int | None:
    """Size of the last-level cache (Linux sysfs), which small KV caches can stay in between steps."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
            sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20}[text[-1]])
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return max(sizes, default=None)


def _llc_bytes() -> int:
    """The last-level cache's size, 32 MiB where sysfs does not say."""
    return _l3_bytes() or 32 * 2**20


def machine(hw: Hardware) -> dict[str, Any]:
    return dict(
        hardware=dataclasses.asdict(hw),
        processor=platform.processor() or platform.machine(),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "unset"),
        l3_bytes=_l3_bytes(),
        decode_path=decode_path(),
        cpu=fused.cpu_model(),
        isa=fused.isa(),  # the kernels' instructions in this run (ATTNLAB_ISA=avx2 times AVX2's on AVX-512 CPUs)
        load_average=[round(x, 2) for x in os.getloadavg()],  # 1, 5, 15 minutes: the machine is shared
    )


def decode_path() -> str:
    """Which kernel "fused" (and "auto" for CPU decode) runs, and why: builds the C++ kernel if not yet tried."""
    fused.available()
    return fused.status()


def estimated_bytes(grid: DecodeGrid) -> int:
    """Peak memory of the largest row of ``grid``, roughly (rows run one at a time; each frees what it made).

    Attention rows hold a ring (``ring_size``) of caches at 2x and 4x the context (two of them at the largest
    shapes, about twice the last-level cache at small ones), the float32 draws that filled the first, and the
    baselines' repeated float32 K/V; MLA rows add Hugging Face's decompressed per-head K/V (and its copy per step).
    """
    b, s, n_kv = max(grid.batches), max(grid.contexts), max(grid.kv_heads)
    elem = max(torch.finfo(torch_dtype(d)).bits // 8 for d in grid.dtypes)
    kv = b * n_kv * s * grid.head_dim  # elements of K (or V) at the largest shape
    repeated = b * grid.n_heads * s * grid.head_dim
    attention = 2 * 12 * kv * elem + 12 * _llc_bytes() + 8 * kv + 8 * repeated + 2 * repeated * elem
    mla = grid.mla_cfg
    per_head = b * s * mla.n_heads * (mla.qk_head_dim + mla.v_head_dim)
    mla_bytes = (b * s * mla.cache_dim * 4 + 3 * per_head * elem) if grid.mla else 0
    return max(attention, mla_bytes)


def check_memory(grid: DecodeGrid) -> None:
    """A grid too large for this machine is an error before anything is allocated or timed."""
    need, have = estimated_bytes(grid), available_memory_bytes()
    if have is not None and need > have:
        raise ValueError(
            f"bench decode: context {max(grid.contexts)} x batch {max(grid.batches)} x {max(grid.kv_heads)} KV "
            f"heads needs about {need / 2**30:,.1f} GiB for its caches and baselines; this machine has "
            f"{have / 2**30:,.1f} GiB available: lower --context, --batch or --kv-heads"
        )


def run_decode(grid: DecodeGrid, progress=None) -> dict[str, Any]:
    """Run ``grid``; returns {"machine": ..., "grid": ..., "rows": [...]} (JSON-ready)."""
    check_memory(grid)
    fused.ensure_built()  # a first-use build before any clock starts
    hw = measure_local(fresh=grid.fresh_hardware)
    rows: list[dict] = []

    def note(row: dict) -> None:
        rows.append(row)
        if progress is not None:
            progress(row)

    for dtype in grid.dtypes:
        for b in grid.batches:
            for context in grid.contexts:
                for n_kv in grid.kv_heads:
                    note(attention_row(grid, hw, dtype, b, context, n_kv))
                    if grid.layer and b == grid.batches[0]:
                        note(layer_row(grid, hw, dtype, b, context, n_kv))
                    if grid.paged and n_kv <= 8:
                        note(paged_row(grid, hw, dtype, b, context, n_kv))
                if grid.mla and b == grid.batches[0]:
                    note(mla_row(grid, hw, dtype, b, context))
        if grid.e2e:
            for row in e2e_rows(grid, dtype):
                note(row)
    grid_json = {k: v for k, v in dataclasses.asdict(grid).items() if k != "mla_cfg"}
    grid_json["mla_cfg"] = dataclasses.asdict(grid.mla_cfg)
    return {"machine": machine(hw), "grid": grid_json, "rows": rows}
