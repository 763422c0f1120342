"""The full decode sweep: writes benchmarks/results/decode.json + decode.png and regenerates docs/performance.md.

    python benchmarks/decode.py                 # the representative grid (~10 min on 2 cores)
    python benchmarks/decode.py --quick         # a 1-2 minute subset
    python benchmarks/decode.py --docs-only     # rebuild the page from the saved JSON

The issue's full grid (n_kv_heads 32..1 x batch 1-8 x context 512-16384 x fp32/bf16, each against three
baselines) takes hours on a 2-core CPU; the representative grid below keeps every n_kv_heads, both dtypes and
the 4096/16384 contexts at batch 1, and batch 4 at 4096 for three n_kv_heads.

OpenMP worker threads spin after each parallel region by default. On an idle machine that is what a chain of
short ops wants; on one shared with other jobs the spinning steals the core from the thread doing the work,
and a kernel made of several short ops (ours) then suffers far more than a single fused one (SDPA): run with
``OMP_WAIT_POLICY=PASSIVE`` there. The policy in force is recorded in the JSON and on the page.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "performance.md"


def grids(quick: bool):
    from attnlab.bench import DecodeGrid

    if quick:
        return [
            DecodeGrid(kv_heads=(32, 8, 1), contexts=(4096,), dtypes=("fp32", "bf16"), repeats=5, e2e=False)
        ]
    return [
        DecodeGrid(
            kv_heads=(32, 16, 8, 4, 2, 1), contexts=(4096, 16384), dtypes=("fp32", "bf16"), repeats=7,
            e2e=True, e2e_context=4096, e2e_steps=6,
        ),
        DecodeGrid(
            kv_heads=(32, 8, 1), batches=(4,), contexts=(4096,), dtypes=("fp32", "bf16"), repeats=5,
            layer=False, mla=False,
        ),
    ]  # fmt: skip


def run(quick: bool, cached_hardware: bool) -> dict:
    from attnlab.bench import run_decode

    merged: dict = {"rows": [], "grids": []}
    start = time.time()
    for i, grid in enumerate(grids(quick)):
        # bandwidth and peak are measured once, at the start of this run, under the load it sees
        grid = dataclasses.replace(grid, fresh_hardware=i == 0 and not cached_hardware)
        result = run_decode(grid, progress=lambda r: print(json.dumps(r), flush=True))
        merged["machine"] = result["machine"]
        merged["grids"].append(result["grid"])
        merged["rows"] += result["rows"]
    merged["seconds"] = round(time.time() - start, 1)
    return merged


def _sel(rows, **want):
    return [r for r in rows if all(r.get(k) == v for k, v in want.items())]


def _shape(r: dict) -> str:
    kv = "MLA" if r["kind"] == "mla" else f"n_kv {r['n_kv_heads']}"
    return f"{r['dtype']} B{r['batch']} ctx {r['context']} {kv}"


def targets(result: dict) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) for each target of the issue, computed from the rows."""
    rows, out = result["rows"], []

    def check(name: str, pairs: list[tuple[float, dict]], bound: float, fmt: str = "{:.2f}x") -> None:
        if not pairs:
            return
        worst, worst_row = min(pairs, key=lambda p: p[0])
        best = max(p[0] for p in pairs)
        misses = sum(1 for v, _ in pairs if v < bound)
        measured = (f"min {fmt.format(worst)} ({_shape(worst_row)}), max {fmt.format(best)}; "
                    f"{len(pairs) - misses} of {len(pairs)} shapes meet it")  # fmt: skip
        out.append((name, measured, "met" if misses == 0 else "not met"))

    att = [r for r in _sel(rows, kind="attention") if r["n_kv_heads"] <= 8 and r["context"] >= 4096]
    for dt, bound in (("fp32", 1.5), ("bf16", 3.0)):
        check(f"grouped vs SDPA(enable_gqa), {dt}, n_kv<=8, ctx>=4096: >= {bound}x",
              [(r["speedup"]["sdpa"], r) for r in att if r["dtype"] == dt], bound)  # fmt: skip
    check("grouped vs repeat-KV reference, n_kv<=8, ctx>=4096: >= 20x",
          [(r["speedup"]["reference"], r) for r in att], 20)  # fmt: skip
    check("grouped within 2x of the roofline (fraction >= 0.5), n_kv<=8, ctx>=4096",
          [(r["roofline_fraction"], r) for r in att], 0.5, "{:.2f}")  # fmt: skip
    # The live view sits in a 2x-context buffer; the same live length in a 4x buffer would take 2x as long if a
    # step read the whole buffer. Inverse ratio so that "higher is better" holds for every check.
    live = [(r["ms"]["grouped"] / r["ms"]["grouped_4x_buffer"], r) for r in _sel(rows, kind="attention")]
    check("cost follows the live length, not max_seq_len: time(2x buffer) / time(4x buffer) >= 0.67 "
          "(0.5 if the buffer were read)", live, 0.67, "{:.2f}")  # fmt: skip
    gqa = []
    for r in _sel(rows, kind="attention"):
        mha = _sel(
            rows, kind="attention", dtype=r["dtype"], batch=r["batch"], context=r["context"], n_kv_heads=32
        )
        if mha and 4 <= r["n_kv_heads"] < r["n_heads"]:
            ideal = r["n_heads"] / r["n_kv_heads"]
            gqa.append((mha[0]["ms"]["grouped"] / r["ms"]["grouped"] / (0.6 * ideal), r))
    check("MHA -> GQA-g speedup / (0.6 x n_heads/n_kv), n_kv>=4: >= 1", gqa, 1.0, "{:.2f}")
    mla = [r for r in _sel(rows, kind="mla") if r["context"] >= 4096]
    check("MLA absorbed vs naive at >= 4096 tokens: >= 5x", [(r["speedup"]["naive"], r) for r in mla], 5)
    check(
        "MLA absorbed vs HF DeepseekV3Attention: > 1x",
        [(r["speedup"]["hf_deepseek_v3"], r) for r in mla],
        1.0,
    )
    check("paged vs contiguous: time(contiguous)/time(paged) >= 1/1.2",
          [(r["speedup"]["contiguous"], r) for r in _sel(rows, kind="paged")], 1 / 1.2)  # fmt: skip
    check("whole layer vs HF LlamaAttention (sdpa): >= 1x",
          [(r["speedup"]["hf_llama_sdpa"], r) for r in _sel(rows, kind="layer")], 1.0)  # fmt: skip
    return out


