"""The GLM families (``attnlab.families.glm``, ``attnlab.families.chatglm``): GLM (pre norms) and GLM-4 (sandwich
norms) against transformers' ``GlmForCausalLM`` / ``Glm4ForCausalLM``; ChatGLM2/3 checkpoints in THUDM's own layout,
built here from random weights, against ``GlmForCausalLM`` holding the same weights mapped as transformers'
``convert_glm_weights_to_hf.py`` maps them (``glm_oracle``: transformers has no ChatGLM class)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import family_oracle
import pytest
import torch
import transformers
from family_oracle import (
    VOCAB,
    build,
    check_convert,
    check_convert_mla,
    check_generate,
    check_left_padded,
    check_logits,
    deepseek_without_latent_norm,
    tokens,
)
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from attnlab.cli import app
from attnlab.convert import convert_model_to_mla
from attnlab.convert.mla import full_rank
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

# A ChatGLM2/3 config.json as THUDM writes it (chatglm2-6b's fields), at a small size.
CHATGLM = {
    "model_type": "chatglm",
    "architectures": ["ChatGLMModel"],
    "auto_map": {"AutoConfig": "configuration_chatglm.ChatGLMConfig",
                 "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration"},
    "add_bias_linear": False, "add_qkv_bias": True, "apply_query_key_layer_scaling": True,
    "apply_residual_connection_post_layernorm": False, "attention_dropout": 0.0, "attention_softmax_in_fp32": True,
    "bias_dropout_fusion": True, "ffn_hidden_size": 40, "fp32_residual_connection": False, "hidden_dropout": 0.0,
    "hidden_size": 48, "kv_channels": 16, "layernorm_epsilon": 1e-05, "multi_query_attention": True,
    "multi_query_group_num": 2, "num_attention_heads": 6, "num_layers": 2, "original_rope": True,
    "padded_vocab_size": VOCAB, "post_layer_norm": True, "prefix_projection": False, "pre_seq_len": None,
    "quantization_bit": 0, "rmsnorm": True, "seq_length": 64, "tie_word_embeddings": False, "torch_dtype": "float32",
    "use_cache": True, "eos_token_id": 2, "pad_token_id": 0,
}  # fmt: skip

CASES = {
    "glm (q/k/v biases, half rotary)": (transformers.GlmConfig, SMALL),
    "glm-4 (sandwich norms)": (transformers.Glm4Config, SMALL),
    "glm-4 (yarn, full rotary, tied)": (
        transformers.Glm4Config,
        dict(SMALL, rope_parameters=YARN_ROPE, tie_word_embeddings=True),
    ),
    "chatglm2 (2 groups, qkv bias)": ("chatglm", {}),
    "chatglm3-32k (rope_ratio 50, 3 groups)": ("chatglm", dict(rope_ratio=50, multi_query_group_num=3)),
    "chatglm (MHA per-head qkv, add_bias_linear)": (
        "chatglm",
        dict(multi_query_attention=False, add_bias_linear=True, add_qkv_bias=False),
    ),
}


# ---- ChatGLM checkpoints and their GLM oracle ----------------------------------------------------------------


def build_chatglm(path: Path, seed: int = 0, **fields) -> Path:
    """A ChatGLM checkpoint in THUDM's layout with random weights (norm gains and biases off their init), and the
    ``rotary_pos_emb.inv_freq`` buffer THUDM's checkpoints hold."""
    raw = CHATGLM | fields
    g = torch.Generator().manual_seed(seed)
    d, heads, hd, ffn = (
        raw["hidden_size"],
        raw["num_attention_heads"],
        raw["kv_channels"],
        raw["ffn_hidden_size"],
    )
    groups = raw["multi_query_group_num"] if raw["multi_query_attention"] else heads
    linear_bias = raw["add_bias_linear"]

    def weight(*shape):
        return torch.randn(shape, generator=g) * 0.08

    def small(n, mean=0.0):
        return mean + 0.2 * torch.randn(n, generator=g)

    t = {"transformer.embedding.word_embeddings.weight": weight(VOCAB, d)}
    for i in range(raw["num_layers"]):
        p = f"transformer.encoder.layers.{i}."
        rows = heads * hd + 2 * groups * hd
        t[p + "input_layernorm.weight"] = small(d, 1.0)
        t[p + "self_attention.query_key_value.weight"] = weight(rows, d)
        if raw["add_qkv_bias"] or linear_bias:
            t[p + "self_attention.query_key_value.bias"] = small(rows)
        t[p + "self_attention.dense.weight"] = weight(d, heads * hd)
        t[p + "post_attention_layernorm.weight"] = small(d, 1.0)
        t[p + "mlp.dense_h_to_4h.weight"] = weight(2 * ffn, d)
        t[p + "mlp.dense_4h_to_h.weight"] = weight(d, ffn)
        if linear_bias:
            t[p + "self_attention.dense.bias"] = small(d)
            t[p + "mlp.dense_h_to_4h.bias"] = small(2 * ffn)
            t[p + "mlp.dense_4h_to_h.bias"] = small(d)
    t["transformer.encoder.final_layernorm.weight"] = small(d, 1.0)
    t["transformer.output_layer.weight"] = weight(VOCAB, d)
    n_elem = hd // 2  # THUDM's RotaryEmbedding(kv_channels // 2): a buffer its forward does not read
    t["transformer.rotary_pos_emb.inv_freq"] = 1.0 / (10000 ** (torch.arange(0, n_elem, 2).float() / n_elem))
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    return path


