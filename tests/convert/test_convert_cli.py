"""``attnlab convert`` on real Hugging Face checkpoint directories: results, safety rules, error handling."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from typer.testing import CliRunner

from attnlab.cli import app
from attnlab.convert import convert_model
from attnlab.hf import convert_checkpoint, load_llama
from attnlab.hf.checkpoint import calibration_batches
from conftest import seeded

WORDS = [
    "the",
    "king",
    "queen",
    "lord",
    "lady",
    "good",
    "night",
    "day",
    "love",
    "death",
    "sword",
    "crown",
    "heart",
    "blood",
    "fair",
    "sweet",
]


def tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def make_checkpoint(path: Path, kind: str = "llama", sharded: bool = False, **overrides) -> Path:
    """A small random checkpoint, with a word-level tokenizer.json for calibration."""
    torch.manual_seed(seeded(0))
    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind]
    cfg = config_cls(
        **{
            "vocab_size": 32,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "max_position_embeddings": 64,
        }
        | overrides
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.2)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="40KB" if sharded else "5GB")
    vocab = {"[UNK]": 0} | {w: i + 1 for i, w in enumerate(WORDS)}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return path


def run(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def hf_logits(path: Path, x: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(x).logits


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory) -> Path:
    g = torch.Generator().manual_seed(seeded(1))
    lines = [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (12,), generator=g)) for _ in range(16)]
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def tokens() -> torch.Tensor:
    return torch.randint(0, 32, (2, 13), generator=torch.Generator().manual_seed(seeded(5)))


@pytest.mark.parametrize(
    "kind,method,sharded,overrides",
    [
        ("llama", "mean", True, {}),
        ("llama", "fit", False, {"attention_bias": True}),
        ("qwen2", "mean", False, {}),
        ("qwen2", "fit", False, {"num_key_value_heads": 4}),
        ("llama", "grouped-fit", False, {}),
    ],
)
def test_convert_matches_attnlab_and_loads_in_transformers(
    tmp_path, calib_file, kind, method, sharded, overrides
):
    src = make_checkpoint(tmp_path / "src", kind, sharded, **overrides)
    before = tree_hash(src)
    dst = tmp_path / "dst"
    args = ["convert", src, dst, "--kv-heads", 2, "--method", method, "--json"]
    result = run(*args, *(["--calib", calib_file] if method != "mean" else []))
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)  # stderr names the device of a fit
    assert summary["n_kv_heads_after"] == 2 and summary["kv_values_per_token_after"] == 2 * 2 * 2 * 8
    assert tree_hash(src) == before  # the source is never modified

    config = json.loads((dst / "config.json").read_text())
    assert config["num_key_value_heads"] == 2
    assert {k: v for k, v in config.items() if k != "num_key_value_heads"} == {
        k: v for k, v in json.loads((src / "config.json").read_text()).items() if k != "num_key_value_heads"
    }
    assert (dst / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert sorted(p.name for p in dst.iterdir()) == sorted([".attnlab", *(p.name for p in src.iterdir())])
    assert not list(tmp_path.glob(".dst.tmp-*"))  # the temporary directory was renamed, not left behind

    # The same conversion done in attnlab: its logits equal the transformers model loaded from dst.
    reference = load_llama(src)
    calib = calibration_batches(src, calib_file) if method != "mean" else None
    converted = convert_model(reference, 2, method, calib=calib)
    with torch.no_grad():
        x = tokens()
        torch.testing.assert_close(hf_logits(dst, x), converted(x), rtol=1e-5, atol=1e-5)

    # k/v projections rewritten (and q/o for "fit"); every other tensor copied bit for bit.
    old, new = {}, {}
    for f in src.glob("*.safetensors"):
        old |= load_file(f)
    for f in dst.glob("*.safetensors"):
        new |= load_file(f)
    assert set(old) == set(new)
    rewritten = ("k_proj", "v_proj") + (("q_proj", "o_proj") if method != "mean" else ())
    for key in old:
        if any(f".{name}." in key for name in rewritten):
            assert new[key].shape[0] == (16 if "k_proj" in key or "v_proj" in key else old[key].shape[0])
        else:
            assert torch.equal(old[key], new[key]) and old[key].dtype == new[key].dtype, key
    # rewritten: the tensors whose values the conversion changed (fit leaves o_proj's bias as it was)
    assert summary["tensors_rewritten"] == sum(1 for k in old if not torch.equal(old[k], new[k]))


def test_table_output_and_overwrite(tmp_path):
    src = make_checkpoint(tmp_path / "src")
    dst, mine = tmp_path / "dst", tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("old")
    before = tree_hash(src)
    assert run("convert", src, dst, "--kv-heads", 2).exit_code == 0
    refused = run("convert", src, dst, "--kv-heads", 4)
    assert refused.exit_code == 2 and "exists" in refused.output
    done = run("convert", src, dst, "--kv-heads", 4, "--overwrite")  # an earlier attnlab output: replaced
    assert done.exit_code == 0, done.output
    assert "n_kv_heads_after" in done.output
    assert json.loads((dst / "config.json").read_text())["num_key_value_heads"] == 4
    # Issue 29: a directory attnlab did not write is never replaced, --overwrite or not.
    kept = run("convert", src, mine, "--kv-heads", 4, "--overwrite")
    assert (
        kept.exit_code == 2
        and "without attnlab's .attnlab marker" in kept.output
        and (mine / "keep.txt").read_text() == "old"
    )
    assert tree_hash(src) == before


@pytest.mark.parametrize(
    "mutate,args,message",
    [
        (None, ["--kv-heads", 3], "--kv-heads 3"),
        (None, ["--kv-heads", 0], "--kv-heads 0"),
        (None, ["--kv-heads", 2, "--method", "median"], "--method"),
        (None, ["--kv-heads", 2, "--method", "fit"], "--calib"),
        (
            None,
            ["--kv-heads", 2, "--method", "fit", "--calib", "missing.txt"],
            "--calib missing.txt: calibration file not found",
        ),
        (None, ["--kv-heads", 2, "--method", "fit", "--calib", "/dev"], "--calib /dev is not a text file"),
        ("no_config", ["--kv-heads", 2], "config.json"),
        ("bad_json", ["--kv-heads", 2], "malformed"),
        ("gpt2", ["--kv-heads", 2], "unsupported model_type 'gpt2'"),
        # a family attnlab does not read: the list is what convert takes (it once named gpt2 and deepseek_v3)
        ("olmo", ["--kv-heads", 2], "model_type='olmo' is not supported; convert takes llama, mistral"),
        ("bin_only", ["--kv-heads", 2], "only safetensors"),
        ("missing_src", ["--kv-heads", 2], "not found"),
        ("dst_inside_src", ["--kv-heads", 2], "lies inside the source"),
    ],
)
def test_user_errors_exit_2_with_one_line_and_no_destination(tmp_path, mutate, args, message):
    src = make_checkpoint(tmp_path / "src")
    if mutate == "no_config":
        (src / "config.json").unlink()
    elif mutate == "bad_json":
        (src / "config.json").write_text("{not json")
    elif mutate == "gpt2":
        cfg = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps(cfg | {"model_type": "gpt2"}))
    elif mutate == "olmo":
        cfg = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps(cfg | {"model_type": "olmo"}))
    elif mutate == "bin_only":
        (src / "model.safetensors").rename(src / "pytorch_model.bin")
    elif mutate == "missing_src":
        src = tmp_path / "nowhere"
    before = tree_hash(src) if src.exists() else None
    dst = src / "dst" if mutate == "dst_inside_src" else tmp_path / "dst"
    result = run("convert", src, dst, *args)
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnlab: error:") and message in lines[0], result.output
    assert not dst.exists() and not list(tmp_path.glob(".dst.*")) and not list(tmp_path.glob("*/.dst.*"))
    if before is not None:
        assert tree_hash(src) == before


def test_padded_calibration_equals_one_sequence_at_a_time(tmp_path, calib_file):
    # Right padding cannot change what a causal decoder computes at the real tokens.
    from attnlab.convert import attention_inputs

    src = make_checkpoint(tmp_path / "src")
    model = load_llama(src)
    batches = calibration_batches(src, calib_file, batch_size=5)
    assert len(batches) == 4 and batches[0][1].shape[0] == 5
    singles = [
        ids[mask.bool()][None] for b_ids, b_mask in batches for ids, mask in zip(b_ids, b_mask, strict=True)
    ]
    torch.testing.assert_close(attention_inputs(model, 1, batches), attention_inputs(model, 1, singles))


def test_calibration_lines_are_cut_at_the_models_positions(tmp_path, calib_file):
    """Calibration lines were cut at 128 tokens whatever the model's max_position_embeddings, so a short-context
    model was calibrated past the positions it was made for."""
    src = make_checkpoint(tmp_path / "src", max_position_embeddings=8)
    longest = max(ids.shape[1] for ids, _ in calibration_batches(src, calib_file))
    assert longest == 12  # twelve words a line
    assert max(ids.shape[1] for ids, _ in calibration_batches(src, calib_file, max_positions=8)) == 8
    with pytest.raises(TypeError, match=r"n_kv_heads .* must be an int, got '2'"):
        convert_checkpoint(
            src, tmp_path / "dst", "2"
        )  # once: '--kv-heads 2 must be a positive divisor of ... 8'


# --- issue 8: nothing lost, no traceback, no silent corruption ------------------------------------------


def one_line_error(result, *fragments: str) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnlab: error:"), result.output
    assert all(f in lines[0] for f in fragments), lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "relation", ["equal", "dst contains src", "dst inside src", "symlink to src", "symlink to parent", "dot"]
)
def test_overwrite_never_touches_the_source(tmp_path, monkeypatch, relation):
    # Issue 8: `convert work/src work --overwrite` deleted the source and exited 0; with `.` it crashed.
    work = tmp_path / "work"
    src = make_checkpoint(work / "src")
    (tmp_path / "link").symlink_to(src if relation == "symlink to src" else work)
    before, everything = tree_hash(src), tree_hash(tmp_path)
    monkeypatch.chdir(tmp_path if relation != "dot" else work)
    dst = {
        "equal": "work/src",
        "dst contains src": "work",
        "dst inside src": "work/src/out",
        "symlink to src": "link",
        "symlink to parent": "link",
        "dot": ".",
    }[relation]
    source = "work/src" if relation != "dot" else "src"
    one_line_error(run("convert", source, dst, "--kv-heads", 2, "--overwrite"), "the source")
    assert tree_hash(src) == before and tree_hash(tmp_path) == everything


@pytest.mark.parametrize(
    "to", [["--kv-heads", 2, "--method", "fit"], ["--to", "mla", "--kv-lora-rank", 8, "--rope-dim", 4]]
)
def test_overwrite_never_replaces_a_destination_holding_the_calibration_file(tmp_path, calib_file, to):
    # Issue 29: --calib is an input like SRC; `convert src prev --calib prev/calib.txt --overwrite` (prev an earlier
    # output) replaced prev and deleted the calibration file with it, exit 0.
    src = make_checkpoint(tmp_path / "src")
    assert run("convert", src, tmp_path / "prev", "--kv-heads", 4).exit_code == 0
    (tmp_path / "prev" / "calib.txt").write_bytes(calib_file.read_bytes())
    everything = tree_hash(tmp_path)
    result = run(
        "convert", src, tmp_path / "prev", *to, "--calib", tmp_path / "prev" / "calib.txt", "--overwrite"
    )
    one_line_error(result, "contains the source", "calib.txt")
    assert tree_hash(tmp_path) == everything


def test_weight_files_the_conversion_did_not_write_are_left_out_and_named(tmp_path):
    # Issue 8: a pytorch_model.bin beside model.safetensors was copied into the GQA destination.
    src = make_checkpoint(tmp_path / "src")
    stale = ["pytorch_model.bin", "pytorch_model.bin.index.json", "consolidated.safetensors", "model.gguf",
             "onnx/model.onnx", "flax_model.msgpack", "tf_model.h5", "old.pt", "old.pth", ".cache/huggingface/x",
             "uptrain.json", "uptrain_log.jsonl"]  # fmt: skip
    # the last two: an uptrained source's records of its training, which do not describe the converted model
    for name in stale:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(b"old weights")
    (src / "onnx" / "README.md").write_text("kept")
    (src / "onnx" / "uptrain.json").write_text("kept: not an attnlab record where it lies")
    result = run("convert", src, tmp_path / "dst", "--kv-heads", 2, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    expected = sorted({n if not n.startswith(".cache") else ".cache/" for n in stale})
    assert sorted(summary["files_left_out"]) == expected
    assert "left out of the destination" in result.stderr and "pytorch_model.bin" in result.stderr
    kept = sorted(str(p.relative_to(tmp_path / "dst")) for p in (tmp_path / "dst").rglob("*") if p.is_file())
    assert kept == [
        ".attnlab",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "onnx/README.md",
        "onnx/uptrain.json",
        "tokenizer.json",
    ]


def test_the_weight_files_keep_their_metadata_and_the_index_its_own(tmp_path):
    """Each rewritten safetensors file came out with {"format": "pt"} alone (a license, an origin dropped), and the
    index lost everything but total_size (transformers writes total_parameters). total_size is the written
    tensors'; total_parameters, counted by transformers' rules (a tied head once, no buffers), is the source's moved
    by what the conversion removed: it kept the source's, 4096 too many for a phi3 of 4 KV heads converted to 2."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    src = make_checkpoint(tmp_path / "src", sharded=True)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    for shard in set(index["weight_map"].values()):
        save_file(
            load_file(src / shard), src / shard, metadata={"format": "pt", "license": "mine", "origin": shard}
        )
    index["metadata"]["total_parameters"] = 12345
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert run("convert", src, tmp_path / "dst", "--kv-heads", 2).exit_code == 0
    written = json.loads((tmp_path / "dst" / "model.safetensors.index.json").read_text())
    tensors, before = {}, {}
    for shard in set(written["weight_map"].values()):
        tensors |= load_file(tmp_path / "dst" / shard)
    for shard in set(index["weight_map"].values()):
        before |= load_file(src / shard)
    removed = sum(t.numel() for t in before.values()) - sum(t.numel() for t in tensors.values())
    assert removed > 0 and written["metadata"]["total_parameters"] == 12345 - removed
    assert written["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert written["metadata"]["total_size"] < index["metadata"]["total_size"]  # fewer KV heads, fewer bytes
    for shard in set(written["weight_map"].values()):
        with safe_open(tmp_path / "dst" / shard, "pt") as f:
            assert f.metadata() == {"format": "pt", "license": "mine", "origin": shard}


def test_a_single_weights_file_is_read_before_a_stale_index_as_transformers_reads_it(tmp_path):
    """transformers' save_pretrained over a sharded save leaves the old index behind; transformers reads
    model.safetensors first, and attnlab read the index (refusing its missing shards, or reading stale ones)."""
    from attnlab.hf import load_causal_lm

    src = make_checkpoint(tmp_path / "src", sharded=True)
    stale = json.loads((src / "model.safetensors.index.json").read_text())
    for shard in set(stale["weight_map"].values()):
        (src / shard).unlink()
    make_checkpoint(tmp_path / "single")
    (tmp_path / "single" / "model.safetensors").rename(src / "model.safetensors")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    tokens = torch.arange(12)[None] % 32
    with torch.no_grad():
        torch.testing.assert_close(load_causal_lm(src)(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)
    result = run("convert", src, tmp_path / "dst", "--kv-heads", 2, "--json")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "dst").glob("model*")) == ["model.safetensors"]


