"""The job runner (``attnlab.jobs``): a finished job is not rerun, a changed input reruns exactly the jobs
downstream of it, a killed run resumes with what was not finished, a failing job does not stop the others."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab.jobs import Job, job_keys, run_jobs


def record(args: dict, deps: dict, out: Path | None) -> dict:
    """A job that logs its call to ``args["log"]`` and returns its value plus its dependencies'."""
    with open(args["log"], "a") as f:
        f.write(args["id"] + "\n")
    if args.get("fail"):
        raise ValueError(f"{args['id']} cannot be done")
    if args.get("crash"):
        raise MemoryError("no memory")
    if args.get("kill") and not Path(args["kill"]).exists():
        Path(args["kill"]).write_text("killed once")
        os.kill(os.getpid(), signal.SIGKILL)
    if out is not None:
        out.mkdir()
        (out / "value.txt").write_text(str(args["value"]))
    total = args["value"] + sum(d["total"] for d in deps.values())
    for d in deps.values():
        if d["out"] is not None:
            total += int((Path(d["out"]) / "value.txt").read_text())
    return {"total": total}


def graph(log: Path, **changes: dict) -> list[Job]:
    """a -> b -> c, and d alone."""
    args = {
        name: {"id": name, "log": str(log), "value": v}
        for name, v in zip("abcd", (1, 10, 100, 1000), strict=True)
    }
    for name, extra in changes.items():
        args[name] |= extra
    return [
        Job("a", record, args["a"], output=True),
        Job("b", record, args["b"], deps=("a",)),
        Job("c", record, args["c"], deps=("b",)),
        Job("d", record, args["d"]),
    ]


