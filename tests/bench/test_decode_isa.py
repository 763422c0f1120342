"""benchmarks/decode_isa.py: a run replaces only its own (CPU, instruction set) in the JSON, and the page's counts and
verdicts are computed from the rows (a hand-made result, so every figure is known)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from attnlab.bench import DecodeGrid

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def isa_bench():
    spec = importlib.util.spec_from_file_location(
        "decode_isa_for_tests", ROOT / "benchmarks" / "decode_isa.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def _row(dtype, batch, context, n_kv, fraction):
    return dict(
        kind="attention", dtype=dtype, batch=batch, context=context, n_heads=32, n_kv_heads=n_kv, head_dim=128,
        ms={"fused": 1.0, "sdpa": 2.5}, speedup={"sdpa": 2.5}, roofline_fraction=fraction,
        bytes=16 * 2**20 * (2 if dtype == "fp32" else 1) * batch * context // 4096 * n_kv // 4,
        flops=2**26 * batch * context // 4096,
    )  # fmt: skip


def _run(cpu, isa, fractions):
    shapes = [(d, 1, c, k) for d in ("fp32", "bf16") for c in (4096, 16384) for k in (8, 4, 2, 1)]
    shapes += [(d, 4, 4096, k) for d in ("fp32", "bf16") for k in (8, 4, 2, 1)]
    hardware = dict(name="local", bandwidth=20e9, peak_flops={"fp32": 1e11, "bf16": 6e11}, memory_bytes=2**34,
                    source="made up")  # fmt: skip
    return dict(
        cpu=cpu, isa=isa, date="2026-11-26", command="python benchmarks/decode_isa.py",
        machine={"hardware": hardware, "load_average": [0.1, 0.1, 0.1]},
        rows=[_row(*s, f) for s, f in zip(shapes, fractions, strict=False)],
    )  # fmt: skip


def test_a_run_replaces_only_its_own_cpu_and_instruction_set(isa_bench):
    saved = {
        "runs": [
            _run("cpu A", "avx512", [0.9] * 24),
            _run("cpu A", "avx2", [0.4] * 24),
            _run("B", "avx2", [1] * 24),
        ]
    }
    new = _run("cpu A", "avx2", [0.8] * 24)
    merged = isa_bench.merge(saved, [new], "python benchmarks/decode_isa.py --isa avx2")
    assert [(r["cpu"], r["isa"]) for r in merged["runs"]] == [
        ("cpu A", "avx512"),
        ("B", "avx2"),
        ("cpu A", "avx2"),
    ]
    assert merged["runs"][-1]["rows"][0]["roofline_fraction"] == 0.8
    assert merged["runs"][-1]["command"] == "python benchmarks/decode_isa.py --isa avx2"


def test_the_page_counts_the_shapes_at_half_the_roofline_per_run(isa_bench, monkeypatch):
    monkeypatch.setattr(isa_bench, "_reference_run", lambda: None)
    good = _run("cpu A", "avx512", [0.5 + i / 100 for i in range(24)])
    bad = _run("cpu A", "avx2", [0.49] + [0.7] * 22)  # 23 shapes run, one below the target
    text = isa_bench.page({"runs": [good, bad]})
    assert "| 1 | AVX-512 | 24 of 24 | 0.50 (fp32 B1 ctx 4096 n_kv 8) | yes |" in text
    assert "| 2 | AVX2 | 22 of 23 | 0.49 (fp32 B1 ctx 4096 n_kv 8) | no |" in text
    assert "| fp32 | 1 | 4096 | 8 | 4 | **0.50** (1.00 ms; 2.50x) | 0.49 (1.00 ms; 2.50x) |" in text
    assert "not run" in text  # the shape the second run lacks
    # at 20 GB/s, 100 fp32 GFLOP/s and 600 bf16: the fp32 MQA rows (3) are bound by their FLOPs, nothing else
    assert "- Run 1 (AVX-512): 3 of 24 shapes are bound by FLOPs" in text
    assert "fp32 peak / bf16 peak = 0.17 of its roofline." in text
    assert "by query group, 4: 0.50-" in text


def test_the_grids_are_the_24_shapes_with_sdpa_beside_the_kernel(isa_bench):
    shapes = {
        (dt, b, c, k) for g in isa_bench.grids(False, 5) for dt in g.dtypes for b in g.batches for c in g.contexts
        for k in g.kv_heads
    }  # fmt: skip
    assert len(shapes) == 24 and all(
        g.attention_baselines == ("sdpa", "stream") for g in isa_bench.grids(False, 5)
    )
    with pytest.raises(ValueError, match="attention_baselines"):
        DecodeGrid(attention_baselines=("flash",))
    # n_heads=0 killed the process in the kernel (SIGFPE); a negative head_dim or block_size 0 went on
    for field, value in (("n_heads", 0), ("head_dim", -5), ("block_size", 0), ("e2e_steps", 0)):
        with pytest.raises(ValueError, match=f"{field} must be >= 1, got {value}"):
            DecodeGrid(**{field: value})


def test_the_typical_roofline_holds_every_row_to_the_median_of_its_rounds(isa_bench, monkeypatch):
    """A row whose own rounds caught the matmul slow reads high against its own roofline; against the run's
    median bandwidth and peaks it reads what its time is worth."""
    monkeypatch.setattr(isa_bench, "_reference_run", lambda: None)
    run = _run("cpu A", "avx2", [0.6] * 24)
    for x in run["rows"]:
        x.update(bandwidth=20e9, peak_flops={"fp32": 1e11, "bf16": 6e11})
    slow = run["rows"][3]  # fp32 B1 ctx 4096 n_kv 1: 8 MiB, 2^26 FLOPs, bound by FLOPs at 1e11
    slow["peak_flops"] = {"fp32": 5e10, "bf16": 6e11}
    slow["roofline_fraction"] = 1.34  # 2^26 / 5e10 s over its 1 ms
    typical = isa_bench._typical_fractions(run)
    assert typical[3] == pytest.approx(2**26 / 1e11 / 1e-3)  # 0.67: the median peak, not its own
    bytes_bound = run["rows"][0]  # fp32 B1 ctx 4096 n_kv 8: 64 MiB at 20 GB/s
    assert typical[0] == pytest.approx(bytes_bound["bytes"] / 20e9 / 1e-3)
    text = isa_bench.page({"runs": [run]})
    # below half: the bf16 B1 ctx 4096 rows of 2 and 1 KV heads at 1 ms (8 and 4 MiB at 20 GB/s: 0.42, 0.21)
    assert (
        "| 1 | AVX2 | 24 of 24 | 0.60 (fp32 B1 ctx 4096 n_kv 8) | yes | 22 of 24 | 0.21 (bf16 B1 ctx 4096 n_kv 1) |"
        in text
    )
