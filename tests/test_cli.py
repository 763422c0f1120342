"""What a new user meets on every command: help without ``<bool>``, one rule for ``--plot``, tables that never cut
a figure, one hardware measurement per run, and one-line errors for sizes, a full disk and missing packages."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import resource
import signal
import subprocess
import sys

import pytest
from rich.console import Console
from typer.testing import CliRunner

from attnlab.bench.compare import compare_table
from attnlab.cli import app
from attnlab.console import Grid, column_widths, print_grid
from attnlab.cost import compare, get_preset
from attnlab.cost.hardware import Hardware

runner = CliRunner()
COMMANDS = [["compare"], ["convert"], ["bench", "decode"], ["bench"], []]


def one_line_error(result, *fragments: str) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnlab: error:"), result.stderr
    assert all(f in lines[0] for f in fragments), lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "command",
    [*COMMANDS, ["sweep"], ["uptrain"], ["eval"], ["generate"]],
    ids=lambda c: " ".join(c) or "attnlab",
)
def test_flags_show_no_bool_metavar(command):
    result = runner.invoke(app, [*command, "--help"])
    assert result.exit_code == 0 and "--help" in result.stdout
    assert "<bool>" not in result.stdout
    usage = next(line for line in result.stdout.splitlines() if "Usage:" in line)
    assert "[]" not in usage  # sweep's extra variants read "[]..."
    if command == ["convert"]:
        assert "--overwrite" in result.stdout and "<int>" in result.stdout  # values keep their type


@pytest.mark.parametrize("width", [60, 80, 100, 120, 200])
@pytest.mark.parametrize("model", ["llama-2-7b", "deepseek-v3", "llama-3.1-405b"])
def test_compare_table_never_cuts_a_figure(model, width):
    # Issue 8: at 80 columns the table printed "524,2…".
    comparison = compare(get_preset(model), seq_len=131072, batch=64)
    grid = compare_table(comparison)
    console = Console(width=width, record=True, force_terminal=True, file=open("/dev/null", "w"))  # noqa: SIM115
    print_grid(grid, console)
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= width
    words = " ".join(text.split())
    for row in grid.rows:  # every figure is printed whole (a cell may wrap only between its words)
        for cell in row:
            for word in cell.split():
                assert word in words, (word, width)
    if width >= 80:  # a table down to 80 columns; below what its longest words need, one line per variant
        assert column_widths(grid, width) is not None


def test_piped_tables_are_never_squeezed(tmp_path):
    grid = Grid("t", ["name", "value"], [["a" * 150, "1,234,567"]])
    out = tmp_path / "out.txt"
    with out.open("w") as f:
        print_grid(grid, Console(file=f, width=80))
    assert "a" * 150 in out.read_text() and "1,234,567" in out.read_text()


def test_plot_rule_is_the_same_for_compare_and_bench(tmp_path, monkeypatch):
    # Issue 8: bench --plot wrote PNG bytes to x.jpg (and made directories) while compare --plot refused both.
    monkeypatch.chdir(tmp_path)
    tiny_bench = ["bench", "decode", "--kv-heads", "1", "--context", "16", "--repeats", "1", "--no-layer",
                  "--no-mla", "--no-paged", "--cached-hardware", "--json"]  # fmt: skip
    for command in (["compare", "--json"], tiny_bench):
        one_line_error(runner.invoke(app, [*command, "--plot", "out/x.jpg"]), "ending in .png", "out/x.jpg")
        assert not (tmp_path / "out").exists()  # refused before any work or any directory
        done = runner.invoke(app, [*command, "--plot", f"new/dir/{command[0]}.png"])
        assert done.exit_code == 0, done.output
        assert (tmp_path / "new" / "dir" / f"{command[0]}.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_never_plots_into_the_checkpoint_it_reads(tmp_path):
    """`compare --model DIR --plot DIR/x.png` wrote the figure into the checkpoint (which every later convert of it
    would then copy); the write rule refuses a destination inside an input."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
         "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 100}
    ))  # fmt: skip
    for plot in (ckpt / "x.png", ckpt / "sub" / "x.png"):
        one_line_error(
            runner.invoke(app, ["compare", "--model", str(ckpt), "--plot", str(plot)]), "lies inside"
        )
    assert sorted(p.name for p in ckpt.rglob("*")) == ["config.json"]
    done = runner.invoke(app, ["compare", "--model", str(ckpt), "--plot", str(tmp_path / "x.png")])
    assert done.exit_code == 0, done.output


