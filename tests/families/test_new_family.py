"""A family module plus a registry entry is all a new family needs (issue 30; docs/architecture.md, "A model
family"). The family below is defined here, in the test, as a family module defines one: its own config.json field
names, its own tensor names with fused QKV and gate/up tensors (named transforms), sliding-window layers in its own
pattern, its KV-head field and its MLA verdict. Registered, and with nothing else changed, every command takes it:
``save_model`` writes it, ``generate``, ``eval``, ``uptrain``, ``compare``, ``convert --kv-heads`` run on it,
``convert --to mla`` refuses it saying why, and ``attnlab families`` lists it. Oracle: the attnlab model it was
written from, and ``convert_model`` in memory for the conversion.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from test_llama import _tokenizer
from typer.testing import CliRunner

from attnlab import families
from attnlab.cli import app
from attnlab.config import AttentionConfig, ModelConfig
from attnlab.convert.model import convert_model
from attnlab.cost import kv_cache_bytes
from attnlab.families.base import GATE_UP_CONCAT, QKV_CONCAT, Family, Fields, MLASupport, Rule, TensorMap, put
from attnlab.hf import load_causal_lm, save_model
from attnlab.model import Transformer

# ---- the family, as its module in src/attnlab/families/ would hold it --------------------------------------------


def read(f: Fields) -> ModelConfig:
    """Every ``local_every``-th layer attends to the whole context; the others to the last ``window`` tokens."""
    n_layers, every = f.int("n_layer"), f.int("local_every", 2)
    attention = AttentionConfig(
        d_model=f.int("width"),
        n_heads=f.int("n_head"),
        n_kv_heads=f.int("n_kv_head"),
        rope_theta=f.float("theta"),
    )
    if f.raw.get("kv_shared_layers"):
        f.unsupported("kv_shared_layers", "cross-layer KV sharing")
    types = tuple("full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n_layers))
    return ModelConfig(
        vocab_size=f.int("vocab"),
        n_layers=n_layers,
        attention=attention,
        ffn_dim=f.int("ffn"),
        max_seq_len=f.int("max_len"),
        norm_eps=f.float("eps", 1e-5),
        tie_embeddings=f.bool("tied", False),
        sliding=attention.replace(window=f.int("window")),
        layer_types=types,
    )


def write(cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
    attn = cfg.attention
    hf = dict(base, model_type="toylm")
    for key, value in (("width", attn.d_model), ("n_head", attn.n_heads), ("n_kv_head", attn.n_kv_heads),
                       ("theta", attn.rope_theta), ("n_layer", cfg.n_layers), ("vocab", cfg.vocab_size),
                       ("ffn", cfg.ffn_dim), ("max_len", cfg.max_seq_len), ("window", cfg.sliding.window)):  # fmt: skip
        put(hf, key, value)
    put(hf, "eps", cfg.norm_eps, 1e-5)  # what a missing field means
    put(hf, "tied", cfg.tie_embeddings, False)
    return hf


TENSORS = TensorMap(
    (
        Rule(
            "blocks.{i}.attn.qkv.{p}",
            ("layers.{i}.attention.wq.{p}", "layers.{i}.attention.wk.{p}", "layers.{i}.attention.wv.{p}"),
            QKV_CONCAT,
        ),
        Rule("blocks.{i}.attn.out.{p}", ("layers.{i}.attention.wo.{p}",)),
        Rule(
            "blocks.{i}.mlp.gate_up.{p}",
            ("layers.{i}.feed_forward.w1.{p}", "layers.{i}.feed_forward.w3.{p}"),
            GATE_UP_CONCAT,
        ),
        Rule("blocks.{i}.mlp.down.{p}", ("layers.{i}.feed_forward.w2.{p}",)),
        Rule("blocks.{i}.ln1.{p}", ("layers.{i}.attention_norm.{p}",)),
        Rule("blocks.{i}.ln2.{p}", ("layers.{i}.ffn_norm.{p}",)),
        Rule("embed.{p}", ("tok_embeddings.{p}",)),
        Rule("ln_f.{p}", ("norm.{p}",)),
        Rule("head.{p}", ("output.{p}",)),
    ),
    "ToyLM",
)
EXAMPLE = dict(model_type="toylm", vocab=97, width=48, n_head=6, n_kv_head=2, theta=10000.0, n_layer=3, ffn=80,
               max_len=64, window=6)  # fmt: skip
TOYLM = Family(
    "toylm",
    ("toylm",),
    read,
    write,
    TENSORS,
    mla=lambda cfg: MLASupport("refused", f"sliding windows of {cfg.sliding.window} tokens"),
    covers="ToyLM (a family defined in a test)",
    example=EXAMPLE,
)

# ---- registered: its entry in REGISTERED, and nothing else --------------------------------------------------------


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(families, "REGISTERED", (*families.REGISTERED, TOYLM))
    monkeypatch.setitem(families.FAMILIES, "toylm", TOYLM)


@pytest.fixture
def checkpoint(registered, tmp_path) -> tuple[Transformer, Path]:
    model = Transformer(read(Fields(EXAMPLE, "toylm")))
    model.init_weights(std=0.3, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(mean=1.0, std=0.2)
    src = save_model(model.eval(), tmp_path / "src", "toylm", base_config=EXAMPLE)
    _tokenizer(src)  # the numbers 0..95, one token each
    return model, src


def run(*args) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args])


X = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))  # past the window of 6


@torch.no_grad()
def test_written_and_loaded_by_its_own_names_and_fused_tensors(checkpoint):
    model, src = checkpoint
    with safe_open(src / "model.safetensors", framework="pt") as f:
        assert f.get_slice("blocks.0.attn.qkv.weight").get_shape() == [48 + 2 * 2 * 8, 48]
        assert f.get_slice("blocks.2.mlp.gate_up.weight").get_shape() == [2 * 80, 48]
        assert all(k.split(".")[0] in ("blocks", "embed", "ln_f", "head") for k in f.keys())  # noqa: SIM118
    assert json.loads((src / "config.json").read_text()) == EXAMPLE
    loaded = load_causal_lm(src)
    assert [a.window for a in loaded.cfg.layer_attentions] == [6, None, 6]
    torch.testing.assert_close(loaded(X), model(X), rtol=0, atol=0)


def test_generate_eval_uptrain_and_compare_take_it(checkpoint, tmp_path):
    model, src = checkpoint
    rows = [X[0, :9].tolist(), X[1, :14].tolist()]  # two lengths: the paged cache, past the window
    prompts = [arg for row in rows for arg in ("--prompt", " ".join(map(str, row)))]
    result = run("generate", src, *prompts, "--max-new", 12, "--ignore-eos", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["cache"] == "paged"
    with torch.no_grad():  # greedy tokens = rerunning the whole sequence
        for row, got in zip(rows, out["outputs"], strict=True):
            tokens = list(row)
            for _ in range(12):
                tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
            assert got["tokens"] == tokens[len(row) :]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "numbers.txt").write_text(
        "\n".join(" ".join(str((i * j) % 96) for j in range(40)) for i in range(30))
    )
    result = run("eval", src, "--data", corpus, "--seq-len", 16, "--json")
    assert result.exit_code == 0, result.output
    result = run("uptrain", src, tmp_path / "up", "--data", corpus, "--steps", 2, "--seq-len", 16,
                 "--batch-size", 2, "--save-every", 0)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert load_causal_lm(tmp_path / "up").cfg == load_causal_lm(src).cfg
    result = run("compare", "--model", src / "config.json", "--seq-len", 40, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    native = next(r for r in doc["rows"] if r["native"])
    assert (
        native["kv_cache_bytes"] == 2 * 2 * 8 * 2 * (6 + 6 + 40) == kv_cache_bytes(model.cfg, 1, 40, "bf16")
    )
    assert (doc["sliding_layers"], doc["window"]) == (2, 6)


@torch.no_grad()
def test_convert_writes_it_at_fewer_kv_heads_and_refuses_mla_saying_why(checkpoint, tmp_path):
    model, src = checkpoint
    result = run("convert", src, tmp_path / "gqa", "--kv-heads", 1, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["layout"] == "gqa"
    written = json.loads((tmp_path / "gqa" / "config.json").read_text())
    assert written == EXAMPLE | {"n_kv_head": 1}  # its writer: the KV-head field, nothing else
    with safe_open(tmp_path / "gqa" / "model.safetensors", framework="pt") as f:
        assert f.get_slice("blocks.1.attn.qkv.weight").get_shape() == [48 + 2 * 8, 48]
    want = convert_model(model, 1, "mean")(X)
    torch.testing.assert_close(load_causal_lm(tmp_path / "gqa")(X), want, rtol=1e-5, atol=1e-5)
    result = run("convert", src, tmp_path / "mla", "--to", "mla", "--kv-lora-rank", 16)
    assert result.exit_code == 2 and "sliding windows of 6 tokens" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "mla").exists()


def test_an_unmodelled_field_is_refused_naming_it(checkpoint):
    _, src = checkpoint
    (src / "config.json").write_text(json.dumps(EXAMPLE | {"kv_shared_layers": 2}))
    result = run("eval", src, "--data", src / "config.json")
    assert (
        result.exit_code == 2
        and "kv_shared_layers=2 is not supported (cross-layer KV sharing)" in result.stderr
    )


def test_attnlab_families_lists_it(registered):
    rows = json.loads(run("families", "--json").stdout)
    row = next(r for r in rows if r["family"] == "toylm")
    assert [row[c]["text"] for c in ("import", "convert_gqa", "convert_mla", "generate", "compare")] == [
        "yes", "yes", "refused", "yes", "yes",
    ]  # fmt: skip
    assert "toylm" in run("families", "--markdown").stdout
