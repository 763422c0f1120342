"""The benchmark scripts' command lines, without running a benchmark: ``--help`` only prints help, and quick or
partial runs write under benchmarks/.cache/quick/, never over the results the repository keeps (locations.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if 'if __name__ == "__main__":' in p.read_text())
MODULES = {"gqa_study_report.py", "mla_study_report.py", "locations.py", "llamacpp.py"}  # imported, not run
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


@pytest.fixture
def scripts(monkeypatch):
    """Loads a benchmark script as a module (its ``main`` is not run); sys.path, which the scripts extend with
    benchmarks/, and sys.modules are restored afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module

    return load


R, D = ROOT / "benchmarks" / "results", ROOT / "docs"
DECODE = {"json": R / "decode.json", "doc": D / "performance.md", "png": R / "decode.png"}
GENERATE = {"json": R / "generate.json", "doc": D / "performance.md"}
MINILM = {"json": R / "convert_minilm.json", "png": D / "conversion_minilm.png", "doc": D / "conversion.md"}
MLA = {"json": R / "mla_study.json", "png": D / "conversion_mla.png", "doc": D / "conversion.md"}
# (script, options of a full run, options of a partial one, what a full run writes); how often a timing is
# repeated, and on how many threads, does not make a run partial
RUNS = [
    ("decode", [], ["--quick"], DECODE),
    ("decode", ["--repeats", "3", "--threads", "1"], ["--quick", "--from-json"], DECODE),
    ("generate", [], ["--contexts", "512"], GENERATE),
    ("generate", ["--long-variants", "gqa3", "--repeats", "1"], ["--variants", "gqa3"], GENERATE),
    ("generate", [], ["--new", "2"], GENERATE),
    ("kernel_ab", ["--base", "HEAD", "--repeats", "16"], ["--base", "HEAD", "--contexts", "4096"],
     {"json": R / "kernel_ab.json"}),
    ("kernel_ab", ["--base", "HEAD"], ["--base", "HEAD", "--dtypes", "fp32"], {"json": R / "kernel_ab.json"}),
    ("linear", ["--repeats", "5"], ["--rows", "1"], {"json": R / "linear.json"}),
    ("convert_speed", [], ["--n-layers", "2"], {"json": R / "convert_speed.json", "doc": D / "convert_speed.md"}),
    ("convert_minilm", ["--replot"], ["--kv-heads", "12,4"], MINILM),
    ("mla_conversion", ["--src", "x"], ["--src", "x", "--n-eval", "2"], {"json": R / "mla_conversion.json"}),
    ("gqa_study", ["--workers", "1"], ["--quick"], {"json": R / "gqa_study.json", "docs": D}),
    ("mla_study", [], ["--quick"], MLA),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "full", "partial", "files"), RUNS, ids=lambda x: x if isinstance(x, str) else ""
)
def test_only_full_runs_write_the_committed_results(scripts, name, full, partial, files):
    module = scripts(name)
    quick = ROOT / "benchmarks" / ".cache" / "quick"
    full_args, partial_args = module.arguments(full), module.arguments(partial)
    for option, committed in files.items():
        assert getattr(full_args, option) == committed
        assert getattr(partial_args, option) == quick / committed.relative_to(ROOT)
    given = module.arguments([*partial, "--json", "elsewhere.json"])
    assert given.json == Path("elsewhere.json")  # a path on the command line wins


def test_a_full_run_without_the_full_corpus_says_where_it_goes(scripts, monkeypatch, tmp_path, capsys):
    locations = scripts("locations")
    monkeypatch.setattr(locations, "FULL_CORPUS", tmp_path / "missing")
    with pytest.raises(SystemExit) as exit:
        locations.corpus(True, "gqa_study.py")
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path / "missing") in err and err.startswith("gqa_study.py: ")
    from attnlab.data import shakespeare

    assert (
        locations.corpus(False, "gqa_study.py") == shakespeare()
    )  # quick and partial runs: the shipped plays


def test_scripts_replace_files_in_their_own_directories_only(scripts, tmp_path):
    # attnlab's write rule for the scripts: the checkout's results, docs and cache directories are theirs; a file of
    # the user's elsewhere (a --json path) is replaced only when it carries attnlab's mark.
    from attnlab.atomic import write_atomic, write_json

    locations = scripts("locations")
    assert locations.own_path(ROOT / "benchmarks" / "results" / "decode.json")
    assert locations.own_path(ROOT / "benchmarks" / ".cache" / "quick" / "docs" / "performance.md")
    assert not locations.own_path(tmp_path / "decode.json") and not locations.own_path(ROOT / "README.md")
    theirs = tmp_path / "decode.json"
    theirs.write_text('{"mine": true}')
    with pytest.raises(FileExistsError, match="without attnlab's mark"):
        write_atomic(theirs, "{}", ours=locations.own_path(theirs))
    write_json(tmp_path / "marked.json", {"rows": []}, by="benchmarks/decode.py")
    write_atomic(tmp_path / "marked.json", "{}", ours=locations.own_path(tmp_path / "marked.json"))


@pytest.mark.parametrize(
    "name,args,message",
    [
        ("decode", ["--repeats", "0"], "argument --repeats: expected an integer >= 1, got '0'"),
        ("decode", ["--threads", "0"], "argument --threads: expected an integer >= 1"),
        ("decode", ["--png", "mine.json"], "--png mine.json: expected a .png file"),
        ("generate", ["--contexts", "abc"], "--contexts: expected a comma list of integers >= 1, got 'abc'"),
        ("generate", ["--new", "0"], "argument --new: expected an integer >= 1"),
    ],
)
def test_bad_options_are_one_line_before_any_work(scripts, capsys, name, args, message):
    # they were tracebacks, --new 0 after building four SmolLM-sized checkpoints
    with pytest.raises(SystemExit) as stop:
        scripts(name).arguments(args)
    assert stop.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("name", ["decode", "generate"])
def test_from_json_without_a_saved_result_is_one_line(scripts, monkeypatch, capsys, tmp_path, name):
    module = scripts(name)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--from-json", "--json", str(tmp_path / "none.json")])
    assert module.main() == 2
    assert f"--from-json: no saved result at {tmp_path / 'none.json'}" in capsys.readouterr().err


def test_kernel_ab_imports_a_copy_of_the_checkouts_wrapper(scripts, tmp_path):
    # The copy lives outside the package: fused.py's `from ..config import env_switch` failed there ("attempted
    # relative import with no known parent package"), so no A/B could run at all.
    module = scripts("kernel_ab")
    text = module._wrapper((module.ATTENTION / "fused.py").read_text(), "probe")
    assert "\nfrom ." not in text
    (tmp_path / "fused.py").write_text(text)
    spec = importlib.util.spec_from_file_location("attnlab_kernel_probe", tmp_path / "fused.py")
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)  # imports, without building anything
    assert copy._NAMESPACE == "attnlab_probe"
