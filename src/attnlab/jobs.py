"""The job runner: independent pieces of work (convert, uptrain, eval, time), each cached by a hash of its inputs,
run in worker processes with a progress display; a failing job is reported, and the jobs that do not need it go on.

A ``Job`` is a module-level function (so that a worker process can import it), its JSON-able ``args`` and the
names of the jobs whose results it reads (``deps``). Its key is the SHA-256 of the function's name, its args and its
dependencies' keys, so that a changed input changes the key of that job and of every job downstream of it, and of
no other. ``run_jobs`` writes each finished job's result to ``ROOT/<name>-<key>.json`` and gives a job that writes
files (``output=True``) the directory ``ROOT/<name>-<key>/``; a later run reuses every result it finds, so an
interrupted or extended run (a killed process, a new variant, more steps) computes only what is new. An output
directory deleted since (a sweep that keeps only its best checkpoints) is made again only when a job that has to
run reads it, or when the caller names its job in ``remake``.

A job that raises ``Exception`` is reported with its one-line reason (``Outcome.error``) and the jobs that need it
are skipped, naming it; the others run on. Failures that come from the inputs (``ValueError``, ``TypeError``,
``KeyError``, ``NotImplementedError``: a rank the layers cannot use, a family that refuses a conversion) are cached
like results; any other failure (memory, a full disk) is tried again by the next run. ``KeyboardInterrupt`` and
``SystemExit`` stop the run.

With ``workers`` > 1 the jobs run in that many spawned processes with ``threads // workers`` torch threads each.
A job marked ``alone`` (a timing) runs only while no other job runs, so that the others do not disturb it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from .atomic import claim_dir, write_json
from .console import Progress

INPUT_ERRORS = (ValueError, TypeError, KeyError, NotImplementedError)  # the same inputs fail the same way


@dataclass(frozen=True)
class Job:
    """``fn(args, deps, out) -> dict``: ``deps`` maps each name of ``self.deps`` to that job's result with its
    ``"out"`` directory (None when it writes none); ``out`` is this job's directory (``output``), else None."""

    name: str
    fn: Callable[[dict, dict, Path | None], dict]
    args: dict = field(default_factory=dict)
    deps: tuple[str, ...] = ()
    output: bool = False
    alone: bool = False


@dataclass
class Outcome:
    name: str
    key: str
    result: dict | None  # None: failed (error) or skipped
    error: str | None
    seconds: float
    cached: bool  # taken from an earlier run
    out: Path | None
    skipped: bool = False  # not run: a job it needs failed
    cpu_seconds: float | None = None  # this process's or its worker's CPU time (None: not recorded)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", name)


def _fn_name(fn: Callable) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def _order(jobs: list[Job]) -> list[Job]:
    """The jobs in an order where every job comes after its dependencies; refuses duplicates, unknown names and
    cycles."""
    by_name: dict[str, Job] = {}
    for job in jobs:
        if job.name in by_name:
            raise ValueError(f"two jobs are named {job.name!r}")
        by_name[job.name] = job
    order: list[Job] = []
    state: dict[str, int] = {}  # 1: being visited, 2: placed

    def visit(job: Job, path: tuple[str, ...]) -> None:
        if state.get(job.name) == 2:
            return
        if state.get(job.name) == 1:
            raise ValueError(f"jobs depend on each other in a cycle: {' -> '.join((*path, job.name))}")
        state[job.name] = 1
        for dep in job.deps:
            if dep not in by_name:
                raise ValueError(f"job {job.name!r} needs {dep!r}, which is not a job")
            visit(by_name[dep], (*path, job.name))
        state[job.name] = 2
        order.append(job)

    for job in jobs:
        visit(job, ())
    return order


