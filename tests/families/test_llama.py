"""The Llama family (``attnlab.families.llama``): Llama 3.x (llama3 RoPE), Mistral (sliding window), Ministral
(sliding and full layers), Qwen2 / Qwen2.5 (yarn, sliding layers), against their transformers classes with the same
random weights."""

from __future__ import annotations

import json
import re

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
from typer.testing import CliRunner

from attnlab.cli import app
from attnlab.cost import kv_cache_bytes
from attnlab.hf import load_causal_lm
from attnlab.hf_config import from_hf_config, to_hf_config

SMALL = dict(
    hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2
)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16, rope_theta=500000.0)  # fmt: skip
DYNAMIC_ROPE = dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0)
YARN_ROPE = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, rope_theta=10000.0)
CASES = {
    "llama-3.2 (llama3 RoPE, tied)": (
        transformers.LlamaConfig,
        dict(SMALL, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True, max_position_embeddings=128),
    ),
    "llama (dynamic RoPE)": (
        transformers.LlamaConfig,
        dict(SMALL, rope_parameters=DYNAMIC_ROPE, max_position_embeddings=16),
    ),
    "mistral (window 8)": (
        transformers.MistralConfig,
        dict(SMALL, sliding_window=8, max_position_embeddings=64),
    ),
    "ministral (full and sliding layers)": (
        transformers.MinistralConfig,
        dict(
            SMALL,
            num_hidden_layers=3,
            head_dim=8,  # (transformers' MinistralAttention fails on the default None)
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            max_position_embeddings=64,
        ),
    ),
    "qwen2.5 (yarn, sliding layers)": (
        transformers.Qwen2Config,
        dict(
            SMALL,
            num_hidden_layers=3,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
            rope_parameters=YARN_ROPE,
            max_position_embeddings=64,
        ),
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    cls, fields = CASES[request.param]
    return build(cls, tmp_path_factory.mktemp("llama") / "src", **fields)


def test_logits_equal_transformers_also_past_the_window(checkpoint):
    check_logits(checkpoint, n=24)  # 24 tokens: three windows of 8, and past the 16 original positions


def test_bfloat16_logits_within_its_rounding(checkpoint):
    model, theirs = load_causal_lm(checkpoint).to(torch.bfloat16), transformers.AutoModelForCausalLM
    hf = theirs.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    x = tokens(12)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits.float(), rtol=0.05, atol=0.05)


def test_greedy_tokens_equal_transformers_through_both_caches(checkpoint):
    if "dynamic" in str(checkpoint.parent):
        pytest.skip("dynamic RoPE: transformers keeps grown frequencies between calls (stateful)")
    check_generate(checkpoint, lengths=(5, 11), new=8)  # 11 + 8 tokens: past the window of 8 in the ring


def test_a_left_padded_batch_equals_its_rows_alone(checkpoint):
    check_left_padded(checkpoint, lengths=(3, 13))  # 13 tokens: past the window of 8, 10 pads before row 0


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
    src_cfg = json.loads((checkpoint / "config.json").read_text())
    dst_cfg = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert dst_cfg["num_key_value_heads"] == 1 and summary["n_kv_heads_after"] == 1
    # nothing stale: every other field as the source wrote it
    assert {k: v for k, v in dst_cfg.items() if k != "num_key_value_heads"} == {
        k: v for k, v in src_cfg.items() if k != "num_key_value_heads"
    }


def test_mla_conversion_is_refused_where_deepseek_cannot_express_it(checkpoint, tmp_path):
    result = CliRunner().invoke(app, ["convert", str(checkpoint), str(tmp_path / "mla"), "--to", "mla",
                                      "--kv-lora-rank", "8"])  # fmt: skip
    assert result.exit_code == 2 and "cannot be converted to MLA" in result.stderr
    assert "rope_type" in result.stderr or "sliding window" in result.stderr
    assert not (tmp_path / "mla").exists()


def test_compare_reads_the_config(checkpoint):
    result = CliRunner().invoke(app, ["compare", "--model", str(checkpoint / "config.json"), "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]
    native = next(r for r in rows if r["native"])
    assert native["kv_cache_bytes_per_token"] == kv_cache_bytes(from_hf_config(checkpoint), 1, 1, "bf16")


def test_an_unknown_rope_type_is_one_line(tmp_path):
    src = build(transformers.LlamaConfig, tmp_path / "src", **SMALL)
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "ntk-by-parts", "rope_theta": 10000.0}
    (src / "config.json").write_text(json.dumps(cfg))
    result = CliRunner().invoke(app, ["eval", str(src), "--data", str(src / "config.json")])
    assert result.exit_code == 2
    assert "rope_type='ntk-by-parts' is not supported" in result.stderr


@pytest.mark.parametrize("config_class", [transformers.LlamaConfig, transformers.Qwen2Config, transformers.Phi3Config,
                                          transformers.Qwen3Config])  # fmt: skip
def test_num_key_value_heads_null_is_read_as_transformers_reads_it(config_class):
    """Present as null, transformers' config classes take as many KV heads as query heads; attnlab refused it."""
    raw = config_class(hidden_size=64, num_attention_heads=4, num_key_value_heads=2).to_dict()
    raw["num_key_value_heads"] = None
    theirs = config_class(**{k: v for k, v in raw.items() if k != "model_type"})
    assert from_hf_config(raw).attention.n_kv_heads == theirs.num_key_value_heads == 4


@pytest.mark.parametrize("config_class", [transformers.LlamaConfig, transformers.MistralConfig,
                                          transformers.Qwen2Config])  # fmt: skip
def test_missing_kv_heads_and_positions_mean_what_transformers_defaults_to(config_class):
    """Without num_key_value_heads MistralConfig has 8 KV heads and Qwen2Config 32 (attnlab read the head count:
    MHA); without max_position_embeddings LlamaConfig has 2048, MistralConfig 131072, Qwen2Config 32768 (attnlab
    read 4096). Read as transformers reads them, refused where its default does not divide the heads, and written
    so that transformers reads back the same model."""
    model_type = config_class.model_type
    for n_heads in (32, 16):
        raw = dict(model_type=model_type, vocab_size=64, hidden_size=4 * n_heads, intermediate_size=64,
                   num_hidden_layers=2, num_attention_heads=n_heads)  # fmt: skip
        theirs = config_class(**{k: v for k, v in raw.items() if k != "model_type"})
        if n_heads % theirs.num_key_value_heads:
            with pytest.raises(
                ValueError, match=f"num_key_value_heads={theirs.num_key_value_heads} does not divide"
            ):
                from_hf_config(raw)
            continue
        ours = from_hf_config(raw)
        assert ours.attention.n_kv_heads == theirs.num_key_value_heads
        assert ours.max_seq_len == theirs.max_position_embeddings
        for n_kv, positions in (
            (n_heads, 4096),
            (theirs.num_key_value_heads, theirs.max_position_embeddings),
        ):
            cfg = ours.replace(attention=ours.attention.replace(n_kv_heads=n_kv), max_seq_len=positions)
            written = to_hf_config(cfg, model_type)
            back = config_class(**{k: v for k, v in written.items() if k != "model_type"})
            assert (back.num_key_value_heads, back.max_position_embeddings) == (n_kv, positions)


@pytest.mark.parametrize(
    ("model_type", "change", "named"),
    [
        ("llama", {"hidden_act": "gelu"}, "src/config.json: hidden_act='gelu' is not supported"),
        (  # transformers cannot build a sliding layer's mask without a window; Qwen3 was refused, Qwen2 read as full
            "qwen2",
            {"use_sliding_window": False, "layer_types": ["full_attention", "sliding_attention"]},
            "src/config.json: layer_types names sliding_attention layers but no window is set",
        ),
        (  # Llama 4's chunked attention: another model, refused by the field's name
            "qwen2",
            {"use_sliding_window": True, "layer_types": ["full_attention", "chunked_attention"]},
            "src/config.json: layer_types must list num_hidden_layers=2 of full_attention, sliding_attention",
        ),
        # named ModelConfig.norm_eps and AttentionConfig.rope_theta, or "llama config.json" without the file
        ("llama", {"rms_norm_eps": -1}, "src/config.json: field 'rms_norm_eps' must be >= 0, got -1"),
        (
            "llama",
            {"rope_parameters": {"rope_theta": 0}},
            "src/config.json: field 'rope_theta' must be > 0, got 0",
        ),
        (
            "llama",
            {"rope_parameters": {"rope_type": "default", "rope_theta": -5}},
            "'rope_theta' must be > 0, got -5",
        ),
        (
            "llama",
            {"rope_parameters": {"rope_theta": "1e4"}},
            "src/config.json: field 'rope_theta' must be a number",
        ),
        ("olmo2", {"rms_norm_eps": -1e-6}, "src/config.json: field 'rms_norm_eps' must be >= 0, got -1e-06"),
    ],
)
def test_a_field_attnlab_does_not_model_is_refused_naming_it(tmp_path, model_type, change, named):
    src = build(transformers.LlamaConfig, tmp_path / "src", **SMALL)
    cfg = json.loads((src / "config.json").read_text()) | {"model_type": model_type}
    (src / "config.json").write_text(json.dumps(cfg | change))
    result = CliRunner().invoke(app, ["eval", str(src), "--data", str(src / "config.json")])
    assert result.exit_code == 2 and named in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        ("missing", "do not match its config.json: missing model.layers.1.self_attn.k_proj.weight"),
        ("transposed", "model.layers.1.mlp.down_proj.weight (80, 48) where config.json gives (48, 80)"),
        ("extra layer", "not in its model: model.layers.2.input_layernorm.weight, "),
        ("nan", "the checkpoint's tensor model.layers.1.mlp.down_proj.weight holds NaN"),
        # a tied model's head is its embedding: lm_head.weight, which no file of it holds, was named too
        ("tied vocab", "model.embed_tokens.weight (97, 48) where config.json gives (96, 48)\n"),
        ("tied missing", "do not match its config.json: missing model.embed_tokens.weight\n"),
    ],
)
def test_a_damaged_checkpoint_is_named_by_its_own_tensor_names(tmp_path, damage, named):
    """The errors named attnlab's internal names (layers.1.attention.wk.weight, output.weight), which no weight
    file holds, and a misshapen tensor was torch's message for every layer on one line."""
    from safetensors.torch import load_file, save_file

    tied = damage.startswith("tied")
    src = build(transformers.LlamaConfig, tmp_path / "src", **SMALL, vocab_size=97, tie_word_embeddings=tied)
    weights = src / "model.safetensors"
    tensors = load_file(weights)
    if damage == "tied vocab":
        cfg = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps(cfg | {"vocab_size": 96}))
    elif damage == "tied missing":
        del tensors["model.embed_tokens.weight"]
    elif damage == "missing":
        del tensors["model.layers.1.self_attn.k_proj.weight"]
    elif damage == "transposed":
        for i in (0, 1):
            name = f"model.layers.{i}.mlp.down_proj.weight"
            tensors[name] = tensors[name].T.contiguous()
    elif damage == "extra layer":
        tensors |= {
            k.replace("layers.1.", "layers.2."): v.clone() for k, v in tensors.items() if "layers.1." in k
        }
    else:
        tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    result = CliRunner().invoke(app, ["eval", str(src), "--data", str(src / "config.json")])
    assert result.exit_code == 2 and named in result.stderr, result.output
    assert "layers.0.mlp.down_proj" not in result.stderr or damage == "transposed"
    assert "wk.weight" not in result.stderr and "feed_forward" not in result.stderr
    assert "lm_head" not in result.stderr
    if not tied:  # the public Llama loader names them the same way
        from attnlab.hf import load_llama

        with pytest.raises(ValueError, match=re.escape(named.strip())):
            load_llama(src)


