"""Decode-step linear layers: the fused C++ few-row product (``attention.fused.linear``) against ``F.linear``
(the BLAS matrix product) on the weight shapes of a SmolLM-135M-shaped model, cold and in one process (issue 13).

A decode step reads every weight once, so what matters is how fast a product streams a weight that is not in
cache: each timed call takes the next of enough copies of the weight to fill 256 MB, more than the last-level
cache. Rows 1, 4 and 8 (a batch of sequences decoded together); float32 and bfloat16; both in alternating
order, median of ``--repeats`` calls each. Prints a table (GB/s = weight bytes / time) and writes
benchmarks/results/linear.json (a run with fewer rows or dtypes: the same name under benchmarks/.cache/quick/).

    python benchmarks/linear.py
    python benchmarks/linear.py --rows 1 --dtypes fp32 --repeats 30
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from attnlab.cost import get_preset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # locations.py, beside this script
from locations import at_defaults, output, own_path

ROOT = Path(__file__).resolve().parents[1]
# (name, out_features, in_features): SmolLM-135M's projections (q and wq+wk+wv of GQA-3 in one pass, the MLP's
# gate+up in one pass, down) and its output head (vocabulary 49152), from attnlab's preset.
_SMOLLM = get_preset("smollm-135m")
_D, _HD = _SMOLLM.attention.d_model, _SMOLLM.attention.head_dim
SHAPES = [
    ("wq", _SMOLLM.attention.n_heads * _HD, _D),
    ("wq+wk+wv", (_SMOLLM.attention.n_heads + 2 * _SMOLLM.attention.n_kv_heads) * _HD, _D),
    ("w1+w3", 2 * _SMOLLM.ffn_dim, _D),
    ("w2", _D, _SMOLLM.ffn_dim),
    ("output", _SMOLLM.vocab_size, _D),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def timed(product, x: torch.Tensor, weights: list[torch.Tensor], repeats: int) -> float:
    """Median seconds of ``product(x, w)``, each call on the next weight copy (not in cache)."""
    times = []
    for i in range(repeats):
        w = weights[i % len(weights)]
        start = time.perf_counter()
        product(x, w)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ours(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from attnlab.attention import fused

    return fused.linear(x, [w])


def run(rows_list: list[int], dtypes: list[str], repeats: int) -> list[dict]:
    from attnlab.attention import fused

    if not fused.available():
        raise SystemExit(f"the fused kernel is not available: {fused.status()}")
    out = []
    for dname in dtypes:
        dtype = DTYPES[dname]
        for name, n, k in SHAPES:
            nbytes = n * k * torch.finfo(dtype).bits // 8
            copies = [torch.randn(n, k).to(dtype) for _ in range(max(2, 256_000_000 // nbytes))]
            for rows in rows_list:
                x = torch.randn(rows, k).to(dtype)
                fused_s, blas_s = [], []
                for _ in range(3):  # alternating rounds, so both see the same machine
                    fused_s.append(timed(ours, x, copies, repeats))
                    blas_s.append(timed(F.linear, x, copies, repeats))
                t_ours, t_blas = min(fused_s), min(blas_s)
                row = {
                    "dtype": dname,
                    "weight": name,
                    "shape": [n, k],
                    "rows": rows,
                    "fused_us": round(t_ours * 1e6, 1),
                    "blas_us": round(t_blas * 1e6, 1),
                    "fused_gbps": round(nbytes / t_ours / 1e9, 2),
                    "blas_gbps": round(nbytes / t_blas / 1e9, 2),
                    "speedup": round(t_blas / t_ours, 3),
                }
                out.append(row)
                print(
                    f"{dname} {name:9} {n}x{k} rows {rows}: fused {row['fused_gbps']:5.1f} GB/s, "
                    f"F.linear {row['blas_gbps']:5.1f} GB/s, {row['speedup']:.2f}x",
                    flush=True,
                )
            del copies
    return out


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with ``--json`` filled in: the committed file for every row count and dtype, else its place
    under benchmarks/.cache/quick/ (locations.py)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " ")
    )  # the first paragraph
    parser.add_argument("--rows", default="1,4,8", help="comma list of input rows")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per round (median kept)")
    parser.add_argument("--json", type=Path, help="the result file (default: benchmarks/results/linear.json)")
    args = parser.parse_args(argv)
    if bad := [d for d in args.dtypes.split(",") if d not in DTYPES]:
        parser.error(f"--dtypes: unknown {bad}; choose from {', '.join(DTYPES)}")
    args.json = args.json or output(
        ROOT / "benchmarks" / "results" / "linear.json", at_defaults(parser, args, "rows", "dtypes")
    )
    return args


def main() -> int:
    args = arguments()
    sys.path.insert(0, str(ROOT / "src"))
    from attnlab.atomic import write_atomic

    rows = run([int(r) for r in args.rows.split(",")], args.dtypes.split(","), args.repeats)
    result = {
        "command": "python benchmarks/linear.py " + " ".join(sys.argv[1:]),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
        "load": [round(x, 2) for x in os.getloadavg()],
        "rows": rows,
    }
    write_atomic(args.json, json.dumps(result, indent=1), ours=own_path(args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
