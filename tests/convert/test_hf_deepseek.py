"""Dense DeepSeek-V3 checkpoints <-> attnlab.model, and Llama -> native DeepSeek-V3 MLA conversion on disk.

Oracle: transformers' own ``DeepseekV3ForCausalLM`` (loaded with ``AutoModelForCausalLM``, no remote code).
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file
from test_hf_roundtrip import hf_model, save_hf, tokens

from attnlab import MLAConfig, ModelConfig
from attnlab.attention.rope import interleaved_to_half_split
from attnlab.convert import convert_model_to_mla
from attnlab.convert.mla import full_rank
from attnlab.hf import (
    convert_checkpoint_to_mla,
    load_causal_lm,
    load_deepseek,
    load_llama,
    save_causal_lm,
    save_deepseek,
)
from attnlab.hf.causal_lm import family_of
from attnlab.hf.deepseek import hf_config_from_model, model_config_from_deepseek, permute_rotary_rows
from attnlab.model import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

DENSE = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=6,
    v_head_dim=10,
    first_k_dense_replace=2,  # = num_hidden_layers: no MoE layer
    n_routed_experts=0,
    num_mtp_layers=0,
    max_position_embeddings=64,
    rope_parameters={"rope_type": "default", "rope_theta": 300.0},
)


def deepseek_model(**overrides) -> transformers.PreTrainedModel:
    """A small random dense DeepseekV3ForCausalLM; norms and biases randomised so that each copy matters."""
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(**(DENSE | overrides))
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(mean=1.0 if "norm" in name else 0.0, std=0.2)
    return model


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"rope_interleave": False, "attention_bias": True},
        {"q_lora_rank": 12, "tie_word_embeddings": True},
        {"qk_nope_head_dim": 0, "rms_norm_eps": 1e-5},
    ],
)
def test_import_matches_transformers_and_export_is_bit_identical(tmp_path, overrides):
    ref = deepseek_model(**overrides)
    src = save_hf(ref, tmp_path / "src")
    ours = load_deepseek(src)
    attn = ours.cfg.attention
    assert isinstance(attn, MLAConfig) and attn.kv_norm and not ours.cfg.is_moe
    assert attn.softmax_scale == ref.model.layers[0].self_attn.scaling
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x).logits, rtol=1e-5, atol=1e-5)
    interleave = overrides.get("rope_interleave", True)
    dst = save_deepseek(ours, tmp_path / "dst", rope_interleave=interleave)
    original, written = load_file(src / "model.safetensors"), load_file(dst / "model.safetensors")
    assert set(original) == set(written)
    for key in original:
        assert original[key].shape == written[key].shape and torch.equal(original[key], written[key]), key
    again = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager").eval()
    assert type(again).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, ref(x).logits, rtol=0, atol=0)


def _mla_model(nope: int = 8, bias: bool = False) -> Transformer:
    cfg = ModelConfig(
        vocab_size=96,
        n_layers=2,
        attention=MLAConfig(
            d_model=48,
            n_heads=4,
            kv_lora_rank=12,
            qk_nope_head_dim=nope,
            qk_rope_head_dim=4,
            v_head_dim=12,
            rope_theta=700.0,
            bias=bias,
        ),
        ffn_dim=64,
        max_seq_len=64,
        norm_eps=1e-6,
    )
    model = Transformer(cfg)
    model.init_weights(std=0.1, seed=2)
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.kv_norm.weight.normal_(1.0, 0.2)
    return model.eval()


def test_attnlab_model_exports_to_deepseek_and_back(tmp_path):
    model = _mla_model(bias=True)
    dst = save_deepseek(
        model, tmp_path / "m", base_config={"bos_token_id": 5, "eos_token_id": 6, "rope_theta": 1}
    )
    hf = json.loads((dst / "config.json").read_text())
    assert hf["model_type"] == "deepseek_v3" and hf["architectures"] == ["DeepseekV3ForCausalLM"]
    assert hf["first_k_dense_replace"] == hf["num_hidden_layers"] == 2 and hf["n_routed_experts"] == 0
    assert hf["q_lora_rank"] is None and hf["rope_interleave"] is True and hf["attention_bias"] is True
    assert hf["rope_parameters"] == {"rope_type": "default", "rope_theta": 700.0} and "rope_theta" not in hf
    assert (hf["bos_token_id"], hf["eos_token_id"]) == (5, 6)
    ref = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager").eval()
    assert not any("experts" in name for name, _ in ref.named_parameters())
    assert {k: tuple(v.shape) for k, v in ref.state_dict().items()} == {
        k: tuple(v.shape) for k, v in load_file(dst / "model.safetensors").items()
    }
    x = tokens(96, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(ref(x).logits, model(x), rtol=1e-5, atol=1e-5)
        back = load_deepseek(dst)
        assert back.cfg.attention == model.cfg.attention
        for (name, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items(), strict=True):
            assert torch.equal(a, b), name


def test_rotary_rows_are_permuted_to_interleaved_pairs():
    # The named transform: DeepSeek's pair (2j, 2j+1) of the rotary rows is attnlab's (j, j + rope_dim/2).
    model = _mla_model(nope=8)
    attn = model.cfg.attention
    wq = model.layers[0].attention.wq.weight.detach()
    wkv_a = model.layers[0].attention.wkv_a.weight.detach()
    hf_q = permute_rotary_rows("layers.0.attention.wq.weight", wq, attn, to_half_split=False)
    hf_kv = permute_rotary_rows("layers.0.attention.wkv_a.weight", wkv_a, attn, to_half_split=False)
    perm = interleaved_to_half_split(4)
    head = hf_q.view(4, 12, 48)[1]
    assert torch.equal(head[:8], wq.view(4, 12, 48)[1, :8])  # nope rows untouched
    assert torch.equal(head[8:][perm], wq.view(4, 12, 48)[1, 8:])
    assert torch.equal(hf_kv[:12], wkv_a[:12]) and torch.equal(hf_kv[12:][perm], wkv_a[12:])
    assert not torch.equal(hf_kv, wkv_a)  # the permutation is not the identity: the test can fail
    back = permute_rotary_rows("layers.0.attention.wkv_a.weight", hf_kv, attn, to_half_split=True)
    assert torch.equal(back, wkv_a)


def test_bad_deepseek_configs_are_refused():
    good = transformers.DeepseekV3Config(**DENSE).to_dict()
    assert model_config_from_deepseek(good).n_layers == 2
    with pytest.raises(ValueError, match="n_routed_experts=8 is not supported"):
        model_config_from_deepseek(good | {"n_routed_experts": 8, "first_k_dense_replace": 1})
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        model_config_from_deepseek(good | {"num_key_value_heads": 2})
    with pytest.raises(ValueError, match="rope_type"):
        model_config_from_deepseek(good | {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="model_type"):
        model_config_from_deepseek(good | {"model_type": "llama"})
    no_norm = _mla_model().cfg
    no_norm = no_norm.with_attention(no_norm.attention.replace(kv_norm=False))
    with pytest.raises(ValueError, match="kv_norm=False"):
        hf_config_from_model(no_norm)


def _digest(path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_llama_checkpoint_converts_to_native_deepseek(tmp_path):
    # MQA with every plane kept at full rank: attnlab's MLA (no latent norm) gives the source's logits; the
    # native DeepSeek checkpoint differs only by its latent norm, by the distance the summary reports.
    ref = hf_model("llama", num_key_value_heads=1, head_dim=8)
    src = save_hf(ref, tmp_path / "src")
    (src / "tokenizer.json").write_text("{}")  # any extra file is copied as is
    before = _digest(src)
    rank = full_rank(load_llama(src).cfg.attention, 8)
    summary = convert_checkpoint_to_mla(src, tmp_path / "dst", rank, 8)
    assert _digest(src) == before  # the source is untouched
    # every head dim keeps RoPE: no nope part, but one zero dim (llama.cpp needs qk_nope_head_dim >= 1)
    assert summary["kv_values_per_token_after"] == 2 * (rank + 8) and summary["qk_nope_head_dim"] == 1
    assert max(summary["layer_output_error"]) < 1e-5
    assert summary["logits_source_vs_mla"]["max_abs"] < 1e-4
    assert 0 < summary["logits_mla_vs_native"]["rel_rms"] < 0.5
    dst = tmp_path / "dst"
    assert (dst / "tokenizer.json").read_text() == "{}"
    hf = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager").eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, load_deepseek(dst)(x), rtol=1e-5, atol=1e-5)
        mla = convert_model_to_mla(load_llama(src), rank, 8)  # the same conversion, no latent norm
        torch.testing.assert_close(mla(x), ref(x).logits, rtol=1e-4, atol=1e-4)


def test_bad_targets_leave_no_destination(tmp_path):
    src = save_hf(hf_model("llama", num_key_value_heads=2, head_dim=8), tmp_path / "src")  # 6 heads of 8
    for rank, rope_dim, match in [
        (1000, 8, r"--kv-lora-rank must be an int in \[1, 32\].*1000"),  # 2 KV heads * (8 + 8) rows
        (16, 7, "--rope-dim must be even.*7"),
        (16, 10, "--rope-dim must be an int in.*10"),
        (0, 8, "--kv-lora-rank.*0"),
    ]:
        with pytest.raises(ValueError, match=match):
            convert_checkpoint_to_mla(src, tmp_path / "dst", rank, rope_dim)
        assert not (tmp_path / "dst").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]  # no temporary directory left either
    with pytest.raises(ValueError, match="lies inside the source"):  # attnlab.atomic's rule
        convert_checkpoint_to_mla(src, src / "inner", 16, 8)


@pytest.mark.parametrize("interleave", [True, False])
def test_deepseek_is_a_causal_lm_family_saved_like_its_source(tmp_path, interleave):
    # What training does: load by model_type, change the values, write a checkpoint like the source.
    ref = deepseek_model(rope_interleave=interleave, attention_bias=True)
    src = save_hf(ref, tmp_path / "src")
    model = load_causal_lm(src)
    assert family_of(src) == "deepseek_v3" and isinstance(model.cfg.attention, MLAConfig)
    state = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
    dst = save_causal_lm(state, model.cfg, tmp_path / "dst", like=src)
    assert (dst / "config.json").read_text() == (src / "config.json").read_text()
    moved = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager").eval()
    x = tokens()
    with torch.no_grad():
        model.load_state_dict(state)
        torch.testing.assert_close(moved(x).logits, model(x), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(moved(x).logits, ref(x).logits, atol=1e-3)
    # Unchanged values come back bit for bit, in either RoPE layout.
    same = save_causal_lm(load_causal_lm(src).state_dict(), model.cfg, tmp_path / "same", like=src)
    original, written = load_file(src / "model.safetensors"), load_file(same / "model.safetensors")
    assert set(original) == set(written) and all(torch.equal(original[k], written[k]) for k in original)
