"""Decode attention per instruction set: the fused kernel's fraction of the roofline on the small-KV shapes, built
for each ISA this CPU can run, with SDPA timed beside it in the same run. Writes benchmarks/results/decode_isa.json
and docs/performance_isa.md.

    python benchmarks/decode_isa.py                  # native, and AVX2 too where the CPU has AVX-512 (~10 minutes)
    python benchmarks/decode_isa.py --isa avx2       # one instruction set
    python benchmarks/decode_isa.py --from-json      # the page from the saved JSON (seconds)

The shapes: n_heads 32 of 128 dims, n_kv_heads 8, 4, 2 and 1 (groups of 4 to 32 queries per KV head), batch 1 at
4096 and 16384 tokens and batch 4 at 4096, float32 and bfloat16: the 20 shapes docs/performance.md holds to 0.5 of
the roofline, and batch 4 with 4 and 2 KV heads besides (24). The kernels of a process are one build, so each
instruction set runs in a child process of its own with ``ATTNLAB_ISA`` set (``attnlab.attention.fused``):
``native`` is every instruction this CPU has (AVX-512, and AMX tiles for bfloat16 where there are any), ``avx2``
is the build an AVX2-only CPU makes (AMD Zen 1-3, Intel before Skylake-SP). An AVX-512 CPU running the AVX2 build
stands in for an AVX2-only one: the same instructions, registers and tiles, on another core (Zen 4 executes a
512-bit FMA as two 256-bit halves, so its AVX2 FLOP rate is its AVX-512 one). The AVX2 child holds PyTorch's
kernels and its matmul libraries to AVX2 as well (``attnlab.bench.machine.LIBRARY_ISA``), so that its roofline's
peak and its SDPA are an AVX2 CPU's: without bfloat16 instructions the library multiplies bfloat16 no faster than
float32, and the roofline takes the faster of the two. Each child measures its roofline at its start: the
bandwidth of a streaming read and the best library matmul.

The JSON keeps one run per (CPU, instruction set); a run replaces only its own, so runs on other machines stand
beside this one's. The page adds, for reference, the fused rows of benchmarks/results/decode.json (the run of
docs/performance.md, on the machine that made it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # locations.py, beside this script
from locations import output, own_path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "performance_isa.md"
KV_HEADS = (8, 4, 2, 1)
TARGET = 0.5  # of the roofline (issue 33, item 4)
ISA_LABEL = {"amx": "AVX-512 + AMX", "avx512": "AVX-512", "avx2": "AVX2", "generic": "no AVX2"}


def _label(run: dict) -> str:
    """The run's instructions, with AVX512-BF16 named where its bfloat16 steps took the dot products."""
    label = ISA_LABEL.get(run["isa"], run["isa"])
    return label + " + AVX512-BF16" if "AVX512-BF16" in run["machine"].get("decode_path", "") else label


def grids(quick: bool, repeats: int):
    from attnlab.bench import DecodeGrid

    one = dict(
        kv_heads=KV_HEADS, dtypes=("fp32", "bf16"), repeats=repeats, layer=False, mla=False, paged=False
    )
    one["attention_baselines"] = ("sdpa", "stream")  # each row's bandwidth from its own rounds
    if quick:
        return [DecodeGrid(batches=(4,), contexts=(4096,), **one)]
    return [
        DecodeGrid(batches=(1,), contexts=(4096, 16384), **one),
        DecodeGrid(batches=(4,), contexts=(4096,), **one),
    ]


def child(isa: str, out: Path, quick: bool, repeats: int, fresh: bool) -> None:
    """One instruction set's run (ATTNLAB_ISA is set by the parent): its rows and machine into ``out``."""
    import dataclasses

    from attnlab.attention import fused
    from attnlab.bench import run_decode

    fused.ensure_built()
    if fused.isa() is None:
        raise SystemExit(f"decode_isa.py: the kernels do not run here: {fused.status()}")
    rows, machine, start = [], None, time.time()
    for i, grid in enumerate(grids(quick, repeats)):
        grid = dataclasses.replace(grid, fresh_hardware=fresh and i == 0)
        result = run_decode(
            grid, progress=lambda r: print(f"  {isa}: {_shape(r)}: {r['roofline_fraction']:.2f}", flush=True)
        )
        rows += result["rows"]
        machine = result["machine"]
    out.write_text(json.dumps({"machine": machine, "rows": rows, "seconds": round(time.time() - start, 1)}))


def _shape(r: dict) -> str:
    return f"{r['dtype']} B{r['batch']} ctx {r['context']} n_kv {r['n_kv_heads']}"


