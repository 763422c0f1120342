"""The GPT-NeoX family (``attnlab.families.gpt_neox``): Pythia (parallel residual, RoPE on a quarter of each head, its
legacy config.json fields and buffers) and GPT-NeoX's other forms (sequential residual, full rotary, no attention
bias, tied embeddings, scaled RoPE, the tanh GELUs), against ``GPTNeoXForCausalLM`` with the same random weights."""

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
    convert,
    hf_model,
    tokens,
)
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from attnlab.cli import app
from attnlab.config import AttentionConfig, ModelConfig
from attnlab.convert.model import convert_model
from attnlab.cost import kv_cache_bytes, model_param_count
from attnlab.families import gpt_neox
from attnlab.hf import load_causal_lm, save_causal_lm, save_model
from attnlab.hf.io import read_tensors
from attnlab.hf_config import from_hf_config, to_hf_config
from attnlab.model import Transformer

# head_dim 16: a rotary_pct of 0.25 turns 4 dims of each head
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64)  # fmt: skip
CASES = {
    "pythia (parallel, rotary_pct 0.25, legacy fields)": dict(SMALL, rotary_pct=0.25, rotary_emb_base=10000),
    "gpt-neox (sequential, rotary_pct 1.0)": dict(
        SMALL, use_parallel_residual=False, rotary_pct=1.0, rotary_emb_base=500
    ),
    "tied, no attention bias, linear RoPE on half, gelu_new": dict(
        SMALL,
        num_hidden_layers=3,
        rotary_pct=0.5,
        rope_scaling=dict(rope_type="linear", factor=2.0),
        attention_bias=False,
        tie_word_embeddings=True,
        hidden_act="gelu_new",
    ),
}


def pythia_style(path, buffers: bool = True) -> None:
    """Rewrite a checkpoint as Pythia's hub files are: the legacy RoPE fields in config.json (rotary_pct,
    rotary_emb_base, no rope_parameters) and, ``buffers``, the per-layer buffers older transformers saved (the causal
    mask ``attention.bias``, its fill value ``attention.masked_bias``, ``rotary_emb.inv_freq``)."""
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg.update(
        rotary_pct=rope["partial_rotary_factor"], rotary_emb_base=rope["rope_theta"], rope_scaling=None
    )
    for key in ("attention_bias", "attention_dropout", "hidden_dropout", "classifier_dropout", "is_decoder"):
        cfg.pop(key)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    if buffers:
        tensors = load_file(path / "model.safetensors")
        n, rotary = cfg["max_position_embeddings"], int(16 * rope["partial_rotary_factor"])
        inv_freq = 1.0 / rope["rope_theta"] ** (torch.arange(0, rotary, 2).float() / rotary)
        for i in range(cfg["num_hidden_layers"]):
            prefix = f"gpt_neox.layers.{i}.attention."
            tensors[prefix + "bias"] = torch.ones(1, 1, n, n, dtype=torch.bool).tril()
            tensors[prefix + "masked_bias"] = torch.tensor(-1e9)
            tensors[prefix + "rotary_emb.inv_freq"] = inv_freq.clone()
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    path = build(
        transformers.GPTNeoXConfig, tmp_path_factory.mktemp("gpt_neox") / "src", **CASES[request.param]
    )
    if request.param.startswith("pythia"):
        pythia_style(path)
    return path


def test_the_pythia_checkpoint_is_written_as_the_hub_writes_it(checkpoint):
    cfg = json.loads((checkpoint / "config.json").read_text())
    if "rotary_pct" in cfg:
        assert "rope_parameters" not in cfg and "attention_bias" not in cfg
        assert any(key.endswith("attention.masked_bias") for key in read_tensors(checkpoint)[0])


def test_logits_equal_transformers(checkpoint):
    assert check_logits(checkpoint, n=24) < 1e-4


def test_the_config_reads_as_transformers_reads_it(checkpoint):
    cfg = from_hf_config(checkpoint)
    hf = hf_model(checkpoint)
    layer = hf.gpt_neox.layers[0]
    attn = cfg.attention
    assert attn.rotary_dim == layer.attention.rotary_ndims and attn.n_kv_heads == attn.n_heads
    assert cfg.parallel_residual == layer.use_parallel_residual and cfg.norm == "layernorm"
    assert attn.bias == (layer.attention.query_key_value.bias is not None)
    assert cfg.tie_embeddings == (hf.lm_head.weight is hf.gpt_neox.embed_in.weight)


