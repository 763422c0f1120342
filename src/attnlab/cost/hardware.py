"""Accelerators the roofline runs on: peak dense FLOP/s per dtype, memory bandwidth and capacity, with sources.

Datasheet peaks for tensor cores are quoted "with sparsity"; the figures here are the dense ones (half).
Memory sizes are the datasheet's decimal gigabytes. ``local`` (this machine) is not in the table: it is measured,
by ``attnlab.bench.machine.measure_local``, which returns a ``Hardware`` that every cost function accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

TERA = 1e12


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict[str, float]  # dtype name ("fp32", "bf16", "fp16", ...) -> dense FLOP/s
    bandwidth: float  # bytes/s
    memory_bytes: int
    source: str


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
    ),
    "a100-80gb": Hardware(
        "a100-80gb",
        {"fp32": 19.5 * TERA, "tf32": 156 * TERA, "bf16": 312 * TERA, "fp16": 312 * TERA},
        2.039e12,
        80 * 10**9,
        "NVIDIA A100 Tensor Core GPU datasheet, SXM 80GB",
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
    ),
}
HARDWARE_NAMES = (*HARDWARE, "local")


def get_hardware(name: str) -> Hardware:
    """Exact-name lookup in the datasheet table (``local`` is measured: ``attnlab.bench.machine.get_hardware``)."""
    if name == "local":
        raise ValueError(
            "hardware 'local' is this machine, measured rather than looked up: pass "
            "attnlab.bench.machine.measure_local() (the CLI does)"
        )
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE_NAMES)}")
    return HARDWARE[name]
