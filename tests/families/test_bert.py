"""BERT encoders (``attnlab.families.bert``): the family's tensor map is the one name map of ``attnlab.hf.bert``'s loader
and of ``attnlab convert``, checked against transformers' ``BertModel`` with the same small random weights, with and
without the "bert." prefix of a BertFor... checkpoint. (all-MiniLM-L6-v2's real weights: tests/convert/test_minilm.py.)
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from attnlab.cli import app
from attnlab.convert import convert_model
from attnlab.families.bert import BERT, TENSORS
from attnlab.hf import load_bert
from attnlab.hf_config import from_hf_config


@pytest.fixture(scope="module", params=["", "bert."], ids=["BertModel", "bert. prefix"])
def checkpoint(request, tmp_path_factory):
    """BERT's example config with random weights (norm gains and biases off their init), its names prefixed."""
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.AutoConfig.for_model(**BERT.example)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.2 if p.ndim == 1 else 0.08)
    path = tmp_path_factory.mktemp("bert") / "src"
    model.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    save_file(
        {request.param + k: v for k, v in tensors.items()}, path / "model.safetensors", {"format": "pt"}
    )
    return path


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, BERT.example["vocab_size"], (2, 12), generator=g)
    return ids, torch.tensor([[1] * 12, [1] * 7 + [0] * 5])


@torch.no_grad()
def _hidden(model, ids, mask):
    if isinstance(model, transformers.BertModel):
        return model(input_ids=ids, attention_mask=mask).last_hidden_state
    return model(ids, mask)


@torch.no_grad()
def test_the_encoder_equals_bertmodel(checkpoint):
    ids, mask = _inputs()
    ours, extra = load_bert(checkpoint)
    theirs = transformers.BertModel.from_pretrained(checkpoint).eval()
    keep = mask[..., None].bool()
    torch.testing.assert_close(
        _hidden(ours, ids, mask) * keep, _hidden(theirs, ids, mask) * keep, rtol=1e-4, atol=1e-4
    )
    assert set(extra) == {"pooler.dense.weight", "pooler.dense.bias"}  # carried along, by their bare names


def test_the_tensor_map_round_trips_every_weight(checkpoint):
    tensors = load_file(checkpoint / "model.safetensors")
    cfg = from_hf_config(checkpoint)
    back = TENSORS.to_checkpoint(TENSORS.to_attnlab(tensors, cfg), cfg)
    kept = {TENSORS.bare(k): v for k, v in tensors.items() if not TENSORS.is_ignored(k)}
    assert back.keys() == kept.keys() and all(torch.equal(back[k], v) for k, v in kept.items())
    assert {TENSORS.bare(k) for k in tensors if TENSORS.is_ignored(k)} >= {"pooler.dense.weight"}


@torch.no_grad()
@pytest.mark.parametrize("method", ["mean", "first"])
def test_convert_rewrites_the_source_names_in_the_mha_layout(checkpoint, tmp_path, method):
    dst = tmp_path / "dst"
    result = CliRunner().invoke(app, ["convert", str(checkpoint), str(dst), "--kv-heads", "2",
                                      "--method", method, "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["layout"] == "mha (repeated K/V heads)"
    before, after = load_file(checkpoint / "model.safetensors"), load_file(dst / "model.safetensors")
    assert after.keys() == before.keys()  # the source's names, prefix and pooler included
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".attention.self.key." in k or ".attention.self.value." in k for k in changed)
    assert summary["tensors_rewritten"] == len(changed)
    ids, mask = _inputs()
    encoder, _ = load_bert(checkpoint)
    want = _hidden(convert_model(encoder, 2, method), ids, mask)
    keep = mask[..., None].bool()
    theirs = transformers.BertModel.from_pretrained(dst).eval()
    torch.testing.assert_close(_hidden(theirs, ids, mask) * keep, want * keep, rtol=1e-4, atol=1e-4)
    back, _ = load_bert(dst, n_kv_heads=2)  # one head per group again: the converted encoder's own weights
    torch.testing.assert_close(_hidden(back, ids, mask) * keep, want * keep, rtol=1e-5, atol=1e-5)
