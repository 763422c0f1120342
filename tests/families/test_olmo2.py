"""The OLMo 2 family (``attnlab.families.olmo2``): post-norm blocks and q/k norms over all heads, MHA (OLMo-2 7B) and
GQA with biases and an explicit head_dim, against transformers' ``Olmo2ForCausalLM`` with the same random weights."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from family_oracle import (
    build,
    check_convert,
    check_generate,
    check_left_padded,
    check_logits,
    hf_model,
    tokens,
)
from safetensors.torch import load_file
from typer.testing import CliRunner

from attnlab.cli import app
from attnlab.cost import kv_cache_bytes, model_param_count
from attnlab.families import FAMILIES
from attnlab.families.base import Fields
from attnlab.hf import load_causal_lm
from attnlab.hf_config import from_hf_config

SMALL = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6)
YARN_ROPE = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, rope_theta=10000.0)
CASES = {
    "olmo-2 (MHA, theta 500000)": dict(
        SMALL, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rms_norm_eps=1e-6
    ),
    "olmo-2 (GQA, biases, head_dim 16, tied, yarn)": dict(
        SMALL,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=True,
        tie_word_embeddings=True,
        rope_parameters=YARN_ROPE,
        max_position_embeddings=64,
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    return build(transformers.Olmo2Config, tmp_path_factory.mktemp("olmo2") / "src", **CASES[request.param])


def test_logits_equal_transformers(checkpoint):
    check_logits(checkpoint, n=24)  # past yarn's 16 original positions


def test_bfloat16_logits_within_its_rounding(checkpoint):
    model = load_causal_lm(checkpoint).to(torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    x = tokens(12)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits.float(), rtol=0.05, atol=0.05)


def test_bfloat16_norms_round_as_olmo2rmsnorm(checkpoint):
    """Olmo2RMSNorm applies its gain in float32 before the cast back (``norm_gain_float32``): each norm, the q/k
    norms too, gives transformers' bfloat16 values to the bit."""
    model = load_causal_lm(checkpoint).to(torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    ours, theirs = model.layers[0], hf.model.layers[0]
    attn = model.cfg.attention
    pairs = [
        (ours.post_attention_norm, theirs.post_attention_layernorm, attn.d_model),
        (ours.post_ffn_norm, theirs.post_feedforward_layernorm, attn.d_model),
        (model.norm, hf.model.norm, attn.d_model),
        (ours.attention.q_norm, theirs.self_attn.q_norm, attn.n_heads * attn.head_dim),
        (ours.attention.k_norm, theirs.self_attn.k_norm, attn.n_kv_heads * attn.head_dim),
    ]
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for mine, reference, width in pairs:
            x = (3 * torch.randn(2, 9, width, generator=gen)).bfloat16()
            assert torch.equal(mine(x), reference(x))


def test_greedy_tokens_equal_transformers_through_both_caches(checkpoint):
    check_generate(checkpoint, lengths=(5, 11), new=8)


def test_a_left_padded_batch_equals_its_rows_alone(checkpoint):
    check_left_padded(checkpoint, lengths=(3, 6))


def test_the_blocks_are_post_norm_with_q_k_norms_over_all_heads(checkpoint):
    model, hf = load_causal_lm(checkpoint), hf_model(checkpoint)
    attn = model.cfg.attention
    for ours, theirs in zip(model.layers, hf.model.layers, strict=True):
        assert not hasattr(ours, "attention_norm") and not hasattr(
            ours, "ffn_norm"
        )  # sublayers read x as it is
        assert torch.equal(ours.post_attention_norm.weight, theirs.post_attention_layernorm.weight)
        assert torch.equal(ours.post_ffn_norm.weight, theirs.post_feedforward_layernorm.weight)
        assert ours.attention.q_norm.weight.shape == (attn.n_heads * attn.head_dim,)
        assert ours.attention.k_norm.weight.shape == (attn.n_kv_heads * attn.head_dim,)
        assert torch.equal(ours.attention.k_norm.weight, theirs.self_attn.k_norm.weight)


def test_the_tensor_map_round_trips_every_checkpoint_tensor(checkpoint):
    tensors = load_file(checkpoint / "model.safetensors")
    cfg = from_hf_config(checkpoint)
    tensor_map = FAMILIES["olmo2"].tensor_map({})
    state = tensor_map.to_attnlab(tensors, cfg)
    assert set(state) == set(load_causal_lm(checkpoint).state_dict())
    back = tensor_map.to_checkpoint(state, cfg)
    assert set(back) == set(tensors)
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_the_written_config_is_the_source_and_reads_back(checkpoint):
    src = json.loads((checkpoint / "config.json").read_text())
    cfg = from_hf_config(checkpoint).replace(name="")
    assert FAMILIES["olmo2"].write(cfg, src) == src  # nothing changed, nothing added
    fresh = FAMILIES["olmo2"].write(cfg, {})  # from nothing: every field the model needs
    assert FAMILIES["olmo2"].read(Fields(fresh, "olmo2")) == cfg
    with pytest.raises(ValueError, match="olmo2 cannot express ModelConfig norm_placement='pre'"):
        FAMILIES["olmo2"].write(cfg.replace(norm_placement="pre"), src)


def test_the_cost_model_counts_the_norms_and_the_cache(checkpoint):
    cfg = from_hf_config(checkpoint)
    model = load_causal_lm(checkpoint)
    assert model_param_count(cfg) == sum(p.numel() for p in model.parameters())
    caches = model.new_caches(2, 40)
    assert sum(c.nbytes for c in caches) == kv_cache_bytes(cfg, 2, 40, torch.float32)


@pytest.mark.parametrize("method", ["mean", "fit", "grouped-fit"])
def test_convert_loads_in_transformers_with_attnlab_logits(checkpoint, tmp_path, method):
    """The k_norm gains (one per value of each KV head) become one per value of the new head: each the mean of its
    group's gains, by every method; Olmo2ForCausalLM loads the result with attnlab's logits."""
    args = ("--method", method) + (("--calib", calibration(checkpoint, tmp_path)) if method != "mean" else ())
    summary = check_convert(checkpoint, tmp_path / "dst", 1, *args)
    src_cfg = json.loads((checkpoint / "config.json").read_text())
    dst_cfg = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert dst_cfg["num_key_value_heads"] == 1 and summary["n_kv_heads_after"] == 1
    # nothing stale: every other field as the source wrote it
    assert {k: v for k, v in dst_cfg.items() if k != "num_key_value_heads"} == {
        k: v for k, v in src_cfg.items() if k != "num_key_value_heads"
    }
    before, after = (
        load_file(checkpoint / "model.safetensors"),
        load_file(tmp_path / "dst" / "model.safetensors"),
    )
    head_dim = from_hf_config(checkpoint).attention.head_dim
    for key in (k for k in before if "k_norm" in k):
        assert after[key].shape == (head_dim,)
        pooled = before[key].view(-1, head_dim).mean(0)  # grouped-fit sums the heads in its own order
        torch.testing.assert_close(after[key], pooled, rtol=1e-6, atol=1e-6)
    assert after["model.layers.0.self_attn.k_proj.weight"].shape == (head_dim, 48)


def test_mla_conversion_is_refused_in_one_line_and_writes_nothing(checkpoint, tmp_path):
    result = CliRunner().invoke(app, ["convert", str(checkpoint), str(tmp_path / "mla"), "--to", "mla",
                                      "--kv-lora-rank", "8"])  # fmt: skip
    assert result.exit_code == 2
    assert "cannot be converted to MLA" in result.stderr and "k_norm" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "mla").exists()


