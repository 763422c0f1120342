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
        (["--data", "/dev/null"], "--data /dev/null is neither a text file nor a directory"),
    ):
        result = run_cli("eval", tiny_llama, *args)
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and message in lines[0], result.output


def _eval_json(*args) -> dict:
    result = run_cli("eval", *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_empty_files_change_nothing(tmp_path, tiny_llama, corpus):
    # A QA reproduction: each empty file added an end-of-text token to the stream, scored, so the same text read
    # 5.473 nats / 2.96 bits per byte with two empty files beside it and 5.429 / 1.96 without.
    plain, padded = tmp_path / "plain", tmp_path / "padded"
    plain.mkdir()
    padded.mkdir()
    for f in sorted(corpus.glob("*.txt"))[:2]:
        (plain / f.name).write_text(f.read_text()[:3000])
        (padded / f.name).write_text(f.read_text()[:3000])
    for name in ("0.txt", "b_between.txt", "zz.txt"):
        (padded / name).write_text("")
    want, got = _eval_json(tiny_llama, "--data", plain), _eval_json(tiny_llama, "--data", padded)
    assert {k: got[k] for k in ("loss", "bits_per_byte", "tokens", "bytes")} == {
        k: want[k] for k in ("loss", "bits_per_byte", "tokens", "bytes")
    }
    empties = tmp_path / "empties"
    empties.mkdir()
    for i in range(5):
        (empties / f"{i}.txt").write_text("")
    result = run_cli("eval", tiny_llama, "--data", empties)
    assert result.exit_code == 2 and "has 0 tokens" in result.output, result.output


def test_paths_are_printed_as_they_are(tmp_path, tiny_llama, corpus):
    # A QA reproduction: rich read "ck[v2]" as markup and printed "ck"; a folder "[/b]" raised MarkupError.
    ckpt = tmp_path / "ck[v2]"
    ckpt.mkdir()
    for f in tiny_llama.iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    text = tmp_path / "[" / "b]" / "x.txt"  # "[/b]" in the path
    text.parent.mkdir(parents=True)
    text.write_text((corpus / sorted(p.name for p in corpus.iterdir())[0]).read_text()[:3000])
    from typer.testing import CliRunner

    from attnlab.cli import app

    result = CliRunner().invoke(app, ["eval", str(ckpt), "--data", str(text)], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "attnlab eval: " + str(ckpt) in result.output and str(text) in result.output


def test_a_loss_past_exps_range_reads_as_an_infinite_perplexity():
    stream = data.TokenStream(torch.tensor([0, 1, 2, 3, 4]), torch.ones(5, dtype=torch.int64), ("x.txt",))

    class Sure(torch.nn.Module):  # certain of the wrong token: a loss of 2000 nats a token
        def forward(self, x):
            logits = torch.full((*x.shape, 8), -2000.0)
            logits[..., 7] = 0.0
            return logits

    scores = evaluate(Sure(), stream, 4)
    assert scores["loss"] == 2000.0 and scores["perplexity"] == math.inf


def test_a_teacher_with_fewer_positions_than_seq_len_is_refused(tmp_path, tiny_llama, tokenizer, corpus):
    # A QA reproduction: SRC's positions were checked against --seq-len, the teacher's were not (it was scored at
    # positions it never had).
    teacher = make_llama(tmp_path / "short", tokenizer, max_position_embeddings=32)
    result = run_cli("uptrain", tiny_llama, tmp_path / "up", "--data", corpus, "--teacher", teacher,
                     "--seq-len", 48, "--steps", 1)  # fmt: skip
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "--seq-len 48 exceeds --teacher" in lines[0] and "max_position_embeddings 32" in lines[0]
    assert not (tmp_path / "up").exists()


def test_a_tokenizer_that_cannot_encode_the_text_is_named(tmp_path, tiny_llama):
    # A QA reproduction: a WordLevel tokenizer whose unknown token is not in its vocabulary raised the tokenizers
    # library's bare Exception, a traceback.
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in tiny_llama.iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    tok = Tokenizer(WordLevel({"the": 1, "king": 2}, unk_token="<nope>"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(ckpt / "tokenizer.json"))
    (tmp_path / "t.txt").write_text("the king the queen " * 20)
    result = run_cli("eval", ckpt, "--data", tmp_path / "t.txt", "--seq-len", 2)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "tokenizer.json cannot tokenise the text" in lines[0]


def test_evaluate_names_a_bad_argument():
    # A QA reproduction: seq_len 0 raised ZeroDivisionError, 8.0 an IndexError, batch_size 0 range()'s error.
    stream = data.TokenStream(torch.arange(20), torch.ones(20, dtype=torch.int64), ("x.txt",))
    model = torch.nn.Sequential(torch.nn.Embedding(20, 20))
    for kwargs, error, name in (
        ({"seq_len": 0}, ValueError, "seq_len must be >= 1, got 0"),
        ({"seq_len": 8.0}, TypeError, "seq_len must be an int"),
        ({"seq_len": 4, "batch_size": 0}, ValueError, "batch_size must be >= 1"),
        ({"seq_len": 4, "max_windows": -2}, ValueError, "max_windows must be >= 0"),
    ):
        try:
            evaluate(model, stream, **kwargs)
        except error as err:
            assert name in str(err)
        else:
            raise AssertionError(f"{kwargs} was accepted")


def test_a_held_out_file_too_short_is_named(tmp_path, tiny_llama, corpus):
    # A QA reproduction: "the held-out files has 11 tokens" named no file.
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text(sorted(corpus.glob("*.txt"))[0].read_text()[:6000])
    (text / "z.txt").write_text("The end.")
    result = run_cli("uptrain", tiny_llama, tmp_path / "up", "--data", text, "--seq-len", 32, "--steps", 1)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and f"the held-out text ({text / 'z.txt'}) has" in lines[-1], result.output
