"""The Gemma family (``attnlab.families.gemma``): Gemma (GeGLU, 1 + w norms, scaled embeddings, head_dim apart from
hidden_size / heads), Gemma 2 (sandwich norms, soft-capping, query_pre_attn_scalar, alternating sliding layers) and
Gemma 3 text (q/k norms, a RoPE per layer type with linear scaling on the full layers, five-in-six sliding layers),
against their transformers classes with the same random weights."""

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
    tokens,
)
from safetensors import safe_open
from test_llama import _tokenizer
from typer.testing import CliRunner

from attnlab.cli import app
from attnlab.cost import kv_cache_bytes
from attnlab.cost.params import model_param_count
from attnlab.families import FAMILIES
from attnlab.families.base import Fields
from attnlab.hf import load_causal_lm
from attnlab.hf_config import from_hf_config

# head_dim 16 while hidden_size / num_attention_heads is 12: the attention width is not the model's
SMALL = dict(hidden_size=48, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
}
CASES = {
    "gemma (GQA, tied)": (transformers.GemmaConfig, dict(SMALL, num_hidden_layers=2)),
    "gemma (MHA, attention bias, untied)": (
        transformers.GemmaConfig,
        dict(
            SMALL, num_hidden_layers=2, num_key_value_heads=4, attention_bias=True, tie_word_embeddings=False
        ),
    ),
    # Soft-caps small enough to bite on these logits (~2); a scale other than head_dim ** -0.5; windows of 8 on
    # layers 0 and 2
    "gemma2 (soft-capping, window 8 on alternate layers)": (
        transformers.Gemma2Config,
        dict(
            SMALL,
            num_hidden_layers=3,
            sliding_window=8,
            query_pre_attn_scalar=20,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
        ),
    ),
    # Layers 0, 1 and 3 slide (pattern 3); attn_logit_softcapping is set, and ignored as transformers does
    "gemma3_text (q/k norms, local RoPE, linear scaling, window 8)": (
        transformers.Gemma3TextConfig,
        dict(
            SMALL,
            num_hidden_layers=4,
            sliding_window=8,
            sliding_window_pattern=3,
            query_pre_attn_scalar=20,
            rope_parameters=GEMMA3_ROPE,
            final_logit_softcapping=5.0,
            attn_logit_softcapping=1.0,
        ),
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    cls, fields = CASES[request.param]
    return build(cls, tmp_path_factory.mktemp("gemma") / "src", **fields)


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_logits_equal_transformers_also_past_the_window(checkpoint):
    check_logits(checkpoint, n=24)  # 24 tokens: three windows of 8


def test_bfloat16_logits_within_its_rounding(checkpoint):
    model, theirs = load_causal_lm(checkpoint).to(torch.bfloat16), transformers.AutoModelForCausalLM
    hf = theirs.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    x = tokens(12)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits.float(), rtol=0.05, atol=0.05)


def test_greedy_tokens_equal_transformers_through_both_caches(checkpoint):
    check_generate(checkpoint, lengths=(5, 13), new=8)  # 13 + 8 tokens: past the window of 8, in the ring


def test_a_left_padded_batch_equals_its_rows_alone(checkpoint):
    check_left_padded(checkpoint, lengths=(5, 12))  # 12 tokens: past the window of 8


def test_the_model_is_read_as_transformers_builds_it(checkpoint):
    cfg, hf = from_hf_config(checkpoint), _config(checkpoint)
    model = load_causal_lm(checkpoint)
    assert cfg.attention.head_dim == 16 != cfg.d_model // cfg.n_heads
    assert (cfg.norm_offset, cfg.mlp, cfg.embed_scale) == (1.0, "geglu", 48**0.5)
    assert model_param_count(cfg) == sum(p.numel() for p in model.parameters())
    if hf["model_type"] == "gemma":
        assert cfg.norm_placement == "pre" and cfg.sliding is None and cfg.final_softcap is None
        return
    assert cfg.norm_placement == "sandwich" and cfg.final_softcap == 5.0
    assert cfg.attention.softmax_scale == 20**-0.5
    windows = [getattr(layer.attention.cfg, "window", None) for layer in model.layers]
    assert windows == [8 if t == "sliding_attention" else None for t in hf["layer_types"]]
    if hf["model_type"] == "gemma2":
        assert hf["layer_types"][:2] == ["sliding_attention", "full_attention"]
        assert {a.softcap for a in cfg.layer_attentions} == {2.0}
    else:
        assert hf["layer_types"] == ["sliding_attention"] * 2 + ["full_attention", "sliding_attention"]
        assert hf["attn_logit_softcapping"] == 1.0 and {a.softcap for a in cfg.layer_attentions} == {None}
        assert {a.qk_norm for a in cfg.layer_attentions} == {"head"}
        assert (cfg.attention.rope_theta, dict(cfg.attention.rope_scaling)["factor"]) == (500000.0, 4.0)
        assert (cfg.sliding.rope_theta, cfg.sliding.rope_scaling) == (20000.0, ())


def test_the_tensor_map_names_every_checkpoint_tensor_both_ways(checkpoint):
    hf = _config(checkpoint)
    model = load_causal_lm(checkpoint)
    with safe_open(checkpoint / "model.safetensors", framework="pt") as f:
        theirs = set(f.keys())
    written = FAMILIES[hf["model_type"]].tensor_map(hf).to_checkpoint(model.state_dict(), model.cfg)
    assert set(written) == theirs
    assert ("lm_head.weight" in theirs) == (not hf.get("tie_word_embeddings", True))


def test_the_writer_changes_nothing_of_its_source_and_writes_a_config_from_scratch(checkpoint):
    hf = _config(checkpoint)
    family = FAMILIES[hf["model_type"]]
    cfg = family.read(Fields(hf, hf["model_type"]))
    assert family.write(cfg, hf) == hf
    fresh = family.write(cfg, {"model_type": hf["model_type"]})
    assert family.read(Fields(fresh, hf["model_type"])) == cfg
    # what the model_type cannot hold is refused, naming the field
    with pytest.raises(ValueError, match="cannot hold this model: mlp='swiglu'"):
        family.write(cfg.replace(mlp="swiglu"), hf)


def test_the_cost_model_counts_a_sliding_layer_at_its_window(checkpoint):
    cfg = from_hf_config(checkpoint)
    model = load_causal_lm(checkpoint)
    caches = model.new_caches(2, 40)
    assert sum(c.nbytes for c in caches) == kv_cache_bytes(cfg, 2, 40, torch.float32)
    windows = [getattr(layer.attention.cfg, "window", None) for layer in model.layers]
    assert [c.capacity for c in caches] == [min(w or 40, 40) for w in windows]


@pytest.mark.parametrize("method", ["mean", "fit"])
def test_convert_loads_in_transformers_with_attnlab_logits(checkpoint, tmp_path, method):
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(" ".join(str(i) for i in range(j, j + 12)) for j in range(20)))
    if not (checkpoint / "tokenizer.json").exists():
        _tokenizer(checkpoint)
    args = ("--method", method) + (("--calib", calib) if method == "fit" else ())
    summary = check_convert(checkpoint, tmp_path / "dst", 1, *args)
    src_cfg, dst_cfg = _config(checkpoint), _config(tmp_path / "dst")
    assert dst_cfg["num_key_value_heads"] == 1 and summary["n_kv_heads_after"] == 1
    assert summary["layout"] == "gqa"
    # nothing stale: every other field as the source wrote it
    assert {k: v for k, v in dst_cfg.items() if k != "num_key_value_heads"} == {
        k: v for k, v in src_cfg.items() if k != "num_key_value_heads"
    }
    with safe_open(tmp_path / "dst" / "model.safetensors", framework="pt") as f:
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [16, 48]


