"""The decode kernels against the "reference" backend (repeat-KV, float32 softmax).

Tolerances: float32 atol 2e-5 (summation order only); bfloat16 atol 2e-2 on outputs of magnitude <= ~1 (the
scores and probabilities are rounded to bfloat16 once before each matmul, ~3 significant digits); bfloat16
gradients atol 5e-2 on gradients of magnitude ~5 (measured 0.03).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from attnlab.attention.decode import chunk_bounds, finish, grouped_decode, merge, partial_attention
from attnlab.attention.kernels import attend
from attnlab.cache import KVCache
from conftest import seeded

ATOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _qkv(b, h, n_kv, s, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seeded(seed))
    q = torch.randn(b, h, 1, d, generator=g).to(dtype)
    k = torch.randn(b, n_kv, s, d, generator=g).to(dtype)
    v = torch.randn(b, n_kv, s, d, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_kv", [8, 2, 1])
@pytest.mark.parametrize("s", [1, 7, 257])
@pytest.mark.parametrize("n_split", [1, 2, 3, 8])
def test_grouped_decode_equals_reference(dtype, n_kv, s, n_split):
    q, k, v = _qkv(2, 8, n_kv, s, 16, dtype)
    ref = attend(q, k, v, backend="reference")
    out = grouped_decode(q, k, v, scale=16**-0.5, n_split=n_split)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_shape", [(2, 8, 1, 33), (1, 1, 1, 33), (2, 1, 1, 33), (33,)])
def test_masks_and_fully_masked_rows(dtype, mask_shape):
    q, k, v = _qkv(2, 8, 2, 33, 16, dtype, seed=1)
    g = torch.Generator().manual_seed(seeded(2))
    mask = torch.rand(mask_shape, generator=g) > 0.4
    if len(mask_shape) == 4 and mask_shape[1] == 8:
        mask[0, 3] = False  # one query row attends to nothing -> zeros
        mask[1, :, :, :17] = False  # a chunk that is fully masked for every row of sequence 1
    for n_split in (1, 2, 5):
        for backend_out in (
            grouped_decode(q, k, v, scale=0.25, mask=mask, n_split=n_split),
            attend(q, k, v, attn_mask=mask, scale=0.25, backend="grouped"),
        ):
            ref = attend(q, k, v, attn_mask=mask, scale=0.25, backend="reference")
            assert torch.isfinite(backend_out.float()).all()
            torch.testing.assert_close(backend_out.float(), ref.float(), atol=ATOL[dtype], rtol=0)
    if len(mask_shape) == 4 and mask_shape[1] == 8:
        assert grouped_decode(q, k, v, scale=0.25, mask=mask, n_split=3)[0, 3].abs().max() == 0


def test_merge_of_chunks_equals_one_chunk_for_odd_splits():
    q, k, v = _qkv(1, 4, 2, 101, 8, torch.float32, seed=3)
    q_t = q.reshape(2, 2, 8).transpose(1, 2)
    k3, v3 = k.reshape(2, 101, 8), v.reshape(2, 101, 8)
    whole = finish(partial_attention(q_t, k3, v3, 0.3, None), torch.float32)
    for n in (2, 3, 7, 101):
        bounds = chunk_bounds(101, n)
        assert bounds[0][0] == 0 and bounds[-1][1] == 101 and all(lo < hi for lo, hi in bounds)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
        state = None
        for lo, hi in bounds:
            part = partial_attention(q_t, k3[:, lo:hi], v3[:, lo:hi], 0.3, None)
            state = part if state is None else merge(state, part)
        torch.testing.assert_close(finish(state, torch.float32), whole, atol=1e-6, rtol=0)


def test_merge_with_a_dead_chunk_is_the_live_chunk():
    q, k, v = _qkv(1, 2, 1, 10, 8, torch.float32, seed=4)
    q_t = q.reshape(1, 2, 8).transpose(1, 2)
    k3, v3 = k.reshape(1, 10, 8), v.reshape(1, 10, 8)
    dead = partial_attention(q_t, k3[:, :4], v3[:, :4], 0.3, torch.zeros(1, 2, 4, dtype=torch.bool))
    assert torch.isneginf(dead[1]).all() and (dead[2] == 0).all() and torch.isfinite(dead[0]).all()
    live = partial_attention(q_t, k3[:, 4:], v3[:, 4:], 0.3, None)
    for state in (merge(dead, live), merge(live, dead)):
        torch.testing.assert_close(finish(state, torch.float32), finish(live, torch.float32))
    assert (finish(merge(dead, dead), torch.float32) == 0).all()


def test_live_view_of_a_large_cache_is_read_without_copies():
    """The live prefix of a KVCache is attended in place: no op allocates anything near the cache's size."""
    cache = KVCache(1, 2, 4096, 64)
    q, k, v = _qkv(1, 8, 2, 1024, 64, torch.float32, seed=5)
    k_live, v_live = cache.update(k, v)
    assert k_live.data_ptr() == cache.k.data_ptr() and not k_live.is_contiguous()
    attend(q, k_live, v_live, backend="grouped")  # warm up allocations outside the profile
    with torch.profiler.profile(profile_memory=True) as prof:
        out = attend(q, k_live, v_live, backend="grouped")
    biggest = max(e.self_cpu_memory_usage for e in prof.key_averages())
    assert biggest < k_live.numel() * 4 // 8, f"an op allocated {biggest} bytes (K alone is {k_live.nbytes})"
    torch.testing.assert_close(out, attend(q, k, v, backend="reference"), atol=2e-5, rtol=0)


