"""``convert --to mla`` from sources with scaled RoPE (Llama 3.x "llama3", Qwen2.5 "yarn"): the planes such a
scaling leaves at plain RoPE frequencies keep RoPE in a plain-RoPE DeepSeek export, exactly; the scaled ones
lose it, keeping their mean rotation at their scaled frequencies; yarn's attention factor is folded into the
queries. "linear", "dynamic" and "longrope" are refused, and so is a flag that would keep a scaled plane.

Oracles: transformers' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (the source, with transformers' own scaled
RoPE) and ``DeepseekV3ForCausalLM`` (the export), loaded with ``AutoModelForCausalLM``, no remote code.
"""

from __future__ import annotations

import copy
import json
import math
import shutil

import pytest
import torch
import transformers
from test_convert_cli import make_checkpoint, run, tree_hash
from test_hf_roundtrip import save_hf, tokens

from attnlab import AttentionConfig, ModelConfig
from attnlab.attention.norm import RMSNorm
from attnlab.attention.rope import plain_pairs
from attnlab.convert import choose_stride, convert_model_to_mla, gqa_to_mla, layer_errors, logit_distance
from attnlab.convert.mla import full_rank, plain_planes, source_frequencies
from attnlab.families import family
from attnlab.families.base import freeze
from attnlab.hf import convert_checkpoint_to_mla, load_deepseek, load_llama, save_deepseek
from attnlab.hf.mla_checkpoint import random_batches
from attnlab.model import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

# On 8 planes of theta 100 (head_dim 16), wavelengths 2 pi 100^(f/8) = 6.3, 11, 20, 35, 63, 112, 199, 353:
# llama3 leaves those below 160/4 = 40 as they are (planes 0..3), smooths 63 and 112, divides the rest by 8.
LLAMA3 = dict(rope_type="llama3", rope_theta=100.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=160)  # fmt: skip
# yarn keeps the planes up to beta_fast's correction dim, floor(16 ln(2048 / (32 2 pi)) / (2 ln 100)) = 4, so
# planes 0..4; its attention factor 0.1 ln 4 + 1 multiplies cos and sin.
YARN = dict(rope_type="yarn", rope_theta=100.0, factor=4.0, original_max_position_embeddings=2048)
DIMS = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            head_dim=16, max_position_embeddings=8192)  # fmt: skip


def _source(kind: str, rope: dict, n_kv: int, seed: int = 0) -> transformers.PreTrainedModel:
    """A small random ``kind`` model with ``rope`` as its rope_parameters; norms and biases moved off their
    init, queries and keys scaled up so that attention is far from uniform, the query bias zero (DeepSeek's
    q_proj has none)."""
    torch.manual_seed(seed)
    cls = transformers.AutoConfig.for_model(kind).__class__
    model = transformers.AutoModelForCausalLM.from_config(
        cls(**DIMS, num_key_value_heads=n_kv, rope_parameters=rope), attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(mean=1.0 if "norm" in name else 0.0, std=0.2)
            if name.endswith("q_proj.bias"):
                p.zero_()
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)  # scores of order 1, not the near-uniform attention of init's small weights
    return model


def _key_planes(model: transformers.PreTrainedModel, planes: list[int], gain: float) -> None:
    """Multiply the key rows (and key biases) of ``planes`` in every layer by ``gain``, in place."""
    with torch.no_grad():
        for layer in model.model.layers:
            proj = layer.self_attn.k_proj
            for p in (proj.weight, proj.bias):
                if p is not None:
                    rows = p.view(-1, 16, *p.shape[1:])  # (n_kv, head_dim, ...), a view of p
                    rows[:, planes + [f + 8 for f in planes]] *= gain


def _deepseek_without_latent_norm(mla: Transformer, path, base: dict) -> transformers.PreTrainedModel:
    """transformers' DeepseekV3ForCausalLM holding ``mla`` (a converted model, ``kv_norm=False``) through
    attnlab's export (config, rope_parameters, rotary row layout), with its latent norm bypassed: DeepSeek's norm
    is the one step of the export that no weights make exact (``convert.latent_norm``), measured apart."""
    native = copy.deepcopy(mla)
    for layer in native.layers:
        attn = layer.attention
        attn.cfg = attn.cfg.replace(kv_norm=True)
        attn.kv_norm = RMSNorm(attn.cfg.kv_lora_rank)  # written, then bypassed below
    native.cfg = native.cfg.with_attention(native.layers[0].attention.cfg)
    save_deepseek(native, path, base_config=base)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    for layer in hf.model.layers:
        layer.self_attn.kv_a_layernorm = torch.nn.Identity()
    return hf


