"""``attnlab uptrain`` in one process: it learns, writes a checkpoint like SRC that transformers loads, keeps
SRC untouched, and refuses bad arguments with one line."""

from __future__ import annotations

import errno
import itertools
import json
import math
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from train_helpers import make_llama, run_cli, snapshot

from attnlab.data import tokenize_files
from attnlab.hf import load_causal_lm
from attnlab.train import UptrainOptions, build_optimizer, distill_loss, learning_rate, uptrain
from attnlab.train import checkpoint as ckpt_mod
from attnlab.train.distributed import ONE_PROCESS

FAST = ["--batch-size", 4, "--seq-len", 32, "--lr", 3e-3, "--warmup", 2]


def weights(path):
    return load_file(path / "model.safetensors")


def test_uptrain_lowers_the_loss_and_writes_a_checkpoint_like_src(tmp_path, tiny_llama, corpus):
    before = snapshot(tiny_llama)
    dst = tmp_path / "dst"
    result = run_cli(
        "uptrain", tiny_llama, dst, "--data", corpus, "--steps", 12, "--eval-every", 6, *FAST, "--json"
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["eval"]["loss"] < summary["eval_before"]["loss"] - 0.3  # it learned (random init: ~5.8)
    assert summary["train_files"] == 2 and summary["eval_files"] == 1  # one whole play held out
    assert snapshot(tiny_llama) == before
    assert not (tmp_path / "dst.run").exists()  # the run directory goes once DST is written

    # DST is the same kind of checkpoint as SRC: same config and tokenizer, plus the log and the summary.
    assert (dst / "config.json").read_text() == (tiny_llama / "config.json").read_text()
    assert (dst / "tokenizer.json").read_bytes() == (tiny_llama / "tokenizer.json").read_bytes()
    assert {p.name for p in dst.iterdir()} == {p.name for p in tiny_llama.iterdir()} | {
        "uptrain.json",
        "uptrain_log.jsonl",
        ".attnlab",  # the marker: attnlab's output, which a later --overwrite may replace
    }
    log = [json.loads(line) for line in (dst / "uptrain_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 13)) and "eval" in log[5]

    # transformers loads it and computes what attnlab computes; the weights moved.
    x = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, load_causal_lm(dst)(x), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(hf(x).logits, load_causal_lm(tiny_llama)(x), atol=1e-3)

    # attnlab eval on the held-out play gives the loss uptrain reported; convert takes DST as a source.
    held_out = corpus / "macbeth.txt"
    scored = run_cli("eval", dst, "--data", held_out, "--seq-len", 32, "--json")
    assert math.isclose(json.loads(scored.stdout)["loss"], summary["eval"]["loss"], rel_tol=1e-6)
    converted = run_cli("convert", dst, tmp_path / "gqa", "--kv-heads", 2)
    assert converted.exit_code == 0, converted.output


def test_train_attention_only_keeps_the_rest_bit_for_bit_and_the_dtype(tmp_path, tokenizer, corpus):
    src = make_llama(tmp_path / "src", tokenizer, dtype="bfloat16", tie_word_embeddings=True)
    dst = tmp_path / "dst"
    result = run_cli("uptrain", src, dst, "--data", corpus, "--steps", 3, "--train", "attention", *FAST)
    assert result.exit_code == 0, result.output
    old, new = weights(src), weights(dst)
    assert set(old) == set(new) and "lm_head.weight" not in new  # tied embeddings stay tied
    for key in old:
        assert new[key].dtype == old[key].dtype == torch.bfloat16
        assert torch.equal(old[key], new[key]) == (".self_attn." not in key), key


def test_a_tied_source_that_also_holds_its_head_is_written_with_the_trained_one(tmp_path, tokenizer, corpus):
    """Some published tied checkpoints ship lm_head.weight beside the embedding it is tied to (equal to it). The
    model trains tied; the source's head was copied into DST beside the trained embedding, and DST then read
    (in attnlab and transformers) as an untied model with the untrained head: its loss 6.15 where uptrain
    reported 5.19."""
    from safetensors.torch import save_file

    src = make_llama(tmp_path / "src", tokenizer, tie_word_embeddings=True)
    state = weights(src)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    held_out, dst = corpus / "macbeth.txt", tmp_path / "dst"
    result = run_cli("uptrain", src, dst, "--data", corpus, "--eval-data", held_out, "--steps", 3, *FAST)
    assert result.exit_code == 0, result.output
    new = weights(dst)
    assert not torch.equal(new["model.embed_tokens.weight"], state["model.embed_tokens.weight"])  # trained
    assert torch.equal(new["lm_head.weight"], new["model.embed_tokens.weight"])
    reported = json.loads((dst / "uptrain.json").read_text())["eval"]["loss"]
    scored = json.loads(run_cli("eval", dst, "--data", held_out, "--seq-len", 32, "--json").stdout)["loss"]
    assert math.isclose(reported, scored, rel_tol=1e-9), (reported, scored)


def test_the_reported_loss_is_the_written_checkpoints_and_an_overflow_is_refused(tmp_path, tokenizer, corpus):
    """The final evaluation scored the float32 training copy: a bfloat16 run reported a loss 0.01-0.02 nats below
    the checkpoint it wrote (and sweep ranked rows on it), and a float16 run wrote inf weights with exit 0."""
    held_out = corpus / "macbeth.txt"
    src = make_llama(tmp_path / "src", tokenizer, dtype="bfloat16")
    dst = tmp_path / "dst"
    result = run_cli(
        "uptrain", src, dst, "--data", corpus, "--eval-data", held_out, "--steps", 3, "--lr", 3e-3, *FAST
    )
    assert result.exit_code == 0, result.output
    reported = json.loads((dst / "uptrain.json").read_text())["eval"]["loss"]
    scored = json.loads(run_cli("eval", dst, "--data", held_out, "--seq-len", 32, "--json").stdout)["loss"]
    assert math.isclose(reported, scored, rel_tol=1e-9), (reported, scored)

    half = make_llama(tmp_path / "half", tokenizer, dtype="float16")
    big = ("--lr", 1e5, "--warmup", 0)
    result = run_cli("uptrain", half, tmp_path / "inf", "--data", corpus, "--steps", 1, *FAST, *big)
    assert result.exit_code == 2 and "overflow" in result.stderr and "(float16)" in result.stderr, (
        result.output
    )
    errors = [
        line for line in result.stderr.splitlines() if line.startswith("attnlab:")
    ]  # after the device line
    assert len(errors) == 1 and not (tmp_path / "inf").exists()


def test_a_resumed_run_keeps_its_evaluation_before_training_and_refuses_another_src(
    tmp_path, tokenizer, corpus, monkeypatch
):
    """A resumed run reported eval_before as null (only a run starting at step 0 made it), and a SRC replaced at
    the same path by another checkpoint ended in a state-dict traceback."""
    src = make_llama(tmp_path / "src", tokenizer)
    opts = dict(src=src, data=corpus, steps=6, batch_size=2, seq_len=32, lr=3e-3, save_every=2, eval_every=3)
    whole = uptrain(UptrainOptions(dst=tmp_path / "whole", **opts), progress=False)
    save = ckpt_mod.save_checkpoint

    def save_then_die(run, step, *args):
        save(run, step, *args)
        if step == 4:
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(ckpt_mod, "save_checkpoint", save_then_die)
        with pytest.raises(KeyboardInterrupt):
            uptrain(UptrainOptions(dst=tmp_path / "cut", **opts), progress=False)
    config = (src / "config.json").read_bytes()
    changed = json.loads(config) | {"rms_norm_eps": 1e-5}  # another model at SRC's path
    (src / "config.json").write_text(json.dumps(changed))
    with pytest.raises(ValueError, match="is not the checkpoint the interrupted run started from"):
        uptrain(UptrainOptions(dst=tmp_path / "cut", resume=True, **opts), progress=False)
    (src / "config.json").write_bytes(config)
    # another model of the same shape written at SRC's path (a conversion by another method): resumed, it ended
    # in other weights than the uninterrupted run's, without a word
    weights = src / "model.safetensors"
    original, stat = weights.read_bytes(), weights.stat()
    tensors = load_file(weights)
    save_file({name: t + 0.01 for name, t in tensors.items()}, weights, metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"\(its weight files were written since\): start over with --overwrite"
    ):
        uptrain(UptrainOptions(dst=tmp_path / "cut", resume=True, **opts), progress=False)
    weights.write_bytes(original)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # (as a copy that keeps the time would)
    resumed = uptrain(UptrainOptions(dst=tmp_path / "cut", resume=True, **opts), progress=False)
    assert resumed["resumed_from_step"] == 4
    assert resumed["eval_before"] == whole["eval_before"] and whole["eval_before"] is not None


def test_grad_accumulation_equals_the_bigger_batch(tmp_path, tiny_llama, corpus):
    common = dict(src=tiny_llama, data=corpus, steps=3, seq_len=32, lr=3e-3, save_every=0)
    uptrain(UptrainOptions(dst=tmp_path / "a", batch_size=4, **common), progress=False)
    uptrain(UptrainOptions(dst=tmp_path / "b", batch_size=2, grad_accum=2, **common), progress=False)
    loss = [
        [json.loads(x)["loss"] for x in (tmp_path / d / "uptrain_log.jsonl").read_text().splitlines()]
        for d in "ab"
    ]
    assert loss[0] == pytest.approx(loss[1], rel=1e-5)
    for key, value in weights(tmp_path / "a").items():
        torch.testing.assert_close(weights(tmp_path / "b")[key], value, rtol=1e-4, atol=1e-5)


def test_tokens_per_s_counts_training_time_not_the_held_out_evaluations(
    tmp_path, tiny_llama, corpus, monkeypatch
):
    # --eval-every's evaluations once ran inside the step's timer: tokens/s fell ~7x with --eval-every 2.
    from attnlab.train import loop

    real = loop.evaluate

    def slow_eval(*args, **kwargs):
        time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "evaluate", slow_eval)
    opts = UptrainOptions(src=tiny_llama, dst=tmp_path / "d", data=corpus, steps=3, batch_size=2, seq_len=16,
                          save_every=0, eval_every=1, eval_windows=2)  # fmt: skip
    summary = uptrain(opts, progress=False)
    steps = [json.loads(x) for x in (tmp_path / "d" / "uptrain_log.jsonl").read_text().splitlines()]
    assert [("eval" in r) for r in steps] == [True, True, False]  # evaluated after steps 1 and 2
    seconds = [32 / r["tokens_per_s"] for r in steps]  # 2 x 16 tokens a step
    assert max(seconds) < 0.5, seconds  # no step's time holds an evaluation's half second
    assert summary["tokens_per_s"] == pytest.approx(96 / sum(seconds))


def test_distillation_from_the_unconverted_teacher(tmp_path, tokenizer, corpus):
    # A teacher with peaked predictions (5x the usual init), and its 1-KV-head conversion as the student.
    teacher = make_llama(tmp_path / "teacher", tokenizer, initializer_range=0.1)
    gqa = tmp_path / "gqa"
    assert run_cli("convert", teacher, gqa, "--kv-heads", 1).exit_code == 0
    result = run_cli(
        "uptrain", gqa, tmp_path / "dst", "--data", corpus, "--steps", 6, "--teacher", teacher,
        "--distill-weight", 1.0, "--temperature", 1.5, "--train", "attention", *FAST, "--lr", 1e-2,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    log = [json.loads(x) for x in (tmp_path / "dst" / "uptrain_log.jsonl").read_text().splitlines()]
    for r in log:
        assert r["distill"] > 0 and r["ce"] > 0 and r["loss"] == r["distill"]  # weight 1: only the KL term
    # On held-out text, the student moved towards the teacher.
    x, _, _ = tokenize_files(teacher, [corpus / "macbeth.txt"]).windows(torch.arange(8), 32)
    with torch.no_grad():
        target = load_causal_lm(teacher)(x)
        before = distill_loss(load_causal_lm(gqa)(x), target, 1.5)
        after = distill_loss(load_causal_lm(tmp_path / "dst")(x), target, 1.5)
    assert after < 0.8 * before, (before, after)


def test_distill_loss_is_temperature_scaled_kl():
    s, t = torch.randn(2, 3, 11), torch.randn(2, 3, 11)
    p = torch.softmax(t / 2.0, -1)
    kl = (p * (p.log() - torch.log_softmax(s / 2.0, -1))).sum(-1).mean()
    torch.testing.assert_close(distill_loss(s, t, 2.0), 4.0 * kl)
    assert distill_loss(t, t, 2.0).abs() < 1e-6


def test_learning_rate_warmup_then_cosine():
    lrs = [learning_rate(s, lr=1.0, steps=100, warmup=10, min_lr=0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))
    assert lrs[-1] == pytest.approx(0.1) and lrs[54] == pytest.approx(0.55, abs=0.01)
    assert UptrainOptions(src="s", dst="d", data="x", steps=100).warmup_steps == 5


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("steps", 0, "--steps must be >= 1, got 0"),
        ("batch_size", 2.5, "--batch-size must be an int"),
        ("lr", 0.0, "--lr must be in (0.0, inf]"),
        ("distill_weight", 1.5, "--distill-weight must be in [0.0, 1.0]"),
        ("train", "mlp", "--train must be one of all, attention; got 'mlp'"),
        ("dtype", "fp16", "--dtype must be one of fp32, bf16; got 'fp16'"),
        ("warmup", 200, "--warmup must be in [0, --steps=100], got 200"),
        # a QA reproduction: float32's KL at T=1e4 was negative, at 1e20 and 1e-40 NaN ("lower --lr")
        ("temperature", 1e4, "--temperature must be in [0.01, 100.0], got 10000.0"),
        ("temperature", 1e-40, "--temperature must be in [0.01, 100.0], got 1e-40"),
        (
            "lr",
            1e38,
            "--lr must be below 3.4e37 (its AdamW step would overflow float32), got 1e+38",
        ),  # a traceback
    ],
)
def test_options_name_the_field_and_value(field, value, message):
    with pytest.raises((ValueError, TypeError)) as err:
        UptrainOptions(**({"src": "s", "dst": "d", "data": "x", "steps": 100} | {field: value}))
    assert message in str(err.value)


@pytest.mark.parametrize(
    "case,message",
    [
        ("missing_data", "--data"),
        ("empty_data", "fewer than one window"),
        ("empty_dir", "without .txt files"),
        ("seq_len", "--seq-len 65 exceeds the model's max_position_embeddings 64"),
        ("family", "unsupported model_type 'gpt2'"),
        ("teacher_vocab", "vocab_size 400 but SRC has 320"),
        ("teacher_text", "--teacher"),  # a directory of text: once "no config.json at .../config.json"
        ("dst_exists", "DST exists"),
        ("bad_option", "--grad-accum must be >= 1, got 0"),
    ],
)
def test_user_errors_exit_2_with_one_line_and_src_untouched(
    tmp_path, tiny_llama, tokenizer, corpus, case, message
):
    src, dst, data = tiny_llama, tmp_path / "dst", corpus
    args = []
    if case == "missing_data":
        data = tmp_path / "nowhere"
    elif case == "empty_data":
        data = tmp_path / "empty.txt"
        data.write_text("")
    elif case == "empty_dir":
        data = tmp_path / "texts"
        data.mkdir()
    elif case == "seq_len":
        args = ["--seq-len", 65]
    elif case == "family":
        src = make_llama(tmp_path / "src", tokenizer)
        config = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps(config | {"model_type": "gpt2"}))
    elif case == "teacher_vocab":
        args = ["--teacher", make_llama(tmp_path / "teacher", tokenizer, vocab_size=400)]
    elif case == "teacher_text":
        args = ["--teacher", corpus]
    elif case == "dst_exists":
        dst.mkdir()
        (dst / "keep.txt").write_text("mine")
    elif case == "bad_option":
        args = ["--grad-accum", 0]
    before = snapshot(src)
    result = run_cli("uptrain", src, dst, "--data", data, "--steps", 2, "--seq-len", 32, *args)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("attnlab: error:") and message in lines[0], lines[0]
    assert snapshot(src) == before
    assert not (tmp_path / "dst.run").exists()
    assert (dst / "keep.txt").read_text() == "mine" if case == "dst_exists" else not dst.exists()


