"""The GLM families (``attnlab.families.glm``): GLM (pre norms) and GLM-4 (sandwich norms) against transformers'
``GlmForCausalLM`` / ``Glm4ForCausalLM`` with the same random weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from family_oracle import (
    VOCAB,
    build,
    check_convert,
    check_generate,
    check_left_padded,
    check_logits,
    tokens,
)
from safetensors.torch import load_file
from typer.testing import CliRunner

from attnlab.cli import app
from attnlab.cost import kv_cache_bytes, model_param_count
from attnlab.families import FAMILIES
from attnlab.hf import load_causal_lm
from attnlab.hf.causal_lm import save_model
from attnlab.hf_config import from_hf_config, to_hf_config

# head_dim 16 is not hidden_size / heads (8): GLM's projections are n_heads * head_dim wide
SMALL = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0)  # fmt: skip
YARN_ROPE = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, rope_theta=10000.0,
                 partial_rotary_factor=1.0)  # fmt: skip

CASES = {
    "glm (q/k/v biases, half rotary)": (transformers.GlmConfig, SMALL),
    "glm-4 (sandwich norms)": (transformers.Glm4Config, SMALL),
    "glm-4 (yarn, full rotary, tied)": (
        transformers.Glm4Config,
        dict(SMALL, rope_parameters=YARN_ROPE, tie_word_embeddings=True),
    ),
}


def model_type(path: Path) -> str:
    return json.loads((path / "config.json").read_text())["model_type"]


def oracle(path: Path, dtype: torch.dtype = torch.float32):
    """The transformers model a checkpoint is checked against."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    cls, fields = CASES[request.param]
    return build(cls, tmp_path_factory.mktemp("glm") / "src", **fields)


# ---- the oracle checks ----------------------------------------------------------------------------------------


def test_logits_equal_transformers(checkpoint):
    check_logits(checkpoint, n=24)  # 24 positions: past yarn's 16 original ones


def test_bfloat16_logits_within_its_rounding(checkpoint):
    model, theirs = load_causal_lm(checkpoint).to(torch.bfloat16), oracle(checkpoint, torch.bfloat16)
    x = tokens(12)
    with torch.no_grad():
        torch.testing.assert_close(model(x), theirs(x).logits.float(), rtol=0.05, atol=0.05)


def test_greedy_tokens_equal_transformers_through_both_caches(checkpoint):
    check_generate(checkpoint, lengths=(5, 11), new=8)


def test_a_left_padded_batch_equals_its_rows_alone(checkpoint):
    check_left_padded(checkpoint, lengths=(3, 6))


def test_the_cost_model_counts_the_loaded_model(checkpoint):
    cfg, model = from_hf_config(checkpoint), load_causal_lm(checkpoint)
    assert model_param_count(cfg) == sum(p.numel() for p in model.parameters())
    caches = model.new_caches(2, 40)
    assert sum(c.nbytes for c in caches) == kv_cache_bytes(cfg, 2, 40, torch.float32)


def test_tensors_round_trip_through_the_tensor_map(checkpoint):
    """Checkpoint -> attnlab -> checkpoint is exact, with the same names (named transforms both ways)."""
    hf = json.loads((checkpoint / "config.json").read_text())
    family = FAMILIES[hf["model_type"]]
    cfg = from_hf_config(checkpoint)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    tensor_map = family.tensor_map(hf)
    back = tensor_map.to_checkpoint(tensor_map.to_attnlab(tensors, cfg), cfg)
    kept = {k: v for k, v in tensors.items() if not tensor_map.is_ignored(k)}
    assert back.keys() == kept.keys()
    assert all(torch.equal(back[k], v) for k, v in kept.items())


