"""Every command driven with generated arguments and files: it exits 0 or 2, never with a traceback, with one line
on stderr when it fails, and it never changes its inputs or leaves a temporary behind.

The commands are a table (``COMMANDS``: convert, compare, bench decode; ``WRITERS``: uptrain, and eval and
generate, which must write nothing): an entry draws one invocation (arguments, and files in a fresh directory).
A new command is covered by adding its entry. Every command is held to the write rule of ``attnlab.atomic`` over
the whole sandbox: every file is hashed before and after, and only what the command owns may change (``owned``:
DST and the run directory, a --plot file, when they were absent or attnlab's own).
``ATTNLAB_FUZZ_EXAMPLES`` raises the number of examples per command (default 30) for a longer hunt.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from typer.testing import CliRunner

from attnlab.cli import app
from attnlab.cost.presets import HF_CONFIGS

EXAMPLES = int(os.environ.get("ATTNLAB_FUZZ_EXAMPLES", "30"))
WORDS = ["the", "king", "queen", "lord", "lady", "good", "night", "day", "love", "death"]


def build_checkpoint(path: Path, kind: str) -> Path:
    torch.manual_seed(0)
    small = dict(
        vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4
    )
    if kind == "bert":
        model = transformers.BertModel(transformers.BertConfig(**small, max_position_embeddings=32))
    else:
        cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind]
        cfg = cls(**small, num_key_value_heads=4 if kind == "llama" else 2, max_position_embeddings=32)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(path, safe_serialization=True)
    tok = Tokenizer(WordLevel({"[UNK]": 0} | {w: i + 1 for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {kind: build_checkpoint(root / kind, kind) for kind in ("llama", "qwen2", "bert")}


# ------------------------------------------------------------------------------------------- generated files

ODD_VALUES = st.one_of(
    st.integers(-3, 70),
    st.sampled_from([0, 2**31, 2**63, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.none(),
    st.booleans(),
    st.lists(st.integers(0, 3), max_size=2),
)
CONFIG_FIELDS = [
    "model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "head_dim",
    "intermediate_size", "vocab_size", "rope_theta", "tie_word_embeddings", "max_position_embeddings",
    "attention_bias", "kv_lora_rank", "qk_rope_head_dim", "n_routed_experts", "kv_channels", "n_head", "n_embd",
]  # fmt: skip


def odd_config(draw, base: dict) -> dict | str:
    """``base`` with a few fields removed or given odd values, or not JSON at all."""
    kind = draw(st.sampled_from(["fields", "fields", "fields", "not json", "not an object", "empty"]))
    if kind == "not json":
        return draw(st.sampled_from(["{not json", "", "\xff\xfe", "[1, 2"]))
    if kind == "not an object":
        return json.dumps(draw(st.sampled_from([[1], 3, "x", None])))
    if kind == "empty":
        return "{}"
    cfg = dict(base)
    for name in draw(st.lists(st.sampled_from(CONFIG_FIELDS), max_size=3, unique=True)):
        if draw(st.booleans()):
            cfg.pop(name, None)
        else:
            value = draw(ODD_VALUES)
            cfg[name] = (
                draw(st.sampled_from(["llama", "bert", "gpt2", "deepseek_v2", "t5"]))
                if name == ("model_type")
                else value
            )
    return json.dumps(cfg)


def damage_weights(draw, ckpt: Path) -> None:
    """Leave ``model.safetensors`` alone or damage it the ways files get damaged."""
    path = ckpt / "model.safetensors"
    how = draw(st.sampled_from(["none", "none", "truncate", "empty", "bytes", "delete", "shape", "dtype", "nan",
                                "missing tensor", "extra tensor", "directory", "bin beside"]))  # fmt: skip
    if how == "truncate":
        path.write_bytes(path.read_bytes()[: draw(st.integers(0, path.stat().st_size - 1))])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "bytes":
        data = bytearray(path.read_bytes())
        for _ in range(draw(st.integers(1, 8))):
            data[draw(st.integers(0, min(len(data) - 1, 600)))] = draw(st.integers(0, 255))
        path.write_bytes(bytes(data))
    elif how == "delete":
        path.unlink()
    elif how == "directory":
        path.unlink()
        path.mkdir()
    elif how == "bin beside":
        shutil.copy(path, ckpt / "pytorch_model.bin")
    elif how != "none":
        tensors = load_file(path)
        key = draw(st.sampled_from(sorted(tensors)))
        if how == "shape":
            tensors[key] = tensors[key].flatten()[: max(1, tensors[key].numel() // 2)].clone()
        elif how == "dtype":
            tensors[key] = tensors[key].to(
                draw(st.sampled_from([torch.int32, torch.bfloat16, torch.float64]))
            )
        elif how == "nan":
            tensors[key] = tensors[key] * float("nan")
        elif how == "missing tensor":
            del tensors[key]
        else:
            tensors["model.extra.weight"] = torch.ones(3)
        save_file(tensors, path)


# ------------------------------------------------------------------------------------- one entry per command


def draw_convert(draw, work: Path, checkpoints: dict[str, Path]) -> tuple[list[str], list[Path]]:
    kind = draw(st.sampled_from(sorted(checkpoints)))
    src = work / "src"
    shutil.copytree(checkpoints[kind], src)
    if draw(st.booleans()):
        base = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(odd_config(draw, base))
    damage_weights(draw, src)
    if draw(st.integers(0, 5)) == 0:
        (src / "tokenizer.json").write_text(draw(st.sampled_from(["", "{}", "not json"])))
    args = ["convert", "src"]
    dst = draw(
        st.sampled_from(
            ["dst", "dst", "out/deeper/dst", "src", "src/inside", ".", "existing", "afile", "prev"]
        )
    )
    (work / "existing").mkdir()
    (work / "existing" / "keep.txt").write_text("keep")
    (work / "afile").write_text("a file")
    earlier_output(work, checkpoints["llama"])
    args.append(dst)
    to = draw(st.sampled_from([None, None, "gqa", "mla", "mla", "mqa"]))
    if to is not None:
        args += ["--to", to]
    if to != "mla" or draw(st.integers(0, 4)) == 0:  # --to mla with GQA's options must be refused
        args += ["--kv-heads", draw(st.one_of(st.integers(-1, 9), st.sampled_from(["x", "1.5", ""])))]
        method = draw(st.sampled_from(["mean", "first", "random", "fit", "grouped-fit", "median", None]))
        if method is not None:
            args += ["--method", method]
    if to == "mla" or draw(st.integers(0, 6)) == 0:
        if draw(st.integers(0, 5)):
            args += ["--kv-lora-rank", draw(st.one_of(st.integers(-1, 40), st.sampled_from(["x", "8.0"])))]
        if draw(st.booleans()):
            args += ["--rope-dim", draw(st.one_of(st.integers(-1, 10), st.sampled_from(["x"])))]
        if draw(st.integers(0, 3)) == 0:
            args += [
                "--planes",
                draw(st.sampled_from(["norm", "error", "first", "uniform", "2", "0", "low"])),
            ]
    calib = draw(
        st.sampled_from(
            [
                None,
                "calib.txt",
                "calib.txt",
                "missing.txt",
                "binary.txt",
                "empty.txt",
                "src",
                "prev/calib.txt",
            ]
        )
    )
    (work / "calib.txt").write_text("\n".join(" ".join(WORDS[i:] + WORDS[:i]) for i in range(6)))
    shutil.copyfile(work / "calib.txt", work / "prev" / "calib.txt")  # an input inside an earlier output
    (work / "binary.txt").write_bytes(b"\xff\xfe\x00\x81" * 10)
    (work / "empty.txt").write_text("\n\n")
    if calib is not None:
        args += ["--calib", calib]
    args += draw(st.sampled_from([[], ["--overwrite"], ["--json"], ["--overwrite", "--json"]]))
    return args, [src, work / "calib.txt", work / "existing" if "--overwrite" not in args else None]


def draw_compare(draw, work: Path, checkpoints: dict[str, Path]) -> tuple[list[str], list[Path]]:
    args = ["compare"]
    model = draw(st.sampled_from(["preset", "config", "config", "dir", "nonsense", None]))
    if model == "preset":
        args += ["--model", draw(st.sampled_from([*HF_CONFIGS, "llama-2", "LLAMA-2-7B", ""]))]
    elif model in ("config", "dir"):
        base = HF_CONFIGS[draw(st.sampled_from(sorted(HF_CONFIGS)))]
        (work / "model").mkdir()
        (work / "model" / "config.json").write_text(odd_config(draw, base))
        args += ["--model", "model" if model == "dir" else "model/config.json"]
    elif model == "nonsense":
        args += ["--model", draw(st.sampled_from(["nowhere/config.json", "/", "x.json", "/dev/null"]))]
    sizes = st.one_of(
        st.integers(-2, 5000), st.sampled_from([2**40, 2**41, 10**30]), st.sampled_from(["x", "1e3"])
    )
    for flag in ("--seq-len", "--batch", "--devices", "--tp"):
        if draw(st.booleans()):
            args += [flag, str(draw(sizes))]
    if draw(st.booleans()):
        args += [
            "--dtype",
            draw(st.sampled_from(["fp32", "bf16", "fp8", "int4", "fp6", "fp5", "float16", ""])),
        ]
    if draw(st.booleans()):
        args += ["--hardware", draw(st.sampled_from(["h100", "a100-80gb", "rtx4090", "local", "tpu"]))]
    (work / "afile").write_text("x")
    plot = draw(st.sampled_from([None, None, "p.png", "new/dir/p.png", "p.jpg", "afile/p.png", ".", "P.PNG"]))
    if plot is not None:
        args += ["--plot", plot]
    if draw(st.booleans()):
        args.append("--json")
    return args, [work / "model", work / "afile"]


def draw_bench_decode(draw, work: Path, checkpoints: dict[str, Path]) -> tuple[list[str], list[Path]]:
    # Runs that would time for real are kept tiny: no whole layer, no MLA, no end to end, this boot's
    # hardware measurement, contexts up to 64 unless the sizes are meant to be refused.
    args = ["bench", "decode", "--no-layer", "--no-mla", "--cached-hardware", "--repeats"]
    args.append(str(draw(st.integers(-1, 2))))
    args += ["--kv-heads", draw(st.sampled_from(["32,8,1", "1", "3", "0", "x", "", "8,,4", "-8", "64"]))]
    args += ["--context", draw(st.sampled_from(["16", "64,32", "0", "1", "1000000000", "x", "4096,16,"]))]
    args += ["--batch", draw(st.sampled_from(["1", "2", "0", "100000000", "1.5"]))]
    args += ["--dtype", draw(st.sampled_from(["fp32", "bf16", "fp32,bf16", "fp16", "", "FP32"]))]
    args += draw(st.sampled_from([["--no-paged"], ["--paged"]]))
    (work / "afile").write_text("x")
    plot = draw(st.sampled_from([None, "b.png", "x/b.png", "b.jpg", "afile/b.png"]))
    if plot is not None:
        args += ["--plot", plot]
    if draw(st.booleans()):
        args.append("--json")
    return args, [work / "afile"]


Draw = Callable[..., tuple[list[str], list[Path | None]]]
COMMANDS: dict[str, Draw] = {
    "convert": draw_convert,
    "compare": draw_compare,
    "bench decode": draw_bench_decode,
}


# ---------------------------------------------------------------------------------------------- the property


def snapshot(paths: list[Path | None]) -> dict[str, str]:
    out = {}
    for root in paths:
        if root is None or not root.exists():
            continue
        for f in sorted([root] if root.is_file() else root.rglob("*")):
            if f.is_file():
                out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def every_file(root: Path) -> dict[str, str]:
    return {
        str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(root.rglob("*"))
        if f.is_file() and not f.is_symlink()
    }


def owned(work: Path, args: list[str]) -> list[str]:
    """What the command may write (names, directories ending in "/"): DST of a convert or an uptrain, the run
    directory of an uptrain, where they were absent or attnlab's output of that kind; a --plot file that was absent
    or attnlab's picture."""
    from attnlab.atomic import is_own_file, marker_kind

    places = []
    if args[0] in ("convert", "uptrain") and len(args) > 2:
        places.append((args[2], "checkpoint"))
    if args[0] == "uptrain":
        places.append((args[args.index("--run-dir") + 1] if "--run-dir" in args else args[2] + ".run", "run"))
    mine = []
    for path, kind in places:
        target = work / path
        if not (target.exists() or target.is_symlink()) or marker_kind(target) == kind:
            mine.append(path.rstrip("/") + "/")
    if "--plot" in args:
        plot = args[args.index("--plot") + 1]
        if not ((work / plot).exists() or (work / plot).is_symlink()) or is_own_file(work / plot):
            mine.append(plot)
    return mine