LIMITS = """
## What limits the remaining gaps

- **Per-op cost, not bytes.** A step is a handful of library calls: float32 is 3 ops for one chunk
  (`baddbmm`, fused `softmax`, `bmm`), bfloat16 is 2 small 2-D matmuls per (batch, KV head) pair plus the softmax
  (the batched bfloat16 matmul copies strided operands, which we refuse). Each call is a parallel region with a
  fixed cost of tens of microseconds (more with `OMP_WAIT_POLICY=PASSIVE`, whose sleeping workers must be woken),
  so small, cache-resident steps (MQA, GQA-2/4 at 4096 tokens: 2-8 MB of KV) sit at 0.2-0.5 of the roofline even
  though every byte is read once. A fused kernel (one pass: score, online softmax, accumulate) would close this;
  torch.compile's inductor C++ backend was probed: near the roofline for MHA at batch 1, but its reduction
  re-read K once per query of a group (MQA ~10x off), and compiling took 2-17 s per shape, so it is not used.
- **Library matmuls for skinny shapes.** Decode is a batched matrix-vector product (MHA) or a GEMM with 4-32
  columns. MKL streams the cache well only with the cache as the left operand (used here); bfloat16 matmuls
  (oneDNN, AVX512-BF16) are slower per byte than float32 ones at these shapes, so bfloat16 halves the bytes but
  not the time.
- **The roofline inputs.** Bandwidth is `attnlab.cost.hardware.measure_local`'s streaming read of one 512 MiB
  buffer, measured at the start of this run (so under this run's load); the peak is its best square matmul.
  KV up to ~32 MiB can stay partly in the 32 MiB L3 between repeated steps, which flatters small shapes.
- **Whole layer.** At d_model 4096 a decode step reads ~160 MB of projection weights (float32) against 32 MB of
  KV at 4096 tokens (GQA-8): the layer is weight-bound, both implementations spend most of their time in the same
  `nn.Linear` matmuls, and the attention speedup is diluted. Hugging Face's `DynamicCache` also concatenates the
  whole cache at every step (a copy per step), which is why its layer falls further behind at 16384 tokens.
- **Paged cache.** With the worst-fit placement rows stay in one or two runs and the step costs what the
  contiguous one does; the `paged_scattered` column (every block its own run, 16 runs per row at 4096 tokens with
  256-token blocks) shows the price of fragmentation: one chunk, hence ~10 ops, per run.
- **Where the targets fall short** (the table above is computed from this run's JSON). The 20x over the
  repeat-KV reference fails where the reference is cheap, not where ours is slow: GQA-8 in bfloat16 at 4096
  tokens, where the float32 reference takes ~35 ms (no slower than SDPA) against ~500 ms at 16384 tokens.
  MHA -> GQA-4 scaling falls short because a 2-10 ms step is near the per-op floor above, so it cannot shrink
  in proportion to the bytes. Paged within 1.2x fails at batch 4 for small steps (MQA, GQA-8), because paged
  rows are attended one at a time (3 ops each) where the contiguous batch is one set of ops; at batch 1 paged
  and contiguous are equal. Roofline fractions are best for float32 and MHA/MQA, worst for bfloat16 GQA
  (2 matmuls per KV head per step).
- **Shared machine.** Contenders are timed round-robin and medians kept, so ratios are fair even when other
  jobs run; absolute times are not. With other jobs on the 2 cores, OpenMP's default spinning made every
  contender several times slower, ours (more ops) the most: run with `OMP_WAIT_POLICY=PASSIVE` then. The
  policy of this run is in the Machine section. A run under load (PASSIVE) measured fewer shapes within 2x of
  the roofline (0 of 20, fractions 0.10-0.42) with the same pass/fail pattern for the other targets.
"""