def _tokenizer(path: Path) -> None:
    """A word-level tokenizer whose tokens are the numbers the calibration text holds."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    tok = Tokenizer(
        WordLevel({str(i): i for i in range(VOCAB - 1)} | {"[UNK]": VOCAB - 1}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


@pytest.mark.parametrize("method", ["mean", "fit"])
def test_convert_loads_in_transformers_with_attnlab_logits(checkpoint, tmp_path, method):
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(" ".join(str(i) for i in range(j, j + 12)) for j in range(20)))
    if not (checkpoint / "tokenizer.json").exists():
        _tokenizer(checkpoint)
    args = ("--method", method) + (("--calib", calib) if method == "fit" else ())
    dst = tmp_path / "dst"
    summary = check_convert(checkpoint, dst, 1, *args)
    assert summary["n_kv_heads_after"] == 1 and summary["layout"] == "gqa"
    src_cfg = json.loads((checkpoint / "config.json").read_text())
    dst_cfg = json.loads((dst / "config.json").read_text())
    changed = {k for k in src_cfg.keys() | dst_cfg.keys() if src_cfg.get(k) != dst_cfg.get(k)}
    assert dst_cfg["num_key_value_heads"] == 1 and changed == {"num_key_value_heads"}


def test_mla_conversion_is_refused_for_interleaved_partial_rotary(checkpoint, tmp_path):
    result = CliRunner().invoke(app, ["convert", str(checkpoint), str(tmp_path / "mla"), "--to", "mla",
                                      "--kv-lora-rank", "8"])  # fmt: skip
    assert result.exit_code == 2 and "cannot be converted to MLA" in result.stderr
    assert "interleaved" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "mla").exists()


def test_compare_reads_the_config(checkpoint):
    result = CliRunner().invoke(app, ["compare", "--model", str(checkpoint / "config.json"), "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]
    native = next(r for r in rows if r["native"])
    assert native["kv_cache_bytes_per_token"] == kv_cache_bytes(from_hf_config(checkpoint), 1, 1, "bf16")


def test_a_model_written_from_scratch_computes_the_same(checkpoint, tmp_path):
    """``save_model`` with no base config: the family's writer alone says everything (rotary fraction, RoPE, KV
    heads, biases) that transformers (or, for ChatGLM, attnlab) reads back."""
    model = load_causal_lm(checkpoint)
    kind = model_type(checkpoint)
    dst = save_model(model, tmp_path / "new", kind, base_config={"pad_token_id": 0})  # (GLM's is past VOCAB)
    x = tokens(16)
    with torch.no_grad():
        torch.testing.assert_close(load_causal_lm(dst)(x), model(x), rtol=0, atol=0)
        torch.testing.assert_close(oracle(dst)(x).logits, model(x), rtol=1e-4, atol=1e-4)


# ---- reading config.json --------------------------------------------------------------------------------------


def test_the_rotary_fraction_is_read_with_transformers_precedence():
    """Inside rope_parameters first, then top level, then GlmConfig's 0.5, as transformers resolves it."""
    fields = dict(SMALL, model_type="glm", vocab_size=VOCAB, num_hidden_layers=1)
    cases = [
        {},
        {"partial_rotary_factor": 0.25},
        {"partial_rotary_factor": 0.25, "rope_parameters": {"rope_theta": 5.0, "partial_rotary_factor": 1.0}},
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 5.0},
    ]
    for extra in cases:
        raw = fields | extra
        theirs = transformers.GlmConfig.from_dict(raw).rope_parameters["partial_rotary_factor"]
        assert from_hf_config(raw).attention.rotary_dim == int(16 * theirs), extra


def test_missing_fields_take_transformers_defaults():
    raw = {"model_type": "glm4", "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 40,
           "intermediate_size": 13696, "vocab_size": 151552}  # fmt: skip
    cfg, theirs = from_hf_config(raw), transformers.Glm4Config.from_dict(raw)
    attn = cfg.attention
    assert (attn.n_kv_heads, attn.head_dim, attn.bias) == (theirs.num_key_value_heads, theirs.head_dim, True)
    assert (cfg.norm_eps, cfg.max_seq_len) == (theirs.rms_norm_eps, theirs.max_position_embeddings)
    assert attn.rotary_dim == 64 and attn.rope_interleaved and cfg.norm_placement == "sandwich"
    # written back unchanged: also yarn, which reads the default max_position_embeddings
    yarn = raw | {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}
    assert to_hf_config(from_hf_config(yarn), "glm4", yarn) == yarn | {"architectures": ["Glm4ForCausalLM"]}


REFUSED = [
    ("glm", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ("glm", {"partial_rotary_factor": 0.1}, "partial_rotary_factor=0.1 turns 1 of head_dim=16"),
    (
        "glm4",
        {"rope_parameters": {"rope_type": "ntk", "rope_theta": 1e4}},
        "rope_type='ntk' is not supported",
    ),
]


@pytest.mark.parametrize(
    ("kind", "change", "message"), REFUSED, ids=[f"{k}-{next(iter(c))}" for k, c, _ in REFUSED]
)
def test_fields_attnlab_does_not_model_are_refused_in_one_line(tmp_path, kind, change, message):
    src = tmp_path / "src"
    src.mkdir()
    base = dict(SMALL, model_type=kind, vocab_size=VOCAB)
    (src / "config.json").write_text(json.dumps(base | change))
    result = CliRunner().invoke(app, ["convert", str(src), str(tmp_path / "dst"), "--kv-heads", "1"])
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "dst").exists()
