"""Building the fused kernel: the name its build is cached under, the one line a build prints, and the clocks that
must not include it.

The name must change with everything the generated build file holds (two virtual environments on one machine
shared a name and rebuilt each other's kernel in turn), and nothing else: the same inputs give the same name, in
this process and in another. The fresh-cache check compiles the kernel once, in a subprocess (seconds).
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import torch

from attnlab import AttentionConfig, ModelConfig
from attnlab.attention import fused
from attnlab.generate import generate
from attnlab.model import Transformer

SRC = str(Path(fused.__file__).parents[2])  # the attnlab under test, for subprocesses
LINE = "attnlab: building the decode kernel for this CPU"

CHANGES = {  # one input of the build at a time, as another environment or machine would have it
    "another virtual environment": lambda m: m.setattr(sys, "prefix", "/other/.venv"),
    "another PyTorch installation": lambda m: m.setattr(torch, "__file__", "/other/torch/__init__.py"),
    "another PyTorch version": lambda m: m.setattr(torch, "__version__", "9.9.9"),
    "another Python's headers": lambda m: m.setattr(sysconfig, "get_path", lambda *a, **k: "/other/include"),
    "another compiler": lambda m: m.setenv("CXX", "clang++"),
    "another version of it": lambda m: m.setattr(fused, "_compiler_version", lambda cxx: "g++ 99.1"),
    "another CPU": lambda m: m.setattr(fused, "_cpu_model", lambda: "model name\t: another CPU"),
}


def test_the_name_changes_with_every_input_of_the_build_file_and_only_with_them(monkeypatch, tmp_path):
    monkeypatch.delenv("CXX", raising=False)
    base = fused.extension_name()
    names = {}
    for what, change in CHANGES.items():
        with monkeypatch.context() as m:
            change(m)
            names[what] = fused.extension_name()
            assert fused.extension_name() == names[what]  # the same simulated environment, the same name
        assert fused.extension_name() == base  # back to this one
    copy = tmp_path / "csrc"
    shutil.copytree(fused._SOURCE, copy)
    names["the same sources at another path"] = fused.extension_name(copy)
    names["other flags"] = fused.extension_name(flags=("-mno-avx512f",))
    header = copy / "values.h"  # a header the compiled unit includes, not the unit itself
    header.write_text(header.read_text() + "\n// edited\n")
    names["an edited header"] = fused.extension_name(copy)
    assert len({base, *names.values()}) == len(names) + 1, names


def test_the_name_is_the_same_in_another_process(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    code = "from attnlab.attention import fused; print(fused.extension_name())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert proc.stdout.strip() == fused.extension_name()


BUILD_TWICE = """
import torch
from attnlab import AttentionConfig, ModelConfig
from attnlab.attention import fused
from attnlab.generate import generate
from attnlab.model import Transformer

cfg = ModelConfig(vocab_size=40, n_layers=1, attention=AttentionConfig(32, 4, 2), ffn_dim=48, max_seq_len=16)
model = Transformer(cfg).eval()
for _ in range(2):
    generate(model, [[1, 2, 3]], 3)
    fused.ensure_built()