def test_compare_refuses_before_measuring_and_a_refused_run_prints_one_line(monkeypatch):
    """--measure --dtype fp64 measured this machine for 15 s, then failed (no float64 rate is measured here); a
    --tp that does not divide the heads printed a note about the default --seq-len before its error."""

    def no_measuring(*, fresh=False):
        raise AssertionError("measured before refusing")

    monkeypatch.setattr("attnlab.bench.compare.measure_local", no_measuring)
    for args, fragment in [
        (["--measure", "--dtype", "fp64"], "--measure runs in fp32, bf16, fp16; got --dtype 'fp64'"),
        (["--hardware", "local", "--dtype", "fp64"], "--hardware local has no float64 peak"),
        (["--tp", "5"], "--tp 5 must divide"),  # gpt2's 1024 positions < the default --seq-len: no note first
        (["--dtype", "fp64", "--hardware", "l40s"], "no float64 peak"),
    ]:
        one_line_error(runner.invoke(app, ["compare", "--model", "gpt2", *args]), fragment)


def test_compare_prints_a_tiny_models_step_in_microseconds():
    """A small config.json's decode steps all printed as 0.000 ms, beside a sentence saying one was faster."""
    result = runner.invoke(app, ["compare", "--model", "gpt2", "--seq-len", "64", "--hardware", "h100"])
    text = " ".join(result.stdout.split())
    assert result.exit_code == 0 and "µs per decode step" in text and "0.000 ms" not in text
    from attnlab.cost.sweep import format_seconds

    assert (format_seconds(1.37e-7), format_seconds(4.586e-3), format_seconds(2.5)) == (
        "0.137 µs",
        "4.586 ms",
        "2.50 s",
    )


def test_compare_local_measures_the_machine_once(monkeypatch):
    # Issue 8: --hardware local --measure used this boot's cached bandwidth in one table and a fresh one in the
    # other. Now one measurement serves both.
    calls = []
    fake = Hardware("local", {"fp32": 1e11, "bf16": 1e11, "fp16": 1e11}, 7e9, 16 * 2**30, "test")

    def measure_local(*, fresh=False):
        calls.append(fresh)
        return fake

    monkeypatch.setattr("attnlab.bench.compare.measure_local", measure_local)
    monkeypatch.setattr("attnlab.bench.layer.measure_local", measure_local)
    args = [
        "compare",
        "--model",
        "gpt2",
        "--seq-len",
        "64",
        "--hardware",
        "local",
        "--measure",
        "--dtype",
        "fp32",
    ]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert calls == [True]
    doc = json.loads(result.stdout)
    native = next(r for r in doc["rows"] if r["native"])
    assert native["decode_step_bytes"] / native["decode_step_seconds"] == pytest.approx(7e9)
    assert doc["local_hardware"].startswith("bandwidth 7.00 GB/s")
    # the rates as numbers (the string was all, and only with --measure)
    assert doc["local_rates"]["bandwidth_bytes_per_s"] == 7e9
    plain = json.loads(runner.invoke(app, [*args[:-3], "--dtype", "fp32", "--json"]).stdout)
    assert "--measure" not in args[:-3] and plain["local_rates"]["bandwidth_bytes_per_s"] == 7e9
    assert result.stderr == ""  # the timing bar left a blank line on a pipe


def test_bench_sizes_that_cannot_be_allocated_are_one_line():
    # Issue 8: --context 1000000000 was a RuntimeError trying to allocate 32 TB.
    line = one_line_error(
        runner.invoke(app, ["bench", "decode", "--context", "1000000000"]), "GiB", "--context"
    )
    assert re.search(r"needs about [\d,.]+ GiB", line)


