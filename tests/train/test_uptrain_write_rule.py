"""Issue 29: ``attnlab uptrain`` deletes or replaces only what it wrote, has one writer per DST, stops on divergence
and on a full disk with a message that says how to continue, and refuses sizes that cannot be allocated.

Each case below deleted user files, printed a traceback or ran for minutes before the fix (the issue's list)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_helpers import CPU_LINE, make_llama, run_cli, snapshot

from attnlab.atomic import MARKER, marker_kind

FAST = ["--steps", 2, "--batch-size", 2, "--seq-len", 32, "--save-every", 0]


def tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` (hidden ones too), by relative name."""
    return snapshot(path)


def one_line_error(result, message: str, *, started: bool = False) -> None:
    """The one error line; ``started``: after the line that names the device training had started on."""
    lines = result.output.strip().splitlines()
    if started:
        assert lines and CPU_LINE.fullmatch(lines[0]), result.output
        lines = lines[1:]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("attnlab: error: ") and message in lines[0], lines[0]


@pytest.fixture
def work(tmp_path, tiny_llama, corpus, monkeypatch) -> Path:
    """A user's directory holding a checkpoint, a corpus and a file of their own; the cwd of each test."""
    root = tmp_path / "work"
    root.mkdir()
    (root / "gqa2").symlink_to(tiny_llama)  # read through a link, as a checkpoint in a cache usually is
    (root / "corpus").mkdir()
    for f in corpus.glob("*.txt"):
        (root / "corpus" / f.name).write_bytes(f.read_bytes())
    (root / "notes.txt").write_text("mine")
    monkeypatch.chdir(root)
    return root


def test_an_existing_run_dir_of_the_user_is_never_emptied(work):
    important = work / "important"
    important.mkdir()
    (important / "thesis.tex").write_text("years of work")
    before = tree(work)
    result = run_cli("uptrain", "gqa2", "up", "--data", "corpus", "--run-dir", "important", *FAST)
    one_line_error(result, "--run-dir important exists and is a directory without attnlab's .attnlab marker")
    assert tree(work) == before and not (work / "up").exists()
    again = run_cli(
        "uptrain", "gqa2", "up", "--data", "corpus", "--run-dir", "important", "--overwrite", *FAST
    )
    assert again.exit_code == 2 and tree(work) == before  # --overwrite does not make it attnlab's


@pytest.mark.parametrize("flag", ["--overwrite", "--resume", None])
def test_a_run_started_over_refuses_to_empty_a_run_dir_holding_a_users_files(work, flag):
    """A run that starts over empties its run directory (left by a killed run): it deleted the notes and folders
    a user had added there, with exit 0 and no word."""
    from attnlab.atomic import claim_dir

    run = claim_dir(work / "up.run", "run")
    (run / "log.jsonl").write_text("")
    (run / "NOTES.txt").write_text("mine")
    (run / "results").mkdir()
    (run / "results" / "r.txt").write_text("mine")
    before = tree(work)
    result = run_cli("uptrain", "gqa2", "up", "--data", "corpus", *([flag] if flag else []), *FAST)
    one_line_error(
        result, "the run directory up.run holds what attnlab did not write there (NOTES.txt, results)"
    )
    assert tree(work) == before and not (work / "up").exists()


def test_a_run_dir_holding_the_inputs_is_refused(work):
    before = tree(work)
    result = run_cli("uptrain", "gqa2", "up", "--data", "corpus", "--run-dir", ".", *FAST)
    one_line_error(result, "--run-dir .")
    parent = run_cli("uptrain", "gqa2", "up", "--data", "corpus", "--run-dir", str(work), *FAST)
    one_line_error(parent, "contains the source")
    assert tree(work) == before


def test_a_broken_link_in_src_is_refused_before_training_naming_it(work, tiny_llama):
    """SRC's other files are copied into DST after training: a broken link among them failed then, naming DST."""
    src = work / "src"
    src.mkdir()
    for f in Path(tiny_llama).iterdir():
        (src / f.name).symlink_to(f)
    (src / "README.md").symlink_to(work / "gone.md")
    before = tree(work)
    one_line_error(
        run_cli("uptrain", "src", "up", "--data", "corpus", *FAST), "src/README.md: a broken symbolic link"
    )
    assert tree(work) == before


def test_dst_containing_the_source_is_refused_even_with_overwrite(work):
    before = tree(work)
    result = run_cli("uptrain", "gqa2", ".", "--data", "corpus", "--overwrite", *FAST)
    one_line_error(result, "DST")
    sb3 = run_cli("uptrain", "corpus/../gqa2", str(work), "--data", "corpus", "--overwrite", *FAST)
    one_line_error(sb3, "contains the source")
    assert tree(work) == before


