"""GQA/MHA -> MLA (DeepSeek layout): exact cases, RoRoPE, plane selection, the latent norm, bad targets."""

from __future__ import annotations

import pytest
import torch
from test_convert_gqa import heads, inputs, make, rope_commuting

from attnlab import AttentionConfig, GroupedQueryAttention, ModelConfig
from attnlab.attention.rope import apply_rope, inverse_frequencies, rope_cos_sin
from attnlab.convert import (
    choose_stride,
    convert_model_to_mla,
    fold_latent_norm,
    fold_latent_norms,
    gqa_to_mla,
    layer_errors,
    logit_distance,
)
from attnlab.convert.mla import full_rank, mean_phase_queries, mean_rotation, rope_planes
from attnlab.convert.mla_model import attention_distances, attention_scores, with_nope_dim
from attnlab.convert.model import calibrate
from attnlab.model import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("mode", ["naive", "absorbed"])
@pytest.mark.parametrize(
    "rope,bias,n_kv",
    [(False, False, 8), (False, True, 2), (True, False, 1), (True, True, 1)],
)
def test_exact_at_full_rank_without_rope_or_from_one_kv_head(mode, rope, bias, n_kv):
    attn = make(n_kv_heads=n_kv, bias=bias, rope=rope)
    if bias:
        with torch.no_grad():
            attn.wq.bias.zero_()  # MLA's wq has no bias (DeepSeek); k/v/o biases are carried
    rope_dim = 8 if rope else 2  # with RoPE: every plane of the head_dim=8 heads kept
    full = full_rank(attn.cfg, rope_dim)
    mla = gqa_to_mla(attn, full, rope_dim=rope_dim, calib=inputs(n=1, t=6, seed=3))  # rank-deficient calib
    mla.mode = mode
    x = inputs()
    tol = 1e-10
    torch.testing.assert_close(mla(x), attn(x), rtol=tol, atol=tol)
    assert mla.cfg.cache_dim == full + rope_dim and not mla.cfg.kv_norm
    # One KV head, every plane kept: the rotary key is the source key, nothing is left for a nope part.
    assert mla.cfg.qk_nope_head_dim == (0 if rope else 8)
    cache = mla.new_cache(2, 12)
    with torch.no_grad():  # cached decode through the latent cache equals the full forward
        steps = torch.cat([mla(x[:, i : i + 1], cache=cache) for i in range(12)], dim=1)
    torch.testing.assert_close(steps, attn(x), rtol=1e-5, atol=1e-5)


def test_low_rank_error_falls_with_rank():
    attn = make(n_kv_heads=4, rope=False)
    calib, x = inputs(n=8, t=32, seed=4), inputs(seed=5)
    errs = [_rel(gqa_to_mla(attn, r, calib=calib)(x), attn(x)) for r in (8, 24, 40, 64)]
    assert errs[0] > errs[1] > errs[2] > errs[3]
    assert errs[3] < 1e-10  # rank 64 = d_model: the stacked K/V of 4 heads (64 rows) is full


@pytest.mark.parametrize("rorope,exact", [(True, True), (False, False)])
def test_rorope_concentrates_planes_that_differ_by_a_rotation(rorope, exact):
    # Every KV head's key is a per-plane scaled rotation of one key (RoPE-commuting maps): one virtual head
    # per plane carries all of it, so RoRoPE keeps every score exact; the mean over heads cannot.
    attn = make(n_heads=8, n_kv_heads=4)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        base = heads(attn.wk.weight, 4)[0].clone()
        attn.wk.weight.copy_(torch.stack([rope_commuting(8, g) @ base for _ in range(4)]).reshape(32, 64))
    calib, x = inputs(n=8, t=32, seed=2), inputs(seed=3)
    mla = gqa_to_mla(attn, full_rank(attn.cfg, 8), rope_dim=8, calib=calib, rorope=rorope)
    err = _rel(attention_scores(mla, x), attention_scores(attn, x))
    assert (err < 1e-5) if exact else (err > 1e-2), err


def _planted_model(stride: int, n_kv: int = 1, seed: int = 0) -> Transformer:
    """A 2-layer model with head_dim 32 whose query/key planes 0, stride, 2 stride, ... are 10x stronger."""
    cfg = ModelConfig(
        vocab_size=64,
        n_layers=2,
        attention=AttentionConfig(d_model=64, n_heads=4, n_kv_heads=n_kv, head_dim=32, rope_theta=100.0),
        ffn_dim=96,
        max_seq_len=64,
    )
    model = Transformer(cfg)
    model.init_weights(std=0.1, seed=seed)
    strong = rope_planes(32, 8, stride)
    scale = torch.full((16,), 0.1)
    scale[strong] = 1.0
    rows = torch.cat((scale, scale))  # half-split: plane f is rows f and f + 16
    with torch.no_grad():
        for layer in model.layers:
            for lin in (layer.attention.wq, layer.attention.wk):
                w = lin.weight.view(-1, 32, 64)
                w.mul_(rows[None, :, None] * 3.0)
    return model.eval()