def test_allocation_failures_and_missing_packages_are_one_line(monkeypatch):
    def oom(**kwargs):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: 9 TB"
        )

    monkeypatch.setattr("attnlab.bench.compare.run_compare", oom)
    one_line_error(runner.invoke(app, ["compare"]), "out of memory")

    def missing(**kwargs):
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    monkeypatch.setattr("attnlab.bench.compare.run_compare", missing)
    one_line_error(runner.invoke(app, ["compare"]), "pip install 'matplotlib>=3.7'")

    def bug(**kwargs):
        raise RuntimeError("a bug")  # not the user's doing: it must stay visible, not become a polite exit 2

    monkeypatch.setattr("attnlab.bench.compare.run_compare", bug)
    assert runner.invoke(app, ["compare"]).exit_code == 1


def test_full_disk_during_compare_plot_is_one_line(tmp_path):
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))  # writes past 20 kB fail like a full disk

    code = "from attnlab.cli import main; main()"
    proc = subprocess.run([sys.executable, "-c", code, "compare", "--plot", "x.png"], cwd=tmp_path,
                          capture_output=True, text=True, preexec_fn=limit)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "attnlab: error: x.png: File too large (nothing was written; any previous version is unchanged)"
    ]
    assert list(tmp_path.iterdir()) == []