def calls(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def test_a_finished_job_is_not_rerun_and_a_changed_input_reruns_exactly_its_dependants(tmp_path):
    log, root = tmp_path / "log", tmp_path / "cache"
    first = run_jobs(graph(log), root, progress=False)
    assert sorted(calls(log)) == ["a", "b", "c", "d"]
    assert first["c"].result == {"total": 100 + (10 + 1 + 1)}  # b read a's value and its file
    assert not any(o.cached for o in first.values())

    again = run_jobs(graph(log), root, progress=False)
    assert len(calls(log)) == 4  # nothing rerun
    assert all(o.cached for o in again.values())
    assert {n: o.result for n, o in again.items()} == {n: o.result for n, o in first.items()}
    # the CPU time a job used is kept with its result (what a study reports as its cost on idle cores)
    assert all(o.cpu_seconds is not None and o.cpu_seconds >= 0 for o in first.values())
    assert {n: o.cpu_seconds for n, o in again.items()} == {n: o.cpu_seconds for n, o in first.items()}

    run_jobs(graph(log, b={"value": 20}), root, progress=False)
    assert calls(log)[4:] == ["b", "c"]  # b and what reads it; not a, not d
    keys, changed = job_keys(graph(log)), job_keys(graph(log, b={"value": 20}))
    assert [n for n in "abcd" if keys[n] != changed[n]] == ["b", "c"]


def test_paths_inside_the_cache_are_keyed_relative_to_it(tmp_path):
    inside, outside = str(tmp_path / "cache" / "text-1"), str(tmp_path / "elsewhere")
    moved = str(tmp_path / "moved" / "text-1")

    def jobs(text, other=outside):
        return [Job("a", record, {"id": "a", "log": "", "value": 1, "text": text, "other": [other]})]

    here = job_keys(jobs(inside), tmp_path / "cache")
    assert here == job_keys(jobs(moved), tmp_path / "moved")
    assert here != job_keys(jobs(inside), tmp_path / "other")  # not inside: the path itself
    assert here != job_keys(jobs(inside, outside + "2"), tmp_path / "cache")  # other paths as they are


def test_a_new_job_runs_alone_and_a_deleted_output_is_made_again_only_when_needed(tmp_path):
    log, root = tmp_path / "log", tmp_path / "cache"
    outcomes = run_jobs(graph(log), root, progress=False)

    shutil.rmtree(outcomes["a"].out)  # e.g. a sweep that keeps only its best checkpoints
    run_jobs(graph(log), root, progress=False)
    assert len(calls(log)) == 4  # nobody that runs needs a's output
    jobs = [*graph(log), Job("e", record, {"id": "e", "log": str(log), "value": 5}, deps=("a",))]
    out = run_jobs(jobs, root, progress=False)
    assert calls(log)[4:] == ["a", "e"]  # e is new and reads a's directory, which is made again
    assert out["e"].result == {"total": 5 + 1 + 1}


def test_a_deleted_output_named_in_remake_is_made_again_with_the_outputs_it_reads(tmp_path):
    log, root = tmp_path / "log", tmp_path / "cache"
    jobs = [*graph(log), Job("e", record, {"id": "e", "log": str(log), "value": 5}, deps=("a",), output=True)]
    first = run_jobs(jobs, root, progress=False)
    shutil.rmtree(first["a"].out)
    shutil.rmtree(first["e"].out)  # a sweep's --keep best deleted both
    again = run_jobs(jobs, root, progress=False)
    assert len(calls(log)) == 5 and not first["e"].out.is_dir()  # nobody asked for them
    again = run_jobs(jobs, root, progress=False, remake=frozenset({"e"}))
    assert calls(log)[5:] == ["a", "e"]  # e, and a, whose directory e reads
    assert again["e"].out.is_dir() and again["a"].out.is_dir() and not again["e"].cached
    assert again["e"].result == first["e"].result and again["b"].cached


def test_a_failing_job_is_reported_and_the_others_go_on(tmp_path):
    log, root = tmp_path / "log", tmp_path / "cache"
    out = run_jobs(graph(log, b={"fail": True}, d={"crash": True}), root, progress=False)
    assert sorted(calls(log)) == ["a", "b", "d"]
    assert out["a"].result == {"total": 1}
    assert out["b"].result is None and out["b"].error == "b cannot be done"
    assert out["c"].result is None and out["c"].error == "needs b, which failed: b cannot be done"
    assert out["d"].error == "no memory"
    run_jobs(graph(log, b={"fail": True}, d={"crash": True}), root, progress=False)
    # the input's failure is cached; memory may be there next time: d is tried again
    assert calls(log)[3:] == ["d"]


def test_a_killed_run_resumes_with_what_was_not_finished(tmp_path):
    log, root, flag = tmp_path / "log", tmp_path / "cache", tmp_path / "killed"
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); from test_jobs import graph; from pathlib import Path\n"
        "from attnlab.jobs import run_jobs\n"
        "run_jobs(graph(Path(sys.argv[2]), c={'kill': sys.argv[4]}), sys.argv[3], progress=False)\n"
    )
    args = [sys.executable, "-c", script, str(Path(__file__).parent), str(log), str(root), str(flag)]
    killed = subprocess.run(args, capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert calls(log)[-1] == "c" and sorted(calls(log)) in (["a", "b", "c"], ["a", "b", "c", "d"])
    before = len(calls(log))
    resumed = subprocess.run(args, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(calls(log)[before:]) == ["c", "d"][: 1 + (before == 3)]  # a, b (d) finished: not rerun


def sleeper(args: dict, deps: dict, out: Path | None) -> dict:
    """A long job that says which process runs it."""
    Path(args["pids"], args["id"]).write_text(str(os.getpid()))
    import time

    time.sleep(60)
    return {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_workers_stop_soon_after_their_run_is_stopped_or_killed(tmp_path, how):
    """SIGTERM waited for every running job to end (minutes) and threw their results away; SIGKILL left the
    workers running for ever, writing into a cache whose lock was gone."""
    import time

    (tmp_path / "pids").mkdir()
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); from test_jobs import sleeper; from pathlib import Path\n"
        "from attnlab.jobs import Job, run_jobs\n"
        "if __name__ == '__main__':\n"
        "    jobs = [Job(n, sleeper, {'id': n, 'pids': sys.argv[2]}) for n in 'abc']\n"
        "    run_jobs(jobs, sys.argv[3], workers=2, progress=False)\n"
    )
    path = tmp_path / "run.py"
    path.write_text(script)
    args = [
        sys.executable,
        str(path),
        str(Path(__file__).parent),
        str(tmp_path / "pids"),
        str(tmp_path / "cache"),
    ]
    proc = subprocess.Popen(args, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(list((tmp_path / "pids").iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    workers = [int(p.read_text()) for p in (tmp_path / "pids").iterdir()]
    assert len(workers) == 2
    stopped = time.monotonic()
    proc.send_signal(how)
    proc.wait(timeout=30)
    while any(map(_alive, workers)) and time.monotonic() < stopped + 20:
        time.sleep(0.2)
    assert not any(map(_alive, workers)), "a worker outlived its run"
    assert time.monotonic() - stopped < 10  # not the jobs' 60 s


def test_worker_processes_give_the_same_results(tmp_path):
    log = tmp_path / "log"
    one = run_jobs(graph(log), tmp_path / "one", progress=False)
    two = run_jobs(graph(log), tmp_path / "two", workers=2, threads=2, progress=False)
    assert {n: o.result for n, o in one.items()} == {n: o.result for n, o in two.items()}
    assert sorted(calls(log)[4:]) == ["a", "b", "c", "d"]
    recorded = json.loads(next((tmp_path / "two").glob("c-*.json")).read_text())
    assert recorded["generated_by"].startswith("attnlab") and recorded["result"] == two["c"].result


def test_bad_graphs_are_refused(tmp_path):
    log = tmp_path / "log"
    a = Job("a", record, {"id": "a", "log": str(log), "value": 1}, deps=("b",))
    with pytest.raises(ValueError, match="not a job"):
        run_jobs([a], tmp_path / "c", progress=False)
    b = Job("b", record, {"id": "b", "log": str(log), "value": 1}, deps=("a",))
    with pytest.raises(ValueError, match="cycle"):
        run_jobs([a, b], tmp_path / "c", progress=False)
    with pytest.raises(ValueError, match="two jobs"):
        run_jobs([b, b], tmp_path / "c", progress=False)
    with pytest.raises(ValueError, match="--jobs"):
        run_jobs([], tmp_path / "c", workers=0, progress=False)


def test_progress_lines_when_stderr_is_not_a_terminal(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("ATTNLAB_PROGRESS_SECONDS", "0")
    run_jobs(graph(tmp_path / "log"), tmp_path / "cache", title="sweep (jobs)")
    lines = capfd.readouterr().err.splitlines()
    assert lines[-1].startswith("attnlab: sweep (jobs): 4/4 (100%), left 0")
    assert any("running" in line and "left" in line for line in lines)