@pytest.mark.parametrize(
    "kind,rope,plain,rope_dim,stride",
    [
        ("llama", LLAMA3, 4, None, None),  # default --rope-dim: every plane llama3 leaves unscaled (0..3)
        # planes 0, 2, 4 of yarn's 0..4, with its attention factor folded (a Llama with Qwen2.5's RoPE: Qwen2's
        # query bias refuses the conversion, whatever its value)
        ("llama", YARN, 5, 6, 2),
    ],
    ids=["llama3", "yarn"],
)
def test_one_kv_head_whose_scaled_planes_hold_no_score_converts_exactly(
    tmp_path, kind, rope, plain, rope_dim, stride
):
    # One KV head at full rank: the kept planes are carried whole by the rotary key, at the plain RoPE
    # frequencies the source turns them by; the other planes' keys are zero, so losing RoPE costs nothing. Exact.
    ref = _source(kind, rope, n_kv=1)
    kept = list(range(0, plain, stride or 1))[: (rope_dim or 2 * plain) // 2]
    _key_planes(ref, [f for f in range(8) if f not in kept], 0.0)
    src = save_hf(ref, tmp_path / "src")
    attn_cfg = load_llama(src).cfg.attention
    assert plain_planes(attn_cfg) == plain  # as designed above: transformers leaves these planes unscaled
    rank = full_rank(attn_cfg, 2 * len(kept))
    summary = convert_checkpoint_to_mla(src, tmp_path / "dst", rank, rope_dim, planes=stride)
    assert summary["rope_planes"] == kept and summary["qk_rope_head_dim"] == 2 * len(kept)
    assert summary["source_rope_type"] == rope["rope_type"] and summary["source_plain_planes"] == plain
    factor = summary["source_attention_factor"]
    yarn = rope["rope_type"] == "yarn"
    assert factor == (pytest.approx(0.1 * math.log(4.0) + 1) if yarn else 1.0)
    assert summary["mla_conversion"] == "approximate"
    assert repr(rope["rope_type"]) in summary["mla_conversion_note"]
    assert summary["logits_source_vs_mla"]["max_abs"] < 1e-4  # attnlab's MLA, before the latent norm
    x = tokens(96, (2, 40))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "dst", attn_implementation="eager"
    ).eval()
    written = json.loads((tmp_path / "dst" / "config.json").read_text())
    # plain RoPE at theta' = theta^(stride rope_dim / head_dim)
    theta = 100.0 ** ((stride or 1) * 2 * len(kept) / 16)
    assert written["rope_parameters"] == {"rope_type": "default", "rope_theta": pytest.approx(theta)}
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, load_deepseek(tmp_path / "dst")(x), rtol=1e-5, atol=1e-5)
        # transformers' DeepSeek-V3 with attnlab's weights and config computes the scaled source's logits.
        mla = convert_model_to_mla(load_llama(src), rank, rope_dim, planes=stride)
        exact = _deepseek_without_latent_norm(mla, tmp_path / "bypassed", ref.config.to_dict())
        source = ref(x).logits
        torch.testing.assert_close(exact(x).logits, source, rtol=1e-4, atol=1e-4)
        if yarn:  # the test can fail: without yarn's factor on the scores the logits move
            unscaled = copy.deepcopy(ref)
            for layer in unscaled.model.layers:
                layer.self_attn.scaling /= factor**2
            assert (unscaled(x).logits - source).abs().max() > 1e-2


def _unscaled_copy(src, dst):
    """The checkpoint ``src`` with the same weights and its RoPE scaling removed (plain RoPE, same theta)."""
    shutil.copytree(src, dst)
    hf = json.loads((src / "config.json").read_text())
    theta = hf["rope_parameters"]["rope_theta"]
    (dst / "config.json").write_text(
        json.dumps(hf | {"rope_parameters": {"rope_type": "default", "rope_theta": theta}})
    )
    return dst


