"""Llama / Qwen2 checkpoints <-> attnlab.model: key map, logits against transformers, RoPE layout permutation."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from attnlab import AttentionConfig, ModelConfig
from attnlab.attention.rope import apply_rope, interleaved_to_half_split, rope_cos_sin
from attnlab.hf import load_llama, model_config_from_hf, save_llama
from attnlab.hf.llama import state_from_hf, state_to_hf
from attnlab.model import Transformer
from conftest import seeded

SMALL = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=6,
    max_position_embeddings=64,
)


def hf_model(kind: str, **overrides):
    """A small random transformers model; biases made non-zero so that they are tested."""
    torch.manual_seed(seeded(0))
    config_cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
    }[kind]
    cfg = config_cls(
        **(SMALL | {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}} | overrides)
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(mean=1.0 if "norm" in name else 0.0, std=0.2)
    return model


def save_hf(model, path):
    model.save_pretrained(path, safe_serialization=True)
    return path


def tokens(vocab=96, shape=(2, 11), seed=0):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seeded(seed)))


@pytest.mark.parametrize(
    "kind,overrides",
    [
        ("llama", {}),
        ("llama", {"attention_bias": True, "num_key_value_heads": 2, "tie_word_embeddings": True}),
        ("llama", {"head_dim": 16, "mlp_bias": True}),
        ("mistral", {"num_key_value_heads": 2, "sliding_window": None}),
        ("qwen2", {}),
        ("qwen2", {"num_key_value_heads": 3, "tie_word_embeddings": True}),
    ],
)
def test_import_matches_transformers_and_export_is_bit_identical(tmp_path, kind, overrides):
    ref = hf_model(kind, **overrides)
    src = save_hf(ref, tmp_path / "src")
    ours = load_llama(src)
    cfg = ours.cfg
    assert cfg.attention.n_kv_heads == ref.config.num_key_value_heads
    assert cfg.attention.rope_theta == 5000.0 and cfg.norm_eps == ref.config.rms_norm_eps
    if kind == "qwen2":
        assert ours.layers[0].attention.wq.bias is not None and ours.layers[0].attention.wo.bias is None
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x).logits, rtol=1e-5, atol=1e-5)

    # attnlab -> HF: the same tensors, bit for bit, under the same names; config loads back the same.
    dst = save_llama(ours, tmp_path / "dst", kind, base_config=json.loads((src / "config.json").read_text()))
    original, written = load_file(src / "model.safetensors"), load_file(dst / "model.safetensors")
    assert set(original) == set(written)
    for key in original:
        assert torch.equal(original[key], written[key]), key
    again = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, ref(x).logits, rtol=0, atol=0)


def test_attnlab_model_round_trips_through_hf(tmp_path):
    # attnlab -> HF -> attnlab from an attnlab-built model (GQA, tied embeddings).
    cfg = ModelConfig(
        vocab_size=64,
        n_layers=2,
        attention=AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, rope_theta=500000.0),
        ffn_dim=48,
        max_seq_len=32,
        norm_eps=1e-5,
        tie_embeddings=True,
    )
    model = Transformer(cfg)
    model.init_weights(seed=seeded(3))
    dst = save_llama(model, tmp_path / "m")
    back = load_llama(dst)
    assert back.cfg.attention == cfg.attention and back.cfg.tie_embeddings
    for (name, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager").eval()
    x = tokens(64, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), rtol=1e-5, atol=1e-5)


def meta_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Meta's original (interleaved) RoPE, written independently: pairs (2i, 2i+1) as complex numbers."""
    dim = x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.polar(
        torch.ones(len(positions), dim // 2, dtype=torch.float64), positions[:, None] * freqs
    )
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], dim // 2, 2).contiguous())
    return torch.view_as_real(z * angles).reshape(x.shape)


def test_interleaved_to_half_split_is_the_layout_permutation():
    # Scores from interleaved weights with Meta's RoPE == scores from permuted weights with attnlab's RoPE.
    torch.manual_seed(seeded(0))
    head_dim, d, t = 16, 24, 7
    wq, wk = torch.randn(head_dim, d, dtype=torch.float64), torch.randn(head_dim, d, dtype=torch.float64)
    x = torch.randn(t, d, dtype=torch.float64)
    pos = torch.arange(t, dtype=torch.float64)
    meta_scores = meta_rope(x @ wq.T, pos, 10000.0) @ meta_rope(x @ wk.T, pos, 10000.0).T
    p = interleaved_to_half_split(head_dim)
    cos, sin = rope_cos_sin(torch.arange(t), head_dim, 10000.0, dtype=torch.float64)
    ours = apply_rope(x @ wq[p].T, cos, sin) @ apply_rope(x @ wk[p].T, cos, sin).T
    torch.testing.assert_close(ours, meta_scores, rtol=1e-5, atol=1e-5)
    # Without the permutation the scores differ: the test can fail.
    wrong = apply_rope(x @ wq.T, cos, sin) @ apply_rope(x @ wk.T, cos, sin).T
    assert (wrong - meta_scores).abs().max() > 1e-2