def test_linked_directories_are_not_followed_and_a_broken_link_is_refused_naming_it(tmp_path):
    """A directory link inside SRC was followed: an outside tree was copied into DST, a link to SRC itself or its
    parent ended in errors naming DST. A broken link failed at the end, naming DST instead of the link."""
    src = make_checkpoint(tmp_path / "src")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "big.txt").write_text("not the model's")
    (src / "ext").symlink_to(tmp_path / "outside")
    (src / "self").symlink_to(".")
    (src / "up").symlink_to("..")
    result = run("convert", src, tmp_path / "dst", "--kv-heads", 2, "--json")
    assert result.exit_code == 0, result.output
    assert {"ext/", "self/", "up/"} <= set(json.loads(result.stdout)["files_left_out"])
    assert not any((tmp_path / "dst" / name).exists() for name in ("ext", "self", "up"))
    (src / "README.md").symlink_to(tmp_path / "gone.md")
    before = tree_hash(tmp_path)
    for to in (["--kv-heads", 2], ["--to", "mla", "--kv-lora-rank", 8]):
        one_line_error(run("convert", src, tmp_path / "dst2", *to), "src/README.md: a broken symbolic link")
    assert tree_hash(tmp_path) == before


@pytest.mark.parametrize("damage", ["truncated", "empty", "header", "shape", "nan", "bad_index"])
def test_damaged_checkpoints_exit_2_with_one_line(tmp_path, damage):
    # Issue 8: a truncated, empty or corrupt model.safetensors ended in a traceback.
    from safetensors.torch import save_file

    src = make_checkpoint(tmp_path / "src", sharded=damage == "bad_index")
    weights = src / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "empty":
        weights.write_bytes(b"")
    elif damage == "header":
        data = bytearray(weights.read_bytes())
        data[8:40] = b"\xff" * 32
        weights.write_bytes(bytes(data))
    elif damage in ("shape", "nan"):
        tensors = load_file(weights)
        key = "model.layers.0.self_attn.k_proj.weight"
        tensors[key] = tensors[key][:, :10].contiguous() if damage == "shape" else tensors[key] * float("nan")
        save_file(tensors, weights)
    else:
        (src / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"a": "../../etc/passwd"}})
        )
    before = tree_hash(src)
    fragment = {"truncated": "not a readable safetensors file", "empty": "not a readable safetensors file",
                "header": "not a readable safetensors file", "shape": "do not match config.json",
                "nan": "NaN or inf", "bad_index": "not a file name"}[damage]  # fmt: skip
    one_line_error(run("convert", src, tmp_path / "dst", "--kv-heads", 2), fragment)
    assert tree_hash(src) == before and not (tmp_path / "dst").exists()


