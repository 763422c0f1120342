"""benchmarks/gpu_check.py, the GPU check of issue 34, run on the CPU on small shapes (CI has no GPU): every
correctness check holds there too, the page is made from the JSON alone, and the committed page is the committed
JSON's (measured on an H100)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def test_the_cpu_run_passes_every_correctness_check_and_the_page_is_the_jsons(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--json", str(tmp_path / "r.json"),
         "--doc", str(tmp_path / "page.md")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    assert [r["variant"] for r in result["correctness"]] == ["mha", "gqa", "mqa", "mla"]
    for r in result["correctness"]:
        assert "error" not in r, r
        assert r["logits_rel_err_fp32"] < 1e-5 and r["logits_rel_err_bf16"] < 2e-2, r
        assert r["greedy_equal_contiguous"] and r["greedy_equal_paged"] and r["sampled_same_seed_equal"], r
        assert r["greedy_equal_static"] and not r["static_compiled"], r  # the static cache, eager on a CPU
    assert all("error" not in r and r["rel_err"] < 2e-2 for r in result["decode"]), result["decode"]
    assert all(r["rel_err_flex"] < 2e-2 and r["rel_err_flex_paged"] < 2e-2 for r in result["decode"])
    for r in result["prefill"]:  # the SDPA path, contiguous and paged; FlashInfer refused on a CPU
        assert "error" not in r and r["rel_err_sdpa"] < 2e-2 and r["rel_err_sdpa_paged"] < 2e-2, r
        assert r["ms_sdpa"] > 0 and r["ms_sdpa_paged"] > 0 and "ms_flashinfer" not in r, r
    mla = result["mla_decode"]
    assert [(r["model"], r["batch"]) for r in mla] == [("tiny-40", 1), ("tiny-40", 2)]
    for r in mla:  # on a CPU the table refuses the Triton kernel, and the row says so
        assert "error" not in r and r["rel_err_sdpa"] < 2e-2 and r["rel_err_grouped"] < 2e-2, r
        assert r["triton_skipped"] == "triton_mla runs on cuda only" and "ms_triton" not in r, r
    e2e = result["end_to_end"]
    assert (
        "error" not in e2e and e2e["same_tokens"] and e2e["decode_tok_s"] > 0 and e2e["hf_decode_tok_s"] > 0
    )
    assert e2e["static_same_tokens"] and e2e["hf_static_same_tokens"] and e2e["static_decode_tok_s"] > 0
    assert e2e["hf_static_decode_tok_s"] > 0 and not e2e["static_compiled"]
    big = result["end_to_end_1b"]  # Llama-3.2-1B's section, on the quick run's small stand-in shape
    assert "error" not in big and big["same_tokens"] and big["static_same_tokens"], big
    assert "Llama-3.2-1B" in big["model"] and "host_top" not in big
    up = result["uptrain"]
    assert "error" not in up and up["steps"] == 4 and up["tokens_per_s"] > 0, up
    # MFU is tokens/s x the cost model's training FLOPs per token over the measured peak
    assert up["mfu"] == up["tokens_per_s"] * up["flops_per_token"] / (result["machine"]["bf16_tflops"] * 1e12)
    assert 0 < up["mfu"] < 1 and up["flops_per_token"] > 6 * up["parameters"] * 0.5
    assert up["datasheet_bf16_tflops"] == pytest.approx(989.4)  # the cost model's H100, not a copy of it
    page = (tmp_path / "page.md").read_text()
    again = subprocess.run(
        [sys.executable, str(SCRIPT), "--from-json", "--json", str(tmp_path / "r.json"), "--doc",
         str(tmp_path / "again.md")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "again.md").read_text() == page
    assert "## MLA absorbed decode" in page and "| tiny-40 | 40 | 2 | 256 |" in page
    assert "| yes (eager) |" in page and "attnlab, static cache (eager" in page
    assert "## End to end, a ~1B model" in page and "## Uptraining on one GPU" in page and "MFU **" in page
    # a run of some sections (a GPU session's calls are limited in time) replaces them in the saved JSON
    # (the quickest section: the uptrain section, 11 s of the suite, ran again here)
    part = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--sections", "mla_decode", "--json",
         str(tmp_path / "r.json"), "--doc", str(tmp_path / "part.md")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert part.returncode == 0, part.stderr
    both = json.loads((tmp_path / "r.json").read_text())
    assert both["correctness"] == result["correctness"] and both["uptrain"] == result["uptrain"]
    assert both["mla_decode"] != result["mla_decode"] and not any("error" in r for r in both["mla_decode"])
    assert [r["ms_sdpa"] for r in both["mla_decode"]] != [r["ms_sdpa"] for r in result["mla_decode"]]
    assert both["command"].count("--quick") == 2 and "; then " in both["command"]
    assert "## MLA absorbed decode" in (tmp_path / "part.md").read_text()
    assert "| mla | " in page and f"{e2e['decode_tok_s'] / e2e['hf_decode_tok_s']:.2f}x" in page


def test_the_committed_page_is_made_from_the_committed_json(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--from-json", "--doc", str(tmp_path / "page.md")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "page.md").read_text() == (ROOT / "docs" / "performance_gpu.md").read_text()
    assert "NVIDIA H100" in (ROOT / "docs" / "performance_gpu.md").read_text()


def test_the_page_shows_flashinfers_figures_and_its_failures(monkeypatch):
    """A GPU run with FlashInfer installed fills its table: the figures of a row it ran, the error of one it failed
    (it has not run on a GPU before, and the rest of the row must survive that)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_for_tests", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    shape = dict(dtype="bf16", n_heads=32, head_dim=128, context=4096, ms_attnlab=0.1, ms_sdpa=0.2)
    ran = dict(shape, batch=8, n_kv_heads=8, ms_flashinfer=0.0421, ms_flashinfer_paged=0.0502,
               fraction_flashinfer=0.81, rel_err_flashinfer=1.5e-3, rel_err_flashinfer_paged=1.6e-3)  # fmt: skip
    failed = dict(shape, batch=1, n_kv_heads=2, flashinfer_error="RuntimeError: no kernel for head_dim 128")
    saved = json.loads(
        (ROOT / "benchmarks" / "results" / "gpu_check.json").read_text()
    )  # the H100 run, then these
    text = module.page({**saved, "decode": [ran, failed]})
    assert "| bf16 | 8 | 4096 | 8 | 0.0421 | 0.0502 | 0.81 | 1.50e-03 (1.60e-03) |  |" in text
    assert "| bf16 | 1 | 4096 | 2 |  |  |  |  () | RuntimeError: no kernel for head_dim 128 |" in text
    assert "No row: flashinfer has not run" not in text
    assert "No row: flashinfer has not run" in module.page(
        {**saved, "decode": [dict(shape, batch=1, n_kv_heads=2)]}
    )