def test_crash_mid_save_leaves_the_previous_checkpoint_and_resume_is_exact(
    tmp_path, tiny_llama, corpus, monkeypatch
):
    corpus = Path(shutil.copytree(corpus, tmp_path / "corpus"))  # its own: edited below
    common = dict(src=tiny_llama, data=corpus, steps=6, batch_size=4, seq_len=32, lr=3e-3, save_every=2)
    uptrain(UptrainOptions(dst=tmp_path / "whole", **common), progress=False)

    real_save, calls = ckpt_mod.save_safetensors, []

    def crashing_save(tensors, path, *metadata):
        calls.append(path)
        if len(calls) == 4:  # checkpoint 2 (step 4): its model is written, then the optimizer write dies
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(tensors, path, *metadata)

    monkeypatch.setattr(ckpt_mod, "save_safetensors", crashing_save)
    opts = UptrainOptions(dst=tmp_path / "dst", **common)
    run = tmp_path / "dst.run"
    # Issue 29: the message says where the last good checkpoint is and that --resume continues from it.
    expected = (
        f"No space left on device; the last complete checkpoint is {run / 'step-00000002'}: rerun the same "
    )
    with pytest.raises(OSError, match=re.escape(expected) + "command with --resume"):
        uptrain(opts, progress=False)
    monkeypatch.setattr(ckpt_mod, "save_safetensors", real_save)
    assert sorted(p.name for p in run.iterdir()) == [".attnlab", "log.jsonl", "step-00000002"]  # no half one
    assert not (tmp_path / "dst").exists()
    # The surviving checkpoint loads into a fresh model and optimizer.
    model = load_causal_lm(tiny_llama).float()
    state = ckpt_mod.load_checkpoint(run / "step-00000002", model, build_optimizer(model, opts), ONE_PROCESS)
    assert state["step"] == 2 and state["samples"] == 8
    # What a SIGKILL mid-save leaves: a hidden temporary directory. It is never read and resume cleans it up.
    (run / ".step-00000004.tmp-dead").mkdir()
    (run / ".step-00000004.tmp-dead" / "model.safetensors").write_bytes(b"partial")

    refused = run_cli(
        "uptrain", tiny_llama, tmp_path / "dst", "--data", corpus, "--steps", 6, "--seq-len", 32
    )
    assert refused.exit_code == 2 and "pass --resume" in refused.output
    changed = run_cli(
        "uptrain", tiny_llama, tmp_path / "dst", "--data", corpus, "--steps", 6, "--save-every", 2,
        "--batch-size", 4, "--seq-len", 32, "--lr", 1e-3, "--resume",
    )  # fmt: skip
    assert changed.exit_code == 2 and "--lr was 0.003 in the interrupted run, now 0.001" in changed.output
    # --resume compares what the inputs are: a file edited in place is refused (it was accepted), the same files
    # spelled another way are not (they were refused)
    first = sorted(corpus.glob("*.txt"))[0]
    text = first.read_text()
    first.write_text(text + "One more line.\n")
    edited = run_cli(
        "uptrain", tiny_llama, tmp_path / "dst", "--data", corpus, "--steps", 6, "--save-every", 2,
        "--batch-size", 4, "--seq-len", 32, "--lr", 3e-3, "--resume",
    )  # fmt: skip
    assert (
        edited.exit_code == 2
        and "the text of --data / --eval-data is not what the interrupted run read" in (edited.output)
    )
    first.write_text(text)
    spelled = corpus.parent / ".." / corpus.parent.name / corpus.name
    summary = uptrain(opts.replace(resume=True, data=spelled), progress=False)
    assert summary["resumed_from_step"] == 2
    assert not run.exists()
    whole, resumed = weights(tmp_path / "whole"), weights(tmp_path / "dst")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert (tmp_path / "whole" / "uptrain_log.jsonl").read_text().count("\n") == 6
    steps = [json.loads(x)["step"] for x in (tmp_path / "dst" / "uptrain_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # the steps redone after the crash are logged once


def test_resume_with_no_checkpoint_says_it_starts_at_step_0(tmp_path, tiny_llama, corpus):
    # a script that always passes --resume: the first run started from step 0 without a word
    dst = tmp_path / "dst"
    result = run_cli("uptrain", tiny_llama, dst, "--data", corpus, "--steps", 2, *FAST, "--resume")
    assert result.exit_code == 0, result.output
    assert f"--resume: {tmp_path / 'dst.run'} holds no checkpoint; starting at step 0" in result.stderr
    assert json.loads((dst / "uptrain.json").read_text())["resumed_from_step"] is None


def test_a_checkpoint_stores_tied_embeddings_once_and_resumes_them_tied(tmp_path, tokenizer):
    # safetensors refuses shared tensors, so the LM head was stored as a copy of the embedding table: twice the
    # bytes of the largest tensor of a vocabulary-heavy model, in every checkpoint
    src = make_llama(tmp_path / "src", tokenizer, tie_word_embeddings=True)
    model = load_causal_lm(src).float()
    assert model.output.weight is model.tok_embeddings.weight
    opts = UptrainOptions(src=src, dst=tmp_path / "dst", data=src, steps=1)
    optimizer = build_optimizer(model, opts)
    meta = {"options": {}, "global_batch": 1}
    path = ckpt_mod.save_checkpoint(tmp_path / "run", 1, model, optimizer, ONE_PROCESS, meta, keep=1)
    stored = load_file(path / "model.safetensors")
    assert "output.weight" not in stored and "tok_embeddings.weight" in stored
    fresh = load_causal_lm(src).float()
    with torch.no_grad():
        fresh.tok_embeddings.weight.zero_()
    ckpt_mod.load_checkpoint(path, fresh, build_optimizer(fresh, opts), ONE_PROCESS)
    assert fresh.output.weight is fresh.tok_embeddings.weight  # still one tensor
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_run_directory_left_beside_a_finished_dst_is_named(tmp_path, tiny_llama, corpus):
    """A run killed after writing DST but before deleting its run directory left checkpoints (~3x the model) that
    no message ever mentioned: the rerun said only "DST exists"."""
    from attnlab import atomic

    dst = tmp_path / "dst"
    with atomic.atomic_dir(dst) as tmp:
        (tmp / "uptrain.json").write_text("{}")
    atomic.claim_dir(tmp_path / "dst.run", "run")
    result = run_cli("uptrain", tiny_llama, dst, "--data", corpus, "--steps", 2, "--seq-len", 32, "--resume")
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert f"the run directory {tmp_path / 'dst.run'} is left over from the run that wrote it" in lines[0]
    assert (tmp_path / "dst.run").is_dir() and (dst / "uptrain.json").is_file()


def test_files_a_user_puts_in_a_run_checkpoint_are_kept_and_training_goes_on(tmp_path, tokenizer, capsys):
    """With the rule that a checkpoint holding a user's file is not deleted, rotation (--keep) and the run
    directory's removal at the end kept them; a refusal there must not stop the run."""
    from attnlab import atomic

    src = make_llama(tmp_path / "src", tokenizer)
    model = load_causal_lm(src).float()
    opts = UptrainOptions(src=src, dst=tmp_path / "dst", data=src, steps=1)
    optimizer = build_optimizer(model, opts)
    meta = {"options": {}, "global_batch": 1}
    run = atomic.claim_dir(tmp_path / "run", "run")
    first = ckpt_mod.save_checkpoint(run, 1, model, optimizer, ONE_PROCESS, meta, keep=1)
    (first / "NOTES.txt").write_text("mine")
    for step in (2, 3):
        ckpt_mod.save_checkpoint(run, step, model, optimizer, ONE_PROCESS, meta, keep=1)
    said = capsys.readouterr().err
    assert said.count("attnlab: kept") == 1 and "holds what attnlab did not write there (NOTES.txt)" in said
    assert [p.name for p in ckpt_mod.checkpoints(run)] == ["step-00000001", "step-00000003"]
    with pytest.raises(FileExistsError, match=r"\(step-00000001/NOTES.txt\)"):
        atomic.remove_owned(run, "run")  # the run directory answers for its checkpoints' lists
    assert (first / "NOTES.txt").read_text() == "mine"
