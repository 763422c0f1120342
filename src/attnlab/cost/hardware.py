"""Accelerators the roofline runs on: peak dense FLOP/s per dtype, memory bandwidth and capacity, with sources.

Datasheet peaks for tensor cores are quoted "with sparsity"; the figures here are the dense ones (half).
Memory sizes are the datasheet's decimal gigabytes.

Interconnect (what tensor parallelism's all-reduces cross): ``link_bandwidth`` is one GPU's bandwidth to the other
GPUs of its node in one direction, ``network_bandwidth`` the same to GPUs in other nodes, ``gpus_per_node`` how
many share the fast link. Datasheets quote NVLink and PCIe as the sum of both directions (NVLink 4: 18 links x
50 GB/s = 900 GB/s per H100); a ring all-reduce sends and receives at once, so each direction's half is what
bounds it. NVLink GPUs here sit on 8-GPU HGX boards with one InfiniBand port per GPU (DGX H100 / H200: ConnectX-7
400 Gb/s, DGX A100: ConnectX-6 200 Gb/s, per their user guides); a PCIe card reaches the other cards and its NIC
through its own PCIe link, which bounds both. ``local`` is this machine, measured once per boot
(streaming read bandwidth and matmul rates with PyTorch on the CPU) and cached in
``~/.cache/attnlab/local_hardware.json``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..atomic import write_atomic

TERA = 1e12


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict[str, float]  # dtype name ("fp32", "bf16", "fp16", ...) -> dense FLOP/s
    bandwidth: float  # bytes/s
    memory_bytes: int
    source: str
    link_bandwidth: float | None = (
        None  # bytes/s, one direction, to a GPU of the same node; None: not modelled
    )
    gpus_per_node: int = 1
    network_bandwidth: float | None = None  # bytes/s, one direction, to a GPU of another node
    link_source: str = ""


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        "h100",
        {
            "fp32": 66.9 * TERA,
            "tf32": 494.7 * TERA,
            "bf16": 989.4 * TERA,
            "fp16": 989.4 * TERA,
            "fp8": 1978.9 * TERA,
        },
        3.35e12,
        80 * 10**9,
        "NVIDIA H100 Tensor Core GPU datasheet, SXM5 80GB (dense = half the sparsity figures)",
        link_bandwidth=450e9,
        gpus_per_node=8,
        network_bandwidth=50e9,
        link_source="H100 SXM5 datasheet: NVLink 900 GB/s (both directions); DGX H100 user guide: 8 GPUs on "
        "NVSwitch, one ConnectX-7 400 Gb/s InfiniBand port per GPU",
    ),
    "h200": Hardware(
        "h200",
        {
            "fp32": 66.9 * TERA,
            "tf32": 494.7 * TERA,
            "bf16": 989.4 * TERA,
            "fp16": 989.4 * TERA,
            "fp8": 1978.9 * TERA,
        },
        4.8e12,
        141 * 10**9,
        "NVIDIA H200 Tensor Core GPU datasheet, SXM 141GB (dense = half the sparsity figures)",
        link_bandwidth=450e9,
        gpus_per_node=8,
        network_bandwidth=50e9,
        link_source="H200 SXM datasheet: NVLink 900 GB/s (both directions); DGX H200 user guide: 8 GPUs on "
        "NVSwitch, one ConnectX-7 400 Gb/s InfiniBand port per GPU",
    ),
    "a100-80gb": Hardware(
        "a100-80gb",
        {"fp32": 19.5 * TERA, "tf32": 156 * TERA, "bf16": 312 * TERA, "fp16": 312 * TERA},
        2.039e12,
        80 * 10**9,
        "NVIDIA A100 Tensor Core GPU datasheet, SXM 80GB",
        link_bandwidth=300e9,
        gpus_per_node=8,
        network_bandwidth=25e9,
        link_source="A100 SXM datasheet: NVLink 600 GB/s (both directions); DGX A100 user guide: 8 GPUs on "
        "NVSwitch, one ConnectX-6 200 Gb/s InfiniBand port per GPU",
    ),
    "l40s": Hardware(
        "l40s",
        {
            "fp32": 91.6 * TERA,
            "tf32": 183 * TERA,
            "bf16": 362.05 * TERA,
            "fp16": 362.05 * TERA,
            "fp8": 733 * TERA,
        },
        864e9,
        48 * 10**9,
        "NVIDIA L40S datasheet (dense = half the sparsity figures)",
        link_bandwidth=32e9,
        gpus_per_node=8,
        network_bandwidth=32e9,
        link_source="L40S datasheet: no NVLink, PCIe Gen4 x16 64 GB/s (both directions); 8 cards per server "
        "assumed; the NIC is reached through the same PCIe link",
    ),
    "rtx4090": Hardware(
        "rtx4090",
        {
            "fp32": 82.6 * TERA,
            "tf32": 82.6 * TERA,
            "bf16": 165.2 * TERA,
            "fp16": 165.2 * TERA,
            "fp8": 330.3 * TERA,
        },
        1008e9,
        24 * 10**9,
        "NVIDIA Ada Lovelace GPU architecture whitepaper, Appendix A (tensor FLOPs with FP32 accumulate)",
        link_bandwidth=32e9,
        gpus_per_node=8,
        network_bandwidth=32e9,
        link_source="Ada whitepaper: PCIe 4.0 x16, no NVLink; PCI-SIG PCIe 4.0: 16 GT/s x 16 lanes = 32 GB/s per "
        "direction; 8 cards per server assumed; the NIC is reached through the same PCIe link",
    ),
}
HARDWARE_NAMES = (*HARDWARE, "local")


def get_hardware(name: str) -> Hardware:
    """Exact-name lookup; ``local`` measures this machine (once per boot)."""
    if name == "local":
        return measure_local()
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE_NAMES)}")
    return HARDWARE[name]


def _cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnlab" / "local_hardware.json"


def _session_key() -> dict[str, object]:
    """What a cached measurement is valid for: this boot, this thread count, this PyTorch."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = f"pid-{os.getpid()}"  # no boot id: valid for this process only
    return {"boot_id": boot_id, "threads": torch.get_num_threads(), "torch": torch.__version__}