def test_planes_that_lose_rope_keep_their_mean_rotation_at_the_scaled_frequencies(tmp_path):
    # Two KV heads: only one virtual head per plane keeps RoPE, so the result is approximate at any rank. The
    # scaled planes (4..7) carry a large share of the scores, and llama3 turns them up to 8x slower than plain
    # RoPE would: their mean rotation over the distances a head attends to is nearly 1, not the damping plain
    # RoPE's frequencies give. Converting the same weights with the scaling removed turns them by wrong angles.
    ref = _source("llama", LLAMA3, n_kv=2, seed=1)
    _key_planes(ref, [4, 5, 6, 7], 3.0)
    src = save_hf(ref, tmp_path / "src")
    summary = convert_checkpoint_to_mla(src, tmp_path / "dst", 24)  # default --rope-dim: the 4 plain planes
    assert summary["rope_planes"] == [0, 1, 2, 3] and summary["qk_rope_head_dim"] == 8
    assert summary["mla_conversion"] == "approximate" and "'llama3'" in summary["mla_conversion_note"]
    x = tokens(96, (2, 40))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "dst", attn_implementation="eager"
    ).eval()
    with torch.no_grad():  # the export is faithful: transformers computes what attnlab's DeepSeek model does
        torch.testing.assert_close(hf(x).logits, load_deepseek(tmp_path / "dst")(x), rtol=1e-5, atol=1e-5)

    model, plain = load_llama(src), load_llama(_unscaled_copy(src, tmp_path / "plain"))
    calib, held_out = random_batches(96, seed=0, n=2, length=64), random_batches(96, seed=1, n=1, length=64)
    scaled_mla = convert_model_to_mla(model, 24, 8, calib=calib)  # as the command converts, before the norm
    plain_mla = convert_model_to_mla(plain, 24, 8, calib=calib, planes=1)  # the same planes kept (0..3)
    assert scaled_mla.cfg.attention.rope_theta == plain_mla.cfg.attention.rope_theta
    ours, unscaled = layer_errors(model, scaled_mla, held_out), layer_errors(model, plain_mla, held_out)
    baseline = layer_errors(plain, plain_mla, held_out)  # what converting the unscaled model costs it
    for mine, wrong, base in zip(ours, unscaled, baseline, strict=True):
        assert mine["score_error"] < 0.9 * wrong["score_error"], (ours, unscaled)
        assert mine["score_error"] <= base["score_error"], (ours, baseline)
    assert (
        logit_distance(model, scaled_mla, held_out)["kl"] < logit_distance(model, plain_mla, held_out)["kl"]
    )


def test_plane_choices_stay_among_the_planes_the_scaling_leaves_plain(tmp_path):
    ref = _source("llama", LLAMA3, n_kv=2)
    _key_planes(ref, [4, 5, 6, 7], 3.0)  # the strongest planes are scaled: "norm" would like to keep them
    src = save_hf(ref, tmp_path / "src")
    model, plain = load_llama(src), load_llama(_unscaled_copy(src, tmp_path / "plain"))
    attn = model.cfg.attention
    assert plain_planes(attn) == 4 and plain_pairs(16, 100.0) == 8
    calib = random_batches(96, seed=0, n=1, length=32)
    # rope_dim 4 (2 planes): strides 1..3 keep planes among 0..3; the unscaled copy may reach plane 7.
    assert choose_stride(model, 4, "uniform") == 3 and choose_stride(plain, 4, "uniform") == 7
    chosen = choose_stride(model, 4, "norm", calib=calib)
    assert 1 <= chosen <= 3 < choose_stride(plain, 4, "norm", calib=calib)
    assert 1 <= choose_stride(model, 4, "error", calib=calib) <= 3
    with pytest.raises(
        ValueError, match=r"planes \(a stride\) must be in \[1, 3\].*4 planes at plain RoPE.*got 4"
    ):
        choose_stride(model, 4, 4)
    with pytest.raises(ValueError, match=r"rope_dim=10 would keep 5 rotary planes.*'llama3'.*at most 8"):
        gqa_to_mla(model.layers[0].attention, 16, rope_dim=10)
    with pytest.raises(
        ValueError, match=r"stride must be an int in \[1, 3\].*among its 4 planes at plain RoPE"
    ):
        gqa_to_mla(model.layers[0].attention, 16, rope_dim=4, stride=4)
    assert convert_model_to_mla(model, 16).cfg.attention.qk_rope_head_dim == 8  # default: every plain plane


# On 4 planes of theta 10000 (head_dim 8): llama3 leaves planes 0 and 1 plain (wavelengths 6.3 and 63, below
# 1024 / 4), smooths plane 2 and divides plane 3.
BAND = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=1024)  # fmt: skip
# ... and with 16 original positions its band is empty: even plane 0 (wavelength 6.3 > 16 / 4) is smoothed.
NO_BAND = BAND | dict(original_max_position_embeddings=16)
DYNAMIC = dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)
LINEAR = dict(rope_type="linear", rope_theta=10000.0, factor=2.0)
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 4, long_factor=[2.0] * 4,
                original_max_position_embeddings=32)  # fmt: skip


