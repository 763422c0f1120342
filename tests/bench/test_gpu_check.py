"""benchmarks/gpu_check.py, the GPU check of issue 34, run on the CPU on small shapes (CI has no GPU): every
correctness check holds there too, the page is made from the JSON alone, and the committed page is the committed
JSON's (measured on an H100)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
    assert all("error" not in r and r["rel_err"] < 2e-2 for r in result["decode"]), result["decode"]
    assert all(r["rel_err_flex"] < 2e-2 and r["rel_err_flex_paged"] < 2e-2 for r in result["decode"])
    mla = result["mla_decode"]
    assert [(r["model"], r["batch"]) for r in mla] == [("tiny-40", 1), ("tiny-40", 2)]
    for r in mla:  # on a CPU the table refuses the Triton kernel, and the row says so
        assert "error" not in r and r["rel_err_sdpa"] < 2e-2 and r["rel_err_grouped"] < 2e-2, r
        assert r["triton_skipped"] == "triton_mla runs on cuda only" and "ms_triton" not in r, r
    e2e = result["end_to_end"]
    assert (
        "error" not in e2e and e2e["same_tokens"] and e2e["decode_tok_s"] > 0 and e2e["hf_decode_tok_s"] > 0
    )
    page = (tmp_path / "page.md").read_text()
    again = subprocess.run(
        [sys.executable, str(SCRIPT), "--from-json", "--json", str(tmp_path / "r.json"), "--doc",
         str(tmp_path / "again.md")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "again.md").read_text() == page
    assert "## MLA absorbed decode" in page and "| tiny-40 | 40 | 2 | 256 |" in page
    assert "| mla | " in page and f"{e2e['decode_tok_s'] / e2e['hf_decode_tok_s']:.2f}x" in page


def test_the_committed_page_is_made_from_the_committed_json(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--from-json", "--doc", str(tmp_path / "page.md")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "page.md").read_text() == (ROOT / "docs" / "performance_gpu.md").read_text()
    assert "NVIDIA H100" in (ROOT / "docs" / "performance_gpu.md").read_text()
