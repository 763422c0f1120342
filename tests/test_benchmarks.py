"""The benchmark scripts' command lines, without running a benchmark: ``--help`` only prints help."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if 'if __name__ == "__main__":' in p.read_text())
MODULES = {"gqa_study_report.py", "mla_study_report.py"}  # imported by the scripts, not run
COMMITTED = [ROOT / "benchmarks" / "results", ROOT / "docs"]


def committed_files() -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for folder in COMMITTED for p in folder.rglob("*") if p.is_file()}


def test_every_file_in_benchmarks_is_a_script_or_a_module_they_import():
    assert {p.name for p in BENCHMARKS.glob("*.py")} - {p.name for p in SCRIPTS} == MODULES


def test_help_prints_usage_and_runs_nothing(tmp_path):
    # uptrain_checks.py --help ran the whole benchmark (half a minute) and rewrote its committed JSON.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    before = committed_files()

    def run(script: Path) -> tuple[Path, subprocess.CompletedProcess, float]:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        return script, done, time.perf_counter() - start

    with ThreadPoolExecutor(2) as pool:  # two at a time: each spends its ~2 s importing torch
        for script, done, seconds in pool.map(run, SCRIPTS):
            assert done.returncode == 0, f"{script.name}: {done.stderr[-2000:]}"
            assert done.stdout.startswith(f"usage: {script.name} "), script.name
            assert seconds < 30, f"{script.name} --help took {seconds:.0f} s"
    assert committed_files() == before
    assert list(tmp_path.iterdir()) == []