def test_compare_reads_the_config(checkpoint):
    result = CliRunner().invoke(app, ["compare", "--model", str(checkpoint / "config.json"), "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]
    native = next(r for r in rows if r["native"])
    assert native["kv_cache_bytes_per_token"] == kv_cache_bytes(from_hf_config(checkpoint), 1, 1, "bf16")


def test_fields_left_out_mean_what_olmo2config_says():
    """No num_key_value_heads (or null): MHA; no head_dim: hidden_size / heads; Olmo2Config's eps and positions."""
    raw = dict(SMALL, model_type="olmo2", vocab_size=97)
    hf = transformers.Olmo2Config(**{k: v for k, v in raw.items() if k != "model_type"})
    cfg = from_hf_config(raw)
    assert (cfg.attention.n_kv_heads, cfg.attention.head_dim) == (hf.num_key_value_heads, 8) == (6, 8)
    assert (cfg.norm_eps, cfg.attention.norm_eps, cfg.max_seq_len) == (hf.rms_norm_eps,) * 2 + (2048,)
    assert from_hf_config(raw | {"num_key_value_heads": None}).attention.n_kv_heads == 6


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"rope_parameters": {"rope_type": "ntk-by-parts", "rope_theta": 1e4}}, "rope_type='ntk-by-parts'"),
        ({"num_key_value_heads": 4}, "num_key_value_heads=4 does not divide num_attention_heads=6"),
    ],
)
def test_a_field_attnlab_does_not_model_is_refused_in_one_line(tmp_path, change, named):
    src = build(transformers.Olmo2Config, tmp_path / "src", **SMALL)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg | change))
    result = CliRunner().invoke(app, ["eval", str(src), "--data", str(src / "config.json")])
    assert result.exit_code == 2 and named in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1


def calibration(checkpoint, tmp_path):
    """A calibration text of numbers, and beside the checkpoint a word-level tokenizer reading them as token ids."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    if not (checkpoint / "tokenizer.json").exists():
        tok = Tokenizer(WordLevel({str(i): i for i in range(96)} | {"[UNK]": 96}, unk_token="[UNK]"))
        tok.pre_tokenizer = WhitespaceSplit()
        tok.save(str(checkpoint / "tokenizer.json"))
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(" ".join(str((7 * i + j) % 96) for i in range(j, j + 12)) for j in range(20)))
    return calib