def changed_outside(before: dict[str, str], after: dict[str, str], mine: list[str]) -> list[str]:
    """The files (hashes ``before`` and ``after``) that changed, appeared or went, outside what the command owns."""
    return sorted(
        n
        for n in set(before) | set(after)
        if not any(n.startswith(m) for m in mine) and before.get(n) != after.get(n)
    )


def leftovers(work: Path) -> list[Path]:
    """Temporaries and lock files left in the sandbox."""
    return [p for p in work.rglob(".*") if re.search(r"\.(tmp|old)-|\.lock$", p.name)]


def run_in(work: Path, args: list[str]):
    """``attnlab ARGS`` run in ``work``: it exits 0 or 2, never with a traceback, and with one line when it fails.
    Returns the result and the invocation as shown in a failure."""
    cwd = os.getcwd()
    os.chdir(work)
    try:
        result = CliRunner().invoke(app, args)
    finally:
        os.chdir(cwd)
    shown = f"attnlab {' '.join(args)}\n{result.output}"
    event(f"exit {result.exit_code}")
    assert result.exit_code in (0, 2), shown
    assert result.exception is None or isinstance(result.exception, SystemExit), shown
    assert "Traceback" not in result.output, shown
    if result.exit_code == 2:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("attnlab: error: "), shown
    return result, shown