def test_calib_is_refused_where_the_method_ignores_it(tmp_path, calib_file):
    # Issue 8: --calib was silently ignored by mean/first/random, even when the file did not exist.
    src = make_checkpoint(tmp_path / "src")
    for calib in (calib_file, tmp_path / "missing.txt"):
        one_line_error(
            run("convert", src, tmp_path / "dst", "--kv-heads", 2, "--calib", calib), "--calib", "mean"
        )
    assert not (tmp_path / "dst").exists()


def test_missing_package_names_the_pip_line(tmp_path, calib_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # what a quickstart install without it looked like
    src = make_checkpoint(tmp_path / "src")
    result = run("convert", src, tmp_path / "dst", "--kv-heads", 2, "--method", "fit", "--calib", calib_file)
    one_line_error(result, "'tokenizers'", "pip install 'tokenizers")


def test_converted_files_get_the_umask_modes(tmp_path):
    # Issue 8: converted checkpoints were written 0700/0600 whatever the umask.
    src = make_checkpoint(tmp_path / "src")
    before = os.umask(0o002)
    try:
        assert run("convert", src, tmp_path / "dst", "--kv-heads", 2).exit_code == 0
    finally:
        os.umask(before)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [tmp_path / "dst", *(tmp_path / "dst").iterdir()]}
    assert modes == {"dst": 0o775} | {p.name: 0o664 for p in (tmp_path / "dst").iterdir()}


