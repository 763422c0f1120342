"""A/B of two versions of the fused decode kernel (``attention/csrc/``) in one process, warm and cold.

    python benchmarks/kernel_ab.py --base 7654ed3            # this checkout's kernel against a commit's
    python benchmarks/kernel_ab.py --base old/csrc --contexts 4096 --dtypes fp32   # a directory of sources

Both sources are built (cached like the package's own build) and called through the same Python entry
(``attnlab.attention.fused.decode``), alternating which goes first in every round so neither is favoured by the
order. Three states per call:

- warm: right after the same call, so the KV rows are in the caches wherever they fit (flatters small shapes);
- cold: right after reading a buffer larger than the last-level cache, so the KV comes from memory, as in
  ``benchmarks/decode.py``, whose round-robin contenders evict each other's data;
- layers: back-to-back calls over a ring of distinct caches (as many as fill ``--flush-mib``), as a model's
  layers read theirs one after another: the KV comes from memory and the cores are busy, not waking up. The
  time per call.

Prints one row per shape (median ms of each version and state, and base / new) and writes the JSON result:
benchmarks/results/kernel_ab.json for the default shapes, else the same name under benchmarks/.cache/quick/.
Absolute times on a shared machine drift by tens of percent within an hour; compare versions only within a run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from attnlab.atomic import write_atomic
from attnlab.attention import fused

sys.path.insert(0, str(Path(__file__).resolve().parent))  # locations.py, beside this script
from locations import at_defaults, output, own_path

ROOT = Path(__file__).resolve().parents[1]
KERNEL = ROOT / "src" / "attnlab" / "attention" / "csrc"
OLD_KERNEL = KERNEL.with_name("fused.cpp")  # one file, before the kernel was split into headers
RESULTS = ROOT / "benchmarks" / "results"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STATES = ("warm", "cold", "layers")
TOL = {"fp32": 1e-5, "bf16": 2e-2}  # max |new - base|: float32 sums in another order, bf16 output rounding


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def _files(spec: str, role: str) -> dict[str, str]:
    """The kernel's files by name: a directory's ``.cpp``/``.h`` files, a single ``.cpp`` file, or a git revision's
    ``csrc/`` directory (or, before the kernel was split into headers, its one ``fused.cpp``)."""
    path = Path(spec)
    if path.is_dir():
        return {p.name: p.read_text() for p in sorted(path.iterdir()) if p.suffix in (".cpp", ".h")}
    if path.is_file():
        return {"fused.cpp": path.read_text()}
    rel = KERNEL.relative_to(ROOT).as_posix()
    listing = _git("ls-tree", "--name-only", f"{spec}:{rel}")
    if listing.returncode == 0:
        return {name: _git("show", f"{spec}:{rel}/{name}").stdout for name in listing.stdout.split()}
    old = _git("show", f"{spec}:{OLD_KERNEL.relative_to(ROOT).as_posix()}")
    if old.returncode == 0:
        return {"fused.cpp": old.stdout}
    raise SystemExit(
        f"--{role} {spec!r}: neither a directory, a file nor a revision holding {rel} ({old.stderr.strip()})"
    )


def _source(spec: str, tmp: Path, role: str) -> Path:
    """A kernel's sources (see ``_files``) copied into the directory ``tmp/role`` with their C++ namespace renamed
    for ``role``. Two builds loaded into one process share their unique symbols (a template's static thread-local
    scratch, for one) unless their namespaces differ: the second library then uses the first's objects, which
    crashes or computes garbage once the two versions lay them out differently."""
    directory = tmp / role
    directory.mkdir()
    for name, text in _files(spec, role).items():
        (directory / name).write_text(text.replace("attnlab_fused", f"attnlab_fused_{role}"))
    return directory


def _build(source: Path):
    """The kernel library compiled from ``source``."""
    try:
        return fused.load_library(source)
    except Exception as err:  # a compile error in the variant under test: say which file
        raise SystemExit(f"{source}: cannot build: {' '.join(str(err).split())[:600]}") from None


def measure(libs: dict, dtype: str, context: int, n_kv: int, args, flush: torch.Tensor) -> dict:
    gen = torch.Generator().manual_seed(0)
    dt, h, d = DTYPES[dtype], args.n_heads, args.head_dim
    q = torch.randn(1, h, 1, d, generator=gen).to(dt)
    k = torch.randn(1, n_kv, context, d, generator=gen).to(dt)
    v = torch.randn(1, n_kv, context, d, generator=gen).to(dt)
    kv_bytes = 2 * k.nbytes
    n_layers = max(2, -(-args.flush_mib * 2**20 // kv_bytes))
    ring = [(k, v)] + [(torch.randn_like(k), torch.randn_like(v)) for _ in range(n_layers - 1)]
    scale = d**-0.5
    saved = fused._state["lib"]

    def call(name: str, k: torch.Tensor = k, v: torch.Tensor = v) -> torch.Tensor:
        fused._state["lib"] = libs[name]
        return fused.decode(q, k, v, scale=scale)

    def layers(name: str) -> None:
        for kl, vl in ring:
            call(name, kl, vl)

    try:
        outs = {name: call(name) for name in libs}
        err = max((outs[n].float() - outs["base"].float()).abs().max().item() for n in libs)
        if err > TOL[dtype]:
            raise SystemExit(
                f"{dtype} ctx {context} n_kv {n_kv}: versions differ by {err:.3g} (> {TOL[dtype]})"
            )
        times = {(n, s): [] for n in libs for s in STATES}
        for rnd in range(args.repeats):
            order = list(libs) if rnd % 2 == 0 else list(libs)[::-1]
            for state in STATES:
                for name in order:
                    if state == "layers":
                        start = time.perf_counter()
                        layers(name)
                        times[(name, state)].append((time.perf_counter() - start) / n_layers)
                        continue
                    if state == "cold":
                        flush.sum()
                    else:
                        call(name)
                    start = time.perf_counter()
                    call(name)
                    times[(name, state)].append(time.perf_counter() - start)
    finally:
        fused._state["lib"] = saved
    ms = {f"{n}_{s}": round(statistics.median(t) * 1e3, 4) for (n, s), t in times.items()}
    return dict(
        dtype=dtype,
        context=context,
        n_kv_heads=n_kv,
        kv_bytes=kv_bytes,
        layers=n_layers,
        ms=ms,
        max_abs_diff=err,
    )


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked, with ``--json`` filled in: the committed file when every shape option has its
    default (rounds and threads change how they are timed, not which), else its place under .cache/quick/."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--base",
        required=True,
        help="the other kernel: a directory of sources, a .cpp file or a git revision",
    )
    parser.add_argument("--new", default=str(KERNEL), help="the kernel under test (default: this checkout's)")
    parser.add_argument("--contexts", default="4096,16384", help="comma list of cached tokens")
    parser.add_argument("--kv-heads", default="8,4,2,1", help="comma list of KV heads")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16")
    parser.add_argument("--n-heads", type=int, default=32, help="query heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20, help="rounds per shape (medians kept)")
    parser.add_argument(
        "--flush-mib",
        type=int,
        default=256,
        help="buffer read before each cold call; the layers' ring fills it",
    )
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    parser.add_argument(
        "--json", type=Path, help="the result file (default: benchmarks/results/kernel_ab.json)"
    )
    args = parser.parse_args(argv)
    full = at_defaults(parser, args, "contexts", "kv_heads", "dtypes", "n_heads", "head_dim", "flush_mib")
    args.json = args.json or output(RESULTS / "kernel_ab.json", full)
    dtypes = args.dtypes.split(",")
    if bad := [x for x in dtypes if x not in DTYPES]:
        parser.error(f"--dtypes: unknown {bad}, expected some of {sorted(DTYPES)}")
    try:
        contexts = [int(x) for x in args.contexts.split(",")]
        kv_heads = [int(x) for x in args.kv_heads.split(",")]
    except ValueError as err:
        parser.error(f"--contexts / --kv-heads: comma lists of integers ({err})")
    if bad := [n for n in kv_heads if n < 1 or args.n_heads % n]:
        parser.error(f"--kv-heads: {bad} must divide --n-heads {args.n_heads}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    args.dtypes, args.contexts, args.kv_heads = dtypes, contexts, kv_heads  # the lists from here on
    return args


def main() -> int:
    args = arguments()
    dtypes, contexts, kv_heads = args.dtypes, args.contexts, args.kv_heads
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        libs = {role: _build(_source(getattr(args, role), Path(tmp), role)) for role in ("base", "new")}
    flush = torch.ones(args.flush_mib * 2**20 // 4)
    rows = []
    print("dtype ctx    n_kv  KV MB" + "".join(f" | base {s:6s} new {s:6s} base/new" for s in STATES))
    for dtype in dtypes:
        for context in contexts:
            for n_kv in kv_heads:
                r = measure(libs, dtype, context, n_kv, args, flush)
                ms = r["ms"]
                cells = "".join(
                    f" | {ms[f'base_{s}']:11.3f} {ms[f'new_{s}']:10.3f} {ms[f'base_{s}'] / ms[f'new_{s}']:7.2f}x"
                    for s in STATES
                )
                print(f"{dtype:5s} {context:6d} {n_kv:4d} {r['kv_bytes'] / 2**20:6.1f}{cells}", flush=True)
                rows.append(r)
    result = dict(
        base=args.base,
        new=args.new if args.new != str(KERNEL) else "this checkout",
        n_heads=args.n_heads,
        head_dim=args.head_dim,
        batch=1,
        threads=torch.get_num_threads(),
        repeats=args.repeats,
        flush_mib=args.flush_mib,
        torch=torch.__version__,
        rows=rows,
    )
    write_atomic(args.json, json.dumps(result, indent=1), ours=own_path(args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