@pytest.mark.parametrize(
    "rope,args,message",
    [
        (DYNAMIC, [], "rope_parameters.rope_type='dynamic'"),
        (LONGROPE, [], "rope_parameters.rope_type='longrope'"),
        (LINEAR, [], "rope_parameters.rope_type='linear'"),
        (NO_BAND, [], "rope_parameters.rope_type='llama3' scales every plane, the fastest included"),
        (BAND, ["--rope-dim", 6], "--rope-dim=6 would keep 3 rotary planes"),
        (BAND, ["--rope-dim", 4, "--planes", 2], "--planes 2: a stride must be in [1, 1] for --rope-dim 4"),
    ],
    ids=["dynamic", "longrope", "linear", "no-band", "rope-dim", "planes"],
)
def test_scaled_rope_that_cannot_keep_its_planes_exits_2_in_one_line(tmp_path, rope, args, message):
    src = make_checkpoint(tmp_path / "src", rope_parameters=rope)
    before = tree_hash(src)
    result = run("convert", src, tmp_path / "dst", "--to", "mla", "--kv-lora-rank", 8, *args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnlab: error:") and message in lines[0], result.output
    if not args:  # the source's RoPE, not a flag: the family's rule, as for a sliding window
        assert "cannot be converted to MLA" in lines[0]
    if rope is BAND:  # the limit is named: planes 0..1 are the plain ones
        assert "planes 0..1" in lines[0] and ("must be at most 4" in lines[0] or "--planes" in lines[0])
    assert [p.name for p in tmp_path.iterdir()] == ["src"]  # no destination, no temporary
    assert tree_hash(src) == before
    if rope is BAND:  # within the band the same source converts
        done = run("convert", src, tmp_path / "dst", "--to", "mla", "--kv-lora-rank", 8, "--json")
        assert done.exit_code == 0, done.output
        assert json.loads(done.stdout)["rope_planes"] == [0, 1]


# Llama 3.1 / 3.2 / 3.3 and Qwen2.5's long-context settings, as their config.json files write them.
LLAMA31 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192)  # fmt: skip
QWEN25 = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)


@pytest.mark.parametrize(
    "cls,rope,theta,plain",
    [(transformers.LlamaConfig, LLAMA31, 500000.0, 29), (transformers.Qwen2Config, QWEN25, 1e6, 24)],
    ids=["llama-3.1", "qwen2.5"],
)
def test_the_plain_planes_of_real_settings_are_those_transformers_leaves_unscaled(cls, rope, theta, plain):
    # Oracle: transformers' own rotary embedding of the model, scaled and plain (head_dim 128 as both models).
    shape = dict(hidden_size=4096, num_attention_heads=32, head_dim=128, max_position_embeddings=131072)
    scaled_cfg = cls(**shape, rope_parameters=rope | {"rope_theta": theta})
    plain_cfg = cls(**shape, rope_parameters={"rope_type": "default", "rope_theta": theta})
    rotary = {"llama": transformers.models.llama.modeling_llama.LlamaRotaryEmbedding,
              "qwen2": transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding}[scaled_cfg.model_type]  # fmt: skip
    scaled, unscaled = rotary(scaled_cfg), rotary(plain_cfg)
    same = (scaled.inv_freq == unscaled.inv_freq).tolist()
    assert same == [True] * plain + [False] * (64 - plain)  # a band of the fastest planes, then none
    attn = AttentionConfig(d_model=4096, n_heads=32, rope_theta=theta,
                           rope_scaling=freeze(rope | {"max_position_embeddings": 131072}))  # fmt: skip
    assert plain_planes(attn) == plain
    assert source_frequencies(attn)[1] == pytest.approx(
        scaled.attention_scaling
    )  # 1 for llama3, 1.1386 for yarn
    torch.testing.assert_close(source_frequencies(attn)[0], scaled.inv_freq.double())


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_family_verdicts_name_the_rope_type_and_what_is_exact(model_type):
    def verdict(rope: dict, theta: float, **sliding):
        attn = AttentionConfig(d_model=4096, n_heads=32, n_kv_heads=8, rope_theta=theta,
                               rope_scaling=freeze(rope | {"max_position_embeddings": 131072}))  # fmt: skip
        cfg = ModelConfig(
            vocab_size=128, n_layers=2, attention=attn, ffn_dim=64, max_seq_len=131072, **sliding
        )
        return family(model_type).mla(cfg)

    llama = verdict(LLAMA31, 500000.0)
    assert llama.verdict == "approximate" and "'llama3'" in llama.note
    assert "plain RoPE frequencies" in llama.note and "exactly" in llama.note
    assert "attention factor" not in llama.note  # llama3 has none
    qwen = verdict(QWEN25, 1e6)
    assert qwen.verdict == "approximate" and "'yarn'" in qwen.note
    assert "attention factor" in qwen.note and "folded into the queries, exactly" in qwen.note
    for kind, extra in (("linear", {"factor": 2.0}), ("dynamic", {"factor": 2.0}),
                        ("longrope", {"short_factor": [1.0] * 64, "long_factor": [2.0] * 64})):  # fmt: skip
        refused = verdict({"rope_type": kind, **extra}, 10000.0)
        assert refused.verdict == "refused" and f"rope_parameters.rope_type={kind!r}" in refused.note
    windowed = verdict(LLAMA31, 500000.0, sliding=AttentionConfig(d_model=4096, n_heads=32, window=4096))
    assert windowed.verdict == "refused" and "sliding window of 4096" in windowed.note  # unchanged rule
