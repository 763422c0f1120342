"""``GroupedQueryAttention``: cached decode == full forward, backends agree (forward and backward), GQA == MHA
with repeated K/V heads, a textbook per-head oracle, dropout, and bad input.

The textbook oracle below loops over heads in float64 and rotates pairs ``(x[j], x[j + D/2])`` as complex numbers;
query head ``h`` uses KV head ``h // n_rep``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab import AttentionConfig, GroupedQueryAttention

pytestmark = pytest.mark.usefixtures("one_thread")
BACKENDS = ("reference", "sdpa", "grouped", "auto")
VARIANTS = {
    "mha": AttentionConfig(d_model=32, n_heads=4),
    "gqa": AttentionConfig(d_model=48, n_heads=6, n_kv_heads=2, head_dim=10, bias=True),
    "mqa": AttentionConfig(d_model=32, n_heads=4, n_kv_heads=1, rope_theta=500.0),
}


def _err(a, b) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a.double() - b.double()).abs().max().item()


def _build(cfg: AttentionConfig, **changes) -> GroupedQueryAttention:
    attn = GroupedQueryAttention(cfg.replace(**changes) if changes else cfg).eval()
    if cfg.bias:
        with torch.no_grad():
            for lin in (attn.wq, attn.wk, attn.wv, attn.wo):
                lin.bias.normal_()
    return attn


def textbook(attn: GroupedQueryAttention, x: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Causal attention of ``x`` (positions start...) written head by head in float64."""
    cfg = attn.cfg
    b, t, _ = x.shape
    d, n_rep = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads

    def proj(lin, n):
        w = lin.weight.double()
        y = x.double() @ w.T + (lin.bias.double() if lin.bias is not None else 0)
        return y.view(b, t, n, d)

    q, k, v = proj(attn.wq, cfg.n_heads), proj(attn.wk, cfg.n_kv_heads), proj(attn.wv, cfg.n_kv_heads)
    if cfg.rope:
        pos = torch.arange(start, start + t, dtype=torch.float64)
        angle = pos[:, None] * cfg.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        rot = torch.polar(torch.ones_like(angle), angle)[None, :, None, :]  # (1, T, 1, D/2)

        def rope(z):
            c = torch.complex(z[..., : d // 2], z[..., d // 2 :]) * rot
            return torch.cat((c.real, c.imag), dim=-1)

        q, k = rope(q), rope(k)
    heads = []
    for h in range(cfg.n_heads):
        scores = q[:, :, h] @ k[:, :, h // n_rep].transpose(1, 2) / math.sqrt(d)  # (B, T, T)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ v[:, :, h // n_rep])
    y = torch.cat(heads, dim=-1)
    return y @ attn.wo.weight.double().T + (attn.wo.bias.double() if attn.wo.bias is not None else 0)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_equals_textbook_per_head_attention(name):
    attn = _build(VARIANTS[name])
    x = torch.randn(2, 7, attn.cfg.d_model)
    assert _err(attn(x), textbook(attn, x)) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_prefill_then_decode_equals_full_forward(name, backend):
    attn = _build(VARIANTS[name], backend=backend)
    x = torch.randn(3, 11, attn.cfg.d_model)
    with torch.no_grad():
        full = attn(x)
        cache = attn.new_cache(batch_size=3, max_seq_len=11)
        outs = [attn(x[:, :4], cache=cache)]  # prefill 4, then 7 single-token steps
        outs += [attn(x[:, i : i + 1], cache=cache) for i in range(4, 11)]
        assert len(cache) == 11
        assert _err(torch.cat(outs, dim=1), full) <= 1e-5
        # Chunks of several tokens after a prefill (bottom-right causal inside the chunk).
        cache.reset()
        outs = [attn(x[:, a:b], cache=cache) for a, b in ((0, 3), (3, 7), (7, 8), (8, 11))]
        assert _err(torch.cat(outs, dim=1), full) <= 1e-5


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_backends_agree_forward_and_backward(name):
    """Outputs and the gradients of the input and of every weight agree across backends."""
    base = _build(VARIANTS[name])
    x0 = torch.randn(2, 6, base.cfg.d_model)
    grad_out = torch.randn(2, 6, base.cfg.d_model)
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    mask[1, ..., :2] = False  # left padding in the second sequence
    results = {}
    for backend in BACKENDS:
        attn = _build(VARIANTS[name], backend=backend)
        attn.load_state_dict(base.state_dict())
        x = x0.clone().requires_grad_()
        y = attn(x, attn_mask=mask)
        y.backward(grad_out)
        grads = {n: p.grad for n, p in attn.named_parameters()}
        results[backend] = (y, x.grad, grads)
    ref_y, ref_dx, ref_grads = results["reference"]
    assert set(ref_grads) == {n for n, _ in base.named_parameters()}
    for backend, (y, dx, grads) in results.items():
        assert _err(y, ref_y) <= 1e-5, backend
        assert _err(dx, ref_dx) <= 1e-5, backend
        for n, g in grads.items():
            assert _err(g, ref_grads[n]) <= 2e-5, f"{backend} {n}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_n_kv_heads_equal_to_n_heads_is_mha(backend):
    # The oracle is torch's own nn.MultiheadAttention (no RoPE, whose in_proj holds [wq; wk; wv]) with the same
    # weights; with RoPE, the per-head textbook above. (Comparing the module with a copy of itself proved nothing.)
    cfg = AttentionConfig(d_model=32, n_heads=4, n_kv_heads=4, rope=False, bias=True, backend=backend)
    assert cfg.variant == "mha" and cfg.n_rep == 1 and cfg == cfg.replace(n_kv_heads=None)
    ours = _build(cfg)
    ref = torch.nn.MultiheadAttention(32, 4, bias=True, batch_first=True).eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.wq.weight, ours.wk.weight, ours.wv.weight]))
        ref.in_proj_bias.copy_(torch.cat([ours.wq.bias, ours.wk.bias, ours.wv.bias]))
        ref.out_proj.weight.copy_(ours.wo.weight)
        ref.out_proj.bias.copy_(ours.wo.bias)
        x = torch.randn(2, 5, 32)
        future = torch.ones(5, 5, dtype=torch.bool).triu(diagonal=1)  # torch's mask: True = may NOT attend
        assert _err(ours(x), ref(x, x, x, attn_mask=future, need_weights=False)[0]) <= 1e-5
    roped = _build(cfg.replace(rope=True))
    assert _err(roped(x), textbook(roped, x)) <= 1e-5


