"""Building the fused kernel: the name its build is cached under.

The name must change with everything the generated build file holds (two virtual environments on one machine
shared a name and rebuilt each other's kernel in turn), and nothing else: the same inputs give the same name, in
this process and in another.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

from attnlab.attention import fused

SRC = str(Path(fused.__file__).parents[2])  # the attnlab under test, for subprocesses

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
    copy = tmp_path / "fused.cpp"
    copy.write_text(fused._SOURCE.read_text())
    names["the same source at another path"] = fused.extension_name(copy)
    names["other flags"] = fused.extension_name(flags=("-mno-avx512f",))
    copy.write_text(fused._SOURCE.read_text() + "\n// edited\n")
    names["an edited source"] = fused.extension_name(copy)
    assert len({base, *names.values()}) == len(names) + 1, names


def test_the_name_is_the_same_in_another_process(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    code = "from attnlab.attention import fused; print(fused.extension_name())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert proc.stdout.strip() == fused.extension_name()