def cli(*args, cwd: Path, fsize: int | None = None, script: str | None = None, signal: str = ""):
    """``attnlab`` in a subprocess, optionally with writes limited to ``fsize`` bytes (a full disk)."""

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    code = script or "from attnlab.cli import main; main()"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          preexec_fn=limit if fsize else None, env=os.environ | {"SIGNAL": signal})  # fmt: skip


def test_full_disk_during_convert_is_one_line_and_leaves_nothing(tmp_path):
    # Issue 8: a full disk during convert was a traceback. RLIMIT_FSIZE fails writes past 100 kB like one.
    src = make_checkpoint(tmp_path / "src")
    before = tree_hash(src)
    for overwrite in ([], ["--overwrite"]):
        proc = cli("convert", "src", "dst", "--kv-heads", 2, *overwrite, cwd=tmp_path, fsize=100_000)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines() == [
            "attnlab: error: dst: File too large (nothing was written; any previous version is unchanged)"
        ]
        assert sorted(p.name for p in tmp_path.iterdir()) == (["dst", "src"] if overwrite else ["src"])
        if not overwrite:  # a previous version, which the failed --overwrite must leave as it was
            assert run("convert", src, tmp_path / "dst", "--kv-heads", 4).exit_code == 0
            old = tree_hash(tmp_path / "dst")
    assert tree_hash(tmp_path / "dst") == old and tree_hash(src) == before