def test_out_argument_is_filled_in_place():
    q, k, v = _qkv(2, 4, 2, 9, 8, torch.float32, seed=6)
    out = torch.empty(2, 4, 1, 8)
    ret = grouped_decode(q, k, v, scale=0.35, out=out)
    assert ret is out
    torch.testing.assert_close(out, attend(q, k, v, scale=0.35, backend="reference"), atol=2e-5, rtol=0)


def test_empty_context_gives_zeros():
    q, k, v = _qkv(1, 4, 2, 0, 8, torch.float32)
    assert (grouped_decode(q, k, v, scale=0.3) == 0).all()


def test_auto_picks_fused_for_decode_and_sdpa_for_prefill():
    from attnlab.attention import fused
    from attnlab.attention.backends import choose
    from attnlab.attention.kernels import call_of

    q, k, v = _qkv(1, 8, 2, 16, 8, torch.float32)
    assert choose(call_of(q, k, v)).backend.name == ("fused" if fused.available() else "grouped")
    assert choose(call_of(q.expand(1, 8, 4, 8), k, v)).backend.name == "sdpa"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [True, False])
def test_gradients_equal_reference(dtype, masked):
    # The oracle is the reference backend's gradient in float64. float32: both backends within 1e-5 of it.
    # bfloat16: the two backends round differently, so they are not compared with each other (that test
    # failed for 1 base seed in 20, issue 8): each is held to the float64 gradient, relative to |g| + 1. Over
    # 300 seeds the worst such error was 0.050 for grouped and 0.023 for reference; 0.08 is 10 bfloat16 ulps.
    q, k, v = _qkv(2, 4, 2, 11, 8, torch.float64, seed=7)
    mask = (
        torch.rand(2, 4, 1, 11, generator=torch.Generator().manual_seed(seeded(8))) > 0.3 if masked else None
    )

    def grads(backend: str, as_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        x = [t.to(as_dtype).requires_grad_() for t in (q, k, v)]
        out = attend(*x, attn_mask=mask, backend=backend)
        return torch.autograd.grad((out.double() * torch.arange(8.0)).sum(), x)

    exact = grads("reference", torch.float64)
    for backend in ("grouped", "reference"):
        for g, e in zip(grads(backend, dtype), exact, strict=True):
            err = ((g.double() - e).abs() / (e.abs() + 1)).max().item()
            assert err <= (1e-5 if dtype == torch.float32 else 0.08), (backend, err)
