"""``attnlab sweep``: plan the jobs, run them (cached, ``--jobs`` workers, progress on stderr), build the rows, print
the table or JSON and, with ``--out``, write the results JSON, the markdown report and the plots there.

Where it writes: ``--out DIR`` (an attnlab "sweep" directory, created if missing and held by one sweep at a time)
holds everything: ``jobs/`` (the job cache with every converted and uptrained checkpoint), ``sweep.json``,
``report.md`` and the plots. Without ``--out`` the job cache is attnlab's own,
``$XDG_CACHE_HOME/attnlab/sweep/<source>``, and only the table (or JSON) is printed. ``--keep best`` deletes the
checkpoints of the rows that are not Pareto-optimal, ``--keep none`` all of them; their results stay cached, and a
row that a later run (``--keep all`` or ``best``) finds Pareto-optimal gets its checkpoint made again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from ..atomic import (
    check_file,
    claim_dir,
    json_text,
    lock,
    remove_or_keep,
    remove_stale_in,
    write_atomic,
    write_json,
)
from ..data import _cache_home
from ..hf import io
from ..hf.causal_lm import check_causal_lm, model_config
from ..jobs import run_jobs, torch_threads
from ..resources import announce_device, resolve_device
from . import plan, report
from .plan import SweepOptions


def _cache_root(opts: SweepOptions) -> Path:
    if opts.out is not None:
        return opts.out / "jobs"
    key = hashlib.sha256(str(opts.src.resolve()).encode()).hexdigest()[:16]
    return _cache_home() / "attnlab" / "sweep" / f"{opts.src.resolve().name}-{key}"


def run_sweep(opts: SweepOptions, *, as_json: bool = False, progress: bool = True) -> dict:
    """Run the sweep (see the module docstring); returns the results (what ``--json`` prints)."""
    plan.check_options(opts)
    where = resolve_device(opts.device)
    started = time.perf_counter()
    hf = io.read_config(opts.src)
    cfg = model_config(opts.src, hf)
    plan.check_against(opts, cfg, where.type)
    # the jobs load it: a truncated file or a missing tensor failed every row, exit 0
    check_causal_lm(opts.src, hf)
    read = plan.check_data(opts, cfg)  # before --out and the job cache are made
    variants = plan.variants(cfg, opts.variants, opts.quick)
    teacher = None if opts.teacher in ("src", "none") else opts.teacher  # a checkpoint: an input too
    sources = [opts.src, opts.data, opts.eval_data, teacher]
    with contextlib.ExitStack() as held:
        if opts.out is not None:
            out = claim_dir(opts.out, "sweep", sources=sources, what="--out")
            held.enter_context(lock(out, "--out"))
            # a report the user edited (its mark gone) is refused now, not at the end
            for name in report.OUT_FILES:
                check_file(out / name, what="--out file")
        root = claim_dir(_cache_root(opts), "cache", sources=sources, what="job cache")
        if opts.out is None:  # attnlab's own cache of this source: one sweep at a time, as an --out
            held.enter_context(lock(root, "the job cache of this source"))
        # what killed sweeps left half-written or half-deleted (the cache is ours, locked)
        remove_stale_in(root)
        data = plan.prepare_data(opts.data, opts.eval_data, root, read)
        jobs, planned = plan.plan_jobs(opts, cfg, variants, data)
        announce_device(
            where, f"every job that runs a model, {opts.jobs} worker{'s' if opts.jobs > 1 else ''}"
        )
        outcomes = run_jobs(jobs, root, workers=opts.jobs, threads=torch_threads(), progress=progress,
                            title="sweep (jobs)")  # fmt: skip
        rows = report.build_rows(planned, outcomes, hf, opts)
        # a Pareto row whose checkpoint an earlier --keep best/none deleted: made again, if this run keeps it
        lost = frozenset(
            p["checkpoint_job"] for p, r in zip(planned, rows, strict=True)
            if r["pareto"] and r["checkpoint"] is None and p["checkpoint_job"] is not None
            and outcomes[p["checkpoint_job"]].result is not None
        )  # fmt: skip
        if lost and opts.keep != "none":
            first = outcomes
            outcomes = run_jobs(jobs, root, workers=opts.jobs, threads=torch_threads(), progress=progress,
                                title="sweep (checkpoints to keep)", remake=lost)  # fmt: skip
            # a job the first pass ran is cached in the second: it counts as run (it counted as cached)
            ran = {n for n, o in first.items() if not o.cached and not o.skipped}
            outcomes = {n: first[n] if n in ran and o.cached else o for n, o in outcomes.items()}
            rows = report.build_rows(planned, outcomes, hf, opts)
        if opts.keep != "all":
            kept = {r["checkpoint"] for r in rows if r["pareto"] and opts.keep == "best"}
            for r in rows:
                doomed = r["kind"] != "source" and r["checkpoint"] is not None and r["checkpoint"] not in kept
                # one a user added files to stays (remove_or_keep says so), and keeps its path in the row
                if doomed and remove_or_keep(r["checkpoint"], "checkpoint", "checkpoint"):
                    r["checkpoint"] = None
        measured = [r["measured_context"] for r in rows if r.get("measured_context") is not None]
        results = {
            "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()}
            | {"uptrain_steps": list(opts.steps), "variants": [v.name for v in variants]},
            "source": {
                "model_type": hf["model_type"],
                "n_heads": cfg.n_heads,
                "n_kv_heads": cfg.attention.n_kv_heads,
                "head_dim": cfg.attention.head_dim,
                "n_layers": cfg.n_layers,
            },
            "measured_context": min(measured) if measured else None,
            "rows": rows,
            "jobs": {
                "run": sum(not o.cached and not o.skipped for o in outcomes.values()),
                "cached": sum(o.cached for o in outcomes.values()),
                "failed": sum(o.result is None and not o.skipped for o in outcomes.values()),
                "skipped": sum(o.skipped for o in outcomes.values()),
                "computed": sorted(n for n, o in outcomes.items() if not o.cached and not o.skipped),
                "seconds": {n: o.seconds for n, o in outcomes.items()},
            },
            "seconds": time.perf_counter() - started,
            "machine": {"threads": torch_threads(), "workers": opts.jobs, "load_average": os.getloadavg()[0]},
        }
        if opts.out is not None:
            plots = report.plot(results, out)
            write_atomic(out / "report.md", report.markdown(results, plots))
            write_json(out / "sweep.json", results, by="sweep")
    if as_json:
        print(json_text(results), end="")
    else:
        report.print_table(results)
        if opts.out is not None:
            print(f"results: {opts.out / 'sweep.json'}, report: {opts.out / 'report.md'}")
    return results


def load_results(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())