# THUDM's ChatGLMConfig defaults, for the fields a config.json leaves out
CHATGLM_DEFAULTS = dict(kv_channels=128, seq_length=2048, layernorm_epsilon=1e-5, rope_ratio=1, add_qkv_bias=False,
                        add_bias_linear=False, multi_query_attention=False, multi_query_group_num=1)  # fmt: skip

# ChatGLM -> GLM tensor names, as transformers' convert_glm_weights_to_hf.py renames them
RENAMES = (
    (r"^transformer\.output_layer\.", "lm_head."),
    (r"^transformer\.embedding\.word_embeddings\.", "model.embed_tokens."),
    (r"^transformer\.encoder\.final_layernorm\.", "model.norm."),
    (r"^transformer\.encoder\.layers\.", "model.layers."),
    (r"\.self_attention\.dense\.", ".self_attn.o_proj."),
    (r"\.mlp\.dense_h_to_4h\.", ".mlp.gate_up_proj."),
    (r"\.mlp\.dense_4h_to_h\.", ".mlp.down_proj."),
)


def glm_oracle(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' GlmForCausalLM with a ChatGLM checkpoint's weights: its config translated as transformers'
    conversion does (theta = 10000 * rope_ratio, half rotary, KV heads = multi_query_group_num), query_key_value split
    into q/k/v_proj by its layout, and with add_bias_linear, biased o_proj and MLP layers."""
    raw = CHATGLM_DEFAULTS | json.loads((path / "config.json").read_text())
    heads, hd, d = raw["num_attention_heads"], raw["kv_channels"], raw["hidden_size"]
    mqa = raw["multi_query_attention"]
    groups = raw["multi_query_group_num"] if mqa else heads
    linear_bias = raw["add_bias_linear"]
    config = transformers.GlmConfig(
        vocab_size=raw["padded_vocab_size"],
        hidden_size=d,
        intermediate_size=raw["ffn_hidden_size"],
        num_hidden_layers=raw["num_layers"],
        num_attention_heads=heads,
        num_key_value_heads=groups,
        head_dim=hd,
        max_position_embeddings=raw["seq_length"],
        rms_norm_eps=raw["layernorm_epsilon"],
        rope_parameters=dict(
            rope_type="default", rope_theta=10000.0 * raw["rope_ratio"], partial_rotary_factor=0.5
        ),
        attention_bias=raw["add_qkv_bias"] or linear_bias,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    model = transformers.GlmForCausalLM(config)
    if linear_bias:  # GLM has no such biases: its own forward with biased linear layers in their place
        for layer in model.model.layers:
            for parent, name in (
                (layer.self_attn, "o_proj"),
                (layer.mlp, "gate_up_proj"),
                (layer.mlp, "down_proj"),
            ):
                old = getattr(parent, name)
                setattr(parent, name, torch.nn.Linear(old.in_features, old.out_features, bias=True))
    state = {}
    for key, value in load_file(str(path / "model.safetensors")).items():
        if key.endswith("rotary_pos_emb.inv_freq"):
            continue
        for pattern, new in RENAMES:
            key = re.sub(pattern, new, key)
        if ".query_key_value." in key:
            if mqa:  # [q; k; v]
                q, k, v = value.split([heads * hd, groups * hd, groups * hd])
            else:  # head by head: [q_0; k_0; v_0; q_1; ...]
                per_head = value.reshape(heads, 3, hd, *value.shape[1:])
                q, k, v = (per_head[:, j].reshape(heads * hd, *value.shape[1:]) for j in range(3))
            for name, part in zip("qkv", (q, k, v), strict=True):
                state[key.replace(".self_attention.query_key_value.", f".self_attn.{name}_proj.")] = part
        else:
            state[key] = value
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval()


def model_type(path: Path) -> str:
    return json.loads((path / "config.json").read_text())["model_type"]


def oracle(path: Path, dtype: torch.dtype = torch.float32):
    """The transformers model a checkpoint is checked against."""
    if model_type(path) == "chatglm":
        return glm_oracle(path, dtype)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.fixture(autouse=True)
def _oracle(monkeypatch):
    """family_oracle's checks ask ``hf_model`` for transformers' model: for ChatGLM, the GLM oracle."""
    monkeypatch.setattr(family_oracle, "hf_model", oracle)


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    cls, fields = CASES[request.param]
    path = tmp_path_factory.mktemp("glm") / "src"
    if cls == "chatglm":
        return build_chatglm(path, **fields)
    return build(cls, path, **fields)


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
    if src_cfg["model_type"] != "chatglm":
        assert dst_cfg["num_key_value_heads"] == 1 and changed == {"num_key_value_heads"}
        return
    # ChatGLM: one KV group, the fused QKV rewritten at the new width ([q; k; v], also from an MHA checkpoint)
    assert dst_cfg["multi_query_attention"] is True and dst_cfg["multi_query_group_num"] == 1
    assert changed <= {"multi_query_group_num", "multi_query_attention"}
    heads, hd, d = src_cfg["num_attention_heads"], src_cfg["kv_channels"], src_cfg["hidden_size"]
    before, after = (
        load_file(str(checkpoint / "model.safetensors")),
        load_file(str(dst / "model.safetensors")),
    )
    assert after.keys() == before.keys()
    qkv = "transformer.encoder.layers.0.self_attention.query_key_value.weight"
    assert after[qkv].shape == (heads * hd + 2 * hd, d)
    buffer = "transformer.rotary_pos_emb.inv_freq"
    assert torch.equal(after[buffer], before[buffer])  # copied as it was


def test_mla_conversion_is_refused_naming_every_obstacle(checkpoint, tmp_path):
    # Every case here has a query bias (GLM-4-9B's attention_bias, chatglm2/3's add_qkv_bias) or add_bias_linear;
    # GLM-4 adds sandwich norms. Partial, interleaved rotary is no obstacle and is not named.
    result = CliRunner().invoke(app, ["convert", str(checkpoint), str(tmp_path / "mla"), "--to", "mla",
                                      "--kv-lora-rank", "8"])  # fmt: skip
    assert result.exit_code == 2 and "cannot be converted to MLA" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    cfg = from_hf_config(checkpoint)
    named = {
        "sandwich norms": cfg.norm_placement == "sandwich",
        "a query bias": cfg.attention.bias,
        "biases on the MLP (add_bias_linear)": cfg.mlp_bias,
    }
    assert {k for k in named if k in result.stderr} == {k for k, v in named.items() if v}
    assert "interleaved" not in result.stderr and "rotary" not in result.stderr
    assert not (tmp_path / "mla").exists()


# GLM and ChatGLM without a query bias (attention_bias / add_qkv_bias false): rotary on the first 8 of 16 dims in
# interleaved pairs. One KV head for the exact case, two for the approximate one.
MLA_CASES = {
    "glm": lambda path, n_kv: build(
        transformers.GlmConfig, path, **(SMALL | dict(num_key_value_heads=n_kv, attention_bias=False))
    ),
    "chatglm": lambda path, n_kv: build_chatglm(path, add_qkv_bias=False, multi_query_group_num=n_kv),
}


@torch.no_grad()
@pytest.mark.parametrize("kind", sorted(MLA_CASES))
def test_interleaved_partial_rotary_with_one_kv_head_converts_to_mla_exactly(tmp_path, kind):
    # One KV head at full rank keeping all 4 turned planes: the rotary key is the source's 8 turned dims, read in
    # DeepSeek's order, and the 8 dims RoPE never turns are the whole no-RoPE part. Exact but for DeepSeek's
    # latent norm, measured apart; checked against GlmForCausalLM (ChatGLM: with its weights mapped).
    src = MLA_CASES[kind](tmp_path / "src", 1)
    attn = from_hf_config(src).attention
    assert (attn.rotary_dim, attn.head_dim, attn.rope_interleaved) == (8, 16, True)
    rank = full_rank(attn, 8)
    summary = check_convert_mla(src, tmp_path / "mla", "--kv-lora-rank", rank)
    assert summary["source_rotary_dim"] == 8 and summary["source_rope_interleaved"]
    assert summary["qk_rope_head_dim"] == 8 and summary["qk_nope_head_dim"] == 8
    assert summary["mla_conversion"] == "approximate" and "interleaved" in summary["mla_conversion_note"]
    assert summary["logits_source_vs_mla"]["max_abs"] < 1e-4  # attnlab's MLA, before the latent norm
    x = tokens(24)
    mla = convert_model_to_mla(load_causal_lm(src), rank)
    exact = deepseek_without_latent_norm(
        mla, tmp_path / "bypassed", json.loads((src / "config.json").read_text())
    )
    torch.testing.assert_close(exact(x).logits, oracle(src)(x).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", sorted(MLA_CASES))
def test_interleaved_partial_rotary_with_two_kv_heads_converts_approximately(tmp_path, kind):
    src = MLA_CASES[kind](tmp_path / "src", 2)
    summary = check_convert_mla(src, tmp_path / "mla", "--kv-lora-rank", 24, "--rope-dim", 4)
    assert summary["mla_conversion"] == "approximate" and summary["qk_nope_head_dim"] == 16
    assert summary["logits_source_vs_mla"]["max_abs"] > 0  # two KV heads: not exact


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


def test_chatglm2_6b_preset_reads_as_before():
    from attnlab.cost.presets import get_preset

    glm = get_preset("chatglm2-6b")
    attn = glm.attention
    assert (attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.rotary_dim, attn.rope_theta) == (
        32,
        2,
        128,
        64,
        1e4,
    )
    assert (attn.bias, attn.has_out_bias, glm.mlp_bias, glm.tie_embeddings) == (True, False, False, False)


REFUSED = [
    ("glm", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ("glm", {"partial_rotary_factor": 0.1}, "partial_rotary_factor=0.1 turns 1 of head_dim=16"),
    (
        "glm4",
        {"rope_parameters": {"rope_type": "ntk", "rope_theta": 1e4}},
        "rope_type='ntk' is not supported",
    ),
    ("chatglm", {"rmsnorm": False}, "rmsnorm=False is not supported (a LayerNorm ChatGLM)"),
    (
        "chatglm",
        {"apply_residual_connection_post_layernorm": True},
        "apply_residual_connection_post_layernorm=True",
    ),
    ("chatglm", {"post_layer_norm": False}, "post_layer_norm=False is not supported"),
    ("chatglm", {"original_rope": False}, "original_rope=False is not supported"),
    (
        "chatglm",
        {"pre_seq_len": 128, "prefix_projection": True},
        "pre_seq_len=128 is not supported (prefix tuning",
    ),
    ("chatglm", {"position_encoding_2d": True}, "position_encoding_2d=True is not supported"),
    ("chatglm", {"fp32_residual_connection": True}, "fp32_residual_connection=True is not supported"),
    ("chatglm", {"quantization_bit": 4}, "quantization_bit=4 is not supported"),
]


@pytest.mark.parametrize(
    ("kind", "change", "message"), REFUSED, ids=[f"{k}-{next(iter(c))}" for k, c, _ in REFUSED]
)
def test_fields_attnlab_does_not_model_are_refused_in_one_line(tmp_path, kind, change, message):
    src = tmp_path / "src"
    src.mkdir()
    base = CHATGLM if kind == "chatglm" else dict(SMALL, model_type=kind, vocab_size=VOCAB)
    (src / "config.json").write_text(json.dumps(base | change))
    result = CliRunner().invoke(app, ["convert", str(src), str(tmp_path / "dst"), "--kv-heads", "1"])
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "dst").exists()
