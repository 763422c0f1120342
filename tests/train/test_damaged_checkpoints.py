"""Issue 29: ``eval``, ``generate`` (and ``uptrain``) refuse a checkpoint with NaN or inf weights as ``convert`` does,
``--json`` never prints NaN, and a config that says two things is read as transformers reads it."""

from __future__ import annotations

import importlib
import json
from collections import OrderedDict

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from train_helpers import make_llama, run_cli

from attnlab import data
from attnlab.hf import load_causal_lm


def strict_json(text: str) -> object:
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def nan_llama(tmp_path, tokenizer):
    src = make_llama(tmp_path / "nan", tokenizer)
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    return src


@pytest.mark.parametrize("command", ["eval", "generate", "uptrain", "convert"])
def test_non_finite_weights_are_refused_by_every_command(nan_llama, corpus, tmp_path, command):
    # Issue 29: eval printed loss NaN and generate empty text, both exit 0; convert already refused.
    args = {
        "eval": ["eval", nan_llama, "--data", corpus, "--json"],
        "generate": ["generate", nan_llama, "--prompt", "To be", "--max-new", 2, "--json"],
        "uptrain": ["uptrain", nan_llama, tmp_path / "up", "--data", corpus, "--steps", 1, "--seq-len", 32],
        "convert": ["convert", nan_llama, tmp_path / "gqa", "--kv-heads", 2],
    }[command]
    result = run_cli(*args)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "tensor model.layers.1.mlp.up_proj.weight holds NaN or inf values" in lines[0]  # its own name
    assert not (tmp_path / "up").exists() and not (tmp_path / "gqa").exists()


def test_json_output_is_strict_json_even_when_a_figure_is_not_finite(tiny_llama, corpus, monkeypatch):
    evaluate_mod = importlib.import_module("attnlab.train.evaluate")
    real = evaluate_mod.evaluate

    def no_bytes(*args, **kwargs):
        return real(*args, **kwargs) | {"bits_per_byte": float("nan"), "perplexity": float("inf")}

    monkeypatch.setattr(evaluate_mod, "evaluate", no_bytes)
    result = run_cli("eval", tiny_llama, "--data", corpus, "--max-windows", 2, "--json")
    assert result.exit_code == 0, result.output
    out = strict_json(result.stdout)
    assert out["bits_per_byte"] is None and out["perplexity"] is None and out["loss"] > 0


def test_eval_shows_progress_on_stderr_only(tiny_llama, corpus):
    result = run_cli("eval", tiny_llama, "--data", corpus, "--max-windows", 3, "--batch-size", 1, "--json")
    assert result.exit_code == 0
    assert strict_json(result.stdout)["windows"] == 3  # stdout is the JSON alone


def hf_logits(src, x):
    model = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    with torch.no_grad():
        return model(x).logits


def test_tied_embeddings_beside_a_separate_lm_head_are_read_as_transformers_reads_them(tmp_path, tokenizer):
    # Issue 29: tie_word_embeddings: true with a separate lm_head.weight was tied by attnlab (the head dropped),
    # while transformers keeps the head when it differs from the embeddings.
    src = make_llama(tmp_path / "src", tokenizer, tie_word_embeddings=False)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    x = torch.randint(0, 320, (1, 12))
    with torch.no_grad():
        ours = load_causal_lm(src)(x)
    torch.testing.assert_close(ours, hf_logits(src, x), rtol=1e-5, atol=1e-5)


def test_rope_scaling_takes_precedence_over_rope_parameters_as_in_transformers(tmp_path, tokenizer):
    # Issue 29: with rope_parameters "default" and rope_scaling "linear", attnlab read "default" (a silently
    # different model); transformers reads rope_scaling. attnlab now reads what transformers reads.
    from attnlab.hf_config import rope_parameters

    raw = {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}, "rope_scaling": {"type": "linear",
           "factor": 2.0}, "rope_theta": 1000.0}  # fmt: skip
    cfg = transformers.LlamaConfig.from_dict(raw | {"model_type": "llama"})
    ours = rope_parameters(raw)
    assert ours["rope_type"] == cfg.rope_parameters["rope_type"] == "linear"
    assert ours["rope_theta"] == cfg.rope_parameters["rope_theta"] == 1000.0
    assert (
        rope_parameters({"rope_parameters": {"rope_type": "default", "rope_theta": 7.0}})["rope_theta"] == 7.0
    )


@pytest.mark.parametrize("command", ["eval", "uptrain"])
def test_tokenising_shows_progress_on_stderr(tiny_llama, corpus, tmp_path, monkeypatch, command):
    # a large corpus tokenised for ~1 s a MB before the first line (40 MB: ~55 s of nothing)
    monkeypatch.setenv("ATTNLAB_PROGRESS_SECONDS", "0")  # a plain line at every update
    monkeypatch.setattr(data, "_CACHE", OrderedDict())  # tokenised here, not found memoised
    if command == "eval":
        args = ["eval", tiny_llama, "--data", corpus, "--max-windows", 3, "--json"]
    else:
        args = [
            "uptrain",
            tiny_llama,
            tmp_path / "up",
            "--data",
            corpus,
            "--steps",
            1,
            "--seq-len",
            16,
            "--json",
        ]
    result = run_cli(*args)
    assert result.exit_code == 0, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("attnlab: tokenising (kB of text): ")]
    assert lines and "(100%)" in lines[-1], result.stderr
