"""Every cell of docs/families.md (``attnlab.bench.families``), run: for each registered family, a checkpoint of
its example config with random weights (built by transformers where the family has a class, else written by
attnlab), then the command behind each cell. A cell that says the command works: exit 0, and what it wrote loads in
the family's transformers class with attnlab's logits. A cell that says it does not: exit 2, one line, nothing
written. And docs/families.md is what ``attnlab families --markdown`` prints.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from attnlab.bench.families import COLUMNS, example_config, loads, markdown, support
from attnlab.cli import app
from attnlab.data import shakespeare, train_byte_bpe
from attnlab.families import REGISTERED, Family
from attnlab.hf import load_causal_lm
from attnlab.hf.bert import load_bert
from attnlab.hf.causal_lm import check_causal_lm, save_model
from attnlab.model import Transformer
from attnlab.parallel import check_shardable

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = {fam.name: fam for fam in REGISTERED}


def run(*args) -> object:
    return CliRunner().invoke(app, [str(a) for a in args])


def refused(result, dst: Path | None = None) -> None:
    """Exit 2 with one line on stderr, and nothing written at ``dst``."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert dst is None or not dst.exists()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    plays = sorted(shakespeare().glob("*.txt"))[:2]
    for play in plays:
        (root / play.name).write_text(play.read_text()[:6000])
    return root


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return train_byte_bpe([p.read_text() for p in sorted(corpus.glob("*.txt"))], 300)


def _randomize(model: torch.nn.Module) -> None:
    """Weights away from their init (norm gains and biases too), so that a misplaced one shows in the logits."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(mean=0.0 if "bias" in name else float(p.mean()), std=0.2)
            else:
                p.normal_(std=0.08)


def build(fam: Family, path: Path, tokenizer) -> Path:
    """A checkpoint of ``fam``'s example config with random weights, and the tokenizer."""
    if fam.architectures:  # transformers' own class writes it: what a user downloads
        cfg = transformers.AutoConfig.for_model(**fam.example)
        auto = transformers.AutoModelForCausalLM if fam.causal_lm else transformers.AutoModel
        model = auto.from_config(cfg).eval()
        _randomize(model)
        model.save_pretrained(path)
    elif loads(fam):  # no transformers class (ChatGLM): attnlab writes the family's own layout
        model = Transformer(example_config(fam))
        _randomize(model)
        save_model(model, path, fam.model_types[0], base_config=fam.example)
    else:  # read for the cost model only: a config.json is all there is to read
        path.mkdir(parents=True)
        (path / "config.json").write_text(json.dumps(fam.example))
    tokenizer.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, tokenizer) -> tuple[Family, Path]:
    fam = FAMILIES[request.param]
    return fam, build(fam, tmp_path_factory.mktemp(fam.name) / "src", tokenizer)


TOKENS = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def same_logits(path: Path, cls: str) -> None:
    """attnlab's logits of the checkpoint at ``path`` equal those of transformers' ``cls``."""
    theirs = getattr(transformers, cls).from_pretrained(path).eval()
    torch.testing.assert_close(
        load_causal_lm(path)(TOKENS), theirs(TOKENS).logits.float(), rtol=1e-4, atol=1e-4
    )


def test_every_family_has_an_example_and_a_row():
    for fam in REGISTERED:
        assert fam.example is not None and fam.covers, fam.name
        assert fam.example["model_type"] in fam.model_types
        assert set(support(fam)) == set(COLUMNS)


def test_the_docs_page_is_the_registrys():
    """docs/families.md is regenerated with ``attnlab families --markdown > docs/families.md``."""
    assert (ROOT / "docs" / "families.md").read_text() == markdown()
    result = run("families", "--markdown")
    assert result.exit_code == 0 and result.stdout == markdown()


def test_families_command_prints_a_row_per_family_and_json():
    result = run("families")
    assert result.exit_code == 0
    assert all(fam.name in result.stdout for fam in REGISTERED)
    rows = json.loads(run("families", "--json").stdout)
    assert [r["family"] for r in rows] == [fam.name for fam in REGISTERED]
    assert rows[0]["convert_mla"]["text"] == support(REGISTERED[0])["convert MLA"].text
    # keys as the other commands' JSON names them (they were the table's headers, "convert GQA")
    assert all(re.fullmatch(r"[a-z_]+", key) for row in rows for key in row)
    refused(run("families", "--json", "--markdown"))


def test_import(family, tmp_path):
    fam, src = family
    cell = support(fam)["import"]
    if cell.text == "yes":
        if fam.architectures:
            same_logits(src, fam.architectures[fam.model_types[0]])
        else:  # written by attnlab in the family's layout: read back as the example's model
            assert load_causal_lm(src).cfg.attention == example_config(fam).attention
    elif cell.text == "convert only":
        encoder, _ = load_bert(src)
        assert encoder.cfg.attention.n_heads == fam.example["num_attention_heads"]
        (tmp_path / "text.txt").write_text("To be, or not to be, that is the question.\n" * 20)
        refused(run("eval", src, "--data", tmp_path / "text.txt", "--seq-len", 8))
        refused(run("generate", src, "--prompt", "To be", "--max-new", "2"))
    else:
        refused(run("generate", src, "--prompt", "To be", "--max-new", "2"))


