"""mha_to_gqa / permute_heads on single modules: exactness where claimed, errors where not (MLA: test_convert_mla)."""

from __future__ import annotations

import pytest
import torch

from attnlab import AttentionConfig, GroupedQueryAttention
from attnlab.convert import METHODS, mha_to_gqa, permute_heads
from attnlab.convert.gqa import joint_fit
from conftest import seeded


def make(n_heads=8, n_kv_heads=None, bias=False, rope=True, d_model=64, out_bias=None, dtype=torch.float64):
    cfg = AttentionConfig(
        d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, bias=bias, rope=rope, out_bias=out_bias
    )
    attn = GroupedQueryAttention(cfg).to(dtype)
    attn.init_weights(std=0.2)
    with torch.no_grad():
        for lin in (attn.wq, attn.wk, attn.wv, attn.wo):
            if lin.bias is not None:
                lin.bias.normal_()
    return attn


def inputs(n=2, t=12, d=64, dtype=torch.float64, seed=1):
    # Correlated inputs (a random linear mix), as real activations are, rather than white noise.
    g = torch.Generator().manual_seed(seeded(seed))
    mix = torch.randn(d, d, generator=g, dtype=dtype) / d**0.5 + torch.eye(d, dtype=dtype)
    return torch.randn(n, t, d, generator=g, dtype=dtype) @ mix


def heads(w, n, hd=8):
    return w.detach().view(n, hd, -1)


@pytest.mark.parametrize("bias", [False, True])
def test_mean_rows_are_group_means(bias):
    attn = make(n_heads=8, bias=bias)
    new = mha_to_gqa(attn, 2, "mean")
    assert new.cfg.n_kv_heads == 2 and new.wk.weight.shape == (16, 64)
    for lin_new, lin_old in ((new.wk, attn.wk), (new.wv, attn.wv)):
        old = heads(lin_old.weight, 8)
        for g in range(2):
            torch.testing.assert_close(
                heads(lin_new.weight, 2)[g], old[4 * g : 4 * g + 4].mean(0), rtol=0, atol=1e-15
            )
            if bias:
                ob = lin_old.bias.detach().view(8, 8)
                torch.testing.assert_close(
                    lin_new.bias.detach().view(2, 8)[g], ob[4 * g : 4 * g + 4].mean(0), rtol=0, atol=1e-15
                )
    # Queries and output are untouched by mean pooling.
    assert torch.equal(new.wq.weight, attn.wq.weight) and torch.equal(new.wo.weight, attn.wo.weight)


def test_mean_from_gqa_source_equals_mean_over_query_heads():
    # GQA-4 -> GQA-2 pools pairs of source KV heads: the same as pooling the MHA model with repeated KV heads.
    gqa4 = make(n_heads=8, n_kv_heads=4)
    mha = make(n_heads=8)
    with torch.no_grad():
        mha.wq.weight.copy_(gqa4.wq.weight)
        mha.wo.weight.copy_(gqa4.wo.weight)
        mha.wk.weight.copy_(heads(gqa4.wk.weight, 4).repeat_interleave(2, 0).reshape(64, 64))
        mha.wv.weight.copy_(heads(gqa4.wv.weight, 4).repeat_interleave(2, 0).reshape(64, 64))
    x = inputs()
    torch.testing.assert_close(mha(x), gqa4(x))
    torch.testing.assert_close(mha_to_gqa(mha, 2)(x), mha_to_gqa(gqa4, 2)(x))