def test_version_and_help_do_not_import_torch():
    # Issue 29: no --version; --help took 3 s because the package imported torch for it.
    code = (
        "import sys\nfrom attnlab.cli import app\nfrom typer.testing import CliRunner\n"
        "for args in (['--help'], ['--version'], ['uptrain', '--help'], ['convert', '--help']):\n"
        "    r = CliRunner().invoke(app, args)\n    assert r.exit_code == 0, r.output\n"
        "    print(r.output.splitlines()[0])\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and lines[-1] == "False", proc.stdout + proc.stderr
    assert lines[1] == f"attnlab {importlib.metadata.version('attnlab')}"
    import attnlab

    assert attnlab.AttentionConfig(d_model=8, n_heads=2).head_dim == 4  # the public names still load on use


def test_progress_prints_periodic_lines_when_not_a_terminal():
    from io import StringIO

    from rich.console import Console

    from attnlab.console import Progress

    out = StringIO()
    with Progress("converting", 4, fields=("loss",), every=0, console=Console(file=out)) as bar:
        for i in range(1, 5):
            bar.update(i, loss=f"{1 / i:.2f}")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("attnlab: converting: 1/4 (25%), loss 1.00, ")
    assert lines[-1].startswith("attnlab: converting: 4/4 (100%), loss 0.25, ") and len(lines) == 5
    quiet = StringIO()
    with Progress("converting", 4, every=3600, console=Console(file=quiet)) as bar:
        bar.update(4)
    assert quiet.getvalue() == ""  # short work prints nothing (an error stays one line)


def test_convert_progress_reaches_a_log_file(tmp_path):
    # Issue 29: convert's bars vanished when output was not a terminal: a 15-minute conversion printed nothing.
    import transformers

    small = dict(
        vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4
    )
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small))
    model.save_pretrained(tmp_path / "src")
    proc = subprocess.run(
        [sys.executable, "-m", "attnlab", "convert", "src", "dst", "--kv-heads", "2"], cwd=tmp_path,
        capture_output=True, text=True, env=os.environ | {"ATTNLAB_PROGRESS_SECONDS": "0"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "attnlab: converting layers (mean): 2/2 (100%)" in proc.stderr


@pytest.mark.parametrize("rank", ["0", "1"])
def test_an_error_of_one_rank_alone_is_still_said_by_that_rank(rank, monkeypatch, capsys):
    """Under torchrun, rank 0 reports the errors every rank meets alike, and the others wait to be stopped. A rank
    that outlives the wait met its error alone (a --data missing on its machine): it once exited 2 without a word."""
    import typer

    from attnlab import cli

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(cli, "_QUIET_RANK_WAIT_S", 0.0)
    with pytest.raises(typer.Exit) as done:
        cli._fail(FileNotFoundError("--data corpus/ not found"))
    assert done.value.exit_code == 2
    said = "attnlab: error: " if rank == "0" else "attnlab: error (rank 1): "
    assert capsys.readouterr().err == f"{said}--data corpus/ not found\n"


@pytest.mark.parametrize("command", [["compare"], ["bench", "decode"], ["eval"]], ids=" ".join)
def test_a_flag_given_a_value_points_at_its_commands_help(command):
    # the parser's own error carries no context: it pointed at "attnlab --help"
    one_line_error(runner.invoke(app, [*command, "--json=1"]), f"(see 'attnlab {' '.join(command)} --help')")


@pytest.mark.parametrize(
    ("words", "says"),
    [
        (["compare"], " (nothing half-written is left)\n"),
        (
            ["uptrain", "src", "dst", "--data", "x"],
            " (nothing half-written is left); rerun it with --resume to continue",
        ),
    ],
)
@pytest.mark.parametrize(
    ("stop", "code", "how"), [("ctrl-c", 130, "interrupted"), ("sigterm", 143, "terminated")]
)
def test_ctrl_c_and_sigterm_stop_with_one_line(monkeypatch, words, says, stop, code, how):
    # Typer turned Ctrl-C into exit code 130 and printed nothing at all; SIGTERM (kill, timeout, a job scheduler)
    # still said nothing, though an uptrain it stopped can be resumed
    from attnlab.cli import _terminate

    def interrupted(*args, **kwargs):
        if stop == "sigterm":
            _terminate(signal.SIGTERM, None)  # what main() installs for SIGTERM
        raise KeyboardInterrupt

    monkeypatch.setattr("attnlab.bench.compare.run_compare", interrupted)
    monkeypatch.setattr("attnlab.train.options.UptrainOptions", interrupted)
    result = runner.invoke(app, words)
    assert result.exit_code == code and f"attnlab: {how}{says}" in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("words", "says"),
    [
        (["eval", "ck", "--data", ""], "--data '' is empty (see 'attnlab eval --help')"),
        (["eval", "ck", "--data="], "--data '' is empty"),
        (
            ["convert", "", "dst", "--kv-heads", "2"],
            "an argument is '' (empty) (see 'attnlab convert --help')",
        ),
        (["convert", "src", "dst", "--kv-heads", "2", "--method", ""], "--method '' is empty"),
        (["bench", "decode", "--kv-heads", ""], "--kv-heads '' is empty (see 'attnlab bench decode --help')"),
    ],
)
def test_an_empty_value_is_refused_by_name(words, says, tmp_path, monkeypatch):
    # an empty path is the current directory to pathlib: `eval --data ''` scored every .txt file under it (exit 0),
    # `convert '' dst` said dst "lies inside the source ."; `--method ''` converted with the default method
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("a file an empty --data would have read\n")
    one_line_error(runner.invoke(app, words), says)
    assert os.listdir(tmp_path) == ["notes.txt"]


@pytest.mark.parametrize(
    "words",
    [
        ["generate", "nowhere", "--prompt=2+2=", "--max-new", "2"],
        ["generate", "nowhere", "--prompt", "x", "--stop=="],
        ["generate", "nowhere", "--prompt", "--help="],
        ["generate", "nowhere", "--prompt", "=", "--stop", "="],
        ["eval", "--data", "x", "--", "--data="],  # after "--", a checkpoint named --data=
    ],
)
def test_values_that_end_in_an_equals_sign_are_values(words):
    # the empty-value check took '--prompt=2+2=' for an empty '--prompt=2+2', and '--help=' given to --prompt for
    # an empty --help: words are read as the parser reads them now
    line = one_line_error(runner.invoke(app, words), "checkpoint directory not found: ")
    assert line.endswith(("nowhere", "--data=")) and "is empty" not in line


def test_a_path_of_spaces_is_quoted_in_its_message(tmp_path, monkeypatch):
    # "--data not found" and "checkpoint directory not found: " hid the path they could not find
    from attnlab.data import text_files

    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"^--data ' ' not found$"):
        text_files(" ")
    one_line_error(runner.invoke(app, ["eval", " ", "--data", "x"]), "checkpoint directory not found: ' '")
    one_line_error(
        runner.invoke(app, ["eval", "ck ", "--data", "x"]), "checkpoint directory not found: 'ck '"
    )
    assert one_line_error(runner.invoke(app, ["eval", "a b", "--data", "x"])).endswith("not found: a b")