def test_pretraining_tp_is_read_as_the_model_it_sliced(tmp_path):
    """Llama 2's configs say pretraining_tp 2 (or 1): transformers 4.x summed sliced products back to the same model
    and transformers 5 ignores it; attnlab refused such checkpoints. Its logits now equal transformers', and a
    conversion keeps the field."""
    src = build(transformers.LlamaConfig, tmp_path / "src", **SMALL)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg | {"pretraining_tp": 2}))
    check_logits(src)
    check_convert(src, tmp_path / "dst", 1)
    assert json.loads((tmp_path / "dst" / "config.json").read_text())["pretraining_tp"] == 2


@pytest.mark.parametrize(
    "rope",
    [
        YARN_ROPE,
        LLAMA3_ROPE,
        {k: v for k, v in LLAMA3_ROPE.items() if k != "original_max_position_embeddings"},
        dict(
            rope_type="longrope",
            short_factor=[1.0] * 16,
            long_factor=[1.0 + i / 4 for i in range(16)],
            rope_theta=1e4,
        ),
    ],
    ids=["yarn", "llama3", "llama3 top-level only", "longrope"],
)
def test_a_top_level_original_max_position_embeddings_wins_as_in_transformers(tmp_path, rope):
    """transformers 5 takes a top-level original_max_position_embeddings over one inside the RoPE parameters for
    llama3, yarn and longrope. attnlab read the inner one (or max_position_embeddings): logits differed from the
    second position on, and llama3 with the top-level field alone was refused."""
    src = build(transformers.LlamaConfig, tmp_path / "src", **SMALL, head_dim=32, rope_parameters=rope,
                max_position_embeddings=64, initializer_range=0.25)  # fmt: skip
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg | {"original_max_position_embeddings": 8}))
    check_logits(src, n=40)