def notes(result: dict, command: str) -> str:
    rows = targets(result)
    lines = [
        "## Targets of issue 4 (computed from this run)",
        "",
        "| target | measured | verdict |",
        "|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    key = "; ".join(f"{a.split(':')[0]}: {b.split(';')[0]} ({c})" for a, b, c in rows)
    lines += ["", LIMITS.strip(), "", "## Closing note", "",
              f"Reproduce with `{command}` ({result.get('seconds', '?')} s for this run, "
              f"OMP_WAIT_POLICY={result['machine'].get('omp_wait_policy', 'unset')}). Key ratios (worst shape "
              f"of each target): {key}."]  # fmt: skip
    return "\n".join(lines)


def write_docs(result: dict, command: str) -> None:
    from attnlab.atomic import write_atomic
    from attnlab.bench.report import performance_page, plot

    png = plot(result, RESULTS / "decode.png")
    rel = os.path.relpath(png, DOC.parent)
    write_atomic(DOC, performance_page(result, plot_path=rel, command=command, notes=notes(result, command)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 1-2 minute subset")
    parser.add_argument("--docs-only", action="store_true", help="regenerate the page from the saved JSON")
    parser.add_argument(
        "--cached-hardware", action="store_true", help="reuse this boot's bandwidth/peak measurement"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from attnlab.atomic import write_atomic

    path = RESULTS / "decode.json"
    command = "python benchmarks/decode.py" + (" --quick" if args.quick else "")
    if args.docs_only:
        result = json.loads(path.read_text())
        command = result.get("command", command)
    else:
        result = run(args.quick, args.cached_hardware)
        result["command"] = command
        write_atomic(path, json.dumps(result, indent=1))
    write_docs(result, command)
    for target in targets(result):
        print(" | ".join(target))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