def test_overwrite_replaces_only_an_earlier_output_and_the_run_dir_is_marked(work):
    assert run_cli("uptrain", "gqa2", "up", "--data", "corpus", *FAST).exit_code == 0
    assert marker_kind(work / "up") == "checkpoint" and not (work / "up.run").exists()
    assert run_cli("uptrain", "gqa2", "up", "--data", "corpus", "--overwrite", *FAST).exit_code == 0
    # A kept run directory (killed run, here made by hand through the library) carries the "run" marker.
    from attnlab.atomic import claim_dir

    claim_dir(work / "kept.run", "run")
    assert (work / "kept.run" / MARKER).is_file()


SLOW_RUN = """
import sys
from attnlab.cli import main
sys.argv = ["attnlab", "uptrain", *sys.argv[1:]]
main()
"""


@contextlib.contextmanager
def slow_run(work: Path, src: str, dst: str):
    """An ``attnlab uptrain SRC DST`` of 100,000 steps in another process, once it has logged its first step;
    killed at the end of the block."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_RUN, src, dst, "--data", "corpus", "--steps", "100000", "--batch-size", "1",
         "--seq-len", "16", "--save-every", "0"],
        cwd=work, stderr=subprocess.PIPE, text=True, env=os.environ | {"COLUMNS": "200"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (work / f"{dst}.run" / "log.jsonl").is_file() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_one_writer_per_dst(work):
    # Issue 29: a second run to the same DST deleted the first's run directory; both "finished".
    with slow_run(work, "gqa2", "up") as first:
        run_before = tree(work / "up.run")
        second = run_cli("uptrain", "gqa2", "up", "--data", "corpus", "--overwrite", *FAST)
        one_line_error(second, f"DST up is being written by another attnlab process (pid {first.pid}")
        assert set(tree(work / "up.run")) >= set(run_before) and first.poll() is None


def test_a_checkpoint_an_uptrain_reads_is_not_replaced_under_it(work):
    # Last stop's left-alone item: a convert or uptrain --overwrite into a running uptrain's SRC replaced it, and
    # the run's final write, which reads SRC's config and side files again, failed after all the training.
    assert run_cli("uptrain", "gqa2", "up", "--data", "corpus", *FAST).exit_code == 0
    with slow_run(work, "up", "up2") as reader:
        before = tree(work / "up")
        second = run_cli("uptrain", "gqa2", "up", "--data", "corpus", "--overwrite", *FAST)
        one_line_error(second, "DST up is being read by another attnlab process")
        convert = run_cli("convert", "gqa2", "up", "--kv-heads", 1, "--overwrite")
        one_line_error(convert, "destination up is being read by another attnlab process")
        assert tree(work / "up") == before and reader.poll() is None
    # the reader's lock went with it
    assert run_cli("uptrain", "gqa2", "up", "--data", "corpus", "--overwrite", *FAST).exit_code == 0


@pytest.mark.parametrize("lr", ["inf", "nan"])
def test_a_non_finite_learning_rate_is_refused(work, lr):
    result = run_cli("uptrain", "gqa2", "up", "--data", "corpus", "--lr", lr, *FAST)
    one_line_error(result, f"--lr must be a finite number, got {lr}")


def test_divergence_stops_with_exit_2_and_keeps_the_last_good_checkpoint(work):
    # Issue 29: --lr 1e6 wrote an all-NaN checkpoint and exited 0.
    result = run_cli(
        "uptrain", "gqa2", "up", "--data", "corpus", "--lr", 1e6, "--warmup", 0, "--steps", 8, "--save-every", 1,
        "--batch-size", 2, "--seq-len", 32, "--grad-clip", 0,
    )  # fmt: skip
    one_line_error(result, "training diverged at step", started=True)
    assert "nothing was written to DST" in result.output and "lower --lr" in result.output
    assert not (work / "up").exists()
    kept = sorted(p.name for p in (work / "up.run").glob("step-*"))
    assert kept and f"the last complete checkpoint is {Path('up.run') / kept[-1]}" in result.output


def test_a_full_disk_while_saving_keeps_the_last_checkpoint_and_says_how_to_resume(work):
    # Issue 29: a traceback (SafetensorError ... No space left on device). RLIMIT_FSIZE fails writes like a full disk:
    # the model's checkpoint (~170 kB of weights) fits, the optimizer's twice as large does not.
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))

    proc = subprocess.run(
        [sys.executable, "-c", SLOW_RUN, "gqa2", "up", "--data", "corpus", "--steps", "4", "--batch-size", "2",
         "--seq-len", "32", "--save-every", "2"],
        cwd=work, capture_output=True, text=True, preexec_fn=limit,
    )  # fmt: skip
    device, *lines = proc.stderr.strip().splitlines()  # the device training started on, then the error
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert CPU_LINE.fullmatch(device) and len(lines) == 1 and "File too large" in lines[0], proc.stderr
    assert "no checkpoint was saved yet, so a rerun starts from the beginning" in lines[0]
    assert [p.name for p in (work / "up.run").iterdir() if p.name.startswith(("step-", ".step-"))] == []
    assert not (work / "up").exists()


def test_a_batch_that_cannot_be_allocated_is_refused_at_once(work):
    start = time.monotonic()
    args = ["--batch-size", 100_000_000, "--seq-len", 32, "--steps", 1]
    result = run_cli("uptrain", "gqa2", "up", "--data", "corpus", *args)
    one_line_error(result, "--batch-size 100000000 x --seq-len 32 needs at least")
    assert "lower --batch-size" in result.output and time.monotonic() - start < 30
    assert not (work / "up.run").exists()


BASE = ["--data", "corpus", "--steps", 4, "--batch-size", 2, "--seq-len", 32, "--save-every", 2]


def interrupted_after_step_3(work: Path, monkeypatch) -> None:
    """``uptrain gqa2 up`` (``BASE``) stopped after step 3: checkpoint 2 saved, three lines logged."""
    from attnlab.train import progress

    real_step = progress.StepLog.step

    def dies_after_step_3(self, record, **kwargs):
        real_step(self, record, **kwargs)
        if record["step"] == 3:
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(progress.StepLog, "step", dies_after_step_3)
        assert run_cli("uptrain", "gqa2", "up", *BASE).exit_code != 0
    assert sorted(p.name for p in (work / "up.run").glob("step-*")) == ["step-00000002"]


def test_resume_tolerates_a_log_cut_by_the_kill(work, monkeypatch):
    # Issue 29: --resume after a kill that cut the last line of log.jsonl failed with a JSON error naming no file.
    base = BASE
    interrupted_after_step_3(work, monkeypatch)
    log = work / "up.run" / "log.jsonl"
    lines = log.read_text().splitlines()
    log.write_text(
        "\n".join(lines[:2]) + "\n" + lines[2][: len(lines[2]) // 2]
    )  # cut mid-line, as a kill does
    resumed = run_cli("uptrain", "gqa2", "up", *base, "--resume")
    assert resumed.exit_code == 0, resumed.output
    steps = [json.loads(x)["step"] for x in (work / "up" / "uptrain_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    whole = run_cli("uptrain", "gqa2", "whole", *base)
    assert whole.exit_code == 0
    assert (work / "whole" / "model.safetensors").read_bytes() == (
        work / "up" / "model.safetensors"
    ).read_bytes()


def test_a_rerun_over_an_interrupted_run_holding_a_users_file_offers_only_what_it_would_do(work, monkeypatch):
    """A plain rerun advised "--resume ... or --overwrite to start over", and --overwrite was then refused for the
    user's file: the advice now says what to move first, and --resume still continues the run."""
    interrupted_after_step_3(work, monkeypatch)
    plain = run_cli("uptrain", "gqa2", "up", *BASE)
    one_line_error(plain, "pass --resume to continue it, or pass --overwrite to start over")
    (work / "up.run" / "NOTES.txt").write_text("mine")
    before = tree(work)
    advised = run_cli("uptrain", "gqa2", "up", *BASE)
    one_line_error(
        advised,
        "pass --resume to continue it, or to start over, first move away what attnlab did not write there "
        "(NOTES.txt) and pass --overwrite",
    )
    assert tree(work) == before
    (work / "up.run" / "step-00000002" / "rng.json").write_text("[1]")  # damaged: the same advice
    damaged = run_cli("uptrain", "gqa2", "up", *BASE, "--resume")
    one_line_error(damaged, "or to start over, first move away what attnlab did not write there (NOTES.txt)")
    (work / "up.run" / "step-00000002" / "rng.json").write_bytes(before["up.run/step-00000002/rng.json"])
    resumed = run_cli("uptrain", "gqa2", "up", *BASE, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert (work / "up.run" / "NOTES.txt").read_text() == "mine" and (
        work / "up" / "model.safetensors"
    ).is_file()


def test_a_damaged_log_line_before_the_last_names_the_file(tmp_path):
    from attnlab.train.progress import read_log

    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(ValueError, match=rf"{log}, line 2: not a step record"):
        read_log(log)
    log.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    assert [r["step"] for _, r in read_log(log)] == [1]


def test_text_that_is_not_utf8_is_named(work):
    (work / "corpus" / "latin1.txt").write_bytes("Ophélie".encode("latin-1") * 50)
    result = run_cli("uptrain", "gqa2", "up", "--data", "corpus", *FAST)
    one_line_error(result, "latin1.txt is not UTF-8 text")


@pytest.mark.parametrize("damage", ["malformed", "too large"])
def test_a_tokenizer_that_does_not_fit_the_model_is_one_line(
    tmp_path, tokenizer, corpus, damage, monkeypatch
):
    # Issue 29: "Exception: key must be a string" and "IndexError: index out of range in self" tracebacks.
    src = make_llama(tmp_path / "src", tokenizer, vocab_size=200 if damage == "too large" else 320)
    if damage == "malformed":
        (src / "tokenizer.json").write_text('{1: "x"}')
    monkeypatch.chdir(tmp_path)
    message = (
        "is not a readable tokenizer" if damage == "malformed" else "has token ids up to 319, but the model's"
    )
    for args in (
        ["uptrain", src, "up", "--data", corpus, *FAST],
        ["eval", src, "--data", corpus],
        ["generate", src, "--prompt", "To be", "--max-new", 2],
        ["convert", src, "fit", "--kv-heads", 2, "--method", "fit", "--calib", corpus / "hamlet.txt"],
        ["convert", src, "mla", "--to", "mla", "--kv-lora-rank", 8, "--calib", corpus / "hamlet.txt"],
    ):
        one_line_error(run_cli(*args), message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


DAMAGES = [
    ("model.safetensors", "truncate", "model.safetensors is not a readable safetensors file"),
    ("optimizer.safetensors", "truncate", "optimizer.safetensors is not a readable safetensors file"),
    ("state.json", "[1]", "malformed"),  # an AttributeError ('list' object has no attribute 'get')
    ("optimizer.json", "{nope", "optimizer.json: JSONDecodeError"),  # the JSON error named no file
    ("rng.json", '[{"torch": [1, 2, 3]}]', "rng.json: expected a list of RNG states"),  # torch's RuntimeError
]


def test_resume_from_a_damaged_checkpoint_names_it_before_any_work(work, monkeypatch):
    interrupted_after_step_3(work, monkeypatch)
    step = work / "up.run" / "step-00000002"
    for file, damage, message in DAMAGES:
        kept = (step / file).read_bytes()
        if damage == "truncate":
            (step / file).write_bytes(kept[:100])
        else:
            (step / file).write_text(damage)
        result = run_cli("uptrain", "gqa2", "up", *BASE, "--resume")
        one_line_error(result, message)
        assert "--resume: the newest checkpoint is damaged" in result.output and "delete" in result.output
        assert not (work / "up").exists()
        (step / file).write_bytes(kept)


def test_a_checkpoint_under_a_path_that_is_no_utf8_is_named_for_its_path(tiny_llama, corpus, tmp_path):
    # the weights were called "not a readable safetensors file ... re-download or re-export it": the file was fine
    src = tmp_path / "ck_\udcfa"  # a directory named with byte 0xfa, as the shell hands it over
    os.symlink(tiny_llama, src)
    for args in (["eval", src, "--data", corpus], ["generate", src, "--prompt", "To be", "--max-new", 2]):
        one_line_error(
            run_cli(*args), "the path is not valid UTF-8 text, which the safetensors library cannot"
        )


def test_a_file_given_as_the_checkpoint_is_named_a_file(corpus, tiny_llama, tmp_path):
    # "checkpoint directory not found" for a path that was there
    for args in (
        ["eval", corpus / "hamlet.txt", "--data", corpus],
        ["convert", corpus / "hamlet.txt", "x", "--kv-heads", 1],
        ["uptrain", corpus / "hamlet.txt", tmp_path / "x", "--data", corpus],
        ["uptrain", tiny_llama, tmp_path / "x", "--data", corpus, "--teacher", corpus / "hamlet.txt"],
    ):
        one_line_error(run_cli(*args), "hamlet.txt is a file, not a checkpoint directory")
    assert not (tmp_path / "x").exists()
