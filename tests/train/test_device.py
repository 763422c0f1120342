"""Issue 34, item 1: ``--device`` on every command that runs a model (eval, generate, uptrain, convert's fit and MLA
conversions, sweep), through the one resolver ``resources.resolve_device``.

These run on the CPU only: "auto" with CUDA present is checked by pretending ``torch.cuda.is_available`` (no GPU is
touched), and a CUDA run itself is not tested here (none was lent); on this machine ``--device cuda`` must be one
line and exit code 2.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import CPU_LINE, run_cli

from attnlab import resources
from attnlab.train import distributed


def _no_gpu_touched(monkeypatch) -> None:
    """Fail any call that would initialise CUDA: "auto" may ask only whether it is available."""

    def touched(*args, **kwargs):
        raise AssertionError("a CUDA call beyond torch.cuda.is_available")

    for name in ("device_count", "current_device", "get_device_name", "set_device", "init"):
        monkeypatch.setattr(torch.cuda, name, touched)


def test_auto_is_the_cpu_here_and_cuda_where_it_is_available(monkeypatch):
    assert resources.resolve_device() == resources.resolve_device("auto") == torch.device("cpu")
    assert resources.resolve_device(" CPU ") == torch.device("cpu")
    _no_gpu_touched(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resources.resolve_device("auto") == torch.device("cuda", 0)
    assert resources.resolve_device("cpu") == torch.device("cpu")


def test_a_named_gpu_is_checked_against_the_gpus_this_process_sees(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resources.resolve_device("cuda") == torch.device("cuda", 0)
    assert resources.resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(
        ValueError, match=r"^--device cuda:2: this process sees 2 CUDA GPUs \(cuda:0 \.\. cuda:1\)$"
    ):
        resources.resolve_device("cuda:2")


@pytest.mark.parametrize("value", ["gpu", "cuda:x", "cuda:", "cpu:0", "", "cuda:-1", "mps"])
def test_bad_device_names_are_refused_naming_the_value(value):
    with pytest.raises(ValueError, match=f"^--device must be auto, cpu, cuda or cuda:N; got '{value}'$"):
        resources.resolve_device(value)
    with pytest.raises(TypeError, match="--device must be a string"):
        resources.resolve_device(0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("value", ["cuda", "cuda:3"])
def test_cuda_without_a_gpu_says_why(value):
    why = "built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
    with pytest.raises(ValueError, match=f"^--device {value}: .*{why}.*; use --device cpu"):
        resources.resolve_device(value)


def test_the_device_line_names_the_cpu_and_its_threads(one_thread, capsys):
    resources.announce_device(torch.device("cpu"), "fp32")
    line = capsys.readouterr().err
    assert line.endswith(", 1 threads), fp32\n") and CPU_LINE.fullmatch(line.strip()), line


def test_under_torchrun_each_rank_takes_its_own_gpu_and_nccl(monkeypatch):
    # Checked before any collective: a named GPU would put every rank on it; more ranks than GPUs have none.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(ValueError, match=r"^--device cuda:1: under torchrun each rank takes its own GPU"):
        distributed.setup(device="cuda:1")
    with pytest.raises(ValueError, match=r"LOCAL_RANK=3 has no GPU of its own \(this node shows 2\)"):
        distributed.setup(device="cuda")
    assert distributed.backend(torch.device("cuda", 1)) == "nccl"
    assert distributed.backend(torch.device("cpu")) == "gloo"


def _same_with_device_cpu(*args, keep=lambda out: out):
    """The command's JSON without and with ``--device cpu`` (equal after ``keep``), and its stderr device line."""
    plain, cpu = run_cli(*args, "--json"), run_cli(*args, "--json", "--device", "cpu")
    for result in (plain, cpu):
        assert result.exit_code == 0, result.output
        assert CPU_LINE.fullmatch(result.stderr.strip()), result.stderr
    a, b = json.loads(plain.stdout), json.loads(cpu.stdout)
    assert a["device"] == b["device"] == "cpu"
    assert keep(a) == keep(b)
    return a


def test_eval_on_the_cpu_equals_eval_without_the_option(tiny_llama, corpus):
    result = _same_with_device_cpu("eval", tiny_llama, "--data", corpus / "othello.txt", "--seq-len", 32)
    assert result["windows"] > 0


def test_generate_on_the_cpu_equals_generate_without_the_option(tiny_llama):
    def tokens(out):
        return [(o["tokens"], o["text"]) for o in out["outputs"]]

    args = ("generate", tiny_llama, "--prompt", "To be", "--prompt", "Good night", "--max-new", 4)
    result = _same_with_device_cpu(*args, "--bandwidth", 10, keep=tokens)
    assert [len(o["tokens"]) for o in result["outputs"]] == [4, 4]


