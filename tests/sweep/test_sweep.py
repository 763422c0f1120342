"""``attnlab sweep`` on a tiny random Llama: the rows (source first, a failing conversion reported in its row), KV
bytes equal to the caches' ``nbytes``, ``--json``, the files of ``--out`` and nothing written outside it, a warm
rerun and an added variant running only what is new, the Pareto marks on a hand-made table, CLI errors."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from attnlab.cli import app
from attnlab.data import shakespeare, train_byte_bpe
from attnlab.hf import load_causal_lm
from attnlab.sweep import SweepOptions, pareto, work
from attnlab.sweep.command import _cache_root

runner = CliRunner()
FAST = ["--quick", "--methods", "mean", "--uptrain-steps", "0,2", "--seq-len", "16", "--batch-size", "2",
        "--eval-windows", "4", "--context", "24"]  # fmt: skip


def snapshot(path: Path, skip: Path) -> dict[str, tuple[int, int]]:
    return {
        str(f.relative_to(path)): (f.stat().st_size, f.stat().st_mtime_ns)
        for f in sorted(path.rglob("*"))
        if f.is_file() and skip not in f.parents
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sweep")
    corpus = root / "corpus"
    corpus.mkdir()
    for name in ("hamlet", "macbeth", "othello"):
        (corpus / f"{name}.txt").write_text((shakespeare() / f"{name}.txt").read_text()[:8000])
    tok = train_byte_bpe([p.read_text() for p in sorted(corpus.glob("*.txt"))], 320)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                   eos_token_id=0, bos_token_id=0)  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "src")
    tok.save(str(root / "src" / "tokenizer.json"))
    return {"root": root, "src": root / "src", "corpus": corpus}


def sweep(tiny, *args, env: dict | None = None):
    result = runner.invoke(app, ["sweep", str(tiny["src"]), "--data", str(tiny["corpus"]), *FAST, *map(str, args)],
                           env=env)  # fmt: skip
    return result


@pytest.fixture(scope="module")
def first(tiny):
    """gqa-2, MLA at gqa-2's bytes (8 x 2 x 2 - 4 = 28) and a rank the layers cannot use, with --out."""
    before = snapshot(tiny["root"], tiny["root"] / "out")
    result = sweep(tiny, "--variants", "gqa:2 mla:28,500", "--out", tiny["root"] / "out", "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), before, snapshot(tiny["root"], tiny["root"] / "out")


def test_rows_source_first_and_a_failing_conversion_in_its_row(first):
    results, _, _ = first
    rows = results["rows"]
    assert [(r["variant"], r["method"], r["steps"]) for r in rows] == [
        ("source", "-", 0), ("gqa-2", "mean", 0), ("gqa-2", "mean", 2), ("mla-28", "plain", 0),
        ("mla-28", "plain", 2), ("mla-500", "plain", 0), ("mla-500", "plain", 2),
    ]  # fmt: skip
    for r in rows[:5]:
        assert r["error"] is None and r["loss"] > 0 and r["tokens_per_s"] > 0
    assert rows[1]["kv_bytes_per_token"] == rows[3]["kv_bytes_per_token"] == rows[0]["kv_bytes_per_token"] / 2
    for r in rows[5:]:  # the conversion refused: one line, no figures, the sweep went on
        assert "kv-lora-rank" in r["error"] and "\n" not in r["error"] and r.get("loss") is None
        assert not r["pareto"]
    assert any(r["pareto"] for r in rows)
    assert results["jobs"]["failed"] == 1 and results["jobs"]["skipped"] == 3  # its speed, eval, uptrain


def test_the_note_column_is_there_only_for_rows_that_could_not_be_done(first):
    # the table and report.md had a "note" column that every sweep without a refused conversion left empty
    from attnlab.sweep.report import header, markdown, table_rows

    results, _, _ = first
    done = results | {"rows": [r for r in results["rows"] if r["error"] is None]}
    for res, notes in ((results, True), (done, False)):
        names, cells = header(res), table_rows(res)
        assert ("note" in names) is notes and all(len(row) == len(names) for row in cells)
        table = markdown(res, [])
        assert ("| note |" in table) is notes and "| ms/step " in table
    assert "kv-lora-rank" in table_rows(results)[-1][-1]


def test_kv_bytes_equal_the_caches_nbytes(first):
    results, _, _ = first
    ctx, batch = results["options"]["context"], results["options"]["batch"]
    for r in results["rows"][:5]:
        model = load_causal_lm(r["checkpoint"])
        caches = model.new_caches(batch, ctx, dtype=torch.bfloat16)
        assert r["kv_bytes_per_request"] * batch == sum(c.nbytes for c in caches)
        assert r["cache_nbytes"] > 0  # the timed caches, checked against the cost model in the job


def test_kv_bytes_per_request_are_one_requests_at_any_batch(tiny):
    from attnlab.sweep.report import costs

    hf = json.loads((tiny["src"] / "config.json").read_text())
    one, four = costs(hf, 256, 1, ()), costs(hf, 256, 4, ())
    model = load_causal_lm(tiny["src"])
    request = sum(c.nbytes for c in model.new_caches(1, 256, dtype=torch.bfloat16))
    assert one["kv_bytes_per_request"] == four["kv_bytes_per_request"] == request
    assert one["kv_bytes_per_token"] == four["kv_bytes_per_token"] == request / 256


def test_out_holds_everything_and_nothing_is_written_outside(first, tiny):
    results, before, after = first
    out = tiny["root"] / "out"
    assert before == after  # inputs untouched, no file beside --out
    assert not _cache_root(SweepOptions(tiny["src"], tiny["corpus"])).exists()  # the cache without --out
    saved = json.loads((out / "sweep.json").read_text())
    assert saved["rows"] == results["rows"] and saved["generated_by"].startswith("attnlab")
    report = (out / "report.md").read_text()
    assert "| * | source |" in report or "|  | source |" in report
    for png in ("quality_vs_kv_bytes.png", "quality_vs_steps.png", "quality_vs_speed.png"):
        assert (out / png).stat().st_size > 5000
        assert f"]({png})" in report


def test_uptraining_under_a_launcher_gives_the_in_process_result(first, monkeypatch, tmp_path):
    """ATTNLAB_SWEEP_LAUNCH (torchrun in practice; here the plain interpreter, the same subprocess path) runs
    ``attnlab uptrain`` with the job's options: the same held-out loss as the job run in the sweep's process."""
    results, _, _ = first
    converted, uptrained = results["rows"][1], results["rows"][2]
    saved = json.loads(
        next(Path(uptrained["checkpoint"]).parent.glob("uptrain_gqa-2_mean_2-*.json")).read_text()
    )
    monkeypatch.setenv(work.LAUNCH, sys.executable)
    summary = work.uptrain(saved["args"], {"convert": {"out": converted["checkpoint"]}}, tmp_path / "up")
    assert summary["eval"]["loss"] == pytest.approx(uptrained["loss"], rel=1e-5)
    assert summary["options"]["steps"] == 2 and (tmp_path / "up").is_dir()


def test_a_launched_uptrain_that_fails_reports_attnlabs_line_not_the_launchers(first, monkeypatch, tmp_path):
    """Under torchrun the last line of stderr is its failure banner ("===="), which the row reported as the reason;
    the rank's "attnlab: error:" line above it is the reason."""
    results, _, _ = first
    converted, uptrained = results["rows"][1], results["rows"][2]
    saved = json.loads(
        next(Path(uptrained["checkpoint"]).parent.glob("uptrain_gqa-2_mean_2-*.json")).read_text()
    )
    # runs the command, then ends its stderr with a banner, as torchrun does
    launcher = tmp_path / "launcher.py"
    launcher.write_text(
        "import subprocess, sys\n"
        "proc = subprocess.run([sys.executable, *sys.argv[1:]], capture_output=True, text=True)\n"
        "sys.stderr.write(proc.stderr + '=' * 60 + '\\nChildFailedError:\\n' + '=' * 60 + '\\n')\n"
        "sys.exit(proc.returncode)\n"
    )
    monkeypatch.setenv(work.LAUNCH, f"{sys.executable} {launcher}")
    monkeypatch.setenv(work.UPTRAIN_FLAGS, "--tp 2")  # one process: refused
    with pytest.raises(RuntimeError, match=r"uptrain failed: attnlab: error: --tp 2"):
        work.uptrain(saved["args"], {"convert": {"out": converted["checkpoint"]}}, tmp_path / "up")


def test_warm_rerun_runs_nothing_and_a_new_variant_runs_only_its_jobs(first, tiny):
    out = tiny["root"] / "out"
    again = sweep(tiny, "--variants", "gqa:2 mla:28,500", "--out", out, "--json")
    assert again.exit_code == 0, again.output
    warm = json.loads(again.stdout)
    assert warm["jobs"]["run"] == 0 and warm["jobs"]["computed"] == []
    assert [r.get("loss") for r in warm["rows"]] == [r.get("loss") for r in first[0]["rows"]]
    more = sweep(tiny, "--variants", "gqa:2 mla:28,500 gqa:1", "--out", out, "--json", "--keep", "best")
    assert more.exit_code == 0, more.output
    extended = json.loads(more.stdout)
    assert extended["jobs"]["computed"] == [
        "convert/mqa/mean",
        "eval/mqa/mean",
        "speed/mqa",
        "uptrain/mqa/mean/2",
    ]
    rows = extended["rows"]
    assert [r["variant"] for r in rows][-2:] == ["mqa", "mqa"]
    for r in rows:  # --keep best: only the Pareto-optimal rows keep their checkpoints
        if r["kind"] != "source":
            assert (r["checkpoint"] is not None) == r["pareto"]
            assert r["checkpoint"] is None or Path(r["checkpoint"]).is_dir()


def test_a_row_that_becomes_pareto_optimal_gets_back_its_deleted_checkpoint(first, tiny):
    """After --keep best deleted the checkpoints of the rows it did not keep, a run where one of those rows is
    Pareto-optimal (here: fewer variants to beat it) makes its checkpoint again; the losses stay the cached ones."""
    out = tiny["root"] / "out"
    before = json.loads((out / "sweep.json").read_text())["rows"]
    # MLA of rank 28, uptrained 2 steps: beaten by gqa-2 then (the same bytes, a lower loss, faster), and alone
    # with the source now, whose loss it beats with half the bytes
    lost = [r for r in before if r["variant"] == "mla-28" and r["steps"] == 2 and r["checkpoint"] is None]
    assert lost, before
    again = sweep(tiny, "--variants", "mla:28", "--out", out, "--json", "--keep", "best")
    assert again.exit_code == 0, again.output
    rows = json.loads(again.stdout)["rows"]
    for r in rows:
        if r["kind"] != "source":
            assert (r["checkpoint"] is not None) == r["pareto"], r
            assert r["checkpoint"] is None or Path(r["checkpoint"]).is_dir()
    remade = next(r for r in rows if r["variant"] == "mla-28" and r["steps"] == 2)
    assert remade["pareto"] and Path(remade["checkpoint"]).is_dir()
    m = remade["method"]  # MLA's counterpart of --methods mean
    assert json.loads(again.stdout)["jobs"]["computed"] == [f"convert/mla-28/{m}", f"uptrain/mla-28/{m}/2"]
    old = {(r["variant"], r["steps"]): r.get("loss") for r in before}
    assert all(r["loss"] == old[(r["variant"], r["steps"])] for r in rows)


def test_a_report_the_user_edited_and_files_added_to_a_checkpoint_are_kept(first, tiny):
    """A rerun replaced a report.md the user had rewritten (its mark gone) with no --overwrite, and --keep none
    deleted a job checkpoint together with the notes a user had put in it."""
    out = tiny["root"] / "out"
    report = out / "report.md"
    generated = report.read_text()
    report.write_text("# my notes on this sweep: ask Bob\n")
    again = sweep(tiny, "--variants", "gqa:2 mla:28,500", "--out", out, "--json")
    assert again.exit_code == 2 and "report.md exists and is a file without attnlab's mark" in again.stderr
    assert report.read_text().startswith("# my notes")
    report.write_text(generated)
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    kept = next(Path(r["checkpoint"]) for r in rows if r["kind"] != "source" and r["checkpoint"])
    (kept / "NOTES.md").write_text("ask Bob")
    again = sweep(tiny, "--variants", "gqa:2 mla:28,500", "--out", out, "--json", "--keep", "none")
    assert again.exit_code == 0, again.output
    said = f"attnlab: kept checkpoint {kept}: it holds what attnlab did not write there (NOTES.md), with all it holds"
    assert said in again.stderr
    assert (kept / "NOTES.md").read_text() == "ask Bob"
    left = {r["checkpoint"] for r in json.loads(again.stdout)["rows"] if r["kind"] != "source"} - {None}
    assert left == {str(kept)}
    (kept / "NOTES.md").unlink()
    # a deletion a kill cut short, of a job no later run writes again (cached): removed by the next sweep
    stale = out / "jobs" / f".{kept.name}.del-999999999-0123abcd"
    stale.mkdir()
    (stale / "model-00002-of-00005.safetensors").write_text("half")
    again = sweep(tiny, "--variants", "gqa:2 mla:28,500", "--out", out, "--json")
    assert again.exit_code == 0, again.output
    assert not stale.exists()


def test_pareto_on_a_hand_made_table():
    rows = [
        {"loss": 3.0, "kv_bytes_per_token": 256, "tokens_per_s": 100},  # best loss
        {"loss": 3.2, "kv_bytes_per_token": 64, "tokens_per_s": 100},  # fewest bytes
        {"loss": 3.3, "kv_bytes_per_token": 64, "tokens_per_s": 90},  # beaten by the row above
        {"loss": 3.1, "kv_bytes_per_token": 128, "tokens_per_s": 150},  # fastest
        {"loss": 3.1, "kv_bytes_per_token": 128, "tokens_per_s": 150},  # a tie: neither beats the other
        {"loss": 3.4, "kv_bytes_per_token": 256, "tokens_per_s": 80},  # beaten by all of the first
        {"loss": None, "kv_bytes_per_token": 32, "tokens_per_s": 500},  # no quality: not a candidate
        {"loss": float("nan"), "kv_bytes_per_token": 32, "tokens_per_s": 500},
    ]
    assert pareto(rows) == [True, True, False, True, True, False, False, False]
    assert pareto([]) == []


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--variants", "gqa:3"], "--variants gqa:3"),
        (["--variants", "bogus"], "--variants takes"),
        (["--methods", "median"], "--methods"),
        (["--keep", "some"], "--keep"),
        (["--hardware", "tpu"], "--hardware"),
        (["--uptrain-steps", "x"], "--uptrain-steps"),
        (["--jobs", "0"], "--jobs"),
        (["--timing", "apart"], "--timing"),
        (["--warmup", "2"], "--warmup"),
        (["--temperature", "0"], "--temperature"),
        # inf ran every other job, then failed each uptraining, with exit 0
        (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
        (["--temperature", "inf"], "--temperature must be a finite number > 0, got inf"),
        # uptrain's own ranges, before any job (each row failed on them, exit 0)
        (["--temperature", "0.005"], "--temperature must be in [0.01, 100.0], got 0.005"),
        (["--seed", str(10**23)], "--seed must be in [0, 2**64)"),
        (["--variants", "gqa:2/median"], "--variants gqa:2/median"),
        (["--variants", "mla:16+x"], "--variants mla:R+"),
        # checked before any job runs, not as every row's error (--seq-len 0 once meant the default)
        (["--seq-len", "0"], "--seq-len must be an integer >= 1, got 0"),
        (["--seq-len", "100000"], "--seq-len 100000 is longer than the source's 64 positions"),
        # a timing cache this machine cannot hold: each row failed with torch's allocation error, exit 0
        (
            ["--batch", str(2**40)],
            f"--batch {2**40} x 48 tokens (the decode timing's prefill and cache; --context 4096, at most the ",
        ),
        (["--eval-windows", "-3"], "--eval-windows must be an integer >= 0, got -3"),
        (["--teacher", "/no/such/teacher", "--uptrain-steps", "0"], "--teacher /no/such/teacher"),
    ],
)
def test_cli_errors_exit_2_with_one_line(tiny, args, fragment):
    result = runner.invoke(app, ["sweep", str(tiny["src"]), "--data", str(tiny["corpus"]), *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnlab: error:") and fragment in lines[0], result.stderr


def test_an_out_directory_of_the_user_is_refused(tiny):
    mine = tiny["root"] / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    result = sweep(tiny, "--out", mine)
    assert result.exit_code == 2 and "--out" in result.stderr and "marker" in result.stderr, result.stderr
    assert os.listdir(mine) == ["notes.txt"]


def test_an_out_directory_holding_the_teacher_is_refused(tiny):
    # Issue 29's write rule: --out may not contain any input, --teacher included (here an earlier sweep's directory,
    # whose --keep could delete a checkpoint the user now distils from).
    from attnlab.atomic import claim_dir

    out = claim_dir(tiny["root"] / "earlier", "sweep")
    shutil.copytree(tiny["src"], out / "teacher")
    before = snapshot(tiny["root"], skip=tiny["root"] / "nothing")
    result = sweep(tiny, "--out", out, "--teacher", out / "teacher", "--keep", "best")
    assert result.exit_code == 2 and "--out" in result.stderr and "contains the source" in result.stderr, (
        result.output
    )
    assert snapshot(tiny["root"], skip=tiny["root"] / "nothing") == before


def test_auto_variants_compare_at_equal_cache():
    from attnlab.config import AttentionConfig, ModelConfig
    from attnlab.sweep.plan import variants

    def cfg(n_kv: int) -> ModelConfig:
        return ModelConfig(64, 2, AttentionConfig(d_model=64, n_heads=8, n_kv_heads=n_kv), 128)

    names = [v.name for v in variants(cfg(8), ("auto",), quick=False)]
    # rope 4: 2 g 8 - 4; the source's own bytes (124) exceed what an MLA layer of d_model 64 can hold (rank 64):
    # planned, that row could only fail, and with --timing together take every row's tok/s with it
    assert names == ["gqa-4", "gqa-2", "mqa", "mla-60", "mla-28", "mla-12"]
    assert [v.name for v in variants(cfg(8), ("auto",), quick=True)] == ["gqa-2", "mqa", "mla-28"]
    assert [v.name for v in variants(cfg(1), ("auto",), quick=True)] == ["mla-12"]
    assert [v.name for v in variants(cfg(4), ("gqa:2", "mla:16,16"), quick=False)] == ["gqa-2", "mla-16"]


def test_sweep_options_that_would_run_wrong_are_refused_by_name(tmp_path):
    """Two specs naming one row kept the first silently; empty and repeated lists ran (a sweep of the source
    alone) or failed naming an internal job; a str path failed deep in the run."""
    from attnlab.config import AttentionConfig, ModelConfig
    from attnlab.sweep.plan import check_options, variants

    cfg = ModelConfig(64, 2, AttentionConfig(d_model=64, n_heads=8), 128)
    for spec in (("mla:28+4", "mla:28+8"), ("gqa:2/mean", "gqa:2/fit"), ("auto", "gqa:2/fit")):
        with pytest.raises(ValueError, match=r"asks for .* twice, differently"):
            variants(cfg, spec, quick=False)
    assert [v.name for v in variants(cfg, ("gqa:2", "gqa:2"), quick=False)] == ["gqa-2"]  # the same ask, once
    for spec in ("mla:2_8", "gqa:\uff12"):  # Python's int() reads 28 and a full-width 2: plain digits only
        with pytest.raises(ValueError, match="comma list of integers"):
            variants(cfg, (spec,), quick=False)
    base = dict(src=tmp_path, data=tmp_path)
    for kwargs, field in [(dict(methods=()), "--methods needs at least one value"),
                          (dict(variants=("",)), "--variants needs at least one value"),
                          (dict(methods=("mean", "mean")), "--methods lists a value twice"),
                          (dict(uptrain_steps=(5, 5)), "--uptrain-steps lists a value twice"),
                          (dict(uptrain_steps=(0.5,)), "--uptrain-steps must be integers")]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            check_options(SweepOptions(**(base | kwargs)))
    with pytest.raises(TypeError, match=r"SweepOptions\.src must be a pathlib\.Path, got 'model'"):
        check_options(SweepOptions(src="model", data=tmp_path))
    with pytest.raises(TypeError, match="--lr must be a number"):
        check_options(SweepOptions(**base, lr="1e-3"))
    # an empty item was dropped: 'gqa:2/mean,' ran as gqa:2/mean, --uptrain-steps '100,' as 100
    from attnlab.sweep.plan import parse_ints

    for spec in ("gqa:2/mean,", "gqa:2/,fit", "gqa:2,", "gqa:,2"):
        with pytest.raises(ValueError, match=r"is not a method|comma list of integers"):
            variants(cfg, (spec,), quick=False)
    for text in ("100,", ",100", "100,,200"):
        with pytest.raises(ValueError, match="--uptrain-steps takes a comma list of integers"):
            parse_ints(text, "--uptrain-steps")
    # the command line dropped an empty item: --methods 'mean,' ran as --methods mean
    for methods in ("mean,", "mean,,fit", ","):
        result = runner.invoke(app, ["sweep", str(tmp_path), "--data", str(tmp_path), "--methods", methods])
        assert (
            result.exit_code == 2 and "--methods needs at least one value and no empty ones" in result.stderr
        )


def test_a_file_moved_between_the_training_and_held_out_text_is_other_text(tmp_path):
    """The fingerprint of --data a,b with --eval-data c equalled that of --data a with --eval-data b,c: the second
    sweep took the first one's cached losses; and the folder kept a file that had moved to the held-out text."""
    from attnlab.sweep.plan import prepare_data

    for name in "abc":
        (tmp_path / f"{name}.txt").write_text(f"{name}: a line of seven words or more here\n")
    for d, files in (("D1", "ab"), ("E1", "c"), ("D2", "a"), ("E2", "bc")):
        (tmp_path / d).mkdir()
        for f in files:
            (tmp_path / d / f"{f}.txt").symlink_to(tmp_path / f"{f}.txt")
    (tmp_path / "cache").mkdir()
    one = prepare_data(tmp_path / "D1", tmp_path / "E1", tmp_path / "cache")
    two = prepare_data(tmp_path / "D2", tmp_path / "E2", tmp_path / "cache")
    assert one["fingerprint"] != two["fingerprint"]
    assert sorted(p.name for p in two["train"].iterdir()) == ["0000-a.txt"]
    assert sorted(p.name for p in two["heldout"].iterdir()) == ["0000-b.txt", "0001-c.txt"]


def test_warmup_0_is_no_warmup_as_in_uptrain(tiny):
    from attnlab.sweep import plan

    opts = SweepOptions(tiny["src"], tiny["corpus"], warmup=0.0)
    data = {"train": tiny["corpus"], "heldout": tiny["corpus"], "fingerprint": "x"}
    assert plan.uptrain_args(opts, load_causal_lm(tiny["src"]).cfg, data, 5)["warmup"] == 0  # once 1


def test_variant_specs_with_rotary_dims_and_their_own_methods():
    from attnlab.config import AttentionConfig, ModelConfig
    from attnlab.sweep.plan import methods_of, variants

    cfg = ModelConfig(64, 2, AttentionConfig(d_model=64, n_heads=8), 128)  # head_dim 8: default rope 4
    vs = variants(cfg, ("gqa:4,2/mean,fit", "mla:60+4,56+8/fit", "mla:28"), quick=False)
    assert [(v.name, v.kv_lora_rank, v.rope_dim) for v in vs] == [
        ("gqa-4", None, None), ("gqa-2", None, None), ("mla-60", 60, 4), ("mla-56", 56, 8), ("mla-28", 28, 4),
    ]  # fmt: skip
    methods = ("first", "random")  # --methods: for the specs without their own
    assert [methods_of(v, methods) for v in vs] == [
        ["mean", "fit"], ["mean", "fit"], ["calib"], ["calib"], ["plain"],
    ]  # fmt: skip


def test_the_study_options_reach_uptrain_and_a_source_without_a_dependency(first, tiny, tmp_path):
    """--seed, --warmup, --distill-weight and --temperature are what the uptraining job runs with; a job given
    ``src`` and no dependency (a study's pretraining from a random init) trains that checkpoint."""
    from attnlab.sweep import plan

    assert first[0]["jobs"]["run"] > 0  # the sweep whose uptraining job this test reads ran
    saved = json.loads(next((tiny["root"] / "out" / "jobs").glob("uptrain_gqa-2_mean_2-*.json")).read_text())
    # the defaults keep attnlab uptrain's own
    assert {k: saved["args"][k] for k in ("seed", "warmup", "distill_weight", "temperature")} == {
        "seed": 0, "warmup": None, "distill_weight": 0.5, "temperature": 2.0,
    }  # fmt: skip
    opts = SweepOptions(tiny["src"], tiny["corpus"], seed=3, warmup=0.5, distill_weight=1.0, temperature=1.0,
                        seq_len=16, batch_size=2, eval_windows=4)  # fmt: skip
    data = {"train": Path(saved["args"]["data"]), "heldout": Path(saved["args"]["eval_data"]),
            "fingerprint": saved["args"]["data_id"]}  # fmt: skip
    args = plan.uptrain_args(opts, load_causal_lm(tiny["src"]).cfg, data, 2)
    assert (args["seed"], args["warmup"], args["distill_weight"], args["temperature"]) == (3, 1, 1.0, 1.0)
    summary = work.uptrain(args | {"src": str(tiny["src"])}, {}, tmp_path / "up")
    assert {k: summary["options"][k] for k in ("seed", "warmup", "distill_weight", "temperature", "src")} == {
        "seed": 3, "warmup": 1, "distill_weight": 1.0, "temperature": 1.0, "src": str(tiny["src"]),
    }  # fmt: skip
    assert summary["eval"]["loss"] > 0 and (tmp_path / "up" / "config.json").is_file()


def test_timing_together_times_every_variant_in_one_job_in_turn(tiny, tmp_path):
    """--timing together: one speed job, round robin over the source and every variant; each row reads its own
    figures from it, and the caches' bytes are the cost model's (the job checks them)."""
    out = tmp_path / "together"
    result = sweep(tiny, "--variants", "gqa:2,1", "--uptrain-steps", "0", "--timing", "together", "--out", out,
                   "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    results = json.loads(result.stdout)
    assert [n for n in results["jobs"]["computed"] if n.startswith("speed")] == ["speed"]
    saved = json.loads(next((out / "jobs").glob("speed-*.json")).read_text())["result"]
    timed = saved["models"]
    assert list(timed) == ["source", "gqa-2", "mqa"]
    for row in results["rows"]:
        assert row["tokens_per_s"] == timed[row["variant"]]["tokens_per_s"] > 0
        assert row["cache_nbytes"] == timed[row["variant"]]["cost_model_nbytes"]
    assert (
        timed["source"]["cache_nbytes"]
        == 2 * timed["gqa-2"]["cache_nbytes"]
        == 4 * timed["mqa"]["cache_nbytes"]
    )


def test_one_text_file_of_any_name_holds_out_its_last_lines_and_local_hardware_is_measured(
    tiny, tmp_path, monkeypatch
):
    """--data as one file (not named .txt): its last tenth of lines is the held-out text (every row once failed
    with an empty held-out directory, and a file without .txt with a directory without .txt files); --hardware
    local is this machine's roofline (it once ran every job and then exited 2)."""
    import dataclasses

    from attnlab.bench import machine
    from attnlab.cost.hardware import get_hardware
    from attnlab.cost.roofline import roofline
    from attnlab.hf import io
    from attnlab.hf.causal_lm import model_config

    play = tmp_path / "hamlet-plain"
    play.write_text((tiny["corpus"] / "hamlet.txt").read_text())
    here = dataclasses.replace(get_hardware("l40s"), name="local", bandwidth=12e9)  # a stand-in, not measured
    monkeypatch.setattr(machine, "measure_local", lambda: here)
    result = runner.invoke(app, ["sweep", str(tiny["src"]), "--data", str(play), *FAST, "--variants", "gqa:2",
                                 "--uptrain-steps", "0", "--hardware", "local", "--out", tmp_path / "out",
                                 "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    results = json.loads(result.stdout)
    cfg = model_config(tiny["src"], io.read_config(tiny["src"]))
    assert results["source"]["n_kv_heads"] == results["rows"][0]["n_kv_heads"] == 4
    for row in results["rows"]:
        assert row["error"] is None and row["loss"] > 0, row
    assert results["rows"][0]["predicted_decode_s"] == {
        "local": roofline(cfg, here, batch=1, seq_len=24).decode.seconds
    }
    saved = json.loads(next((tmp_path / "out" / "jobs").glob("eval_source-*.json")).read_text())["args"]
    (held,) = Path(saved["eval_data"]).glob("*.txt")
    (train,) = (tmp_path / "out" / "jobs").glob("train-*/*.txt")
    lines = play.read_text().splitlines(keepends=True)
    assert held.read_text() == "".join(lines[len(lines) - len(lines) // 10 :])
    assert train.read_text() + held.read_text() == play.read_text()


def test_files_of_one_name_in_subdirectories_are_all_read(tmp_path):
    from attnlab.sweep.plan import prepare_data

    for part in ("a", "b", "c"):
        (tmp_path / "corpus" / part).mkdir(parents=True)
        (tmp_path / "corpus" / part / "act.txt").write_text(
            f"the act of {part}, a line of seven words or more\n"
        )
    (tmp_path / "cache").mkdir()
    data = prepare_data(tmp_path / "corpus", None, tmp_path / "cache")
    texts = sorted(p.read_text() for folder in ("train", "heldout") for p in data[folder].glob("*.txt"))
    assert texts == [f"the act of {part}, a line of seven words or more\n" for part in ("a", "b", "c")]


def test_the_same_text_from_another_place_is_read_from_there(tmp_path):
    """The data folders are named by the text's fingerprint, and an existing one was reused as it was: a copy of the
    corpus swept into the same cache kept reading the first corpus, after it was deleted (every job failed) or
    edited (the new jobs trained on other text than their key says)."""
    import shutil

    from attnlab.sweep.plan import prepare_data

    (tmp_path / "a").mkdir()
    for i in range(3):
        (tmp_path / "a" / f"part{i}.txt").write_text(f"part {i}: a line of seven words or more here\n")
    (tmp_path / "cache").mkdir()
    first = prepare_data(tmp_path / "a", None, tmp_path / "cache")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    (tmp_path / "a" / "part0.txt").write_text("edited after the copy\n")
    second = prepare_data(tmp_path / "b", None, tmp_path / "cache")
    assert second == first  # the same folders: the cached results of the same text stay valid
    for folder in ("train", "heldout"):
        for link in second[folder].glob("*.txt"):
            assert link.resolve().parent == (tmp_path / "b").resolve()
            assert link.read_text().startswith("part ")
    assert not list((tmp_path / "cache").glob(".*"))  # no temporary or replaced folder left


def test_a_copied_out_reuses_its_cache_and_edited_text_reruns_only_what_reads_it(tiny, tmp_path):
    """Job keys hashed the absolute paths of the sweep's copies of its text: a copied or moved --out ran every job
    again. And every conversion's args held the calibration file's path, named by the text's fingerprint: editing
    the text ran the mean conversion, which never reads it, and the variant's timing, which depends on it."""
    import shutil

    corpus = tmp_path / "corpus"
    shutil.copytree(tiny["corpus"], corpus)
    args = [str(tiny["src"]), "--data", str(corpus), *FAST, "--variants", "gqa:2", "--json"]

    def run(out):
        result = runner.invoke(app, ["sweep", *args, "--out", str(out)])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["jobs"]

    assert run(tmp_path / "a")["run"] > 0
    shutil.copytree(tmp_path / "a", tmp_path / "b", symlinks=True)
    shutil.move(tmp_path / "a", tmp_path / "c")
    for out in ("b", "c"):
        assert run(tmp_path / out)["computed"] == [], out
    hamlet = corpus / "hamlet.txt"
    hamlet.write_text(hamlet.read_text().replace("the", "thee", 1))
    assert run(tmp_path / "b")["computed"] == ["eval/gqa-2/mean", "eval/source", "uptrain/gqa-2/mean/2"]


def test_a_second_sweep_of_the_same_source_without_out_is_refused(tiny, tmp_path, monkeypatch):
    """Without --out, sweeps of one source share attnlab's job cache: a second one exits 2 naming the first, where
    it once ran, lost a job to the first's lock and exited 0 with that row's error."""
    import threading

    from attnlab.atomic import lock

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = _cache_root(SweepOptions(tiny["src"], tiny["corpus"]))
    held, release = threading.Event(), threading.Event()

    def first_sweep():  # the lock is re-entrant within a thread: the other sweep holds it from another one
        with lock(root, "the job cache of this source"):
            held.set()
            release.wait(60)

    holder = threading.Thread(target=first_sweep)
    holder.start()
    try:
        assert held.wait(60)
        result = sweep(tiny, "--variants", "gqa:2", "--uptrain-steps", "0")
    finally:
        release.set()
        holder.join()
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert (
        "\n" not in line and f"the job cache of this source {root}" in line and "another attnlab" in line
    ), line


def test_text_that_is_not_utf8_is_named(tiny, tmp_path):
    # A QA reproduction: "'utf-8' codec can't decode byte 0xe9 ..." without the file or the flag.
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"line one\ncaf\xe9\nline three\nfour\n" * 10)
    result = runner.invoke(
        app, ["sweep", str(tiny["src"]), "--data", str(latin), *FAST, "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2 and f"--data: {latin} is not UTF-8 text" in result.output, result.output


def test_text_no_job_can_use_is_refused_before_out_is_made(tiny, tmp_path):
    # a held-out text shorter than one window gave every row an empty loss, exit 0, and a message naming the job
    # cache's folder; a --data that holds no text left a new --out behind
    short = tmp_path / "short"
    short.mkdir()
    (short / "x.txt").write_text("To be or not.\n")
    cases = [
        (["--eval-data", short], f"--eval-data {short} has about"),
        (["--data", tmp_path / "none"], f"--data {tmp_path / 'none'} not found"),
    ]
    for args, fragment in cases:
        out = tmp_path / "out"
        result = runner.invoke(
            app,
            [
                "sweep",
                str(tiny["src"]),
                "--data",
                str(tiny["corpus"]),
                *FAST,
                *map(str, args),
                "--out",
                str(out),
            ],
        )
        assert result.exit_code == 2 and fragment in result.stderr, result.output
        assert not out.exists()


def test_the_job_counts_include_the_first_pass_when_checkpoints_are_remade(tiny, tmp_path):
    # the second pass (checkpoints --keep none had deleted) replaced the first's outcomes: "2 run, 7 cached" where 5
    # ran
    out = tmp_path / "out"
    base = ["--methods", "mean", "--uptrain-steps", "0,1", "--out", out, "--json"]
    assert sweep(tiny, *base, "--variants", "gqa:2", "--keep", "none").exit_code == 0
    again = sweep(tiny, *base, "--variants", "gqa:2 mla:12", "--keep", "all")  # new jobs, and gqa-2's remade
    assert again.exit_code == 0, again.output
    result = json.loads(again.stdout)
    jobs, m = result["jobs"], next(r["method"] for r in result["rows"] if r["variant"] == "mla-12")
    remade = {"convert/gqa-2/mean", "uptrain/gqa-2/mean/1"} & set(jobs["computed"])
    assert remade and {f"convert/mla-12/{m}", f"uptrain/mla-12/{m}/1"} <= set(jobs["computed"]), jobs
    assert jobs["run"] == len(jobs["computed"]) and jobs["run"] + jobs["cached"] + jobs["skipped"] == len(
        jobs["seconds"]
    )


def test_source_weights_no_job_can_load_are_refused_before_any_job(tiny, tmp_path):
    # every row failed on a truncated file and the sweep exited 0, with a report
    src = tmp_path / "src"
    shutil.copytree(tiny["src"], src)
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    out = tmp_path / "out"
    result = runner.invoke(app, ["sweep", str(src), "--data", str(tiny["corpus"]), *FAST, "--out", str(out)])
    assert result.exit_code == 2 and "is not a readable safetensors file" in result.stderr, result.output
    assert not out.exists()
    # a tensor missing: the same, found on the headers (the rows failed one by one, exit 0)
    shutil.rmtree(src)
    shutil.copytree(tiny["src"], src)
    tensors = load_file(weights)
    gone = next(k for k in sorted(tensors) if k.endswith("v_proj.weight"))
    del tensors[gone]
    save_file(tensors, weights, metadata={"format": "pt"})
    result = runner.invoke(app, ["sweep", str(src), "--data", str(tiny["corpus"]), *FAST, "--out", str(out)])
    assert result.exit_code == 2 and f"do not match its config.json: missing {gone}\n" in result.stderr
    assert not out.exists()


def test_the_title_says_when_no_speed_was_measured():
    # a sweep whose timing jobs all failed titled its table "tok/s measured here at None tokens"
    from attnlab.sweep.report import title

    results = {"options": {"src": "m", "batch": 1, "context": 256}, "measured_context": None}
    assert "tok/s not measured (no timing job succeeded)" in title(results) and "None" not in title(results)
    assert "tok/s measured here at 128 tokens" in title(results | {"measured_context": 128})


def test_the_text_folders_a_killed_sweep_was_making_are_removed(tiny, tmp_path):
    # its temporaries had no process id in their names, so no later run could tell they were stale: kept for good
    from attnlab.sweep import plan

    root = tmp_path / "jobs"
    root.mkdir()
    folders = plan.prepare_data(tiny["corpus"], None, root)
    train = folders["train"]
    stale = root / f".{train.name}.tmp-999999999-0123abcd"  # a process that no longer runs
    stale.mkdir()
    (stale / "hamlet.txt").write_text("half")
    again = plan.prepare_data(tiny["corpus"], None, root)
    assert again == folders and not stale.exists()
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []


def test_timings_say_the_threads_they_ran_on_and_another_count_times_again(tiny, tmp_path):
    """A timing is keyed and reported by the threads torch runs on (OMP_NUM_THREADS, torch.set_num_threads), not by
    the cores the process may use: a sweep at 1 thread says 1, and a rerun at 2 times again rather than reusing the
    1-thread figures under the label of 2."""
    out, before = tmp_path / "threads", torch.get_num_threads()
    args = ("--variants", "gqa:2", "--uptrain-steps", "0", "--out", out, "--json")
    try:
        torch.set_num_threads(1)
        one = sweep(tiny, *args)
        torch.set_num_threads(2)
        two = sweep(tiny, *args)
    finally:
        torch.set_num_threads(before)
    assert one.exit_code == 0 and two.exit_code == 0, one.output + two.output
    one, two = json.loads(one.stdout), json.loads(two.stdout)
    assert one["machine"]["threads"] == 1 and two["machine"]["threads"] == 2
    assert sorted(n for n in two["jobs"]["computed"] if n.startswith("speed")) == [
        "speed/gqa-2",
        "speed/source",
    ]
    assert "eval/source" not in two["jobs"]["computed"]  # the losses do not depend on it: cached
    timed = sorted(json.loads(p.read_text())["result"]["threads"] for p in (out / "jobs").glob("speed*.json"))
    assert timed == [1, 1, 2, 2]  # source and gqa-2, each at 1 thread and at 2
    assert "(2 threads)" in (out / "report.md").read_text()


def test_a_timing_runs_on_the_threads_its_key_names_whoever_runs_it(tiny):
    """The studies plan with one torch thread (their workers') and give a lone timing all of the workers' threads
    through run_jobs: the key said 1 while it ran on 2. The count is the plan's (SweepOptions.timing_threads, else
    this process's), and the speed job runs on it whatever threads it was started with."""
    from attnlab.sweep.plan import timing_args

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        opts = SweepOptions(src=tiny["src"], data=tiny["corpus"])
        assert timing_args(opts)["threads"] == 1
        assert (
            timing_args(SweepOptions(src=tiny["src"], data=tiny["corpus"], timing_threads=2))["threads"] == 2
        )
        torch.set_num_threads(2)
        args = {"ckpt": str(tiny["src"]), "context": 8, "batch": 1, "steps": 2, "repeats": 1, "threads": 1}
        assert work.speed(args, {}, None)["threads"] == 1
        assert torch.get_num_threads() == 2  # given back
    finally:
        torch.set_num_threads(before)