def _tokenizer(path):
    """A word-level tokenizer whose tokens are the numbers the calibration text holds."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    tok = Tokenizer(WordLevel({str(i): i for i in range(96)} | {"[UNK]": 96}, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def test_a_family_module_and_a_registry_entry_are_all_a_new_family_needs(tmp_path, monkeypatch):
    """A family defined here, in the test: registered, it is loaded, converted and costed like any other."""
    from attnlab import families
    from attnlab.families import llama

    mine = families.Family(
        "llamalike", ("llamalike",), llama.read, llama.write, llama.TENSORS, {"llamalike": "LlamaForCausalLM"}
    )
    monkeypatch.setitem(families.FAMILIES, "llamalike", mine)
    src = build(transformers.LlamaConfig, tmp_path / "src", **SMALL)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg | {"model_type": "llamalike"}))
    model = load_causal_lm(src)
    with torch.no_grad():
        x = tokens(8)
        reference = transformers.LlamaForCausalLM.from_pretrained(src).eval()  # the class, by its name
        torch.testing.assert_close(model(x), reference(x).logits, rtol=1e-4, atol=1e-4)
    summary = convert(src, tmp_path / "dst", "--kv-heads", 1)
    assert (
        summary["model_type"] == "llamalike"
        and load_causal_lm(tmp_path / "dst").cfg.attention.n_kv_heads == 1
    )


def _edited(src, dst, **changes):
    """A copy of checkpoint ``src`` at ``dst`` with its config.json fields changed."""
    import shutil

    shutil.copytree(src, dst)
    hf = json.loads((dst / "config.json").read_text()) | changes
    (dst / "config.json").write_text(json.dumps(hf))
    return dst


def test_a_mistral_config_with_layer_types_is_read_as_transformers_reads_it(tmp_path):
    # transformers loads it as Ministral (full layers where the list says so); attnlab slid every layer (logits
    # 3.7 apart on a window of 8)
    src = build(
        transformers.MistralConfig, tmp_path / "src", **SMALL, sliding_window=8, max_position_embeddings=64
    )
    types = ["full_attention", "sliding_attention"]
    edited = _edited(src, tmp_path / "typed", layer_types=types)
    assert hf_model(edited).config.model_type == "ministral"
    check_logits(edited, n=24)
    x = tokens(24)
    with torch.no_grad():
        assert (load_causal_lm(edited)(x) - load_causal_lm(src)(x)).abs().max() > 0.1  # the full layer counts
    assert to_hf_config(from_hf_config(edited), "mistral")["layer_types"] == types  # written back
    with pytest.raises(
        ValueError, match=r"layer_types names sliding_attention layers but no window is set \(sl"
    ):
        from_hf_config(_edited(src, tmp_path / "no-window", layer_types=types, sliding_window=None))


@pytest.mark.parametrize(("model_type", "field"), [("mistral", "attention_bias"), ("mistral", "mlp_bias"),
                                                   ("qwen2", "mlp_bias")])  # fmt: skip
def test_bias_flags_only_llama_reads_are_ignored_elsewhere_as_in_transformers(tmp_path, model_type, field):
    # attnlab read Llama's attention_bias / mlp_bias on every model_type of the family, and refused these
    # checkpoints for missing bias tensors that transformers' Mistral and Qwen2 classes never make
    cls = {"mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config}[model_type]
    src = build(cls, tmp_path / "src", **SMALL, max_position_embeddings=64)
    check_logits(_edited(src, tmp_path / "flagged", **{field: True}), n=12)


def test_a_window_no_layer_uses_is_no_window(tmp_path):
    # a Ministral whose layer_types are all full_attention kept its sliding_window, and convert --to mla refused it
    # for "a sliding window of 8 tokens" though every layer attends to everything (transformers' model does)
    src = build(
        transformers.MinistralConfig, tmp_path / "src", **SMALL, head_dim=8, sliding_window=8,
        layer_types=["full_attention", "full_attention"], max_position_embeddings=64,
    )  # fmt: skip
    assert from_hf_config(src).sliding is None
    check_logits(src, n=24)
    done = CliRunner().invoke(
        app, ["convert", str(src), str(tmp_path / "mla"), "--to", "mla", "--kv-lora-rank", "8"]
    )
    assert done.exit_code == 0, done.output