# What keeps each config from DeepSeek-V3's MLA, as the refusal says it, and what it does not have
MLA_REASONS = {
    "gemma": (["GeGLU MLP", "sqrt(hidden_size)"], ["sandwich", "soft-capping", "sliding", "q/k norms"]),
    "gemma2": (["sandwich norms", "attention-logit soft-capping at 2.0", "final-logit soft-capping at 5.0",
                "sliding windows of 8"], ["q/k norms", "RoPE"]),
    "gemma3_text": (["q/k norms", "sliding windows of 8", "a RoPE per layer type", "scaled RoPE"],
                    ["attention-logit"]),
}  # fmt: skip


def test_mla_conversion_is_refused_saying_why(checkpoint, tmp_path):
    result = CliRunner().invoke(app, ["convert", str(checkpoint), str(tmp_path / "mla"), "--to", "mla",
                                      "--kv-lora-rank", "8"])  # fmt: skip
    assert result.exit_code == 2 and "cannot be converted to MLA" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    said, unsaid = MLA_REASONS[_config(checkpoint)["model_type"]]
    assert all(r in result.stderr for r in said) and not any(r in result.stderr for r in unsaid), (
        result.stderr
    )
    assert not (tmp_path / "mla").exists()


def test_compare_reads_the_config(checkpoint):
    result = CliRunner().invoke(app, ["compare", "--model", str(checkpoint / "config.json"), "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]
    native = next(r for r in rows if r["native"])
    assert native["kv_cache_bytes_per_token"] == kv_cache_bytes(from_hf_config(checkpoint), 1, 1, "bf16")


# ---- config.json as transformers reads it ----------------------------------------------------------------------

# 16 heads: GemmaConfig has 16 KV heads by default, Gemma2Config and Gemma3TextConfig 4
MINIMAL = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=7, num_attention_heads=16, vocab_size=97
)


@pytest.mark.parametrize("model_type", ["gemma", "gemma2", "gemma3_text"])
def test_missing_fields_mean_transformers_defaults(model_type):
    theirs = transformers.AutoConfig.for_model(model_type, **MINIMAL)
    cfg = from_hf_config({"model_type": model_type, **MINIMAL})
    attn = cfg.attention
    assert attn.head_dim == theirs.head_dim == 256 and attn.n_kv_heads == theirs.num_key_value_heads
    assert cfg.max_seq_len == theirs.max_position_embeddings and cfg.tie_embeddings
    if model_type == "gemma":
        return
    assert cfg.final_softcap == theirs.final_logit_softcapping
    assert attn.softmax_scale == theirs.query_pre_attn_scalar**-0.5
    assert list(cfg.layer_types) == theirs.layer_types and cfg.sliding.window == theirs.sliding_window
    if model_type == "gemma2":
        assert attn.softcap == theirs.attn_logit_softcapping == 50.0
    else:  # five of every six layers slide; the two RoPE bases
        assert cfg.layer_types.count("full_attention") == 1
        thetas = {k: v["rope_theta"] for k, v in theirs.rope_parameters.items()}
        assert thetas == {"full_attention": attn.rope_theta, "sliding_attention": cfg.sliding.rope_theta}


def test_gemma3_older_rope_fields_are_read_as_transformers_reads_them(tmp_path):
    """rope_theta, rope_local_base_freq, a rope_scaling for the full layers, sliding_window_pattern: the fields of
    Gemma 3 checkpoints written before transformers 5 keyed RoPE by layer type."""
    cls, fields = CASES["gemma3_text (q/k norms, local RoPE, linear scaling, window 8)"]
    src = build(cls, tmp_path / "src", **fields)
    hf = _config(src)
    for key in ("rope_parameters", "layer_types"):
        del hf[key]
    hf |= dict(
        rope_theta=500000.0, rope_local_base_freq=20000.0, rope_scaling={"rope_type": "linear", "factor": 4.0}
    )
    (src / "config.json").write_text(json.dumps(hf))
    assert from_hf_config(src).replace(name="") == from_hf_config(
        build(cls, tmp_path / "new", **fields)
    ).replace(name="")
    check_logits(src, n=24)


def test_gemma_legacy_gelu_is_the_tanh_gelu(tmp_path):
    src = build(transformers.GemmaConfig, tmp_path / "src", **SMALL, num_hidden_layers=2)
    (src / "config.json").write_text(json.dumps(_config(src) | {"hidden_act": "gelu"}))
    assert transformers.AutoConfig.from_pretrained(src).hidden_act == "gelu_pytorch_tanh"
    check_logits(src)


REFUSED = [
    ("gemma", {"hidden_act": "silu"}, "hidden_act='silu' is not supported"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation='gelu' is not supported"),  # exact GELU
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True is not supported"),
    ("gemma2", {"sliding_window": None}, "sliding_window is null"),
    ("gemma2", {"attn_logit_softcapping": 0}, "'attn_logit_softcapping' must be > 0"),
    ("gemma2", {"query_pre_attn_scalar": -1}, "'query_pre_attn_scalar' must be > 0"),
    ("gemma3_text", {"layer_types": ["chunked_attention"] * 7}, "layer_types must list"),
    ("gemma3_text", {"layer_types": [{}] * 7}, "layer_types must list"),
    ("gemma2", {"layer_types": ["full_attention"]}, "layer_types must list num_hidden_layers=7"),
    ("gemma3_text", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters=.* is not supported"),
    ("gemma3_text", {"rope_parameters": {"full_attention": {"rope_type": "ntk"}}}, "rope_type='ntk' is not supported"),
]  # fmt: skip


@pytest.mark.parametrize(("model_type", "change", "message"), REFUSED, ids=[r[2] for r in REFUSED])
def test_a_field_attnlab_does_not_model_is_refused_naming_it(model_type, change, message):
    with pytest.raises(ValueError, match=message):
        from_hf_config({"model_type": model_type, **MINIMAL, **change})


def test_a_refused_field_is_one_line_on_the_command_line(tmp_path):
    src = build(transformers.Gemma2Config, tmp_path / "src", **SMALL, num_hidden_layers=2)
    (src / "config.json").write_text(json.dumps(_config(src) | {"hidden_activation": "gelu"}))
    result = CliRunner().invoke(app, ["eval", str(src), "--data", str(src / "config.json")])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "hidden_activation='gelu' is not supported" in result.stderr