KILLED_CONVERT = """
import os, signal, sys
from attnlab.hf import io
real = io.write_config
def die(*args, **kwargs):
    real(*args, **kwargs)
    os.kill(os.getpid(), getattr(signal, os.environ["SIGNAL"]))  # mid-write: the weights are in the temporary
io.write_config = die
sys.argv = ["attnlab", *sys.argv[1:]]
from attnlab.cli import main
main()
"""


def test_convert_killed_mid_write_then_a_successful_run_leaves_no_temporary(tmp_path):
    # Issue 8: a conversion killed while writing left a hidden .DST.tmp-* of the checkpoint's size forever.
    src = make_checkpoint(tmp_path / "src")
    before = tree_hash(src)
    killed = cli(
        "convert", "src", "dst", "--kv-heads", 2, cwd=tmp_path, script=KILLED_CONVERT, signal="SIGKILL"
    )
    assert killed.returncode == -9
    (leftover,) = [p for p in tmp_path.iterdir() if p.name.startswith(".dst.tmp-")]
    assert (leftover / "model.safetensors").stat().st_size > 100_000
    done = cli("convert", "src", "dst", "--kv-heads", 2, "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"] and tree_hash(src) == before


def test_convert_terminated_mid_write_cleans_up_itself(tmp_path):
    # SIGTERM (kill, timeout, a scheduler) unwinds like Ctrl-C: the temporary goes at once, not on the next run.
    make_checkpoint(tmp_path / "src")
    stopped = cli(
        "convert", "src", "dst", "--kv-heads", 2, cwd=tmp_path, script=KILLED_CONVERT, signal="SIGTERM"
    )
    assert stopped.returncode == 128 + 15 and "Traceback" not in stopped.stderr, stopped.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_tensors_are_written_in_the_layout_of_the_config_written_beside_them(tmp_path, monkeypatch):
    """A family whose tensor layout follows a config field (ChatGLM's fused QKV follows multi_query_attention) is
    written by the tensor map of the converted config.json, which the writer may have changed, not the source's."""
    from attnlab import families
    from attnlab.families import llama

    asked = []

    def tensors(hf: dict):
        asked.append(hf["num_key_value_heads"])
        return llama.TENSORS

    mine = families.Family("layoutlike", ("layoutlike",), llama.read, llama.write, tensors)
    monkeypatch.setitem(families.FAMILIES, "layoutlike", mine)
    src = make_checkpoint(tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg | {"model_type": "layoutlike"}))
    result = run("convert", src, tmp_path / "dst", "--kv-heads", "2")
    assert result.exit_code == 0, result.output
    assert asked[-1] == 2  # the written config's map made the tensors (the source's, 8, loaded them)
    assert json.loads((tmp_path / "dst" / "config.json").read_text())["num_key_value_heads"] == 2


