"""Accelerators the roofline runs on: peak dense FLOP/s per dtype, memory bandwidth and capacity, with sources.

Datasheet peaks for tensor cores are quoted "with sparsity"; the figures here are the dense ones (half).
Memory sizes are what the card reports as its total: ``torch.cuda.get_device_properties().total_memory`` for the
H100 (79.2 GiB on this project's H100 run, docs/performance_gpu.md) and the A100 (a published reading), nvidia-smi's
MiB for the others (published readings, not measured here). A datasheet's "80GB" is 80 GiB of HBM, not 80e9 bytes:
read as decimal, an H100 was 6 % short, and compare said Llama-3-70B in bf16 does not fit an H200.

Interconnect (what tensor parallelism's all-reduces cross): ``link_bandwidth`` is one GPU's bandwidth to the other
GPUs of its node in one direction, ``network_bandwidth`` the same to GPUs in other nodes, ``gpus_per_node`` how
many share the fast link. Datasheets quote NVLink and PCIe as the sum of both directions (NVLink 4: 18 links x
50 GB/s = 900 GB/s per H100); a ring all-reduce sends and receives at once, so each direction's half is what
bounds it. NVLink GPUs here sit on 8-GPU HGX boards with one InfiniBand port per GPU (DGX H100 / H200: ConnectX-7
400 Gb/s, DGX A100: ConnectX-6 200 Gb/s, per their user guides); a PCIe card reaches the other cards and its NIC
through its own PCIe link, which bounds both.

``local`` (this machine) is not in the table: it is measured, by ``attnlab.bench.machine.measure_local``, which
returns a ``Hardware`` that every cost function accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

TERA = 1e12
MIB = 2**20


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
            "fp64": 67 * TERA,  # FP64 Tensor Core
            "fp32": 66.9 * TERA,
            "tf32": 494.7 * TERA,
            "bf16": 989.4 * TERA,
            "fp16": 989.4 * TERA,
            "fp8": 1978.9 * TERA,
        },
        3.35e12,
        int(79.2 * 2**30),  # torch, this project's H100 run (nvidia-smi: 81,559 MiB, 79.6 GiB)
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
            "fp64": 67 * TERA,  # FP64 Tensor Core
            "fp32": 66.9 * TERA,
            "tf32": 494.7 * TERA,
            "bf16": 989.4 * TERA,
            "fp16": 989.4 * TERA,
            "fp8": 1978.9 * TERA,
        },
        4.8e12,
        143_771 * MIB,  # 140.4 GiB
        "NVIDIA H200 Tensor Core GPU datasheet, SXM 141GB (dense = half the sparsity figures)",
        link_bandwidth=450e9,
        gpus_per_node=8,
        network_bandwidth=50e9,
        link_source="H200 SXM datasheet: NVLink 900 GB/s (both directions); DGX H200 user guide: 8 GPUs on "
        "NVSwitch, one ConnectX-7 400 Gb/s InfiniBand port per GPU",
    ),
    "a100-80gb": Hardware(
        "a100-80gb",
        {
            "fp64": 19.5 * TERA,
            "fp32": 19.5 * TERA,
            "tf32": 156 * TERA,
            "bf16": 312 * TERA,
            "fp16": 312 * TERA,
        },
        2.039e12,
        85_056_798_720,  # 79.2 GiB
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
        46_068 * MIB,  # 45.0 GiB, ECC on (the default)
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
        24_564 * MIB,  # 24.0 GiB
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
    """Exact-name lookup in the datasheet table (``local`` is measured: ``attnlab.bench.machine.get_hardware``)."""
    if name == "local":
        raise ValueError(
            "hardware 'local' is this machine, measured rather than looked up: pass "
            "attnlab.bench.machine.measure_local() (the CLI does)"
        )
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE_NAMES)}")
    return HARDWARE[name]
