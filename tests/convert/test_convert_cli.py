"""``attnlab convert`` on real Hugging Face checkpoint directories: results, safety rules, error handling."""

from __future__ import annotations

import hashlib
import json
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
from attnlab.hf import load_llama
from attnlab.hf.checkpoint import calibration_batches

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
    torch.manual_seed(0)
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
    g = torch.Generator().manual_seed(1)
    lines = [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (12,), generator=g)) for _ in range(16)]
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


X = torch.randint(0, 32, (2, 13), generator=torch.Generator().manual_seed(5))


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
    summary = json.loads(result.output)
    assert summary["n_kv_heads_after"] == 2 and summary["kv_values_per_token_after"] == 2 * 2 * 2 * 8
    assert tree_hash(src) == before  # the source is never modified

    config = json.loads((dst / "config.json").read_text())
    assert config["num_key_value_heads"] == 2
    assert {k: v for k, v in config.items() if k != "num_key_value_heads"} == {
        k: v for k, v in json.loads((src / "config.json").read_text()).items() if k != "num_key_value_heads"
    }
    assert (dst / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert sorted(p.name for p in dst.iterdir()) == sorted(p.name for p in src.iterdir())
    assert not list(tmp_path.glob(".dst.tmp-*"))  # the temporary directory was renamed, not left behind

    # The same conversion done in attnlab: its logits equal the transformers model loaded from dst.
    reference = load_llama(src)
    calib = calibration_batches(src, calib_file) if method != "mean" else None
    converted = convert_model(reference, 2, method, calib=calib)
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(dst, X), converted(X), rtol=1e-5, atol=1e-5)

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
    assert summary["tensors_rewritten"] == sum(1 for k in old if any(f".{n}." in k for n in rewritten))


def test_table_output_and_overwrite(tmp_path):
    src = make_checkpoint(tmp_path / "src")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("old")
    refused = run("convert", src, dst, "--kv-heads", 4)
    assert refused.exit_code == 2 and "exists" in refused.output and (dst / "keep.txt").exists()
    done = run("convert", src, dst, "--kv-heads", 4, "--overwrite")
    assert done.exit_code == 0, done.output
    assert "n_kv_heads_after" in done.output and not (dst / "keep.txt").exists()
    assert json.loads((dst / "config.json").read_text())["num_key_value_heads"] == 4


@pytest.mark.parametrize(
    "mutate,args,message",
    [
        (None, ["--kv-heads", 3], "--kv-heads 3"),
        (None, ["--kv-heads", 0], "--kv-heads 0"),
        (None, ["--kv-heads", 2, "--method", "median"], "--method"),
        (None, ["--kv-heads", 2, "--method", "fit"], "--calib"),
        ("no_config", ["--kv-heads", 2], "config.json"),
        ("bad_json", ["--kv-heads", 2], "malformed"),
        ("gpt2", ["--kv-heads", 2], "unsupported model_type 'gpt2'"),
        ("bin_only", ["--kv-heads", 2], "only safetensors"),
        ("missing_src", ["--kv-heads", 2], "not found"),
        ("dst_inside_src", ["--kv-heads", 2], "outside the source"),
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
