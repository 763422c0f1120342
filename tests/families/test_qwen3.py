"""The Qwen3 family (``attnlab.families.qwen3``): per-head q/k norms, an explicit head_dim, q/k/v/o biases, yarn,
sliding layers, against transformers' ``Qwen3ForCausalLM`` with the same random weights."""

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

# head_dim 16 on a width of 48 with 6 heads: not hidden_size / num_attention_heads (8), as in every Qwen3
SMALL = dict(
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
)
YARN_ROPE = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, rope_theta=1000000.0)
CASES = {
    "qwen3-0.6b (tied, head_dim 16)": dict(SMALL, tie_word_embeddings=True),
    "qwen3 (attention_bias, yarn)": dict(
        SMALL, attention_bias=True, rope_parameters=YARN_ROPE, max_position_embeddings=64
    ),
    "qwen3 (sliding layers)": dict(
        SMALL,
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
        max_position_embeddings=64,
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    return build(transformers.Qwen3Config, tmp_path_factory.mktemp("qwen3") / "src", **CASES[request.param])


def test_logits_equal_transformers_also_past_the_window(checkpoint):
    check_logits(checkpoint, n=24)  # 24 tokens: three windows of 8, and past yarn's 16 original positions


def test_bfloat16_logits_within_its_rounding(checkpoint):
    model = load_causal_lm(checkpoint).to(torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    x = tokens(12)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits.float(), rtol=0.05, atol=0.05)


def test_greedy_tokens_equal_transformers_through_both_caches(checkpoint):
    check_generate(checkpoint, lengths=(5, 11), new=8)  # 11 + 8 tokens: past the window of 8 in the ring


def test_a_left_padded_batch_equals_its_rows_alone(checkpoint):
    check_left_padded(checkpoint, lengths=(3, 13))  # 13 tokens: past the window of 8, 10 pads before row 0


def test_the_q_k_norms_are_per_head_gains_read_from_the_checkpoint(checkpoint):
    model, hf = load_causal_lm(checkpoint), hf_model(checkpoint)
    for ours, theirs in zip(model.layers, hf.model.layers, strict=True):
        assert ours.attention.cfg.qk_norm == "head" and ours.attention.cfg.head_dim == 16
        assert torch.equal(ours.attention.q_norm.weight, theirs.self_attn.q_norm.weight)
        assert torch.equal(ours.attention.k_norm.weight, theirs.self_attn.k_norm.weight)
        assert ours.attention.k_norm.weight.shape == (16,)


def test_the_sliding_layers_are_those_transformers_slides(checkpoint):
    model, hf = load_causal_lm(checkpoint), hf_model(checkpoint)
    ours = [layer.attention.cfg.window for layer in model.layers]
    assert ours == [layer.self_attn.sliding_window for layer in hf.model.layers]
    sliding = json.loads((checkpoint / "config.json").read_text())["use_sliding_window"]
    assert ours == ([None, 8, 8] if sliding else [None, None])


def test_the_tensor_map_round_trips_every_checkpoint_tensor(checkpoint):
    tensors = load_file(checkpoint / "model.safetensors")
    cfg = from_hf_config(checkpoint)
    tensor_map = FAMILIES["qwen3"].tensor_map({})
    state = tensor_map.to_attnlab(tensors, cfg)
    assert set(state) == set(load_causal_lm(checkpoint).state_dict())
    back = tensor_map.to_checkpoint(state, cfg)
    assert set(back) == set(tensors)
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_the_written_config_is_the_source_and_reads_back(checkpoint):
    src = json.loads((checkpoint / "config.json").read_text())
    cfg = from_hf_config(checkpoint).replace(name="")
    assert FAMILIES["qwen3"].write(cfg, src) == src  # nothing changed, nothing added
    fresh = FAMILIES["qwen3"].write(cfg, {})  # from nothing: every field the model needs
    assert FAMILIES["qwen3"].read(Fields(fresh, "qwen3")) == cfg
    assert transformers.Qwen3Config(**fresh).to_dict()["layer_types"] == src["layer_types"]


def test_the_cost_model_counts_the_norms_and_a_sliding_layer_at_its_window(checkpoint):
    cfg = from_hf_config(checkpoint)
    model = load_causal_lm(checkpoint)
    assert model_param_count(cfg) == sum(p.numel() for p in model.parameters())
    caches = model.new_caches(2, 40)
    assert sum(c.nbytes for c in caches) == kv_cache_bytes(cfg, 2, 40, torch.float32)
    windows = [getattr(layer.attention.cfg, "window", None) for layer in model.layers]
    assert [c.capacity for c in caches] == [min(w or 40, 40) for w in windows]


@pytest.mark.parametrize("method", ["mean", "fit", "grouped-fit"])
def test_convert_loads_in_transformers_with_attnlab_logits(checkpoint, tmp_path, method):
    args = ("--method", method) + (("--calib", calibration(checkpoint, tmp_path)) if method != "mean" else ())
    summary = check_convert(checkpoint, tmp_path / "dst", 1, *args)
    src_cfg = json.loads((checkpoint / "config.json").read_text())
    dst_cfg = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert dst_cfg["num_key_value_heads"] == 1 and summary["n_kv_heads_after"] == 1
    # nothing stale: every other field as the source wrote it
    assert {k: v for k, v in dst_cfg.items() if k != "num_key_value_heads"} == {
        k: v for k, v in src_cfg.items() if k != "num_key_value_heads"
    }
    # the k_norm gain is one per head dim, shared by every head: copied as it was
    before, after = (
        load_file(checkpoint / "model.safetensors"),
        load_file(tmp_path / "dst" / "model.safetensors"),
    )
    for key in (k for k in before if "k_norm" in k):
        assert torch.equal(after[key], before[key])
    assert after["model.layers.0.self_attn.k_proj.weight"].shape == (16, 48)


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


def test_fields_left_out_mean_what_qwen3config_says():
    """No head_dim: Qwen3Config's 128 (not hidden_size / heads); no num_key_value_heads: its 32; null: MHA."""
    raw = dict(SMALL, model_type="qwen3", vocab_size=97, num_attention_heads=32)
    del raw["head_dim"], raw["num_key_value_heads"]
    hf = transformers.Qwen3Config(**{k: v for k, v in raw.items() if k != "model_type"})
    attn = from_hf_config(raw).attention
    assert (attn.head_dim, attn.n_kv_heads) == (hf.head_dim, hf.num_key_value_heads) == (128, 32)
    assert (
        from_hf_config(raw | {"num_attention_heads": 16, "num_key_value_heads": None}).attention.n_kv_heads
        == 16
    )


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"rope_parameters": {"rope_type": "ntk-by-parts", "rope_theta": 1e6}}, "rope_type='ntk-by-parts'"),
        ({"head_dim": None}, "field 'head_dim' must be an int"),
        (
            {"use_sliding_window": False, "layer_types": ["sliding_attention"] * 2},
            "layer_types names sliding",
        ),
        (  # Llama 4's chunked attention: another model, refused by the field's name
            {"use_sliding_window": True, "layer_types": ["full_attention", "chunked_attention"]},
            "src/config.json: layer_types must list num_hidden_layers=2 of full_attention, sliding_attention",
        ),
    ],
)
def test_a_field_attnlab_does_not_model_is_refused_in_one_line(tmp_path, change, named):
    src = build(transformers.Qwen3Config, tmp_path / "src", **SMALL)
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