print(fused.status())
"""


def test_a_build_is_announced_once_on_stderr_and_a_cached_one_not_at_all(tmp_path):
    """A fresh extension cache (but for the lock file a killed build left): the first run compiles, says so in one
    line on stderr (the default estimate: no build recorded there yet) and records how long it took; the second
    loads the cached build and prints nothing."""
    if os.environ.get("ATTNLAB_FUSED") == "0":
        pytest.skip("ATTNLAB_FUSED=0 turns the kernel off")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    env.pop("ATTNLAB_ISA", None)  # the build named below
    # the lock file of a build that was killed: PyTorch's builder alone would wait for it forever
    (tmp_path / fused.library_name(flags=())).mkdir()
    (tmp_path / fused.library_name(flags=()) / "lock").write_text("")
    runs = [
        subprocess.run(
            [sys.executable, "-c", BUILD_TWICE], capture_output=True, text=True, env=env, timeout=600
        )
        for _ in range(2)
    ]
    for proc in runs:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("fused C++ kernel"), proc.stdout
    first = [line for line in runs[0].stderr.splitlines() if line.startswith("attnlab:")]
    assert first == [f"{LINE} (first use, ~{fused._DEFAULT_BUILD_S} s)"], runs[0].stderr
    assert "attnlab:" not in runs[1].stderr, runs[1].stderr
    assert float((tmp_path / fused._BUILD_SECONDS).read_text()) > 0


def test_a_process_that_waited_for_another_build_does_not_announce_one(tmp_path, monkeypatch, capsys):
    # the build was announced before the lock: a process that waited for another's build said "building" too
    import contextlib

    import torch.utils.cpp_extension as cpp

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(fused, "_compiler_version", lambda compiler: "13")  # a part of the build's name
    name = fused.extension_name(flags=())
    library = tmp_path / name / f"{name}.so"

    def fake_load(**kwargs):
        library.touch()
        return str(library)

    @contextlib.contextmanager
    def other_builder_first(directory):  # the lock comes free once another process has built the library
        library.touch()
        yield

    monkeypatch.setattr(cpp, "load", fake_load)
    monkeypatch.setattr(fused, "_build_lock", other_builder_first)
    assert fused._build(fused._SOURCE) == str(library)
    assert "building" not in capsys.readouterr().err
    library.unlink()
    monkeypatch.setattr(fused, "_build_lock", lambda directory: contextlib.nullcontext())
    fused._build(fused._SOURCE)  # nobody built it: this process does, and says so
    assert capsys.readouterr().err.startswith(LINE)


def test_the_estimate_is_the_last_build_recorded_in_the_cache(tmp_path, capsys):
    (tmp_path / fused._BUILD_SECONDS).write_text("23.4\n")
    fused._announce_build(tmp_path)
    assert capsys.readouterr().err == f"{LINE} (first use, ~23 s)\n"


def test_prefill_time_does_not_include_the_build(monkeypatch):
    """The build (here: a stand-in that takes a second) happens in ``generate`` before its clock starts."""
    if os.environ.get("ATTNLAB_FUSED") == "0":
        pytest.skip("ATTNLAB_FUSED=0 turns the kernel off")
    fused.ensure_built()  # the real kernel, which the stand-in hands back (None: it could not be built)
    for key, value in fused._state.items():  # restored after the test: the built kernel stays in use
        monkeypatch.setitem(fused._state, key, value)
    built, calls = fused._state["ops"], []

    def slow_build(flags=()):
        calls.append(time.perf_counter())
        time.sleep(1.0)
        if built is None:
            raise OSError("no kernel in this run")
        return built

    monkeypatch.setattr(fused, "load_library", slow_build)
    fused.reset()
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=40, n_layers=1, attention=AttentionConfig(32, 4, 2), ffn_dim=48, max_seq_len=16
    )
    gen = generate(Transformer(cfg).eval(), [[1, 2, 3]], 2)
    assert len(calls) == 1
    assert gen.prefill_s < 0.5 and gen.decode_s < 0.5


def test_the_package_ships_every_kernel_source():
    """A wheel builds the kernel at first use from the files it ships: every file of ``csrc/`` (the two compiled
    units and each header they include) must match a package-data pattern of pyproject.toml."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(fused.__file__).parents[3]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "attnlab"
    ]
    package = Path(fused.__file__).parents[1]
    files = [p.relative_to(package).as_posix() for p in fused._source_files(fused._SOURCE)]
    assert {"attention/csrc/kernels.cpp", "attention/csrc/ops.cpp", "attention/csrc/kernels.h"} <= set(files)
    assert [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)] == []


def test_a_pytorch_older_than_2_13_is_refused_before_any_build(monkeypatch):
    """Its stable library lets a refused operand's C++ error kill the process (seen with 2.11): no kernels there."""
    monkeypatch.setattr(fused.torch, "__version__", "2.11.0+cu130")
    monkeypatch.setattr(fused, "_build", lambda *a, **k: pytest.fail("built on an old PyTorch"))
    with pytest.raises(RuntimeError, match=r"PyTorch 2\.13 or later, this is 2\.11\.0\+cu130"):
        fused.load_library(namespace="attnlab_old_torch")