def isas_here() -> list[str]:
    """native, and avx2 where native is more (a CPU with AVX-512): every build this CPU runs."""
    from attnlab.attention.fused import cpu_flags

    return ["native", "avx2"] if "avx512f" in cpu_flags() else ["native"]


def run(isas: list[str], quick: bool, repeats: int, cached_hardware: bool) -> list[dict]:
    """Each instruction set in a child process, one after another; their results."""
    runs = []
    for isa in isas:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "run.json"
            cmd = [
                sys.executable,
                __file__,
                "--child",
                isa,
                "--child-out",
                str(out),
                "--repeats",
                str(repeats),
            ]
            cmd += ["--quick"] * quick + ["--cached-hardware"] * cached_hardware
            env = {
                **os.environ,
                "ATTNLAB_ISA": isa,
            }  # the child puts this checkout's src/ first itself (main)
            if isa == "avx2":  # the libraries too (the roofline's matmul peak, SDPA): as on an AVX2-only CPU
                from attnlab.bench.machine import LIBRARY_ISA

                env |= LIBRARY_ISA
            print(f"decode_isa.py: ATTNLAB_ISA={isa}", flush=True)
            subprocess.run(cmd, env=env, check=True)
            result = json.loads(out.read_text())
        m = result["machine"]
        runs.append(
            dict(cpu=m.get("cpu"), isa=m.get("isa"), asked=isa, date=time.strftime("%Y-%m-%d"), **result)
        )  # fmt: skip
    return runs


def merge(saved: dict, runs: list[dict], command: str) -> dict:
    """``saved`` with each of ``runs`` in place of the saved run of the same CPU and instruction set."""
    kept = [
        r
        for r in saved.get("runs", [])
        if not any((r["cpu"], r["isa"]) == (n["cpu"], n["isa"]) for n in runs)
    ]
    for r in runs:
        r["command"] = command
    return {"runs": kept + runs}


def _reference_run() -> dict | None:
    """The fused rows of docs/performance.md's run (benchmarks/results/decode.json) on the shapes here."""
    path = RESULTS / "decode.json"
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    rows = [
        r for r in result["rows"] if r["kind"] == "attention" and r["n_kv_heads"] in KV_HEADS and r["context"] >= 4096
    ]  # fmt: skip
    m = result["machine"]
    isa = "amx" if "AMX" in m.get("decode_path", "") else m.get("isa")
    return dict(cpu=m.get("cpu") or "the machine of docs/performance.md (model not recorded)", isa=isa,
                machine=m, rows=rows, reference=True)  # fmt: skip