def _mha_with_repeated_kv(gqa: GroupedQueryAttention) -> GroupedQueryAttention:
    """The MHA whose K/V head h is the GQA's KV head h // n_rep (consecutive query heads share one)."""
    cfg = gqa.cfg
    mha = _build(cfg, n_kv_heads=cfg.n_heads)
    state = gqa.state_dict()
    for name in ("wk", "wv"):
        w = state[f"{name}.weight"].view(cfg.n_kv_heads, cfg.head_dim, cfg.d_model)
        state[f"{name}.weight"] = w.repeat_interleave(cfg.n_rep, dim=0).reshape(-1, cfg.d_model)
        if cfg.bias:
            bias = state[f"{name}.bias"].view(cfg.n_kv_heads, cfg.head_dim)
            state[f"{name}.bias"] = bias.repeat_interleave(cfg.n_rep, dim=0).reshape(-1)
    mha.load_state_dict(state)
    return mha


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["gqa", "mqa"])
def test_gqa_equals_mha_with_repeated_kv_heads(name, backend):
    gqa = _build(VARIANTS[name], backend=backend)
    mha = _mha_with_repeated_kv(gqa)
    x = torch.randn(2, 7, gqa.cfg.d_model)
    with torch.no_grad():
        assert _err(gqa(x), mha(x)) <= 1e-5
        # And through the caches: the GQA cache is n_rep times smaller for the same outputs.
        c_gqa, c_mha = gqa.new_cache(2, 7), mha.new_cache(2, 7)
        assert c_mha.nbytes == gqa.cfg.n_rep * c_gqa.nbytes
        for a, b in ((0, 4), (4, 5), (5, 6), (6, 7)):
            assert _err(gqa(x[:, a:b], cache=c_gqa), mha(x[:, a:b], cache=c_mha)) <= 1e-5