@pytest.mark.parametrize("command", list(COMMANDS))
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_command_exits_0_or_2_and_never_changes_its_inputs(command, data, checkpoints):
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        args, inputs = COMMANDS[command](data.draw, work, checkpoints)
        args = [str(a) for a in args]
        before, everything, mine = snapshot(inputs), every_file(work), owned(work, args)
        _, shown = run_in(work, args)
        assert snapshot(inputs) == before, shown
        assert changed_outside(everything, every_file(work), mine) == [], shown
        assert leftovers(work) == [], shown


# ------------------------------------------------------------------ the write rule over the whole sandbox

CORPUS = ["the king and the queen", "good night lord", "love and death the day", "the lady of the night"]


def sandbox(work: Path, checkpoints: dict[str, Path], draw) -> None:
    """A user's directory: a causal-LM checkpoint, a corpus, a directory and a file of their own, an earlier
    attnlab output (``prev``), and now and then a damaged checkpoint."""
    shutil.copytree(checkpoints[draw(st.sampled_from(["llama", "qwen2"]))], work / "src")
    damage = draw(st.sampled_from(["none"] * 7 + ["config", "weights", "tokenizer"]))
    if damage == "config":
        (work / "src" / "config.json").write_text(
            odd_config(draw, json.loads((work / "src" / "config.json").read_text()))
        )
    elif damage == "weights":
        damage_weights(draw, work / "src")
    elif damage == "tokenizer":
        (work / "src" / "tokenizer.json").write_text(
            draw(st.sampled_from(["", "{}", "not json", '{1: "x"}']))
        )
    (work / "corpus").mkdir()
    for i in range(3):
        (work / "corpus" / f"work{i}.txt").write_text(" ".join(CORPUS[i:] + CORPUS[:i]) * 20)
    (work / "heldout.txt").write_text(" ".join(CORPUS) * 10)
    (work / "existing").mkdir()
    (work / "existing" / "keep.txt").write_text("keep")
    (work / "afile").write_text("a file")
    earlier_output(work, work / "src")


