"""A/B of two versions of the fused decode kernel (``attention/csrc/``) in one process, warm and cold.

    python benchmarks/kernel_ab.py --base 7654ed3            # this checkout's kernel against a commit's
    python benchmarks/kernel_ab.py --base old/csrc --contexts 4096 --dtypes fp32   # a directory of sources
    python benchmarks/kernel_ab.py --base main --overhead     # the cost of a call: tiny shapes of every entry point

Each version is loaded as it was written: a revision's own ``attention/fused.py`` with its own kernel sources (the
C++ operators of today, or the ctypes library of older revisions), copied under benchmarks/.cache/kernel_ab/ and
imported as a module of its own; a directory of sources is built with this checkout's ``fused.py``. Two builds in
one process must not share names: the copies' C++ namespace (``attnlab_fused``) and operator namespace
(``_NAMESPACE = "attnlab"`` in fused.py) are renamed for their role. Both versions are called through their own
Python entry (``fused.decode``), so a change of the call path counts as much as one of the kernel, alternating
which goes first in every round so neither is favoured by the order. Three states per call:

- warm: right after the same call, so the KV rows are in the caches wherever they fit (flatters small shapes);
- cold: right after reading a buffer larger than the last-level cache, so the KV comes from memory, as in
  ``benchmarks/decode.py``, whose round-robin contenders evict each other's data;
- layers: back-to-back calls over a ring of distinct caches (as many as fill ``--flush-mib``), as a model's
  layers read theirs one after another: the KV comes from memory and the cores are busy, not waking up. The
  time per call.

Prints one row per shape (median ms of each version and state, and base / new) and writes the JSON result:
benchmarks/results/kernel_ab.json for the default shapes, else the same name under benchmarks/.cache/quick/.
``--overhead`` instead times calls whose work is a few hundred FLOPs (decode, paged decode, MLA decode, a
two-weight few-row linear, a decoder block step), microseconds per call of each version (the fastest round).
Absolute times on a shared machine drift by tens of percent within an hour; compare versions only within a run.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from attnlab.atomic import write_atomic

sys.path.insert(0, str(Path(__file__).resolve().parent))  # locations.py, beside this script
from locations import at_defaults, output, own_path

ROOT = Path(__file__).resolve().parents[1]
ATTENTION = ROOT / "src" / "attnlab" / "attention"
KERNEL = ATTENTION / "csrc"
COPIES = ROOT / "benchmarks" / ".cache" / "kernel_ab"
RESULTS = ROOT / "benchmarks" / "results"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STATES = ("warm", "cold", "layers")
TOL = {"fp32": 1e-5, "bf16": 2e-2}  # max |new - base|: float32 sums in another order, bf16 output rounding


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def _version_files(spec: str, role: str) -> dict[str, str]:
    """A version's ``fused.py`` and kernel sources by their paths relative to ``attention/``: a git revision's own,
    or a directory of sources with this checkout's ``fused.py``."""
    path = Path(spec)
    if path.is_dir():
        files = {
            f"csrc/{p.name}": p.read_text() for p in sorted(path.iterdir()) if p.suffix in (".cpp", ".h")
        }
        return {"fused.py": (ATTENTION / "fused.py").read_text(), **files}
    rel = ATTENTION.relative_to(ROOT).as_posix()
    wrapper = _git("show", f"{spec}:{rel}/fused.py")
    if wrapper.returncode != 0:
        raise SystemExit(f"--{role} {spec!r}: neither a directory nor a revision holding {rel}/fused.py")
    files = {"fused.py": wrapper.stdout}
    listing = _git("ls-tree", "--name-only", f"{spec}:{rel}/csrc")
    names = [f"csrc/{n}" for n in listing.stdout.split()] if listing.returncode == 0 else ["fused.cpp"]
    for name in names:
        files[name] = _git("show", f"{spec}:{rel}/{name}").stdout
    return files


def _wrapper(text: str, role: str) -> str:
    """A version's ``fused.py`` as a module of its own: its operator namespace renamed for ``role``, and its
    relative imports (``from ..config import env_switch``) made absolute, since the copy lives outside the package."""
    text = re.sub(r'^_NAMESPACE = "attnlab"', f'_NAMESPACE = "attnlab_{role}"', text, flags=re.M)
    text = re.sub(r"^from \.\.(\w)", r"from attnlab.\1", text, flags=re.M)
    return re.sub(r"^from \.(\w)", r"from attnlab.attention.\1", text, flags=re.M)