@pytest.mark.parametrize("to", ["gqa", "mla"])
def test_convert_holds_the_destination_from_start_to_end(tmp_path, monkeypatch, to):
    """A second writer of DST is refused while the conversion computes, not only while it writes: two converts
    into one DST once both ran, and with --overwrite the later finisher replaced the other's result."""
    import threading

    from attnlab.atomic import Busy, lock
    from attnlab.hf import checkpoint, mla_checkpoint

    src, dst = make_checkpoint(tmp_path / "src"), tmp_path / "dst"
    module, name = (checkpoint, "convert_model") if to == "gqa" else (mla_checkpoint, "convert_model_to_mla")
    real, seen = getattr(module, name), []

    def converting(*args, **kwargs):  # another writer of DST, from another thread (the lock is per thread)
        def second_writer():
            try:
                with lock(dst):
                    seen.append("taken")
            except Busy as err:
                seen.append(str(err))

        writer = threading.Thread(target=second_writer)
        writer.start()
        writer.join()
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, converting)
    args = ["--kv-heads", "1"] if to == "gqa" else ["--to", "mla", "--kv-lora-rank", "16"]
    result = run("convert", src, dst, *args)
    assert result.exit_code == 0, result.output
    assert len(seen) == 1 and "is being written by another attnlab process" in seen[0], seen
    assert (dst / "config.json").is_file() and not (tmp_path / ".dst.lock").exists()


def test_calibration_shorter_than_a_head_is_refused_naming_the_file(tmp_path):
    # 3 tokens for heads of 8 dims: each head's error weight was singular, and "fit" gave maps thousands of
    # times the source's weights (worse than "mean"); now refused before anything is converted or written.
    src = make_checkpoint(tmp_path / "src")
    short = tmp_path / "short.txt"
    short.write_text("the king night\n")
    before = tree_hash(src)
    for method in ("fit", "grouped-fit"):
        result = run("convert", src, tmp_path / "dst", "--kv-heads", 2, "--method", method, "--calib", short)
        assert result.exit_code == 2, result.output
        line = result.output.strip()
        assert f"--calib {short} gives 3 tokens; --method {method} needs at least head_dim=8" in line, line
        assert not (tmp_path / "dst").exists()
    assert tree_hash(src) == before
    # the library says so too, for a caller of mha_to_gqa
    model = load_llama(src)
    with pytest.raises(ValueError, match=r"calibration has 3 token rows, fewer than 8 \(head_dim\)"):
        convert_model(model, 2, "fit", calib=[torch.tensor([[1, 2, 3]])])