def page(result: dict) -> str:
    from attnlab.bench.decode import row_hardware
    from attnlab.cost import Hardware
    from attnlab.cost.roofline import compute_peak

    runs = list(result["runs"])
    ref = _reference_run()
    if ref is not None:
        runs.append(ref)
    shapes: dict[tuple, dict] = {}
    for i, run_ in enumerate(runs):
        for r in run_["rows"]:
            key = (r["dtype"] != "fp32", r["batch"], r["context"], -r["n_kv_heads"])
            shapes.setdefault(key, {"row": r})[i] = r
    lines = [
        "# Decode attention per instruction set",
        "",
        "_Generated by `benchmarks/decode_isa.py` from `benchmarks/results/decode_isa.json`; do not edit by hand._",
        "",
        "The fused decode kernel built for each instruction set, one decode step of attention over a filled cache "
        "(n_heads 32 of 128 dims; the query group is 32 / n_kv), its KV read from memory (a ring of caches, as a "
        "model's layers read theirs). Fraction of the roofline = max(bytes / bandwidth, FLOPs / peak) / measured "
        "time, where a run has them with the bandwidth of a streaming read of the ring's bytes and the peaks of "
        "library matmuls (768 x 768, float32 and bfloat16) timed in the same rounds as the kernel (medians, as the "
        "kernel's time), else with those measured at the start of the run: on this shared machine the bandwidth "
        "moved between 25 and 49 GB/s and the float32 peak between 102 and 188 GFLOP/s within an hour, and a "
        "roofline from another moment than the kernel's time is off by as much. SDPA "
        "(`F.scaled_dot_product_attention(enable_gqa=True)`) timed in the same rounds. An AVX-512 CPU running the "
        "AVX2 build stands in for an AVX2-only CPU (same instructions, registers and tiles).",
        "",
        "## Runs",
        "",
        "| run | CPU | instructions | bandwidth at the start (in the rows' rounds) | fp32 / bf16 peak (in the rows' rounds) | load average | date | command |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(runs):
        hw, m = r["machine"]["hardware"], r["machine"]
        peaks = " / ".join(f"{hw['peak_flops'][k] / 1e9:.0f}" for k in ("fp32", "bf16"))
        what = (
            "docs/performance.md's run (`benchmarks/decode.py`)"
            if r.get("reference")
            else f"`{r['command']}`"
        )
        rows_bw = [x["bandwidth"] for x in r["rows"] if x.get("bandwidth")]
        bw = f"{hw['bandwidth'] / 1e9:.1f} GB/s" + (
            f" (rows {min(rows_bw) / 1e9:.1f}-{max(rows_bw) / 1e9:.1f})" if rows_bw else ""
        )
        rows_peaks = [x["peak_flops"] for x in r["rows"] if x.get("peak_flops")]
        if rows_peaks:
            ranges = [
                f"{min(p[k] for p in rows_peaks) / 1e9:.0f}-{max(p[k] for p in rows_peaks) / 1e9:.0f}"
                for k in ("fp32", "bf16")
            ]
            peaks += f" (rows {' / '.join(ranges)})"
        lines.append(
            f"| {i + 1} | {r['cpu']} | {_label(r)} | {bw} | "
            f"{peaks} GFLOP/s | {m.get('load_average', '?')} | {r.get('date', '')} | {what} |"
        )
    lines += [
        "",
        "## Fraction of the roofline (fused ms; SDPA / fused)",
        "",
        "| dtype | B | context | n_kv | group | "
        + " | ".join(f"run {i + 1}" for i in range(len(runs)))
        + " |",
        "|---|---|---|---|---|" + "---|" * len(runs),
    ]
    for key in sorted(shapes):
        cell = shapes[key]
        r0 = cell["row"]
        cells = []
        for i in range(len(runs)):
            r = cell.get(i)
            if r is None:
                cells.append("not run")
                continue
            sdpa = r["speedup"].get("sdpa")
            mark = "**" if r["roofline_fraction"] >= TARGET else ""
            cells.append(
                f"{mark}{r['roofline_fraction']:.2f}{mark} ({r['ms']['fused']:.2f} ms"
                + (f"; {sdpa:.2f}x" if sdpa is not None else "")
                + ")"
            )
        lines.append(
            f"| {r0['dtype']} | {r0['batch']} | {r0['context']} | {r0['n_kv_heads']} | "
            f"{r0['n_heads'] // r0['n_kv_heads']} | " + " | ".join(cells) + " |"
        )
    lines += [
        "",
        "## Target (issue 33, item 4): every shape at >= 0.5 of the roofline, per instruction set",
        "",
    ]
    lines += [
        "The last two columns hold every row of a run to one roofline, at the medians of the bandwidths and peaks "
        "that its rows measured: a row whose own rounds caught the matmul or the streaming read at a slow moment "
        "(a float32 peak of 92-103 GFLOP/s where the run's other rows measured up to 195) reads high against its "
        "own roofline, and not against this one; a row whose kernel time caught a slow moment reads low.",
        "",
        "| run | instructions | shapes at >= 0.5 | lowest | met | at >= 0.5 of the run's median roofline | lowest |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(runs):
        fr = [x["roofline_fraction"] for x in r["rows"]]
        worst = min(r["rows"], key=lambda x: x["roofline_fraction"])
        met = all(f >= TARGET for f in fr) and len(fr) >= 24
        typical = _typical_fractions(r)
        low = min(range(len(typical)), key=typical.__getitem__)
        lines.append(
            f"| {i + 1} | {_label(r)} | {sum(f >= TARGET for f in fr)} of {len(fr)} | "
            f"{worst['roofline_fraction']:.2f} ({_shape(worst)}) | {'yes' if met else 'no'} | "
            f"{sum(f >= TARGET for f in typical)} of {len(typical)} | {typical[low]:.2f} ({_shape(r['rows'][low])}) |"
        )
    lines += ["", "## What bounds each run (computed from its rows)", ""]
    for i, r in enumerate(runs):
        hw = r["machine"]["hardware"]
        fp32, bf16 = hw["peak_flops"]["fp32"], max(hw["peak_flops"]["bf16"], hw["peak_flops"]["fp32"])
        compute = [
            x
            for x in r["rows"]
            if x["flops"] / compute_peak(h := row_hardware(Hardware(**hw), x), x["dtype"])
            > x["bytes"] / h.bandwidth
        ]
        by_group: dict[int, list[float]] = {}
        for x in r["rows"]:
            by_group.setdefault(x["n_heads"] // x["n_kv_heads"], []).append(x["roofline_fraction"])
        groups = ", ".join(f"{g}: {min(f):.2f}-{max(f):.2f}" for g, f in sorted(by_group.items()))
        lines.append(
            f"- Run {i + 1} ({_label(r)}): {len(compute)} of {len(r['rows'])} shapes are bound "
            f"by FLOPs rather than bytes at this machine's peaks; fraction of the roofline by query group, {groups}. "
            + _bf16_bound(r, fp32 / bf16)
        )
    return "\n".join(lines) + "\n"


def _typical_fractions(run: dict) -> list[float]:
    """Each row's fraction of one roofline for the whole run, at the medians of the bandwidths and peaks its rows
    measured in their rounds (where it has them, else those of its start), in the order of its rows."""
    from attnlab.cost import Hardware, step_seconds

    hw = Hardware(**run["machine"]["hardware"])
    rows = [x for x in run["rows"] if x.get("bandwidth") and x.get("peak_flops")]
    if rows:
        peaks = {
            name: statistics.median(x["peak_flops"][name] for x in rows) for name in rows[0]["peak_flops"]
        }
        hw = dataclasses.replace(
            hw,
            bandwidth=statistics.median(x["bandwidth"] for x in rows),
            peak_flops={**hw.peak_flops, **peaks},
        )
    return [
        step_seconds(hw, x["flops"], x["bytes"], x["dtype"]) / (x["ms"]["fused"] / 1e3) for x in run["rows"]
    ]


def _bf16_bound(run: dict, ratio: float) -> str:
    """What caps the run's FLOP-bound bfloat16 steps, by the path they took."""
    widened = f"fp32 peak / bf16 peak = {ratio:.2f} of its roofline"
    if run["isa"] == "amx":
        return f"Groups of 8 or more run on the AMX tiles; smaller ones in float32 (widened on load), at most {widened}."
    if "AVX512-BF16" in run["machine"].get("decode_path", ""):
        return (
            "bfloat16 groups of 8 or more run on AVX512-BF16's dot products (two products per lane an instruction, "
            f"as the library's bfloat16 matmul); smaller ones in float32 (widened on load), at most {widened}."
        )
    return f"The kernels compute bfloat16 in float32 (widened on load), so a FLOP-bound bfloat16 step reaches at most {widened}."


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " ")
    )  # the first paragraph
    parser.add_argument(
        "--isa", default=None, help="comma list of native, avx2 (default: every one this CPU runs)"
    )
    parser.add_argument("--quick", action="store_true", help="batch 4 at 4096 tokens only (a few minutes)")
    # 15, not 5: on the 2-core AMD EPYC of the page, one kernel's 5-round median was up to 1.67x its 15-round one
    # (bf16 B4 n_kv 2: 0.61 of the roofline read 0.38); two 15-round runs timed every row within 0.86-1.16x.
    parser.add_argument("--repeats", type=int, default=15, help="round-robin rounds per shape (median kept)")
    parser.add_argument("--cached-hardware", action="store_true", help="reuse this boot's bandwidth/peak")
    parser.add_argument("--from-json", action="store_true", help="only rewrite the page from the saved JSON")
    parser.add_argument(
        "--json", type=Path, help="the result file (default: benchmarks/results/decode_isa.json)"
    )
    parser.add_argument("--doc", type=Path, help="the page (default: docs/performance_isa.md)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from attnlab.attention.fused import _ISA_FLAGS

    args.isas = isas_here() if args.isa is None else args.isa.split(",")
    if bad := [i for i in args.isas if i not in _ISA_FLAGS]:
        parser.error(f"--isa: unknown {bad}; choose from {', '.join(_ISA_FLAGS)}")
    full = not args.quick
    args.json = args.json or output(RESULTS / "decode_isa.json", full)
    args.doc = args.doc or output(DOC, full)
    return args


def main() -> int:
    sys.path.insert(0, str(ROOT / "src"))
    args = arguments()
    if args.child:
        child(args.child, args.child_out, args.quick, args.repeats, fresh=not args.cached_hardware)
        return 0
    from attnlab.atomic import write_atomic

    saved = json.loads(args.json.read_text()) if args.json.is_file() else {"runs": []}
    if args.from_json:
        result = saved
    else:
        command = "python benchmarks/decode_isa.py" + "".join(
            f" {a}" for a in sys.argv[1:] if a not in ("--cached-hardware",)
        )
        result = merge(saved, run(args.isas, args.quick, args.repeats, args.cached_hardware), command)
        write_atomic(args.json, json.dumps(result, indent=1), ours=own_path(args.json))
    write_atomic(args.doc, page(result), ours=own_path(args.doc))
    for line in page(result).splitlines():
        if line.startswith("| ") and ("yes |" in line or "no |" in line):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
