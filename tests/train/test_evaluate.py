"""``attnlab eval`` / ``attnlab.train.evaluate`` against transformers' own loss on the same windows."""

from __future__ import annotations

import json
import math

import torch
import transformers
from train_helpers import make_llama, run_cli

from attnlab import data
from attnlab.hf import load_causal_lm
from attnlab.train import evaluate


def hf_loss(path, stream, seq_len: int, index: torch.Tensor) -> float:
    """transformers' mean loss over the windows: each window of seq_len + 1 tokens, labels = inputs (the model
    shifts them itself)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    losses = []
    with torch.no_grad():
        for i in index.tolist():
            window = stream.tokens[i * seq_len : i * seq_len + seq_len + 1][None]
            losses.append(model(input_ids=window, labels=window).loss.item())
    return sum(losses) / len(losses)  # every window scores seq_len tokens: the mean of means is the mean


def test_attnlab_eval_equals_transformers_loss(tmp_path, tokenizer, corpus):
    src = make_llama(tmp_path / "qwen", tokenizer, kind="qwen2", num_key_value_heads=2)
    result = run_cli("eval", src, "--data", corpus / "othello.txt", "--seq-len", 48, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    stream = data.tokenize_files(src, [corpus / "othello.txt"])
    n = stream.n_windows(48)
    assert report["windows"] == n and report["tokens"] == n * 48
    assert math.isclose(report["loss"], hf_loss(src, stream, 48, torch.arange(n)), rel_tol=1e-5)
    assert math.isclose(report["perplexity"], math.exp(report["loss"]), rel_tol=1e-12)
    scored_bytes = int(stream.nbytes[1 : n * 48 + 1].sum())
    assert report["bytes"] == scored_bytes
    assert math.isclose(
        report["bits_per_byte"], report["loss"] * report["tokens"] / math.log(2) / scored_bytes
    )


def test_max_windows_scores_an_even_spread(tiny_llama, corpus):
    stream = data.tokenize_files(tiny_llama, data.text_files(corpus))
    model = load_causal_lm(tiny_llama)
    report = evaluate(model, stream, 32, batch_size=3, max_windows=7)
    index = torch.linspace(0, stream.n_windows(32) - 1, 7).round().long()
    assert report["windows"] == 7 and report["tokens"] == 7 * 32
    assert math.isclose(report["loss"], hf_loss(tiny_llama, stream, 32, index), rel_tol=1e-5)
    assert not model.training  # evaluate restores the mode it found


def test_eval_user_errors(tmp_path, tiny_llama, corpus):
    for args, message in (
        (["--data", tmp_path / "none.txt"], "not found"),
        (["--data", corpus, "--seq-len", 65], "--seq-len must be in [1, 64]"),
    ):
        result = run_cli("eval", tiny_llama, *args)
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and message in lines[0], result.output