def test_grouping_order_is_consecutive_not_strided():
    """Repeating K/V heads in the other order (head h -> KV head h % n_kv_heads) must give other outputs."""
    gqa = _build(VARIANTS["gqa"])
    cfg = gqa.cfg
    wrong = _build(cfg, n_kv_heads=cfg.n_heads)
    state = gqa.state_dict()
    for name in ("wk", "wv"):
        w = state[f"{name}.weight"].view(cfg.n_kv_heads, cfg.head_dim, cfg.d_model)
        state[f"{name}.weight"] = w.repeat(cfg.n_rep, 1, 1).reshape(-1, cfg.d_model)
        bias = state[f"{name}.bias"].view(cfg.n_kv_heads, cfg.head_dim)
        state[f"{name}.bias"] = bias.repeat(cfg.n_rep, 1).reshape(-1)
    wrong.load_state_dict(state)
    x = torch.randn(1, 6, cfg.d_model)
    assert _err(gqa(x), wrong(x)) > 1e-3


def test_attention_mask_and_is_causal_false():
    attn = _build(VARIANTS["gqa"])
    x = torch.randn(2, 5, attn.cfg.d_model)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    assert _err(attn(x, attn_mask=causal, is_causal=False), attn(x)) <= 1e-6
    everything = attn(x, is_causal=False)
    assert _err(attn(x, attn_mask=torch.ones(5, dtype=torch.bool), is_causal=False), everything) <= 1e-6
    assert _err(everything[:, -1], attn(x)[:, -1]) <= 1e-5  # the last query sees every key either way
    assert _err(everything[:, 0], attn(x)[:, 0]) > 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_in_training_only(backend):
    attn = _build(AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, dropout=0.5, backend=backend))
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        evaluated = attn(x)
        assert torch.equal(attn(x), evaluated)  # eval is deterministic
        attn.train()
        first, second = attn(x), attn(x)
        assert _err(first, evaluated) > 1e-3 and _err(first, second) > 1e-3
        no_dropout = _build(attn.cfg.replace(dropout=0.0)).train()
        no_dropout.load_state_dict(attn.state_dict())
        assert _err(no_dropout(x), evaluated) <= 1e-6


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    b=st.integers(1, 3),
    n_kv=st.integers(1, 3),
    group=st.integers(1, 3),
    head_dim=st.sampled_from([8, 40, 80, 96, 128, 192]),
    prefill=st.integers(1, 6),
    steps=st.integers(1, 4),
    backend=st.sampled_from(BACKENDS),
    seed=st.integers(0, 2**16),
)
def test_property_cache_equals_full_and_textbook(b, n_kv, group, head_dim, prefill, steps, backend, seed):
    torch.manual_seed(seed)
    n_heads = n_kv * group
    cfg = AttentionConfig(d_model=24, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, backend=backend)
    attn = GroupedQueryAttention(cfg).eval()
    assert attn.wq.weight.shape == (n_heads * head_dim, 24)
    assert attn.wk.weight.shape == attn.wv.weight.shape == (n_kv * head_dim, 24)
    assert attn.wo.weight.shape == (24, n_heads * head_dim)
    x = torch.randn(b, prefill + steps, 24)
    with torch.no_grad():
        full = attn(x)
        assert _err(full, textbook(attn, x)) <= 1e-5
        cache = attn.new_cache(batch_size=b, max_seq_len=prefill + steps + 2)  # a longer cache is fine
        outs = [attn(x[:, :prefill], cache=cache)]
        outs += [attn(x[:, i : i + 1], cache=cache) for i in range(prefill, prefill + steps)]
        assert _err(torch.cat(outs, dim=1), full) <= 1e-5


# ------------------------------------------------------------------------------------------ bad input