def test_interleaved_layout_import_and_export_invert_each_other():
    ref = hf_model("llama")
    tensors = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    cfg = model_config_from_hf(ref.config.to_dict())
    model = Transformer(cfg)
    model.load_state_dict(state_from_hf(tensors, cfg, layout="interleaved"))
    q_hf = tensors["model.layers.0.self_attn.q_proj.weight"].view(6, 8, 48)
    q_ours = model.layers[0].attention.wq.weight.detach().view(6, 8, 48)
    assert torch.equal(q_ours, q_hf[:, interleaved_to_half_split(8)])
    assert torch.equal(model.layers[0].attention.wv.weight, tensors["model.layers.0.self_attn.v_proj.weight"])
    back = state_to_hf(model, layout="interleaved")
    for key, value in tensors.items():
        assert torch.equal(back[key], value), key


def test_bad_configs_are_refused():
    good = transformers.LlamaConfig(**SMALL).to_dict()
    with pytest.raises(ValueError, match="model_type"):
        model_config_from_hf(good | {"model_type": "gpt2"})
    with pytest.raises(
        ValueError, match="rope_type='axial' is not supported"
    ):  # yarn, llama3, ... are (issue 30)
        model_config_from_hf(good | {"rope_parameters": {"rope_type": "axial", "factor": 4.0}})
    # a scaling without the parameters transformers requires: once read, converted and written unloadable
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}
    with pytest.raises(
        ValueError, match="rope_parameters: rope_type 'llama3' needs low_freq_factor, a number; got None"
    ):
        model_config_from_hf(good | {"rope_parameters": llama3})
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": "2"}
    with pytest.raises(
        ValueError, match="rope_scaling: rope_type 'longrope' needs long_factor, a list of numbers"
    ):
        model_config_from_hf(good | {"rope_scaling": longrope})
    with pytest.raises(ValueError, match="hidden_size"):
        model_config_from_hf(good | {"hidden_size": "48"})
    with pytest.raises(ValueError, match="num_key_value_heads=4 does not divide num_attention_heads=6"):
        model_config_from_hf(good | {"num_key_value_heads": 4})


def test_every_loader_and_writer_goes_through_the_one_load_and_the_one_save(tmp_path, monkeypatch):
    """Issue 30: hf/llama.py, hf/deepseek.py and hf/bert.py each carried a copy of the load body (build on meta,
    check the key set, assign) and of the save body (atomic directory, tensors, config). There is one of each now
    (``io.assign``, ``io.write_checkpoint``): every entry point of every family calls it, once."""
    from attnlab import MLAConfig
    from attnlab.families.bert import BERT
    from attnlab.hf import causal_lm, export_bert_mha, io, load_bert, load_deepseek, save_deepseek, save_model

    calls: list[str] = []
    for name in ("assign", "write_checkpoint"):
        real = getattr(io, name)
        monkeypatch.setattr(
            io, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k)
        )

    def once(what: str, fn) -> object:
        calls.clear()
        out = fn()
        assert calls == [what], (fn, calls)
        return out

    llama = Transformer(
        ModelConfig(vocab_size=96, n_layers=1, attention=AttentionConfig(48, 6, 2), ffn_dim=64)
    )
    once("write_checkpoint", lambda: save_llama(llama, tmp_path / "llama"))
    once("write_checkpoint", lambda: save_model(llama, tmp_path / "model", "mistral"))
    once("assign", lambda: load_llama(tmp_path / "llama"))
    once("assign", lambda: causal_lm.load_causal_lm(tmp_path / "model"))
    mla = MLAConfig(
        d_model=48, n_heads=6, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8
    )
    deepseek = Transformer(ModelConfig(vocab_size=96, n_layers=1, attention=mla, ffn_dim=64))
    once("write_checkpoint", lambda: save_deepseek(deepseek, tmp_path / "deepseek"))
    once("assign", lambda: load_deepseek(tmp_path / "deepseek"))
    transformers.BertModel(transformers.AutoConfig.for_model(**BERT.example)).save_pretrained(
        tmp_path / "bert"
    )
    encoder, extra = once("assign", lambda: load_bert(tmp_path / "bert"))
    once("write_checkpoint", lambda: export_bert_mha(encoder, tmp_path / "bert-mha", extra=extra))