def test_bfloat16_logits_within_its_rounding(checkpoint):
    model = load_causal_lm(checkpoint).to(torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    x = tokens(12)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits.float(), rtol=0.05, atol=0.05)


def test_greedy_tokens_equal_transformers_through_both_caches(checkpoint):
    check_generate(checkpoint, lengths=(5, 11), new=8)


def test_a_left_padded_batch_equals_its_rows_alone(checkpoint):
    check_left_padded(checkpoint, lengths=(3, 6))


def test_the_tensor_map_round_trips_every_weight_exactly(checkpoint):
    tensors, _ = read_tensors(checkpoint)
    cfg = load_causal_lm(checkpoint).cfg
    state = gpt_neox.TENSORS.to_attnlab(tensors, cfg)
    back = gpt_neox.TENSORS.to_checkpoint(state, cfg)
    weights = {k: v for k, v in tensors.items() if not gpt_neox.TENSORS.is_ignored(k)}
    assert set(back) == set(weights)
    assert all(torch.equal(back[k], v) for k, v in weights.items())


def test_query_key_value_is_split_head_by_head(checkpoint):
    """Rows [q_h; k_h; v_h] per head h: head 1's key is rows 3 * 16 + 16 .. + 32 of the fused weight."""
    tensors, _ = read_tensors(checkpoint)
    model = load_causal_lm(checkpoint)
    fused = tensors["gpt_neox.layers.0.attention.query_key_value.weight"]
    assert torch.equal(model.layers[0].attention.wk.weight[16:32], fused[64:80])
    assert torch.equal(model.layers[0].attention.wv.weight[48:64], fused[3 * 48 + 32 : 3 * 48 + 48])


def test_the_cost_model_counts_the_cache_and_the_parameters(checkpoint):
    cfg = from_hf_config(checkpoint)
    model = load_causal_lm(checkpoint)
    caches = model.new_caches(2, 40)
    assert sum(c.nbytes for c in caches) == kv_cache_bytes(cfg, 2, 40, torch.float32)
    n = model_param_count(cfg)  # LayerNorm and MLP biases, no gate, the head tied or not
    assert n == sum(p.numel() for p in model.parameters()) == hf_model(checkpoint).num_parameters()