def earlier_output(work: Path, like: Path) -> None:
    """``prev``: what an earlier convert or uptrain left (a copy of ``like``'s files), attnlab's and replaceable."""
    from attnlab.atomic import atomic_dir

    with atomic_dir(work / "prev") as tmp:
        for f in like.iterdir():
            if f.is_file():
                shutil.copyfile(f, tmp / f.name)


def often(draw, usual, *others):
    """``usual`` three times in four, else one of ``others``."""
    return usual if draw(st.integers(0, 3)) else draw(st.sampled_from(others))


PLACES = ("out/deeper/dst", "src", "src/inside", ".", "existing", "afile", "prev", "corpus", "corpus/inside",
          "heldout.txt")  # fmt: skip


def draw_uptrain(draw, work: Path, checkpoints: dict[str, Path]) -> list[str]:
    sandbox(work, checkpoints, draw)
    dst = often(draw, "dst", *PLACES)
    args = ["uptrain", "src", dst, "--data", often(draw, "corpus", "heldout.txt", "missing", "afile", "src")]
    if draw(st.booleans()):
        args += ["--run-dir", often(draw, "run", *PLACES, "dst", "prev.run")]
    if draw(st.integers(0, 3)) == 0:
        args += ["--eval-data", often(draw, "heldout.txt", "corpus", "src", "missing")]
    if draw(st.integers(0, 4)) == 0:
        args += ["--teacher", often(draw, "src", "prev", "existing")]
    args += ["--steps", str(draw(st.integers(1, 2))), "--seq-len", often(draw, "8", "16", "500"),
             "--batch-size", often(draw, "2", "1", str(10**9)), "--save-every", str(draw(st.integers(0, 1))),
             "--lr", often(draw, "1e-3", "inf", "0", "1e6")]  # fmt: skip
    args += draw(
        st.sampled_from([[], [], ["--overwrite"], ["--resume"], ["--json"], ["--overwrite", "--json"]])
    )
    return args