def test_norm_selection_finds_the_strong_planes_and_beats_first_and_uniform():
    # rope_dim 8 = 4 planes of 16; strides 1..5 are possible ("uniform" = 5, "first" = 1); 3 is planted.
    model = _planted_model(stride=3)
    calib = [torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(1))]
    held_out = [torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(2))]
    assert choose_stride(model, 8, "norm", calib=calib) == choose_stride(model, 8, "error", calib=calib) == 3
    assert choose_stride(model, 8, "first") == 1 and choose_stride(model, 8, "uniform") == 5
    errors = {}
    for planes in (None, "first", "uniform"):  # None: "norm"
        mla = convert_model_to_mla(model, 56, 8, calib=calib, planes=planes)  # full rank: RoPE is the error
        errors[planes] = sum(e["score_error"] for e in layer_errors(model, mla, held_out))
        assert mla.cfg.attention.kv_lora_rank == 56 and mla.cfg.attention.qk_rope_head_dim == 8
    assert errors[None] < 0.5 * min(errors["first"], errors["uniform"]), errors


@pytest.mark.parametrize("rope", [True, False])
def test_model_converted_at_full_rank_gives_source_logits(rope):
    # float32, as checkpoints are used: MQA with every plane kept, or no RoPE at all, converts exactly.
    n_kv = 1 if rope else 2
    cfg = ModelConfig(
        vocab_size=80,
        n_layers=2,
        attention=AttentionConfig(d_model=48, n_heads=4, n_kv_heads=n_kv, head_dim=12, rope=rope),
        ffn_dim=64,
        max_seq_len=64,
    )
    src = Transformer(cfg)
    src.init_weights(std=0.1, seed=4)
    src.eval()
    before = {k: v.clone() for k, v in src.state_dict().items()}
    calib = [torch.randint(0, 80, (2, 16), generator=torch.Generator().manual_seed(5))]
    rope_dim = 12 if rope else 2
    full = full_rank(cfg.attention, rope_dim)
    mla = convert_model_to_mla(src, full, rope_dim, calib=calib)
    tokens = torch.randint(0, 80, (2, 20), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(mla(tokens), src(tokens), rtol=1e-4, atol=1e-4)
    for key, value in src.state_dict().items():  # the source is untouched
        assert torch.equal(value, before[key]), key
    dist = logit_distance(src, mla, [tokens])
    assert dist["max_abs"] < 1e-4 and dist["kl"] < 1e-8
    assert all(e["output_error"] < 1e-5 and e["score_error"] < 1e-5 for e in layer_errors(src, mla, [tokens]))
    # DeepSeek's latent norm then changes each token's latent scale: measured, small but not zero.
    native, stats = fold_latent_norms(mla, calib)
    assert native.cfg.attention.kv_norm and len(stats) == 2
    assert 0 < logit_distance(mla, native, calib)["rel_rms"] < 0.5
    # With every plane kept from one KV head there is no nope part; the on-disk conversion adds a zero one for
    # llama.cpp (with_nope_dim): the same logits, and a model that has one is returned as it is.
    padded = with_nope_dim(mla)
    assert (
        mla.cfg.attention.qk_nope_head_dim == (0 if rope else 12)
        and padded.cfg.attention.qk_nope_head_dim >= 1
    )
    assert (padded is mla) == (not rope)
    with torch.no_grad():
        torch.testing.assert_close(padded(tokens), mla(tokens), rtol=1e-5, atol=1e-5)
    if rope:
        attn = padded.layers[0].attention
        assert attn.wq.weight.view(4, 13, 48)[:, 0].abs().max() == 0
        assert attn.wkv_b.weight.view(4, 13, -1)[:, 0].abs().max() == 0


@pytest.mark.parametrize("tilt,kind", [(0.0, "diagonal"), (0.6, "general")])
def test_latent_norm_fold_scales_each_token_and_balancing_makes_the_rms_constant(tilt, kind):
    # A 2-value latent on an ellipse (cos t, 3 sin t), turned by ``tilt``: its RMS varies, but a map of the
    # latent makes it constant (a diagonal one for an upright ellipse, a general one for a tilted one), so the
    # balanced fold reproduces the layer; the plain one cannot.
    attn = make(n_heads=4, n_kv_heads=1, rope=False, d_model=8)
    mla = gqa_to_mla(attn, 2, rope_dim=2)
    turn = torch.tensor([[1.0, -tilt], [tilt, 1.0]], dtype=torch.float64) / (1 + tilt**2) ** 0.5
    with torch.no_grad():
        mla.wkv_a.weight.zero_()
        mla.wkv_a.weight[:2, :2] = turn
    t = torch.linspace(0, 6.0, 40, dtype=torch.float64)
    x = torch.zeros(1, 40, 8, dtype=torch.float64)
    x[0, :, 0], x[0, :, 1], x[0, :, 2:] = t.cos(), 3 * t.sin(), 0.3
    plain, plain_stats = fold_latent_norm(mla, x, balance=False)
    balanced, stats = fold_latent_norm(mla, x)
    assert stats["balance"] == kind and stats["latent_error"] < 1e-5 < 0.1 < plain_stats["latent_error"]
    torch.testing.assert_close(balanced(x), mla(x), rtol=1e-5, atol=1e-5)
    assert _rel(plain(x), mla(x)) > 1e-2
    # Whatever the fold, values are the source's scaled per token (the norm's only effect on them).
    with torch.no_grad():
        c = plain.kv_norm(plain.wkv_a(x)[..., :2])
        ratio = plain.wkv_b(c)[..., -8:] / mla.wkv_b(mla.wkv_a(x)[..., :2])[..., -8:]
    assert (ratio - ratio[..., :1]).abs().max() < 1e-5  # RMSNorm computes in float32


def test_the_latent_norms_nnls_meets_its_optimality_conditions_and_repeats_bit_for_bit():
    # Lawson & Hanson's conditions for argmin p^T G p - 2 r^T p over p >= 0: p >= 0, and the residual r - G p is
    # zero where p > 0 and <= 0 where p = 0. A rank-deficient G (64 x 64 of rank 40), as a latent's squares give.
    from attnlab.convert.latent_norm import _nnls

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(40, 64, generator=gen, dtype=torch.float64)
    gram, rhs = a.T @ a, a.T @ torch.randn(40, generator=gen, dtype=torch.float64)
    p = _nnls(gram, rhs)
    residual = rhs - gram @ p
    assert (p >= 0).all() and 0 < int((p > 0).sum()) < 64
    assert residual[p > 0].abs().max() < 1e-8 * rhs.abs().max()
    assert residual[p == 0].max() < 1e-8 * rhs.abs().max()
    # the same inputs, the same bits: a conversion's weights must not change from run to run
    assert all(torch.equal(_nnls(gram, rhs), p) for _ in range(20))


def test_bad_targets_name_the_value():
    attn = make(n_kv_heads=2)  # head_dim 8, d_model 64
    for kwargs, match in [
        ({"kv_lora_rank": 0}, "kv_lora_rank"),
        ({"kv_lora_rank": 33}, r"kv_lora_rank must be an int in \[1, 32\].*got 33"),
        ({"kv_lora_rank": True}, "kv_lora_rank"),
        ({"kv_lora_rank": 8, "rope_dim": 5}, "rope_dim must be even.*5"),
        ({"kv_lora_rank": 8, "rope_dim": 10}, r"rope_dim must be an int in \[2, 8\].*10"),
        ({"kv_lora_rank": 8, "rope_dim": 0}, "rope_dim"),
        ({"kv_lora_rank": 8, "rope_dim": 4, "stride": 4}, r"stride must be an int in \[1, 3\].*got 4"),
        ({"kv_lora_rank": 8, "weighting": "svd"}, "weighting"),
    ]:
        with pytest.raises(ValueError, match=match):
            gqa_to_mla(attn, **kwargs)
    biased = make(bias=True, rope=False)
    with pytest.raises(ValueError, match="query bias"):
        gqa_to_mla(biased, 16)
    # an MLA layer has none of these: converted, the layer once computed another model without a word
    for change in ({"window": 4}, {"qk_norm": "head"}, {"softcap": 5.0}):
        other = GroupedQueryAttention(attn.cfg.replace(**change))
        field = next(iter(change))
        with pytest.raises(ValueError, match=f"the source's {field}=.* cannot be converted to MLA"):
            gqa_to_mla(other, 8)
    with pytest.raises(ValueError, match="planes"):
        choose_stride(Transformer(ModelConfig(64, 1, attn.cfg, 32)), 4, "lowest")


def test_bad_calibration_arguments_are_refused_by_name():
    """A (B, T) tensor as calib raised 'Boolean value of Tensor ... is ambiguous'; ids past the vocabulary an
    IndexError; models of two vocabularies a size mismatch; a str seed a str + int TypeError."""
    from attnlab.convert import convert_model

    model = Transformer(ModelConfig(50, 2, AttentionConfig(d_model=32, n_heads=4), 64)).eval()
    ids = torch.randint(0, 50, (2, 8))
    for call, error, match in [
        (lambda: convert_model(model, 2, "fit", calib=ids), TypeError, r"got a tensor: pass \[calib\]"),
        (lambda: convert_model(model, 2, "fit", calib=[ids + 50]), ValueError, "outside the model's vocabulary"),
        (lambda: convert_model(model, 2, "fit", calib=[(ids, torch.ones(3, 3))]), ValueError, "the mask must be"),
        (lambda: convert_model(model, 2, "random", seed="a"), TypeError, "seed must be an int"),
        (lambda: convert_model(torch.nn.Linear(2, 2), 2), TypeError, "model must be an attnlab Transformer"),
        (lambda: logit_distance(model, Transformer(ModelConfig(60, 2, model.cfg.attention, 64)), [ids]),
         ValueError, "vocabularies differ"),
    ]:  # fmt: skip
        with pytest.raises(error, match=match):
            call()


def test_padded_calibration_equals_one_sequence_at_a_time():
    # Right-padded (ids, mask) batches, as calibration files give them: pads must not count anywhere (inputs,
    # attention distances, plane scores, layer errors, logit distances).
    model = _planted_model(stride=2, n_kv=2, seed=3)
    gen = torch.Generator().manual_seed(4)
    long, short = torch.randint(0, 64, (12,), generator=gen), torch.randint(0, 64, (7,), generator=gen)
    ids = torch.stack((long, torch.cat((short, torch.zeros(5, dtype=torch.long)))))
    mask = torch.tensor([[1] * 12, [1] * 7 + [0] * 5])
    padded, separate = [(ids, mask)], [long[None], short[None]]
    dist_padded = attention_distances(model.layers[0].attention, next(calibrate(model, padded)))
    dist_separate = attention_distances(model.layers[0].attention, next(calibrate(model, separate)))
    torch.testing.assert_close(dist_padded, dist_separate, rtol=1e-5, atol=1e-5)
    assert choose_stride(model, 8, "error", calib=padded) == choose_stride(model, 8, "error", calib=separate)
    a = convert_model_to_mla(model, 24, 8, calib=padded)
    b = convert_model_to_mla(model, 24, 8, calib=separate)
    x = torch.randint(0, 64, (2, 16), generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(a(x), b(x), rtol=1e-4, atol=1e-4)
    errs_a, errs_b = layer_errors(model, a, padded), layer_errors(model, a, separate)
    for ea, eb in zip(errs_a, errs_b, strict=True):
        assert ea == pytest.approx(eb, rel=1e-4)
    assert logit_distance(model, a, padded) == pytest.approx(logit_distance(model, a, separate), rel=1e-4)


# Llama 3's scaling on 4 planes of theta 100: plane 0 as plain RoPE turns it, 1 and 2 smoothed, 3 divided by 8.
LLAMA3 = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
          ("original_max_position_embeddings", 64), ("rope_type", "llama3"))  # fmt: skip


@pytest.mark.parametrize("scaling", [(), LLAMA3], ids=["plain", "llama3"])
def test_mean_phase_is_exact_for_heads_that_attend_at_one_distance(scaling):
    # A head whose attention sits at one distance D sees one rotation e^{-i w D} per plane: turning its
    # query by the conjugate must give the source's rotated score for every pair (t, t - D), unrotated; with
    # scaled RoPE, at the scaled frequencies w the source turns by.
    gen = torch.Generator().manual_seed(8)
    q, k = (
        torch.randn(2, 8, generator=gen, dtype=torch.float64),
        torch.randn(8, generator=gen, dtype=torch.float64),
    )
    distances = torch.zeros(2, 10, dtype=torch.float64)
    distances[0, 3], distances[1, 7] = 1.0, 2.0  # head 0 attends 3 tokens back, head 1 seven
    inv_freq = inverse_frequencies(8, 100.0, scaling)[0]
    turned = mean_phase_queries(q[..., None], mean_rotation(distances, inv_freq))[..., 0]
    plain = mean_phase_queries(q[..., None], mean_rotation(distances, inverse_frequencies(8, 100.0)[0]))[
        ..., 0
    ]
    for h, back in ((0, 3), (1, 7)):
        cos, sin = rope_cos_sin(torch.tensor([9, 9 - back]), 8, 100.0, dtype=torch.float64, scaling=scaling)
        source = apply_rope(q[h], cos[0], sin[0]) @ apply_rope(k, cos[1], sin[1])
        torch.testing.assert_close(turned[h] @ k, source, rtol=1e-5, atol=1e-5)
        assert (
            abs((q[h] @ k - source).item()) > 1e-2
        )  # without the turn the score is wrong: the test can fail
        if (
            scaling
        ):  # ... and so is a turn at plain RoPE's frequencies, which the scaled planes no longer have
            assert abs((plain[h] @ k - source).item()) > 1e-2
