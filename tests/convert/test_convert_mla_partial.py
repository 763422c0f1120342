"""GQA -> MLA from sources whose RoPE turns part of each head (Phi-4-mini, GPT-NeoX, GLM) or pairs its dims as
(2i, 2i + 1) (GLM, ChatGLM): the dims RoPE never turns are DeepSeek's no-RoPE part, exactly; interleaved pairs are
a fixed reordering of a head's rows (``convert.mla.head_rows``), exact; the turned planes keep or lose RoPE as a
Llama's do. The family-level round trips through transformers are in tests/families/test_{phi3,glm}.py."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from attnlab import AttentionConfig, ModelConfig
from attnlab.attention.gqa import GroupedQueryAttention
from attnlab.attention.rope import apply_rope, interleaved_to_half_split, rope_cos_sin
from attnlab.convert import convert_model_to_mla, gqa_to_mla, layer_errors, logit_distance
from attnlab.convert.mla import full_rank, head_rows, plain_planes, source_frequencies
from attnlab.families.base import freeze
from attnlab.hf.mla_checkpoint import random_batches
from attnlab.model import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

# (rotary dims of a 16-dim head, interleaved pairs): Phi-4-mini's 3/4 in half-split pairs, GLM's half in
# interleaved pairs, and interleaved pairs over the whole head (Meta's original Llama layout).
LAYOUTS = {
    "half-split 12 of 16": (12, False),
    "interleaved 8 of 16": (8, True),
    "interleaved 16 of 16": (16, True),
}


def _attention(rotary: int, interleaved: bool, n_kv: int = 1, kv_bias: bool = False, seed: int = 0):
    cfg = AttentionConfig(
        d_model=48,
        n_heads=4,
        n_kv_heads=n_kv,
        head_dim=16,
        rope_theta=100.0,
        rope_dim=None if rotary == 16 else rotary,
        rope_interleaved=interleaved,
        bias=kv_bias,
    )
    attn = GroupedQueryAttention(cfg).double()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(std=0.4 if p.ndim == 2 else 1.0)
        if kv_bias:
            attn.wq.bias.zero_()  # DeepSeek's q_proj has no bias: the key and value biases are carried
    return attn


def _inputs(t: int = 20, seed: int = 1) -> torch.Tensor:
    return torch.randn(2, t, 48, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_head_rows_move_the_turned_pairs_to_half_split_planes_first(layout):
    # The classic conversion bug is pairing the wrong rows: scores with the source's RoPE on its own rows equal
    # scores with half-split RoPE on the first rotary_dim rows of w[head_rows], the other rows as they are.
    rotary, interleaved = LAYOUTS[layout]
    cfg = _attention(rotary, interleaved).cfg
    order = head_rows(cfg)
    assert sorted(order.tolist()) == list(range(16))
    turned = interleaved_to_half_split(rotary) if interleaved else torch.arange(rotary)
    assert torch.equal(order, torch.cat((turned, torch.arange(rotary, 16))))
    if interleaved:  # even rows of the turned part first, then odd rows: pair (2i, 2i + 1) -> plane i
        assert order[: rotary // 2].tolist() == list(range(0, rotary, 2))
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(1, 2, 9, 16, generator=g, dtype=torch.float64) for _ in range(2))
    pos = torch.arange(9)
    cos, sin = rope_cos_sin(pos, rotary, 100.0, torch.float64, interleaved=interleaved)
    source = apply_rope(q, cos, sin, interleaved) @ apply_rope(k, cos, sin, interleaved).transpose(-1, -2)
    cos, sin = rope_cos_sin(pos, rotary, 100.0, torch.float64)
    ours = apply_rope(q[..., order], cos, sin) @ apply_rope(k[..., order], cos, sin).transpose(-1, -2)
    torch.testing.assert_close(ours, source, rtol=1e-12, atol=1e-12)
    if interleaved:  # the test can fail: half-split RoPE on the rows as they are is another model
        wrong = apply_rope(q, cos, sin) @ apply_rope(k, cos, sin).transpose(-1, -2)
        assert (wrong - source).abs().max() > 1e-2


@pytest.mark.parametrize("mode", ["naive", "absorbed"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kv_bias", [False, True])
def test_one_kv_head_keeping_every_turned_plane_converts_exactly(layout, mode, kv_bias):
    rotary, interleaved = LAYOUTS[layout]
    attn = _attention(rotary, interleaved, kv_bias=kv_bias)
    mla = gqa_to_mla(
        attn, full_rank(attn.cfg, rotary), calib=_inputs(seed=3)
    )  # default rope_dim: every plane
    mla.mode = mode
    # the rotary key is the source's turned dims; the dims never turned are the whole no-RoPE part
    assert mla.cfg.qk_rope_head_dim == rotary and mla.cfg.qk_nope_head_dim == 16 - rotary
    assert mla.cfg.rope_theta == pytest.approx(100.0)  # stride 1 over the turned dims: the source's own theta
    x = _inputs()
    torch.testing.assert_close(mla(x), attn(x), rtol=1e-10, atol=1e-10)
    cache = mla.new_cache(2, 20)
    with torch.no_grad():  # cached decode through the latent cache equals the full forward
        steps = torch.cat([mla(x[:, i : i + 1], cache=cache) for i in range(20)], dim=1)
    torch.testing.assert_close(steps, attn(x), rtol=1e-5, atol=1e-5)  # cached angles: float32


@pytest.mark.parametrize("layout", ["half-split 12 of 16", "interleaved 8 of 16"])
def test_dims_never_turned_convert_exactly_from_several_kv_heads(layout):
    # Two KV heads whose keys live in the dims RoPE never turns: nothing rotates, and at full rank the latent
    # holds every KV head's keys and values, so the layer is exact. With keys in the turned dims too, the second
    # virtual head loses RoPE: approximate, as for a Llama.
    rotary, interleaved = LAYOUTS[layout]
    attn = _attention(rotary, interleaved, n_kv=2)
    x = _inputs()
    mixed = gqa_to_mla(attn, full_rank(attn.cfg, 4), rope_dim=4)
    assert (mixed(x) - attn(x)).abs().max() > 1e-3
    turned = torch.cat([torch.arange(rotary) + g * 16 for g in range(2)])
    with torch.no_grad():
        attn.wk.weight[turned] = 0.0
    mla = gqa_to_mla(attn, full_rank(attn.cfg, 4), rope_dim=4)
    assert mla.cfg.qk_nope_head_dim == 16  # several KV heads: every dim of each goes through the latent
    torch.testing.assert_close(mla(x), attn(x), rtol=1e-10, atol=1e-10)


def test_the_planes_and_theta_are_those_of_the_turned_dims():
    attn = _attention(8, True, n_kv=2)  # 4 planes of 8 turned dims, frequencies 100 ** (-2f / 8)
    with pytest.raises(
        ValueError, match=r"rope_dim must be an int in \[2, 8\] \(RoPE turns 8 of .*=16 dims\)"
    ):
        gqa_to_mla(attn, 8, rope_dim=10)
    with pytest.raises(
        ValueError, match=r"stride must be an int in \[1, 3\].*2 planes of a head turning 8 dims"
    ):
        gqa_to_mla(attn, 8, rope_dim=4, stride=4)
    # planes 0 and 3 kept: theta' ** (-2j / 4) = 100 ** (-2 * 3j / 8), theta' = 100 ** (3 * 4 / 8)
    assert gqa_to_mla(attn, 8, rope_dim=4, stride=3).cfg.rope_theta == pytest.approx(100.0**1.5)


def _model(rotary: int, interleaved: bool, noise: float = 0.3) -> Transformer:
    """Two layers of 2 KV heads whose turned dims differ, head to head, by a RoPE-commuting map (a scaled
    rotation of each plane, which RoRoPE carries exactly) plus ``noise`` times a random key: the part that
    loses RoPE. The dims never turned are random."""
    cfg = ModelConfig(
        vocab_size=96,
        n_layers=2,
        attention=_attention(rotary, interleaved, n_kv=2).cfg,
        ffn_dim=64,
        max_seq_len=128,
    )
    model = Transformer(cfg).float()
    model.init_weights(std=0.1, seed=4)
    g = torch.Generator().manual_seed(5)
    order, half = head_rows(cfg.attention), rotary // 2
    with torch.no_grad():
        for layer in model.layers:  # scores of order 1, not the near-uniform attention of small weights
            layer.attention.wq.weight.mul_(6.0)
            wk = layer.attention.wk.weight.view(2, 16, -1).mul_(6.0)  # a view: writes go to the weight
            first = wk[0, order[:rotary]]
            turn = torch.polar(torch.rand(half, generator=g) + 0.5, 6.3 * torch.rand(half, generator=g))
            z = torch.complex(first[:half], first[half:]) * turn[:, None]
            rows = torch.cat((z.real, z.imag)) + noise * first.std() * torch.randn(first.shape, generator=g)
            wk[1, order[:rotary]] = rows
    return model.eval()


def _ignoring_layout(model: Transformer) -> Transformer:
    """The same weights read as a Llama: RoPE on every dim in half-split pairs. What a converter that ignored the
    rotary layout would take them for; the baseline ours is compared with."""
    out = copy.deepcopy(model)
    llama = model.cfg.attention.replace(rope_dim=None, rope_interleaved=False)
    for layer in out.layers:
        layer.attention.cfg = llama
    out.cfg = out.cfg.with_attention(llama)
    return out


@pytest.mark.parametrize("layout", ["half-split 12 of 16", "interleaved 8 of 16"])
def test_several_kv_heads_convert_approximately_and_better_than_the_baselines(layout):
    # Every turned plane kept, at full rank: only what the second KV head's turned dims do not share with the
    # first (the noise) loses RoPE. Baselines on the same weights: a converter that ignores the rotary layout
    # (RoPE on every dim in half-split pairs), and the naive conversion (the mean over KV heads as the rotary
    # key, no mean rotation for what loses RoPE).
    rotary, interleaved = LAYOUTS[layout]
    model = _model(rotary, interleaved)
    calib, held_out = random_batches(96, seed=0, n=2, length=64), random_batches(96, seed=1, n=1, length=64)
    rank = full_rank(model.cfg.attention, rotary)
    ours = convert_model_to_mla(model, rank, rotary, calib=calib)
    baselines = {
        "layout ignored": convert_model_to_mla(_ignoring_layout(model), rank, rotary, calib=calib),
        "naive": convert_model_to_mla(model, rank, rotary, calib=calib, rorope=False, mean_phase=False),
    }
    mine = layer_errors(model, ours, held_out)
    assert all(e["score_error"] < 0.15 and e["output_error"] < 0.35 for e in mine), (
        mine
    )  # measured ~0.09, ~0.25
    kl = logit_distance(model, ours, held_out)["kl"]
    for name, baseline in baselines.items():
        theirs = layer_errors(model, baseline, held_out)
        for a, b in zip(mine, theirs, strict=True):
            assert a["score_error"] < 0.5 * b["score_error"], (name, mine, theirs)
        assert kl < 0.5 * logit_distance(model, baseline, held_out)["kl"], name


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
def test_yarn_factor_is_folded_into_the_turned_dims_only(interleaved):
    # yarn multiplies cos and sin, so only the turned dims' share of a score grows by factor^2 (transformers'
    # GLM leaves the other dims as they are). One KV head whose scaled planes carry no key, its plain planes kept,
    # at full rank: exact up to RoPE's float32 angles. Folding the factor into the whole head is not.
    yarn = freeze(dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=2048))
    attn = _attention(8, interleaved)
    attn.cfg = attn.cfg.replace(rope_scaling=yarn)
    plain, factor = plain_planes(attn.cfg), source_frequencies(attn.cfg)[1]
    assert plain == 3 and factor == pytest.approx(1 + 0.1 * math.log(4.0))
    scaled = [f for f in range(4) if f >= plain]
    with torch.no_grad():
        attn.wk.weight[head_rows(attn.cfg)[scaled + [f + 4 for f in scaled]]] = 0.0
    mla = gqa_to_mla(attn, full_rank(attn.cfg, 2 * plain), rope_dim=2 * plain)
    x = _inputs()
    y = attn(x)
    assert (mla(x) - y).norm() < 1e-5 * y.norm()
    with torch.no_grad():  # the factor^2 on the never-turned dims' queries too: another model
        nope = mla.wq.weight.view(4, -1, 48)[:, : mla.cfg.qk_nope_head_dim]
        nope.mul_(factor**2)
    assert (mla(x) - y).norm() > 1e-2 * y.norm()


def test_logit_distances_of_several_pairs_equal_each_pair_in_float64(monkeypatch):
    # The MLA summary compared three models pairwise: six forward passes, whole batches of logits in float64
    # (7.9 GB at a 65,536-token vocabulary). Now each model runs once, a few rows at a time, compared 64 tokens at a
    # time: the same figures as the whole-batch formula, row splitting forced here (1 row per pass).
    from attnlab.convert import mla_model

    def model(seed: int) -> Transformer:
        attn = AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2)
        m = Transformer(ModelConfig(vocab_size=300, n_layers=1, attention=attn, ffn_dim=48, max_seq_len=128))
        m.init_weights(std=0.3, seed=seed)
        return m.eval()

    models = {"a": model(1), "b": model(2), "c": model(3)}
    ids = torch.randint(0, 300, (3, 100), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, 70:] = 0
    batches = [(ids, mask), ids[:2, :40]]

    def whole(x, y):  # the formula on whole batches in float64
        diffs, kls, dens = [], [], []
        for batch in batches:
            i, m = batch if isinstance(batch, tuple) else (batch, torch.ones_like(batch))
            la, lb = models[x](i)[m.bool()].double(), models[y](i)[m.bool()].double()
            diffs.append(lb - la)
            dens.append((la - la.mean(-1, keepdim=True)).square().sum())
            kls.append(la.log_softmax(-1).exp() * (la.log_softmax(-1) - lb.log_softmax(-1)))
        d = torch.cat(diffs)
        kl = torch.cat(kls).sum() / len(d)
        return d.abs().max().item(), (d.square().sum() / sum(dens)).sqrt().item(), kl.item()

    monkeypatch.setattr(mla_model, "LOGIT_BYTES", 4 * 100 * 300)  # one row of logits per forward pass
    calls = []
    for m in models.values():
        m.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[0]))
    pairs = [("a", "b"), ("b", "c"), ("a", "c")]
    with torch.no_grad():
        got = mla_model.logit_distances(models, pairs, batches)
        for pair in pairs:
            m, rel, kl = whole(*pair)
            assert got[pair]["max_abs"] == m
            assert got[pair]["rel_rms"] == pytest.approx(rel, rel=1e-12)
            assert got[pair]["kl"] == pytest.approx(kl, rel=1e-12)
            assert logit_distance(models[pair[0]], models[pair[1]], batches) == got[pair]
    # each model once a pass: the first batch a row at a time (100 tokens), the second two rows of 40 at once
    assert calls[:12] == [1] * 9 + [2] * 3