def test_bad_input_names_field_and_value():
    attn = _build(VARIANTS["gqa"])
    with pytest.raises(ValueError, match=r"d_model=48\), got shape \(2, 5, 47\)"):
        attn(torch.randn(2, 5, 47))
    with pytest.raises(ValueError, match=r"got shape \(5, 48\)"):
        attn(torch.randn(5, 48))
    with pytest.raises(TypeError, match=r"x has dtype torch.bfloat16 but the weights are torch.float32"):
        attn(torch.randn(2, 5, 48, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor, got list"):
        attn([[0.0] * 48])
    with pytest.raises(TypeError, match=r"cfg must be an AttentionConfig, got dict"):
        GroupedQueryAttention({"d_model": 48, "n_heads": 6})


def test_bad_mask_through_the_module_leaves_the_cache_unchanged():
    attn = _build(VARIANTS["gqa"])
    cache = attn.new_cache(batch_size=2, max_seq_len=8)
    attn(torch.randn(2, 3, 48), cache=cache)
    k_before, v_before = cache.k.clone(), cache.v.clone()
    x = torch.randn(2, 2, 48)
    with pytest.raises(ValueError, match=r"attn_mask of shape \(2, 2\) does not broadcast.*\(2, 6, 2, 5\)"):
        attn(x, attn_mask=torch.ones(2, 2, dtype=torch.bool), cache=cache)  # should be (2, 5): 3 cached + 2
    with pytest.raises(TypeError, match=r"attn_mask must be a bool tensor.*torch.int64"):
        attn(x, attn_mask=torch.ones(2, 5, dtype=torch.long), cache=cache)
    assert len(cache) == 3
    assert torch.equal(cache.k, k_before) and torch.equal(cache.v, v_before)
    attn(x, attn_mask=torch.ones(2, 5, dtype=torch.bool), cache=cache)  # the right shape works
    assert len(cache) == 5


def test_cache_misuse_through_the_module():
    attn = _build(VARIANTS["gqa"])
    cache = attn.new_cache(batch_size=2, max_seq_len=4)
    with pytest.raises(ValueError, match=r"batch of 3 but the cache was made for batch_size=2"):
        attn(torch.randn(3, 1, 48), cache=cache)
    attn(torch.randn(2, 3, 48), cache=cache)
    with pytest.raises(ValueError, match=r"overflow: 3 tokens held \+ 2 new > max_seq_len=4"):
        attn(torch.randn(2, 2, 48), cache=cache)
    assert len(cache) == 3
    bf16_cache = attn.new_cache(batch_size=2, max_seq_len=4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"k has dtype torch.float32, the cache holds torch.bfloat16"):
        attn(torch.randn(2, 1, 48), cache=bf16_cache)
    assert len(bf16_cache) == 0
    other = _build(VARIANTS["mqa"].replace(d_model=48)).new_cache(batch_size=2, max_seq_len=4)
    with pytest.raises(ValueError, match=r"n_kv_heads=1"):
        attn(torch.randn(2, 1, 48), cache=other)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_module_matches_float32(backend):
    attn = _build(VARIANTS["gqa"])
    x = torch.randn(2, 6, 48)
    expected = attn(x)
    attn16 = _build(VARIANTS["gqa"], backend=backend).to(torch.bfloat16)
    attn16.load_state_dict(attn.state_dict())
    cache = attn16.new_cache(batch_size=2, max_seq_len=6)
    assert cache.k.dtype == torch.bfloat16
    x16 = x.bfloat16()
    steps = [attn16(x16[:, :3], cache=cache)] + [attn16(x16[:, i : i + 1], cache=cache) for i in (3, 4, 5)]
    got = torch.cat(steps, dim=1)
    assert got.dtype == torch.bfloat16
    # bfloat16 keeps 8 mantissa bits (relative step 2**-8 ~ 4e-3); measured error 0.3-0.4% of the largest output,
    # so 1% of it leaves room for accumulation without hiding a real bug (a wrong scale or head costs > 10%).
    assert _err(got, expected) <= 1e-2 * expected.abs().max().item()
    assert _err(attn16(x16), expected) <= 1e-2 * expected.abs().max().item()