def _tokenizer(path) -> None:
    """A word-level tokenizer whose tokens are the numbers the calibration text holds."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    tok = Tokenizer(WordLevel({str(i): i for i in range(96)} | {"[UNK]": 96}, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


@pytest.mark.parametrize("method", ["mean", "fit"])
def test_fewer_kv_heads_are_written_repeated_and_compute_the_gqa_model(checkpoint, tmp_path, method):
    """``convert --kv-heads 2``: the MHA layout with each KV head repeated for its group (GPTNeoXConfig has no
    KV-head field), whose logits in transformers and back in attnlab are the GQA model's."""
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(" ".join(str(i) for i in range(j, j + 12)) for j in range(20)))
    if not (checkpoint / "tokenizer.json").exists():
        _tokenizer(checkpoint)
    args = ("--method", method) + (("--calib", calib) if method == "fit" else ())
    dst = tmp_path / "dst"
    summary = check_convert(checkpoint, dst, 2, *args)  # transformers' logits == attnlab's
    assert summary["n_kv_heads_after"] == 2 and summary["layout"] == "mha (repeated K/V heads)"
    # nothing stale: the same config.json (the width of query_key_value is the MHA one)
    assert json.loads((dst / "config.json").read_text()) == json.loads(
        (checkpoint / "config.json").read_text()
    )
    n_layers = load_causal_lm(checkpoint).cfg.n_layers
    # per layer: query_key_value (weight, and bias where there is one); "fit" also moves the output weight
    per_layer = (2 if load_causal_lm(checkpoint).cfg.attention.bias else 1) + (method == "fit")
    assert summary["tensors_rewritten"] == n_layers * per_layer

    model = load_causal_lm(checkpoint).float()
    batches = None
    if method == "fit":
        from attnlab.hf.checkpoint import calibration_batches

        batches = calibration_batches(checkpoint, calib, vocab_size=model.cfg.vocab_size)
    gqa = convert_model(model, 2, method, calib=batches)
    assert gqa.cfg.attention.n_kv_heads == 2
    x = tokens(16)
    with torch.no_grad():
        want, back, theirs = gqa(x), load_causal_lm(dst)(x), hf_model(dst)(x).logits
    torch.testing.assert_close(back, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(theirs, want, rtol=1e-4, atol=1e-4)
    # the two query heads of a group read one key and one value: heads 0 and 1 of the written tensor are equal
    fused = read_tensors(dst)[0]["gpt_neox.layers.1.attention.query_key_value.weight"].reshape(4, 3, 16, 64)
    assert torch.equal(fused[0, 1:], fused[1, 1:]) and torch.equal(fused[2, 1:], fused[3, 1:])
    assert not torch.equal(fused[0, 1:], fused[2, 1:])


def test_a_repeated_layout_loads_as_gqa_and_uptraining_keeps_each_group_one_head(checkpoint, tmp_path):
    """The written MHA layout is read back as the GQA model (2 KV heads), and uptraining trains that model: each
    group's repeated heads stay equal in DST (they were trained apart, 4 heads, before), and DST computes in
    attnlab what it computes in transformers."""
    from attnlab.train import UptrainOptions, uptrain

    if not (checkpoint / "tokenizer.json").exists():
        _tokenizer(checkpoint)
    check_convert(checkpoint, tmp_path / "gqa", 2)
    model = load_causal_lm(tmp_path / "gqa")
    assert model.cfg.attention.n_kv_heads == 2 and load_causal_lm(checkpoint).cfg.attention.n_kv_heads == 4
    text = tmp_path / "text"
    text.mkdir()
    for i in range(2):  # the word-level tokenizer's words: numbers
        (text / f"{i}.txt").write_text(" ".join(str((7 * j + i) % 96) for j in range(600)))
    summary = uptrain(
        UptrainOptions(src=tmp_path / "gqa", dst=tmp_path / "up", data=text, steps=3, batch_size=2, seq_len=16,
                       lr=1e-2, warmup=0, save_every=0),
        progress=False,
    )  # fmt: skip
    fused = read_tensors(tmp_path / "up")[0]["gpt_neox.layers.1.attention.query_key_value.weight"]
    heads = fused.reshape(4, 3, 16, 64)
    before = read_tensors(tmp_path / "gqa")[0]["gpt_neox.layers.1.attention.query_key_value.weight"]
    assert not torch.equal(fused, before)  # trained
    assert torch.equal(heads[0, 1:], heads[1, 1:]) and torch.equal(heads[2, 1:], heads[3, 1:])
    assert summary["parameters"] == sum(p.numel() for p in model.parameters())  # the GQA model's
    up = load_causal_lm(tmp_path / "up")
    assert up.cfg.attention.n_kv_heads == 2
    x = tokens(16)
    with torch.no_grad():
        torch.testing.assert_close(up(x), hf_model(tmp_path / "up")(x).logits, rtol=1e-4, atol=1e-4)


def test_sweep_counts_the_kv_bytes_of_the_gqa_model_a_repeated_layout_computes(checkpoint, tmp_path):
    """A QA reproduction: every GQA/MQA row of a GPT-NeoX sweep showed the source's KV bytes (config.json of the
    repeated layout counts every head)."""
    if not (checkpoint / "tokenizer.json").exists():
        _tokenizer(checkpoint)
    text = tmp_path / "text"
    text.mkdir()
    for i in range(2):
        (text / f"{i}.txt").write_text(" ".join(str((7 * j + i) % 96) for j in range(400)))
    result = CliRunner().invoke(
        app,
        ["sweep", str(checkpoint), "--data", str(text), "--variants", "gqa:2,1", "--methods", "mean",
         "--uptrain-steps", "0", "--seq-len", "16", "--eval-windows", "2", "--context", "24", "--warmup", "0",
         "--out", str(tmp_path / "out"), "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = {r["variant"]: r for r in json.loads(result.stdout)["rows"]}
    source = load_causal_lm(checkpoint).cfg
    for name, n_kv in (("source", 4), ("gqa-2", 2), ("mqa", 1)):
        want = kv_cache_bytes(
            source.replace(attention=source.attention.replace(n_kv_heads=n_kv)), 1, 24, "bf16"
        )
        assert rows[name]["kv_bytes_per_token"] == want / 24, name
        assert rows[name]["cache_nbytes"] < rows["source"]["cache_nbytes"] or name == "source"  # timed as GQA


def test_the_buffers_of_an_old_checkpoint_are_copied_on_conversion(tmp_path):
    src = build(transformers.GPTNeoXConfig, tmp_path / "src", **CASES[min(CASES)])
    pythia_style(src)
    convert(src, tmp_path / "dst", "--kv-heads", 1)
    before, after = read_tensors(src)[0], read_tensors(tmp_path / "dst")[0]
    assert set(before) == set(after)
    buffers = [k for k in before if gpt_neox.TENSORS.is_ignored(k)]
    assert len(buffers) == 3 * 2 and all(torch.equal(before[k], after[k]) for k in buffers)


def test_saving_new_weights_like_an_old_checkpoint_copies_its_boolean_mask(tmp_path):
    """``save_causal_lm(like=src)`` (training's writer) copies buffers that are not float (Pythia's causal mask is
    bool) as they are, and writes the new weight values."""
    src = build(transformers.GPTNeoXConfig, tmp_path / "src", **CASES[min(CASES)])
    pythia_style(src)
    model = load_causal_lm(src)
    state = {k: v + 0.01 for k, v in model.state_dict().items()}
    save_causal_lm(state, model.cfg, tmp_path / "dst", like=src)
    before, after = read_tensors(src)[0], read_tensors(tmp_path / "dst")[0]
    assert set(before) == set(after)
    assert all(torch.equal(before[k], after[k]) for k in before if gpt_neox.TENSORS.is_ignored(k))
    assert after["gpt_neox.layers.0.attention.bias"].dtype == torch.bool
    assert torch.equal(after["embed_out.weight"], state["output.weight"])


def test_mla_conversion_is_refused_with_the_reason(checkpoint, tmp_path):
    result = CliRunner().invoke(app, ["convert", str(checkpoint), str(tmp_path / "mla"), "--to", "mla",
                                      "--kv-lora-rank", "8"])  # fmt: skip
    assert result.exit_code == 2 and "cannot be converted to MLA" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "LayerNorm with a bias" in result.stderr and "GELU MLP with biases" in result.stderr
    cfg = from_hf_config(checkpoint)
    assert ("parallel residuals" in result.stderr) == cfg.parallel_residual
    assert ("a query bias" in result.stderr) == cfg.attention.bias
    assert "rotary" not in result.stderr and "RoPE on" not in result.stderr  # partial rotary is no obstacle
    assert not (tmp_path / "mla").exists()


def test_compare_reads_the_config(checkpoint):
    result = CliRunner().invoke(app, ["compare", "--model", str(checkpoint / "config.json"), "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]
    native = next(r for r in rows if r["native"])
    assert native["kv_cache_bytes_per_token"] == kv_cache_bytes(from_hf_config(checkpoint), 1, 1, "bf16")


YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, partial_rotary_factor=0.5)


@pytest.mark.parametrize(
    "fields",
    [
        dict(rotary_pct=0.0),  # no dims turn
        dict(rotary_pct=0.26),  # int(16 * 0.26) = 4, as transformers truncates
        dict(hidden_act="gelu_fast"),
        dict(hidden_act="gelu_pytorch_tanh"),
        dict(rope_parameters=YARN),  # rope_theta: rotary_emb_base's default
    ],
    ids=["rotary_pct 0", "rotary_pct 0.26", "gelu_fast", "gelu_pytorch_tanh", "yarn"],
)
def test_other_options_equal_transformers(tmp_path, fields):
    src = build(transformers.GPTNeoXConfig, tmp_path / "src", **(SMALL | fields))
    assert check_logits(src, n=24) < 1e-4


def test_the_writer_keeps_the_source_config_and_writes_what_transformers_computes(checkpoint, tmp_path):
    base = json.loads((checkpoint / "config.json").read_text())
    model = load_causal_lm(checkpoint)
    assert to_hf_config(model.cfg, "gpt_neox", base) == base  # nothing changed: nothing written differently
    save_model(model, tmp_path / "same", "gpt_neox", base_config=base)
    x = tokens(12)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tmp_path / "same")(x).logits, model(x), rtol=1e-4, atol=1e-4)
    # a changed RoPE is written as rope_parameters, the legacy fields dropped
    attn = model.cfg.attention.replace(rope_dim=8, rope_theta=1234.0, rope_scaling=())
    hf = to_hf_config(model.cfg.with_attention(attn), "gpt_neox", base)
    assert "rotary_pct" not in hf and "rotary_emb_base" not in hf and "rope_scaling" not in hf
    assert hf["rope_parameters"] == dict(rope_type="default", rope_theta=1234.0, partial_rotary_factor=0.5)
    assert from_hf_config(hf).attention == attn


@pytest.mark.parametrize("rope_dim", [None, 30, 12])
def test_a_model_built_in_attnlab_is_written_as_a_gpt_neox_checkpoint(tmp_path, rope_dim):
    """head_dim 44: rotary_pct 30 / 44 in floats gives int(44 * pct) = 29, so the writer writes the next float up."""
    cfg = ModelConfig(
        vocab_size=97,
        n_layers=2,
        attention=AttentionConfig(d_model=88, n_heads=2, bias=True, rope_theta=777.0, rope_dim=rope_dim),
        ffn_dim=72,
        max_seq_len=32,
        norm="layernorm",
        mlp="gelu_tanh",
        mlp_bias=True,
        parallel_residual=rope_dim == 30,
    )
    model = Transformer(cfg)
    model.init_weights(seed=3)
    save_model(model, tmp_path / "dst", "gpt_neox")
    assert from_hf_config(tmp_path / "dst").replace(name="") == cfg
    assert hf_model(tmp_path / "dst").gpt_neox.layers[0].attention.rotary_ndims == (rope_dim or 44)
    x = tokens(12)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tmp_path / "dst")(x).logits, model(x), rtol=1e-4, atol=1e-4)


