"""This machine as a ``Hardware``: its streaming read bandwidth and matmul rates, measured with PyTorch on the CPU.

``measure_local`` measures once per boot and caches the result in ``~/.cache/attnlab/local_hardware.json`` (keyed
by boot, thread count and PyTorch version); ``get_hardware`` is ``attnlab.cost.get_hardware`` plus ``local``.
The cost model (``attnlab.cost``) only reads the ``Hardware`` this returns: measuring lives here.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from ..atomic import write_atomic
from ..cost import hardware as table
from ..cost.hardware import Hardware
from ..cost.memory import TORCH_DTYPES
from ..resources import available_memory_bytes, memory_bytes

__all__ = ["available_memory_bytes", "get_hardware", "measure_local", "memory_bytes"]


def get_hardware(name: str) -> Hardware:
    """Exact-name lookup; ``local`` measures this machine (once per boot)."""
    return measure_local() if name == "local" else table.get_hardware(name)


# What holds PyTorch's own kernels and its matmul libraries to an instruction set (benchmarks/decode_isa.py sets
# them to AVX2 to stand in for an AVX2-only CPU): ATen's vectorised kernels, oneDNN, MKL.
LIBRARY_ISA = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def _cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnlab" / "local_hardware.json"


def _session_key() -> dict[str, object]:
    """What a cached measurement is valid for: this boot, this thread count, this PyTorch, and the instructions
    its libraries may use (``LIBRARY_ISA``: a run that holds them to AVX2 measures another peak)."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = f"pid-{os.getpid()}"  # no boot id: valid for this process only
    key = {"boot_id": boot_id, "threads": torch.get_num_threads(), "torch": torch.__version__}
    return key | {name: os.environ[name] for name in LIBRARY_ISA if os.environ.get(name)}