def draw_eval(draw, work: Path, checkpoints: dict[str, Path]) -> list[str]:
    sandbox(work, checkpoints, draw)
    args = ["eval", often(draw, "src", "prev", "existing", "missing", "afile")]
    args += ["--data", often(draw, "corpus", "heldout.txt", "afile", "missing", "src")]
    if draw(st.booleans()):
        args += ["--seq-len", often(draw, "8", "0", "4", str(10**6))]
    if draw(st.booleans()):
        args += ["--batch-size", often(draw, "3", "0", "1", str(10**9))]
    return args + draw(st.sampled_from([[], ["--json"]]))


def draw_generate(draw, work: Path, checkpoints: dict[str, Path]) -> list[str]:
    sandbox(work, checkpoints, draw)
    args = ["generate", often(draw, "src", "prev", "existing", "missing")]
    for _ in range(often(draw, 1, 0, 2)):
        args += ["--prompt", often(draw, "the king", "good night lord", "", "zzz")]
    args += ["--max-new", often(draw, "3", "0", "1", "40")]
    sampling = draw(
        st.lists(st.sampled_from(["--temperature", "--top-k", "--top-p"]), max_size=2, unique=True)
    )
    values = {"--temperature": ["0", "0.8", "-1"], "--top-k": ["0", "2"], "--top-p": ["0.5", "2"]}
    for flag in sampling:
        args += [flag, draw(st.sampled_from(values[flag]))]
    return args + draw(st.sampled_from([[], ["--json"]]))


WRITERS: dict[str, Callable[..., list[str]]] = {
    "uptrain": draw_uptrain,
    "eval": draw_eval,
    "generate": draw_generate,
}


@pytest.mark.parametrize("command", list(WRITERS))
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_writing_commands_change_nothing_but_what_they_own(command, data, checkpoints):
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        args = [str(a) for a in WRITERS[command](data.draw, work, checkpoints)]
        before = every_file(work)
        mine = owned(work, args)
        result, shown = run_in(work, args)
        assert changed_outside(before, every_file(work), mine) == [], shown
        assert leftovers(work) == [], shown
        if command == "uptrain" and result.exit_code == 0:
            from attnlab.atomic import marker_kind

            assert marker_kind(work / args[2]) == "checkpoint", shown