def test_the_writer_refuses_what_gpt_neox_cannot_compute():
    cfg = ModelConfig(
        vocab_size=97,
        n_layers=1,
        attention=AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2, bias=True),
        ffn_dim=96,
        norm="layernorm",
        mlp="gelu",
        mlp_bias=True,
    )
    with pytest.raises(ValueError, match=r"n_kv_heads=2 of n_heads=4 \(GPTNeoXConfig has no KV-head field"):
        to_hf_config(cfg, "gpt_neox")
    with pytest.raises(ValueError, match="mlp='swiglu'"):
        to_hf_config(
            cfg.replace(mlp="swiglu").with_attention(cfg.attention.replace(n_kv_heads=4)), "gpt_neox"
        )


BASE = dict(model_type="gpt_neox", vocab_size=97, num_hidden_layers=2, intermediate_size=96, hidden_size=64,
            num_attention_heads=4)  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(hidden_act="relu"), "hidden_act='relu' is not supported"),
        (dict(hidden_act="quick_gelu"), "hidden_act='quick_gelu' is not supported"),
        (dict(rotary_pct=0.19), "rotary_pct=0.19 gives 3 rotary dims"),
        (
            dict(rope_parameters=dict(rope_theta=1e4, partial_rotary_factor=1.5)),
            "partial_rotary_factor=1.5 must",
        ),
        (dict(head_dim=32), "head_dim=32 is not supported"),
        (
            dict(rope_scaling=dict(rope_type="ntk-by-parts", factor=2.0)),
            "rope_type='ntk-by-parts' is not supported",
        ),
        (dict(use_parallel_residual="yes"), "'use_parallel_residual' must be true or false"),
        (dict(rotary_emb_base="big"), "'rotary_emb_base' must be a number"),
    ],
)
def test_what_attnlab_does_not_model_is_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        from_hf_config(BASE | fields)