def test_the_header_check_finds_what_the_load_finds(family, tmp_path):
    # `attnlab sweep` checks SRC before its jobs load it: a checkpoint missing one tensor failed every row, exit 0
    fam, src = family
    if support(fam)["import"].text != "yes":
        return
    check_causal_lm(src)  # a checkpoint the load takes passes
    weights = sorted(src.glob("*.safetensors"))
    assert len(weights) == 1
    tensors = load_file(weights[0])
    for cut in ("missing", "misshapen"):
        broken = tmp_path / cut
        shutil.copytree(src, broken)
        changed = dict(tensors)
        key = next(k for k in sorted(changed) if ("attn" in k or "attention" in k) and changed[k].ndim == 2)
        if cut == "missing":
            del changed[key]
        else:
            changed[key] = changed[key][:-1]
        save_file(changed, broken / weights[0].name, metadata={"format": "pt"})
        with pytest.raises(ValueError) as loaded:
            load_causal_lm(broken)
        with pytest.raises(ValueError) as checked:
            check_causal_lm(broken)
        # the same message, but for torch's own words inside a transform's error (meta tensors word it their way)
        assert str(checked.value).split(" (")[0] == str(loaded.value).split(" (")[0], cut


def test_convert_gqa(family, tmp_path):
    fam, src = family
    cell, dst = support(fam)["convert GQA"], tmp_path / "gqa"
    n_kv = example_config(fam).attention.n_kv_heads if cell.ok else 1
    result = run("convert", src, dst, "--kv-heads", 1, "--json")
    if not cell.ok:
        refused(result, dst)
        return
    assert n_kv > 1, "an example with fewer KV heads to lose"
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["layout"] == ("gqa" if cell.text == "yes" else "mha (repeated K/V heads)"), summary
    if fam.causal_lm:
        # the MHA layout with repeated heads is read back as the GQA model it computes
        assert load_causal_lm(dst).cfg.attention.n_kv_heads == 1
        if fam.architectures:
            same_logits(dst, fam.architectures[fam.model_types[0]])
    else:  # an encoder, written in the MHA layout: BERT's own class reads it
        transformers.AutoModel.from_pretrained(dst)


def test_convert_mla(family, tmp_path):
    fam, src = family
    cell, dst = support(fam)["convert MLA"], tmp_path / "mla"
    result = run("convert", src, dst, "--to", "mla", "--kv-lora-rank", 16, "--json")
    if not cell.ok:
        refused(result, dst)
        return
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary.get("mla_conversion", "exact") == cell.text, summary
    same_logits(dst, "DeepseekV3ForCausalLM")


def test_uptrain(family, corpus, tmp_path):
    fam, src = family
    cell, dst = support(fam)["uptrain"], tmp_path / "up"
    args = ["--data", corpus, "--steps", 2, "--seq-len", 16, "--batch-size", 2, "--save-every", 0]
    result = run("uptrain", src, dst, *args)
    if not cell.ok:
        refused(result, dst)
        return
    assert result.exit_code == 0, result.output
    losses = [json.loads(line)["loss"] for line in (dst / "uptrain_log.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(loss == loss for loss in losses)  # finite, NaN-free
    if (
        cell.text == "yes, no --tp"
    ):  # the refusal is checked on 2 ranks by tests/train/test_tensor_parallel.py
        with pytest.raises(ValueError, match="q/k norms"):
            check_shardable(example_config(fam), 2)


def test_generate(family):
    fam, src = family
    result = run("generate", src, "--prompt", "To be", "--max-new", 3, "--ignore-eos", "--json")
    if not support(fam)["generate"].ok:
        refused(result)
        return
    assert result.exit_code == 0, result.output


def test_compare(family):
    fam, src = family
    result = run("compare", "--model", src / "config.json", "--json")
    assert support(fam)["compare"].ok and result.exit_code == 0, result.output


def test_a_deepseek_mixture_of_experts_is_refused_by_its_config_field(tmp_path):
    """A MoE DeepSeek-V3 checkpoint was refused by its first expert tensor's name ('unexpected tensor ... in a
    dense DeepSeek-V3 checkpoint'); the rule is a field attnlab does not model, refused by name, before any weight."""
    from attnlab.families import FAMILIES

    fam = FAMILIES["deepseek_v3"]
    config = dict(fam.example) | {"n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
                                  "moe_intermediate_size": 16, "n_shared_experts": 1}  # fmt: skip
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    (tmp_path / "text.txt").write_text("To be, or not to be.\n" * 20)
    result = run("eval", tmp_path / "ckpt", "--data", tmp_path / "text.txt")
    refused(result)
    assert "n_routed_experts=4 is not supported" in result.stderr and "compare --model" in result.stderr