def test_a_float64_source_is_converted_in_float64(tmp_path):
    src = make_checkpoint(tmp_path / "src", torch_dtype="float64")
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64)
    model.save_pretrained(src)
    assert run("convert", src, tmp_path / "dst", "--kv-heads", 2).exit_code == 0
    key = "model.layers.0.self_attn.k_proj.weight"
    k, new = load_file(src / "model.safetensors")[key], load_file(tmp_path / "dst" / "model.safetensors")[key]
    assert k.dtype == new.dtype == torch.float64
    # the group mean taken in float64: it was taken in float32 (1e-8 off)
    assert torch.equal(new, k.view(2, 4, 8, 64).mean(1).reshape(16, 64))


def test_a_conversion_to_the_sources_heads_reports_no_calibration(tmp_path, calib_file):
    src = make_checkpoint(tmp_path / "src", num_key_value_heads=2)
    result = run(
        "convert", src, tmp_path / "dst", "--kv-heads", 2, "--method", "fit", "--calib", calib_file, "--json"
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["calibration_sequences"] == 0
    assert (
        load_file(tmp_path / "dst" / "model.safetensors").keys()
        == load_file(src / "model.safetensors").keys()
    )


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_side_file_that_is_no_regular_file_is_refused_before_any_work(tmp_path, kind):
    # a link to /dev/zero among SRC's files was copied for ever (329 MB in 12 s, filling the disk); a FIFO was met
    # at the final write, after the work
    src = make_checkpoint(tmp_path / "src")
    side = src / "notes.txt"
    if kind == "fifo":
        os.mkfifo(side)
    else:
        side.symlink_to("/dev/zero")
    result = run("convert", src, tmp_path / "dst", "--kv-heads", 2)
    assert result.exit_code == 2 and f"{side}: not a regular file" in result.output, result.output
    assert not (tmp_path / "dst").exists() and not list(tmp_path.glob(".dst*"))


def test_source_mistakes_are_named_before_the_destination(tmp_path):
    # with DST present, a missing SRC and an impossible --kv-heads were both reported as "destination exists":
    # a user fixed that, reran, and only then learned of the mistake in the input
    src = make_checkpoint(tmp_path / "src")
    (tmp_path / "dst").mkdir()
    for args, says in (
        (
            ["convert", tmp_path / "nowhere", tmp_path / "dst", "--kv-heads", 2],
            "checkpoint directory not found",
        ),
        (["convert", src, tmp_path / "dst", "--kv-heads", 0], "--kv-heads 0 must be a positive divisor"),
        (["convert", src, tmp_path / "dst", "--kv-heads", 3], "--kv-heads 3 must be a positive divisor"),
        (["convert", src, tmp_path / "dst", "--kv-heads", 2, "--method", "bogus"], "--method must be one of"),
        (
            ["convert", src, tmp_path / "dst", "--to", "mla", "--kv-lora-rank", 100_000],
            "--kv-lora-rank must be",
        ),
        (
            ["convert", src, tmp_path / "dst", "--to", "mla", "--kv-lora-rank", 8, "--rope-dim", 7],
            "must be even",
        ),
        # the calibration file and the device too (a helper found them after DST)
        (
            [
                "convert",
                src,
                tmp_path / "dst",
                "--kv-heads",
                2,
                "--method",
                "fit",
                "--calib",
                tmp_path / "no.txt",
            ],
            "calibration file not found",
        ),
        (
            ["convert", src, tmp_path / "dst", "--to", "mla", "--kv-lora-rank", 8, "--calib", tmp_path],
            "is not a text file",
        ),
        (["convert", src, tmp_path / "dst", "--kv-heads", 2, "--device", "bogus"], "--device must be"),
        (["convert", src, tmp_path / "dst", "--kv-heads", 2], "destination exists"),
    ):
        one_line_error(run(*map(str, args)), says)
    assert os.listdir(tmp_path / "dst") == []