def test_a_refused_field_is_one_line_on_the_command_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE | {"hidden_act": "relu"}))
    result = CliRunner().invoke(app, ["compare", "--model", str(tmp_path / "config.json")])
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0 and "hidden_act='relu' is not supported" in result.stderr


def test_the_legacy_fields_fill_only_what_rope_parameters_lack():
    """As GPTNeoXConfig.convert_rope_params_to_dict: rope_parameters (or rope_scaling) first, then rotary_emb_base and
    rotary_pct; a top-level rope_theta is not read."""
    legacy = dict(rotary_emb_base=1000, rotary_pct=0.5, rope_theta=777)
    read = from_hf_config(BASE | legacy).attention
    assert (read.rope_theta, read.rotary_dim) == (1000, 8)
    params = dict(rope_parameters=dict(rope_type="default", rope_theta=500, partial_rotary_factor=1.0))
    read = from_hf_config(BASE | legacy | params).attention
    assert (read.rope_theta, read.rotary_dim) == (500, 16)
    read = from_hf_config(BASE | dict(rope_theta=777)).attention
    assert (read.rope_theta, read.rotary_dim) == (10000, 4)  # GPTNeoXConfig's defaults
    for raw in (BASE | legacy, BASE | legacy | params, BASE | dict(rope_theta=777)):
        hf = transformers.GPTNeoXConfig(**{k: v for k, v in raw.items() if k != "model_type"})
        attn = transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXAttention(hf, 0)
        rope = transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXRotaryEmbedding(hf)
        ours = from_hf_config(raw).attention
        assert ours.rotary_dim == attn.rotary_ndims and ours.rope_theta == hf.rope_parameters["rope_theta"]
        assert 2 * len(rope.inv_freq) == ours.rotary_dim