def test_uptrain_on_the_cpu_equals_uptrain_without_the_option(tmp_path, tiny_llama, corpus):
    fast = ("--data", corpus, "--steps", 2, "--batch-size", 2, "--seq-len", 32, "--eval-windows", 2)
    runs = [run_cli("uptrain", tiny_llama, tmp_path / name, *fast, *extra, "--json")
            for name, extra in (("plain", ()), ("cpu", ("--device", "cpu")))]  # fmt: skip
    for result in runs:
        assert result.exit_code == 0, result.output
        assert CPU_LINE.fullmatch(result.stderr.strip()) and result.stderr.strip().endswith(", fp32")
    plain, cpu = (json.loads(r.stdout) for r in runs)
    assert plain["device"] == cpu["device"] == "cpu" and plain["eval"] == cpu["eval"]
    assert plain["train_loss_last"] == cpu["train_loss_last"]
    a, b = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("plain", "cpu"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("target", ["fit", "mla"])
def test_convert_on_the_cpu_equals_convert_without_the_option(tmp_path, tiny_llama, corpus, target):
    how = {"fit": ("--kv-heads", 2, "--method", "fit"), "mla": ("--to", "mla", "--kv-lora-rank", 16)}[target]
    calib = corpus / "hamlet.txt"
    runs = [run_cli("convert", tiny_llama, tmp_path / name, *how, "--calib", calib, "--json", *extra)
            for name, extra in (("plain", ()), ("cpu", ("--device", "cpu")))]  # fmt: skip
    for result in runs:
        assert result.exit_code == 0, result.output
        assert CPU_LINE.fullmatch(result.stderr.strip()), result.stderr
    plain, cpu = (json.loads(r.stdout) | {"dst": None} for r in runs)
    assert plain["device"] == cpu["device"] == "cpu"
    if target == "fit":
        a, b = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("plain", "cpu"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert plain == cpu
        return
    # Two MLA conversions in one process (even without the option) choose other bases of the latent when its norm
    # is folded in (kv_a / kv_b differ; seen on main too): the same model, so its logit distances agree closely.
    distances = ("logits_mla_vs_native", "logits_source_vs_native")
    assert {k: v for k, v in plain.items() if k not in distances} == {
        k: v for k, v in cpu.items() if k not in distances
    }
    for key in distances:
        assert all(math.isclose(plain[key][f], cpu[key][f], rel_tol=1e-4) for f in plain[key]), (plain, cpu)


def test_a_weight_only_conversion_runs_no_model_and_names_no_device(tmp_path, tiny_llama):
    result = run_cli("convert", tiny_llama, tmp_path / "mean", "--kv-heads", 2, "--device", "cpu", "--json")
    assert result.exit_code == 0 and result.stderr == "", result.output
    assert json.loads(result.stdout)["device"] == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("command", ["eval", "generate", "uptrain", "convert-fit", "convert-mla", "sweep"])
def test_device_cuda_without_a_gpu_is_one_line_and_exit_2(tmp_path, tiny_llama, corpus, command):
    args = {
        "eval": ["eval", tiny_llama, "--data", corpus],
        "generate": ["generate", tiny_llama, "--prompt", "To be"],
        "uptrain": ["uptrain", tiny_llama, tmp_path / "up", "--data", corpus],
        "convert-fit": ["convert", tiny_llama, tmp_path / "c", "--kv-heads", 2, "--method", "fit", "--calib",
                        corpus / "hamlet.txt"],
        "convert-mla": ["convert", tiny_llama, tmp_path / "c", "--to", "mla", "--kv-lora-rank", 16],
        "sweep": ["sweep", tiny_llama, "--data", corpus, "--out", tmp_path / "sweep"],
    }[command]  # fmt: skip
    result = run_cli(*args, "--device", "cuda")
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("attnlab: error: --device cuda: ") and "use --device cpu" in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # refused before anything was written


def test_only_a_rank_whose_parent_is_torchrun_dies_with_it(tmp_path):
    # The parent-death signal killed processes that only inherited torchrun's variables: a detached job, a rank's own
    # `attnlab eval` started from a thread that ended, the ranks of another elastic launcher running as init
    probe = (
        "import ctypes, os; from attnlab.resources import die_with_launcher; die_with_launcher(); "
        "sig = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0); print(sig.value)"
    )  # PR_GET_PDEATHSIG
    env = os.environ | {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2"}
    got = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "0"  # its parent is pytest, not torchrun: left alone
    fake = subprocess.Popen(["bash", "-c", "exec -a /opt/bin/torchrun sleep 30"])
    try:
        time.sleep(0.5)
        assert resources._is_torchrun(fake.pid) and not resources._is_torchrun(os.getpid())
    finally:
        fake.kill()