def job_keys(jobs: list[Job], root: Path | None = None) -> dict[str, str]:
    """Each job's key: a hash of its function, its args and its dependencies' keys. Paths inside ``root`` (the
    cache: the sweep's copies of its text, named by their content) are hashed relative to it, so that a cache
    moved or copied elsewhere (a sweep's --out) keeps its keys: every job ran again."""

    def portable(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: portable(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [portable(v) for v in value]
        if root is not None and isinstance(value, str) and value.startswith(f"{root}{os.sep}"):
            return "<cache>" + value[len(str(root)) :]
        return value

    keys: dict[str, str] = {}
    for job in _order(jobs):
        text = json.dumps(
            {"fn": _fn_name(job.fn), "args": portable(job.args), "deps": {d: keys[d] for d in job.deps}},
            sort_keys=True,
            default=str,
        )
        keys[job.name] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return keys


def _call(fn: Callable, args: dict, deps: dict, out: str | None, threads: int | None) -> dict:
    """One job, in a worker or in this process: its result, or its error's one line."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    started, cpu = time.perf_counter(), time.process_time()
    try:
        result = fn(args, deps, Path(out) if out is not None else None)
        if not isinstance(result, dict):
            raise TypeError(f"{_fn_name(fn)} returned {type(result).__name__}, not a dict")
        error, cacheable = None, True
    except Exception as err:  # reported in the job's row; the run goes on
        text = " ".join(str(err).split()) or type(err).__name__
        if isinstance(err, KeyError) and err.args:
            text = str(err.args[0])
        result, error, cacheable = None, text, isinstance(err, INPUT_ERRORS)
    return {
        "result": result,
        "error": error,
        "cacheable": cacheable,
        "seconds": time.perf_counter() - started,
        "cpu_seconds": time.process_time() - cpu,
    }


def _running_text(running: dict[str, float], now: float) -> str:
    if not running:
        return "-"
    shown = [f"{name} {now - t:.0f}s" for name, t in sorted(running.items(), key=lambda kv: kv[1])]
    return ", ".join(shown[:3]) + (f" +{len(shown) - 3}" if len(shown) > 3 else "")


def run_jobs(
    jobs: list[Job],
    root: str | Path,
    *,
    workers: int = 1,
    threads: int | None = None,
    progress: bool = True,
    title: str = "jobs",
    remake: frozenset[str] = frozenset(),
) -> dict[str, Outcome]:
    """Run what is not cached in ``root`` (an attnlab "cache" directory, created if missing); returns every
    job's outcome by name. ``threads``: torch threads shared by the workers (default: this process's).
    ``remake``: jobs whose output directory, deleted since, is wanted again (they run again, with the jobs whose
    deleted outputs they read)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"--jobs must be an int >= 1, got {workers!r}")
    order = _order(jobs)
    root = claim_dir(root, "cache", what="job cache")
    keys = job_keys(order, root)
    stem = {j.name: root / f"{_slug(j.name)}-{keys[j.name]}" for j in order}
    outs = {j.name: stem[j.name] if j.output else None for j in order}

    outcomes: dict[str, Outcome] = {}
    for job in order:
        path = stem[job.name].with_suffix(".json")
        if path.is_file():
            try:
                found = json.loads(path.read_text())
            except ValueError:  # a damaged file: the job runs again
                continue
            outcomes[job.name] = Outcome(
                job.name, keys[job.name], found.get("result"), found.get("error"), found.get("seconds", 0.0),
                True, outs[job.name], cpu_seconds=found.get("cpu_seconds"),
            )  # fmt: skip
    dependants: dict[str, list[str]] = {j.name: [] for j in order}
    for job in order:
        for dep in job.deps:
            dependants[dep].append(job.name)
    need = {j.name: j.name not in outcomes for j in order}
    for job in reversed(order):  # a deleted output is made again when a job that runs reads it
        out = outs[job.name]
        if not need[job.name] and out is not None and not out.is_dir() and outcomes[job.name].error is None:
            need[job.name] = job.name in remake or any(need[d] for d in dependants[job.name])
    todo = [j for j in order if need[j.name]]
    for job in todo:
        outcomes.pop(job.name, None)

    if threads is None:
        threads = torch_threads()
    per_worker = max(1, threads // workers) if workers > 1 else None
    running: dict[str, float] = {}
    pending: dict[Future, Job] = {}
    waiting = list(todo)
    done = 0

    def finish(job: Job, raw: dict) -> None:
        outcome = Outcome(
            job.name, keys[job.name], raw["result"], raw["error"], raw["seconds"], False, outs[job.name],
            cpu_seconds=raw["cpu_seconds"],
        )  # fmt: skip
        outcomes[job.name] = outcome
        if raw["cacheable"]:
            record = {"job": job.name, "fn": _fn_name(job.fn), "args": job.args, "key": keys[job.name]}
            record |= {k: raw[k] for k in ("result", "error", "seconds", "cpu_seconds")}
            write_json(stem[job.name].with_suffix(".json"), record, by="jobs", ours=True)

    def ready() -> list[Job]:
        return [j for j in waiting if all(d in outcomes for d in j.deps)]

    def skip_failed() -> None:
        for job in ready():
            failed = [d for d in job.deps if outcomes[d].result is None]
            if failed:
                why = outcomes[failed[0]].error or "failed"
                outcomes[job.name] = Outcome(
                    job.name,
                    keys[job.name],
                    None,
                    f"needs {failed[0]}, which failed: {why}",
                    0.0,
                    False,
                    None,
                    True,
                )
                waiting.remove(job)

    def inputs(job: Job) -> dict[str, dict]:
        return {
            d: (outcomes[d].result or {}) | {"out": str(outs[d]) if outs[d] is not None else None}
            for d in job.deps
        }

    with Progress(title, len(todo), fields=("running", "left"), enabled=progress) as bar:
        pool = (
            ProcessPoolExecutor(
                workers, mp_context=get_context("spawn"), initializer=_worker_start, initargs=(os.getpid(),)
            )
            if workers > 1 and len(todo) > 1
            else None
        )
        # until the loop ends normally: an exception (Ctrl-C, SIGTERM, an error) stops the workers at once
        stopped = True
        try:
            while waiting or pending:
                skip_failed()
                before = len(waiting)
                for job in ready():
                    alone_now = any(j.alone for j in pending.values())
                    if alone_now or (job.alone and pending) or (pool is not None and len(pending) >= workers):
                        break
                    if pool is None and pending:
                        break
                    waiting.remove(job)
                    out = str(outs[job.name]) if outs[job.name] is not None else None
                    running[job.name] = time.monotonic()
                    bar.update(done, running=_running_text(running, time.monotonic()), left=str(len(waiting)))
                    if pool is None:
                        finish(job, _call(job.fn, job.args, inputs(job), out, None))
                        running.pop(job.name)
                        done += 1
                    else:
                        # a job that runs alone (a timing) has every thread, as it would in one process
                        share = threads if job.alone else per_worker
                        pending[pool.submit(_call, job.fn, job.args, inputs(job), out, share)] = job
                done = sum(1 for j in todo if j.name in outcomes)
                bar.update(done, running=_running_text(running, time.monotonic()), left=str(len(waiting)))
                if pending:
                    finished, _ = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                    for future in finished:
                        job = pending.pop(future)
                        running.pop(job.name, None)
                        finish(job, future.result())
                elif waiting and len(waiting) == before and not ready():
                    raise RuntimeError("jobs wait on each other")  # _order makes this impossible
            stopped = False
        finally:
            if pool is not None:
                _stop(pool, now=stopped)
    return {j.name: outcomes[j.name] for j in order}


def _worker_start(parent: int) -> None:
    """In each worker: Ctrl-C is the parent's to handle (it stops the workers); and a worker whose parent is gone
    (killed, SIGKILL included: nothing runs in it to stop them) exits within a second, so that no job writes into a
    cache whose lock its owner no longer holds."""
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="attnlab-parent-watch").start()


def _stop(pool: ProcessPoolExecutor, now: bool) -> None:
    """Shut ``pool`` down: after the last job, waiting for the workers to exit; when the run stops early (Ctrl-C,
    SIGTERM, an error), at once, the running jobs killed: a job can take minutes, and its result would be thrown
    away (the next run computes it again)."""
    if not now:
        pool.shutdown(wait=True)
        return
    processes = list(getattr(pool, "_processes", None) or {})  # CPython's pid -> Process map
    pool.shutdown(wait=False, cancel_futures=True)
    for pid in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)  # a worker's default handler exits
    pool.shutdown(wait=True)


def torch_threads() -> int:
    """The threads torch runs on in this process (OMP_NUM_THREADS, torch.set_num_threads): what a job run here takes,
    and what ``run_jobs`` shares among its workers by default."""
    import torch

    return torch.get_num_threads()
