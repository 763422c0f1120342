"""``attnlab.hf_config``: one config.json reader (and writer) for the cost model, the checkpoint loaders and the
benchmark baselines; read(write(cfg)) == cfg, transformers builds the same shapes from what we write, and BERT is
parsed by the same reader as every other family."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from attnlab import AttentionConfig, MLAConfig, ModelConfig
from attnlab.cost import get_hardware, get_preset, roofline, step_seconds
from attnlab.cost.hardware import HARDWARE
from attnlab.hf.bert import encoder_config_from_hf
from attnlab.hf_config import attention_to_hf, from_hf_config, to_hf_config

DECODERS = {
    "llama": AttentionConfig(d_model=48, n_heads=6, n_kv_heads=2, head_dim=16, rope_theta=5000.0),
    "deepseek_v3": MLAConfig(
        d_model=48,
        n_heads=4,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        q_lora_rank=12,
    ),
}


@pytest.mark.parametrize("model_type", sorted(DECODERS))
def test_written_config_reads_back_and_builds_the_same_shapes_in_transformers(model_type):
    cfg = ModelConfig(vocab_size=96, n_layers=2, attention=DECODERS[model_type], ffn_dim=80, max_seq_len=64)
    fields = to_hf_config(cfg, model_type)
    assert from_hf_config(fields).replace(name="") == cfg
    hf_cls = transformers.LlamaConfig if model_type == "llama" else transformers.DeepseekV3Config
    hf = hf_cls(
        **{k: v for k, v in fields.items() if k not in ("model_type", "architectures")}
    )  # dense: written
    assert from_hf_config(hf.to_dict()).attention == cfg.attention  # transformers keeps every field we wrote
    if model_type == "llama":
        attn = transformers.models.llama.modeling_llama.LlamaAttention(hf, layer_idx=0)
        assert attn.q_proj.weight.shape == (6 * 16, 48) and attn.k_proj.weight.shape == (2 * 16, 48)


def test_attention_fields_are_the_inverse_of_the_reader():
    attn = DECODERS["llama"]
    fields = attention_to_hf(attn)
    assert fields["num_key_value_heads"] == 2 and fields["rope_parameters"]["rope_theta"] == 5000.0
    mla = attention_to_hf(DECODERS["deepseek_v3"])
    assert (mla["num_key_value_heads"], mla["q_lora_rank"], mla["kv_lora_rank"]) == (4, 12, 16)
    with pytest.raises(TypeError, match="attn must be an AttentionConfig or MLAConfig, got dict"):
        attention_to_hf({})


def test_bert_is_read_by_the_same_reader():
    raw = transformers.BertConfig(
        vocab_size=50, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, intermediate_size=64
    ).to_dict()
    model = from_hf_config(raw)  # what the cost model reads
    encoder = encoder_config_from_hf(raw, n_kv_heads=2)  # what the converter loads
    assert encoder.attention == model.attention.replace(n_kv_heads=2)
    assert (encoder.vocab_size, encoder.n_layers, encoder.ffn_dim) == (50, 2, 64)
    assert (encoder.max_position_embeddings, encoder.type_vocab_size, encoder.norm_eps) == (512, 2, 1e-12)
    with pytest.raises(ValueError, match="position_embedding_type='relative_key' is not supported"):
        encoder_config_from_hf(raw | {"position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="hidden_act='relu'"):
        encoder_config_from_hf(raw | {"hidden_act": "relu"})


def test_the_cost_model_measures_nothing():
    with pytest.raises(ValueError, match="hardware 'local' is this machine, measured rather than looked up"):
        get_hardware("local")
    h100 = HARDWARE["h100"]
    # step_seconds is the roofline's one max(compute, memory), the same as a decode phase of the roofline
    r = roofline(get_preset("llama-2-7b"), h100, dtype="bf16")
    assert step_seconds(h100, r.decode.flops, r.decode.bytes, torch.bfloat16) == r.decode.seconds
    assert step_seconds(h100, 1e12, 0, "fp32") == 1e12 / h100.peak_flops["fp32"]


@pytest.mark.parametrize("given", [[1, 2], 5, {"a": 1}, ""])
def test_a_name_that_is_no_string_gives_the_folders(tmp_path, given):
    # [1, 2] became compare's title "[1, 2]:" and its JSON "model"
    from attnlab.cost.presets import HF_CONFIGS

    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(HF_CONFIGS["gpt2"] | {"_name_or_path": given}))
    assert from_hf_config(folder).name == "my-model"


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"model_type": "llama9"}, "model_type='llama9' is not supported"),  # named "config.json", not the file
        (  # the config class's own check (an odd head_dim under RoPE) named no file
            {"model_type": "llama", "hidden_size": 254, "num_attention_heads": 2, "num_hidden_layers": 2,
             "intermediate_size": 64, "vocab_size": 100, "head_dim": 127},
            "AttentionConfig.head_dim=127 must be even when rope=True",
        ),
    ],
)  # fmt: skip
def test_every_config_error_names_the_file_read(tmp_path, raw, message):
    path = tmp_path / "odd.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError) as err:
        from_hf_config(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value), str(err.value)
    with pytest.raises(ValueError, match=message) as bare:  # a dict has no file to name
        from_hf_config(raw)
    assert not str(bare.value).startswith(str(tmp_path))


def test_the_loaders_config_errors_name_the_file_too(tmp_path):
    """convert, generate, eval and sweep read a checkpoint through causal_lm.model_config, which named no file for
    the config classes' own checks after compare's reader did."""
    from attnlab.hf.causal_lm import model_config

    raw = {"model_type": "llama", "hidden_size": 56, "num_attention_heads": 8, "num_hidden_layers": 2,
           "intermediate_size": 64, "vocab_size": 100, "head_dim": 7}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError) as err:
        model_config(tmp_path)
    assert (
        str(err.value)
        == f"{tmp_path / 'config.json'}: AttentionConfig.head_dim=7 must be even when rope=True"
    )


def test_a_deepseek_checkpoints_config_errors_name_the_file(tmp_path):
    """DeepSeek's load checks read the config before Family.config could name the file: an odd rotary dim said
    `MLAConfig.qk_rope_head_dim=7 must be even` in generate, eval, sweep and convert."""
    from attnlab.hf.causal_lm import model_config

    raw = {"model_type": "deepseek_v3", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
           "intermediate_size": 64, "vocab_size": 100, "kv_lora_rank": 16, "q_lora_rank": None,
           "qk_nope_head_dim": 8, "qk_rope_head_dim": 7, "v_head_dim": 8, "n_routed_experts": None,
           "first_k_dense_replace": 1}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError) as err:
        model_config(tmp_path)
    said = str(err.value)
    assert said.startswith(f"{tmp_path / 'config.json'}: ") and "qk_rope_head_dim=7" in said