def load_version(spec: str, role: str):
    """The version's ``fused`` module, imported from its copy and built: its C++ namespace and operator namespace
    renamed for ``role``, so that two builds loaded into one process share no symbol (a template's static
    thread-local scratch, for one: the second library would use the first's objects, which crashes or computes
    garbage once the two versions lay them out differently) and no operator."""
    files = _version_files(spec, role)
    files = {
        name: text.replace("attnlab_fused", f"attnlab_fused_{role}")
        if name != "fused.py"
        else _wrapper(text, role)
        for name, text in files.items()
    }
    key = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:12]
    directory = COPIES / f"{role}-{key}"  # the same version, the same place: its build is found in the cache
    for name, text in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_text() != text:  # an unchanged copy keeps its time: no rebuild
            path.write_text(text)
    loaded = importlib.util.spec_from_file_location(f"attnlab_kernel_{role}", directory / "fused.py")
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)  # type: ignore[union-attr]
    if module._library() is None:
        raise SystemExit(f"--{role} {spec}: cannot build: {module.status()}")
    return module


def measure(versions: dict, dtype: str, context: int, n_kv: int, args, flush: torch.Tensor) -> dict:
    gen = torch.Generator().manual_seed(0)
    dt, h, d = DTYPES[dtype], args.n_heads, args.head_dim
    q = torch.randn(1, h, 1, d, generator=gen).to(dt)
    k = torch.randn(1, n_kv, context, d, generator=gen).to(dt)
    v = torch.randn(1, n_kv, context, d, generator=gen).to(dt)
    kv_bytes = 2 * k.nbytes
    n_layers = max(2, -(-args.flush_mib * 2**20 // kv_bytes))
    ring = [(k, v)] + [(torch.randn_like(k), torch.randn_like(v)) for _ in range(n_layers - 1)]
    scale = d**-0.5

    def call(name: str, k: torch.Tensor = k, v: torch.Tensor = v) -> torch.Tensor:
        return versions[name].decode(q, k, v, scale=scale)

    def layers(name: str) -> None:
        for kl, vl in ring:
            call(name, kl, vl)

    outs = {name: call(name) for name in versions}
    err = max((outs[n].float() - outs["base"].float()).abs().max().item() for n in versions)
    if err > TOL[dtype]:
        raise SystemExit(f"{dtype} ctx {context} n_kv {n_kv}: versions differ by {err:.3g} (> {TOL[dtype]})")
    times = {(n, s): [] for n in versions for s in STATES}
    for rnd in range(args.repeats):
        order = list(versions) if rnd % 2 == 0 else list(versions)[::-1]
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


def _block_step(module, d: int, n_heads: int, n_kv: int, head_dim: int, ffn: int):
    """A ``BlockStep`` of ``module``'s version over random weights (the constructor changed with the operators)."""
    gen = torch.Generator().manual_seed(1)

    def r(*shape):
        return torch.randn(*shape, generator=gen) * 0.1

    norm, wq, wk, wv, wo = (
        r(d) + 1,
        r(n_heads * head_dim, d),
        r(n_kv * head_dim, d),
        r(n_kv * head_dim, d),
        r(d, n_heads * head_dim),
    )
    w1, w3, w2 = r(ffn, d), r(ffn, d), r(d, ffn)
    common = dict(head_dim=head_dim, eps=1e-5, scale=head_dim**-0.5)
    if hasattr(module, "BlockWeights"):
        weights = module.BlockWeights(
            norm, wq, wk, wv, None, None, None, wo, None, norm, w1, w3, w2, None, None, None
        )
        return module.BlockStep(weights, **common)
    return module.BlockStep(
        norm, (wq, wk, wv, None, None, None), (wo, None), norm, (w1, w3, w2, None, None, None), **common
    )


def overhead(versions: dict, repeats: int) -> dict[str, dict[str, float]]:
    """Microseconds per call (the fastest of ``repeats`` rounds of 200 calls) of each entry point, at sizes where the
    call, not the work, is the time: attention over an empty cache (its setup and merge only), a linear layer of
    24 x 32 weights, a block step of width 32 attending to one token."""
    gen = torch.Generator().manual_seed(0)
    q, qm = torch.randn(1, 2, 1, 16, generator=gen), torch.randn(1, 2, 1, 24, generator=gen)
    k, v, rows = torch.zeros(1, 1, 0, 16), torch.zeros(1, 1, 0, 16), torch.zeros(1, 1, 0, 24)
    pool = torch.randn(1, 16, 16, generator=gen)
    x = torch.randn(1, 32, generator=gen)
    ws = [torch.randn(16, 32, generator=gen), torch.randn(8, 32, generator=gen)]
    xb = torch.randn(1, 1, 32, generator=gen)
    cos, sin = torch.ones(1, 8), torch.zeros(1, 8)
    cache = torch.zeros(1, 1, 16, 8), torch.zeros(1, 1, 16, 8)
    steps = {name: _block_step(m, 32, 2, 1, 8, 48) for name, m in versions.items()}
    calls = {
        "decode": lambda m, n: m.decode(q, k, v, scale=0.25),
        "mla decode": lambda m, n: m.decode(qm, rows, rows[..., :16], scale=0.25),
        "paged decode": lambda m, n: m.paged_decode(q, pool, pool, [[]], [0], scale=0.25),
        "linear": lambda m, n: m.linear(x, ws, [None, None]),
        "block step": lambda m, n: steps[n](xb, (cos, sin), *cache, 0),
    }
    result = {}
    for what, fn in calls.items():
        times = {name: [] for name in versions}
        for name, m in versions.items():
            for _ in range(200):  # warm up
                fn(m, name)
        for rnd in range(repeats):
            for name in list(versions) if rnd % 2 == 0 else list(versions)[::-1]:
                m, n = versions[name], 200
                start = time.perf_counter()
                for _ in range(n):
                    fn(m, name)
                times[name].append((time.perf_counter() - start) / n * 1e6)
        # the fastest round: on a shared machine a round is only ever slowed down (preempted), never sped up
        result[what] = {name: round(min(t), 2) for name, t in times.items()}
    return result


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked, with ``--json`` filled in: the committed file when every shape option has its
    default (rounds and threads change how they are timed, not which), else its place under .cache/quick/."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--base",
        required=True,
        help="the other kernel: a git revision, or a directory of sources (built with this checkout's fused.py)",
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
        "--overhead", action="store_true", help="time the call of every entry point at tiny sizes instead"
    )
    parser.add_argument(
        "--json", type=Path, help="the result file (default: benchmarks/results/kernel_ab.json)"
    )
    args = parser.parse_args(argv)
    full = at_defaults(parser, args, "contexts", "kv_heads", "dtypes", "n_heads", "head_dim", "flush_mib")
    full = full and not args.overhead
    args.json = args.json or output(
        RESULTS / ("kernel_ab_overhead.json" if args.overhead else "kernel_ab.json"), full
    )
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

    versions = {role: load_version(getattr(args, role), role) for role in ("base", "new")}
    common = dict(
        base=args.base,
        new=args.new if args.new != str(KERNEL) else "this checkout",
        threads=torch.get_num_threads(),
        repeats=args.repeats,
        torch=torch.__version__,
    )
    if args.overhead:
        result = overhead(versions, args.repeats)
        print(f"{'call':14s} {'base us':>9s} {'new us':>9s} base/new")
        for what, us in result.items():
            print(f"{what:14s} {us['base']:9.2f} {us['new']:9.2f} {us['base'] / us['new']:7.2f}x", flush=True)
        write_atomic(
            args.json, json.dumps(dict(common, us_per_call=result), indent=1), ours=own_path(args.json)
        )
        return 0
    flush = torch.ones(args.flush_mib * 2**20 // 4)
    rows = []
    print("dtype ctx    n_kv  KV MB" + "".join(f" | base {s:6s} new {s:6s} base/new" for s in STATES))
    for dtype in dtypes:
        for context in contexts:
            for n_kv in kv_heads:
                r = measure(versions, dtype, context, n_kv, args, flush)
                ms = r["ms"]
                cells = "".join(
                    f" | {ms[f'base_{s}']:11.3f} {ms[f'new_{s}']:10.3f} {ms[f'base_{s}'] / ms[f'new_{s}']:7.2f}x"
                    for s in STATES
                )
                print(f"{dtype:5s} {context:6d} {n_kv:4d} {r['kv_bytes'] / 2**20:6.1f}{cells}", flush=True)
                rows.append(r)
    result = dict(
        common, n_heads=args.n_heads, head_dim=args.head_dim, batch=1, flush_mib=args.flush_mib, rows=rows
    )
    write_atomic(args.json, json.dumps(result, indent=1), ours=own_path(args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