def _meminfo(field: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024  # the file says kB and means KiB
    except (OSError, ValueError):
        pass
    return None


def _memory_bytes() -> int:
    return _meminfo("MemTotal") or 0


def available_memory_bytes() -> int | None:
    """Memory the kernel could give this process now (``MemAvailable``), or None where unknown."""
    return _meminfo("MemAvailable")


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


def _matmul_rate(dtype: torch.dtype, budget_s: float = 0.25, repeats: int = 3) -> float:
    """FLOP/s of square matmuls, growing the size until one takes long enough to time well."""
    n = 256
    while True:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        t = _best_time(lambda a=a, b=b: a @ b, repeats)
        if t * 4 > budget_s or n >= 4096:
            return 2 * n**3 / t
        n *= 2


def _measure() -> Hardware:
    peaks = {
        name: _matmul_rate(dt)
        for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))
    }
    return Hardware(
        name="local",
        peak_flops=peaks,
        bandwidth=_read_bandwidth(),
        memory_bytes=_memory_bytes(),
        source=f"measured on this machine with PyTorch {torch.__version__}, {torch.get_num_threads()} threads",
    )


@functools.cache
def _local_cached() -> Hardware:
    key = _session_key()
    try:
        saved = json.loads(_cache_path().read_text())
        if saved.get("key") == key:
            return Hardware(**saved["hardware"])
    except (OSError, ValueError, TypeError, KeyError):
        pass  # absent or stale: measure again
    return _measure_and_save()


def _measure_and_save() -> Hardware:
    hw = _measure()
    with contextlib.suppress(OSError):  # a read-only home still gets the in-process cache
        write_atomic(_cache_path(), json.dumps({"key": _session_key(), "hardware": asdict(hw)}, indent=1))
    return hw


def measure_local(*, fresh: bool = False) -> Hardware:
    """This machine: measured bandwidth and matmul peaks, cached for the process and, per boot, on disk.

    ``fresh=True`` measures now and refreshes both caches: what a benchmark wants, so that its roofline reflects
    the machine under the load of the same run.
    """
    if fresh:
        _local_cached.cache_clear()
        hw = _measure_and_save()
        _local_cached()  # re-reads the file just written (or measures, if the home is read-only)
        return hw
    return _local_cached()