def _best_time(fn, repeats: int) -> float:
    fn()  # warm up: first touch of pages, kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _read_bandwidth(n_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of a streaming read: summing a float32 tensor far larger than the caches, best of ``repeats``."""
    x = torch.ones(n_bytes // 4, dtype=torch.float32)
    return x.nbytes / _best_time(lambda: x.sum(), repeats)


def device_bandwidth(device: torch.device) -> float:
    """Bytes/s of a streaming read on ``device``: the CPU's is ``measure_local``'s (cached per boot); a GPU's is
    measured now, 1 GiB summed in its memory (each timing synchronised with the GPU, whose kernels run
    asynchronously). Not yet run on a GPU (none was lent when it was written)."""
    if device.type == "cpu":
        return measure_local().bandwidth
    x = torch.ones(2**28, dtype=torch.float32, device=device)

    def read() -> None:
        x.sum()
        torch.cuda.synchronize(device)

    return x.nbytes / _best_time(read, 5)


def _matmul_rate(dtype: torch.dtype, budget_s: float = 0.25, repeats: int = 3) -> float:
    """FLOP/s of square matmuls, growing the size until one takes long enough to time well."""
    n = 256
    while True:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        t = _best_time(lambda a=a, b=b: a @ b, repeats)
        if t * 4 > budget_s or n >= 4096:
            return 2 * n**3 / t
        n *= 2


# The dtypes whose matmul peak this machine is measured in ("local" has no float64 rate: fp64 is refused there).
MEASURED_DTYPES = ("fp32", "bf16", "fp16")


def _measure(rounds: int = 3) -> Hardware:
    # Each peak is the best of a few rounds, the dtypes taken in turn: one round alone read as little as 0.6 of the
    # others now and then (AMD EPYC, 2 threads: fp32 102 against 147-171 GFLOP/s, bf16 205 against 349-387 in runs
    # of the same hour), and a roofline under a low peak puts kernels above 1.0 of it.
    dtypes = tuple((name, TORCH_DTYPES[name]) for name in MEASURED_DTYPES)
    peaks = {name: 0.0 for name, _ in dtypes}
    for _ in range(rounds):
        for name, dt in dtypes:
            peaks[name] = max(peaks[name], _matmul_rate(dt))
    return Hardware(
        name="local",
        peak_flops=peaks,
        bandwidth=_read_bandwidth(),
        memory_bytes=memory_bytes(),
        source=f"measured on this machine with PyTorch {torch.__version__}, {torch.get_num_threads()} threads",
    )


def _record() -> dict:
    """This boot's cache file as JSON (``_session_key``); empty where it is absent, stale or not JSON of ours."""
    try:
        record = json.loads(_cache_path().read_text())
    # RecursionError: json's reader on brackets nested 100000 deep
    except (OSError, ValueError, RecursionError):
        return {}
    return record if isinstance(record, dict) and record.get("key") == _session_key() else {}


def _saved(record: dict | None = None) -> Hardware | None:
    """This boot's cached measurement (from ``record``, else the file), or None: absent, stale or damaged."""
    record = _record() if record is None else record
    try:
        hw = Hardware(**record["hardware"])
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return hw if _measurable(hw) else None


def _best(saved: Hardware, record: dict) -> Hardware:
    """``saved`` with the boot's best bandwidth and float32 peak (``record``'s "best"), what a new reading is held
    to: against the last one only, readings of 0.7x in turn were each taken and the cached bandwidth crept down
    (23.5, 17.1, then 11.3 GB/s in one hour's commands)."""
    best = record.get("best")
    if not isinstance(best, dict) or not (
        _rate(best.get("bandwidth"), 1e13) and _rate(best.get("fp32"), 1e17)
    ):
        return saved
    peaks = saved.peak_flops | {"fp32": max(saved.peak_flops["fp32"], best["fp32"])}
    return replace(saved, bandwidth=max(saved.bandwidth, best["bandwidth"]), peak_flops=peaks)


def _rate(x: object, top: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and 0 < x < top


def _measurable(hw: Hardware) -> bool:
    """Whether ``hw`` holds what ``_measure`` gives: a file edited by hand (a bandwidth of 0, -5, "fast" or 1e15
    B/s, a memory of "lots" or -1, a dtype's peak left out) is measured again rather than trusted."""
    return (
        hw.name == "local"
        and isinstance(hw.peak_flops, dict)
        and set(hw.peak_flops) == set(MEASURED_DTYPES)
        and all(_rate(x, 1e17) for x in hw.peak_flops.values())
        and _rate(hw.bandwidth, 1e13)
        and isinstance(hw.memory_bytes, int)
        and not isinstance(hw.memory_bytes, bool)
        and hw.memory_bytes >= 0  # 0: unknown (no /proc/meminfo)
        and (hw.link_bandwidth, hw.gpus_per_node, hw.network_bandwidth) == (None, 1, None)
        and doubtful(hw) is None
    )


@functools.cache
def _local_cached() -> Hardware:
    saved = _saved()
    return saved if saved is not None else _measure_and_save()


def _slowed(hw: Hardware, earlier: Hardware) -> str | None:
    """Why ``hw`` reads as this machine under other work rather than as it is: a bandwidth or float32 peak under
    half of what it measured earlier this boot (a busy moment gave 6.0 GB/s where it streamed 17-22 minutes
    before and after, and the next command's roofline fraction came out 3x too high); None otherwise."""
    if hw.bandwidth < earlier.bandwidth / 2:
        return f"a streaming read of {hw.bandwidth / 1e9:.1f} GB/s (earlier this boot {earlier.bandwidth / 1e9:.1f})"
    fp32, before = hw.peak_flops.get("fp32", 0.0), earlier.peak_flops.get("fp32", 0.0)
    if fp32 < before / 2:
        return f"an fp32 matmul peak of {fp32 / 1e9:.0f} GFLOP/s (earlier this boot {before / 1e9:.0f})"
    return None


def doubtful(hw: Hardware) -> str | None:
    """Why a measurement of this machine cannot be what it can do, or None. A machine busy with other work gave
    3.1 GB/s and an fp32 peak of 0.32 GFLOP/s (with bf16 at 26: 80x faster), where it measured 28 GB/s and 86-179
    GFLOP/s that day, and benchmarks then printed kernels at 65x "the roofline". The floors are far below any
    CPU of the last decade (one core streams over 5 GB/s and multiplies float32 at over 10 GFLOP/s); bfloat16 on
    AMX, the fastest a CPU has, is 5.5x its float32 here (docs/performance.md)."""
    fp32, fast = hw.peak_flops.get("fp32", 0.0), max(hw.peak_flops.values(), default=0.0)
    if hw.bandwidth < 1e9:
        return f"a streaming read of {hw.bandwidth / 1e9:.2f} GB/s"
    if fp32 < 2e9:
        return f"an fp32 matmul peak of {fp32 / 1e9:.2f} GFLOP/s"
    if fast > 30 * fp32:
        return f"an fp32 matmul peak {fast / fp32:.0f}x below another dtype's"
    return None


def _best_of(a: Hardware, b: Hardware) -> Hardware:
    peaks = {name: max(a.peak_flops[name], b.peak_flops[name]) for name in a.peak_flops}
    return Hardware(**(asdict(a) | {"peak_flops": peaks, "bandwidth": max(a.bandwidth, b.bandwidth)}))


def _measure_and_save() -> Hardware:
    hw = _measure()
    if doubtful(hw):  # a moment of other work: once more, each figure the better of the two
        hw = _best_of(hw, _measure())
    why = doubtful(hw)
    if why is not None:  # used by this command, said, and not kept for the next ones
        print(
            f"attnlab: warning: this machine measured {why}, which it cannot be at rest (is it busy?): the roofline "
            "figures of this run are unreliable, and the measurement is not cached",
            file=sys.stderr,
        )
        return hw
    record = _record()
    saved = _saved(record)
    earlier = _best(saved, record) if saved is not None else None
    slowed = _slowed(hw, earlier) if earlier is not None else None
    if slowed is not None:  # this run's figures are read against it; later commands keep the earlier one
        print(
            f"attnlab: note: this machine measured {slowed} now (is it busy?): this run's roofline figures use "
            "it, and later commands keep the earlier measurement",
            file=sys.stderr,
        )
        return hw
    with contextlib.suppress(OSError):  # a read-only home still gets the in-process cache
        best = {
            "bandwidth": max(hw.bandwidth, earlier.bandwidth if earlier else 0.0),
            "fp32": max(hw.peak_flops["fp32"], earlier.peak_flops["fp32"] if earlier else 0.0),
        }
        record = {"key": _session_key(), "hardware": asdict(hw), "best": best}
        write_atomic(_cache_path(), json.dumps(record, indent=1), ours=True)
    return hw


def measure_local(*, fresh: bool = False) -> Hardware:
    """This machine: measured bandwidth and matmul peaks, cached for the process and, per boot, on disk.

    ``fresh=True`` measures now and refreshes both caches: what a benchmark wants, so that its roofline reflects
    the machine under the load of the same run.
    """
    if fresh:
        _local_cached.cache_clear()
        hw = _measure_and_save()
        if doubtful(hw) is None:  # (a doubtful one is not cached: the next call measures again)
            _local_cached()  # re-reads the file just written (or measures, if the home is read-only)
        return hw
    return _local_cached()