def test_first_keeps_first_head_and_random_is_seeded():
    attn = make()
    first = mha_to_gqa(attn, 4, "first")
    torch.testing.assert_close(heads(first.wk.weight, 4), heads(attn.wk.weight, 8)[::2], rtol=0, atol=0)
    r1, r2, r3 = (mha_to_gqa(attn, 4, "random", seed=s) for s in (0, 0, 1))
    assert torch.equal(r1.wk.weight, r2.wk.weight) and not torch.equal(r1.wk.weight, r3.wk.weight)
    assert abs(r1.wk.weight.std().item() - attn.wk.weight.std().item()) < 0.05


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n_kv", [8, 4])
def test_same_head_count_is_identity(method, n_kv):
    attn = make(n_kv_heads=n_kv, bias=True)
    new = mha_to_gqa(attn, n_kv, method, calib=inputs())
    assert new is not attn and new.cfg == attn.cfg
    for (name, a), (_, b) in zip(attn.state_dict().items(), new.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("rope", [True, False])
def test_permuting_heads_leaves_output_unchanged(rope):
    attn = make(n_kv_heads=4, bias=True, rope=rope)
    perm = torch.tensor([2, 0, 3, 1])
    moved = permute_heads(attn, perm)
    assert not torch.equal(moved.wk.weight, attn.wk.weight)
    x = inputs()
    torch.testing.assert_close(moved(x), attn(x), rtol=1e-12, atol=1e-12)
    # The KV head in slot 0 is the source's head 2 and carries its two query heads.
    torch.testing.assert_close(heads(moved.wk.weight, 4)[0], heads(attn.wk.weight, 4)[2])
    torch.testing.assert_close(heads(moved.wq.weight, 8)[:2], heads(attn.wq.weight, 8)[4:6])


@pytest.mark.parametrize("qk_norm", ["head", "full"])
def test_q_k_norm_gains_move_with_their_heads(qk_norm):
    # Per-head norms (Qwen3) share one gain; norms over all heads (OLMo 2) have one per value of each head, which
    # must follow its head when heads are reordered, and so when grouped-fit reorders them into groups.
    from attnlab.convert.gqa import similarity_groups

    attn = GroupedQueryAttention(make(n_kv_heads=4, bias=True).cfg.replace(qk_norm=qk_norm)).double()
    attn.init_weights(std=0.2)
    with torch.no_grad():
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.normal_(1.0, 0.3)
    x = inputs()
    tol = dict(rtol=1e-5, atol=1e-6)  # RMSNorm computes in float32: summed in another order, it rounds apart
    torch.testing.assert_close(permute_heads(attn, [2, 0, 3, 1])(x), attn(x), **tol)
    order = similarity_groups(attn, 2, x)
    grouped = mha_to_gqa(attn, 2, "grouped-fit", calib=x)
    fit = mha_to_gqa(permute_heads(attn, order), 2, "fit", calib=x)
    torch.testing.assert_close(grouped(x), fit(x), **tol)


@pytest.mark.parametrize("rope", [True, False])
def test_joint_fit_of_a_single_head_is_exact_and_rope_maps_commute(rope):
    # One projection: the fit must reproduce it exactly (P = A B). With RoPE, A must commute with rotations.
    p = torch.randn(1, 8, 65, dtype=torch.float64)
    s = torch.eye(8, dtype=torch.float64)[None] + 0.1
    c = torch.eye(65, dtype=torch.float64)
    b, a = joint_fit(p, s, c, rope=rope)
    torch.testing.assert_close(a[0] @ b, p[0])
    if rope:
        from attnlab.attention.rope import apply_rope, rope_cos_sin

        cos, sin = rope_cos_sin(torch.arange(5), 8, 10000.0, dtype=torch.float64)
        v = torch.randn(5, 8, dtype=torch.float64)
        torch.testing.assert_close(apply_rope(v @ a[0].T, cos, sin), apply_rope(v, cos, sin) @ a[0].T)


# Ratios of held-out errors on unrelated random heads (the hard case), measured over 100 modules (the seeds
# this test uses for k = 0..99, measured for issue 8): fit beat mean in 96 of 100 RoPE modules (fit/mean up
# to 1.016) and 100 of 100 without; first beat random in 100 and 99 of 100 (first/random up to 1.003); mean
# beat first in all 200. So no order holds per module. Means (sd) per module: fit/mean 0.953 (0.029) with RoPE,
# 0.758 (0.049) without; first/random 0.753 (0.048) and 0.835 (0.071); the worst of six 16-module averages:
# fit/mean 0.960 / 0.778, first/random 0.786 / 0.849. The test averages 16 modules: each bound below is at
# least 3.5 standard errors above the measured mean.
AVERAGED_BOUNDS = {
    True: {"fit/mean": 0.98, "first/random": 0.9},
    False: {"fit/mean": 0.85, "first/random": 0.92},
}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("rope,bias", [(True, False), (False, True)])
def test_fit_beats_mean_and_the_gqa_order_holds_on_average(rope, bias):
    ratios: dict[str, list[float]] = {"fit/mean": [], "first/random": []}
    for k in range(16):
        torch.manual_seed(seeded(1000 * k))
        attn = make(n_heads=8, bias=bias, rope=rope)
        calib, held_out = inputs(n=16, t=32, seed=1000 * k + 2), inputs(n=4, t=32, seed=1000 * k + 3)
        ref = attn(held_out)
        err = {
            m: (mha_to_gqa(attn, 2, m, calib=calib, seed=seeded(k))(held_out) - ref).pow(2).mean().item()
            for m in ("mean", "first", "random", "fit")
        }
        assert err["mean"] < err["first"], err  # robust per module
        ratios["fit/mean"].append(err["fit"] / err["mean"])
        ratios["first/random"].append(err["first"] / err["random"])
    means = {name: sum(r) / len(r) for name, r in ratios.items()}
    assert all(means[name] < bound for name, bound in AVERAGED_BOUNDS[rope].items()), means


def rope_commuting(hd, g):
    """A random map on one head that commutes with RoPE: a scaled rotation of every frequency plane."""
    half = hd // 2
    a, b = (
        torch.randn(half, generator=g, dtype=torch.float64),
        torch.randn(half, generator=g, dtype=torch.float64),
    )
    m = torch.zeros(hd, hd, dtype=torch.float64)
    idx = torch.arange(half)
    m[idx, idx], m[idx, idx + half], m[idx + half, idx], m[idx + half, idx + half] = a, -b, b, a
    return m


@pytest.mark.parametrize("rope", [True, False])
def test_fit_is_exact_when_heads_differ_by_foldable_maps(rope):
    # Within each group, every head is (A_i B) for a shared B and maps A_i that the fit can fold into the
    # queries / the output projection (RoPE-commuting for keys under RoPE). Mean pooling cannot undo the A_i.
    attn = make(n_heads=8, rope=rope)
    g = torch.Generator().manual_seed(seeded(7))
    with torch.no_grad():
        for lin in (attn.wk, attn.wv):
            w = heads(lin.weight, 8).clone()
            for h in range(8):
                base = w[(h // 4) * 4]
                m = (
                    rope_commuting(8, g)
                    if (rope and lin is attn.wk)
                    else torch.randn(8, 8, generator=g, dtype=torch.float64)
                )
                w[h] = m @ base
            lin.weight.copy_(w.reshape(64, 64))
    calib, held_out = inputs(n=8, t=32, seed=2), inputs(n=2, t=16, seed=3)
    ref = attn(held_out)
    fit = mha_to_gqa(attn, 2, "fit", calib=calib)
    mean = mha_to_gqa(attn, 2, "mean")
    tol = 1e-4 if rope else 1e-9  # apply_rope computes in float32 even for float64 inputs
    torch.testing.assert_close(fit(held_out), ref, rtol=tol, atol=tol)
    assert (mean(held_out) - ref).abs().max() > 1e-1


def test_errors_name_the_problem():
    attn = make()
    with pytest.raises(ValueError, match="n_kv_heads=3"):
        mha_to_gqa(attn, 3)
    with pytest.raises(TypeError, match="n_kv_heads"):
        mha_to_gqa(attn, 2.0)
    with pytest.raises(ValueError, match="method"):
        mha_to_gqa(attn, 2, "median")
    with pytest.raises(ValueError, match="calib"):
        mha_to_gqa(attn, 2, "fit")
    with pytest.raises(ValueError, match="perm"):
        permute_heads(attn, [0, 0, 1, 2, 3, 4, 5, 6])


def test_qwen_style_out_bias():
    cfg = AttentionConfig(d_model=32, n_heads=4, bias=True, out_bias=False)
    attn = GroupedQueryAttention(cfg)
    assert attn.wq.bias is not None and attn.wk.bias is not None and attn.wo.bias is None
    assert GroupedQueryAttention(AttentionConfig(d_model=32, n_heads=4, bias=True)).wo.bias is not None
    assert mha_to_gqa(attn, 2).wo.bias is None


@pytest.mark.parametrize("rope", [True, False])
def test_similarity_groups_find_planted_groups(rope):
    # Heads {0, 3, 5, 6} and {1, 2, 4, 7} are each (A_i B) for a shared B: groups that are not consecutive.
    # grouped-fit must find them (and then be exact); "fit" on index groups cannot be.
    from attnlab.convert.gqa import similarity_groups

    planted = [[0, 3, 5, 6], [1, 2, 4, 7]]
    attn = make(n_heads=8, rope=rope)
    g = torch.Generator().manual_seed(seeded(11))
    with torch.no_grad():
        for lin in (attn.wk, attn.wv):
            w = heads(lin.weight, 8).clone()
            for group in planted:
                for h in group:
                    keys = rope and lin is attn.wk
                    m = rope_commuting(8, g) if keys else torch.randn(8, 8, generator=g, dtype=torch.float64)
                    w[h] = m @ w[group[0]]
            lin.weight.copy_(w.reshape(64, 64))
    calib, held_out = inputs(n=8, t=32, seed=2), inputs(n=2, t=16, seed=3)
    order = similarity_groups(attn, 2, calib)
    assert sorted([sorted(order[:4]), sorted(order[4:])]) == planted
    ref = attn(held_out)
    tol = 1e-4 if rope else 1e-9
    torch.testing.assert_close(
        mha_to_gqa(attn, 2, "grouped-fit", calib=calib)(held_out), ref, rtol=tol, atol=tol
    )
    assert (mha_to_gqa(attn, 2, "fit", calib=calib)(held_out) - ref).abs().max() > 1e-2


# Rotary layouts of the families: (rope_dim, interleaved). Full half-split (Llama), partial half-split (Phi-4-mini,
# GPT-NeoX), full and partial interleaved (GLM, ChatGLM: the first half of each head in pairs (2i, 2i + 1)).
LAYOUTS = {"half-split": (None, False), "partial": (4, False), "interleaved": (None, True), "glm": (4, True)}


def layout_commuting(cfg: AttentionConfig, g: torch.Generator) -> torch.Tensor:
    """A random map on one head's rows that commutes with ``cfg``'s RoPE in its own row layout: a scaled rotation
    of every turned plane (wherever its two rows sit), any matrix on the rows RoPE never turns."""
    from attnlab.convert.gqa import head_rows

    hd, rotary = cfg.head_dim, cfg.rotary_dim
    m = torch.zeros(hd, hd, dtype=torch.float64)
    m[:rotary, :rotary] = rope_commuting(rotary, g)
    m[rotary:, rotary:] = torch.randn(hd - rotary, hd - rotary, generator=g, dtype=torch.float64)
    back = torch.argsort(
        head_rows(cfg)
    )  # built in head_rows order (half-split planes first), moved to the module's
    return m[back][:, back]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fit_follows_the_rotary_layout(layout):
    # Heads differ by maps that commute with RoPE in the family's own layout: the fit folds them exactly, for
    # plain ("fit") and similarity ("grouped-fit") groups alike. Before the fit read the layout it paired rows
    # (i, i + head_dim/2) whatever turned, and every layout but the first missed by far more than the tolerance.
    from attnlab.convert.gqa import similarity_groups

    rope_dim, interleaved = LAYOUTS[layout]
    cfg = AttentionConfig(d_model=64, n_heads=8, rope_dim=rope_dim, rope_interleaved=interleaved)
    attn = GroupedQueryAttention(cfg).to(torch.float64)
    attn.init_weights(std=0.2)
    planted = [[0, 3, 5, 6], [1, 2, 4, 7]]
    g = torch.Generator().manual_seed(seeded(13))
    with torch.no_grad():
        for lin in (attn.wk, attn.wv):
            w = heads(lin.weight, 8).clone()
            for group in planted:
                for h in group:
                    keys = lin is attn.wk
                    m = (
                        layout_commuting(cfg, g)
                        if keys
                        else torch.randn(8, 8, generator=g, dtype=torch.float64)
                    )
                    w[h] = m @ w[group[0]]
            lin.weight.copy_(w.reshape(64, 64))
    calib, held_out = inputs(n=8, t=32, seed=2), inputs(n=2, t=16, seed=3)
    ref = attn(held_out)
    assert (
        sorted(
            [
                sorted(o)
                for o in (similarity_groups(attn, 2, calib)[:4], similarity_groups(attn, 2, calib)[4:])
            ]
        )
        == planted
    )
    grouped = mha_to_gqa(attn, 2, "grouped-fit", calib=calib)
    torch.testing.assert_close(grouped(held_out), ref, rtol=1e-4, atol=1e-4)  # RoPE in float32
    ordered = permute_heads(attn, [0, 3, 5, 6, 1, 2, 4, 7])
    torch.testing.assert_close(
        mha_to_gqa(ordered, 2, "fit", calib=calib)(held_out), ref, rtol=1e-4, atol=1e-4
    )
    assert (mha_to_gqa(ordered, 2, "mean")(held_out) - ref).abs().max() > 1e-1  # the maps are not trivial


@pytest.mark.parametrize("method", ["fit", "grouped-fit"])
def test_calibration_it_cannot_fit_on_is_refused_by_name(method):
    attn = make(rope=False)  # head_dim 8
    # two rows: each head's error weight was singular, and the maps came out thousands of times the weights
    with pytest.raises(ValueError, match=r"calibration has 2 token rows, fewer than 8 \(head_dim\)"):
        mha_to_gqa(attn, 2, method, calib=inputs(n=1, t=2))
    x = inputs(n=1, t=64)
    x[0, 5, 3] = float("nan")  # eigh failed on it ("the algorithm failed to converge"), naming nothing
    with pytest.raises(ValueError, match="calibration inputs hold NaN or inf"):
        mha_to_gqa(attn, 2, method, calib=x)
    new = mha_to_gqa(attn, 2, method, calib=inputs(n=1, t=8))  # head_dim rows: fitted, at the source's scale
    assert new.wq.weight.abs().max() < 10 * attn.wq.weight.abs().max()


def test_grouped_fit_never_groups_worse_than_the_heads_own_order():
    """The greedy grouping seeds each group with the first head left and hands the last group what remains: on
    random weights it lost more than the index order in 17 of 40 layers (a QA checkpoint: 1.042 of the layer's
    energy against 1.028), and grouped-fit then lost to fit. Cost: the K and V energy one shared head cannot
    carry, each as a fraction of the layer's (the grouping's own measure)."""
    from attnlab.convert.gqa import _fit_inputs, _gram, _residual, _total, input_moment, similarity_groups

    def lost(attn, x, order, r):
        st = _fit_inputs(attn, input_moment(x, attn.cfg))
        gk, gv = (
            _gram(st["wk"], st["sq"], st["c"], attn.cfg.rotary_dim),
            _gram(st["wv"], st["so"], st["c"], 0),
        )
        return sum(
            _residual(gk, order[i : i + r], attn.head_dim) / _total(gk)
            + _residual(gv, order[i : i + r], attn.head_dim) / _total(gv)
            for i in range(0, len(order), r)
        )

    for seed in (2, 3, 5, 8):  # layers where the heads' own order loses least
        torch.manual_seed(seed)
        attn = GroupedQueryAttention(AttentionConfig(d_model=64, n_heads=8, n_kv_heads=8)).double()
        attn.init_weights(std=0.2)
        x = torch.randn(4, 32, 64, dtype=torch.double)
        order = similarity_groups(attn, 2, x)
        assert lost(attn, x, order, 4) <= lost(attn, x, list(range(8)), 4) + 1e-12, (seed, order)
