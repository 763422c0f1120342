"""PagedKVCache: ragged batches equal per-sequence contiguous caches; blocks on demand; clean failures."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab import AttentionConfig, GroupedQueryAttention
from attnlab.attention.decode import grouped_decode, paged_decode
from attnlab.cache import OutOfBlocksError, PagedKVCache
from conftest import seeded

BS = 4


def _module(n_kv=2, seed=0, backend="auto"):
    torch.manual_seed(seeded(seed))
    attn = GroupedQueryAttention(AttentionConfig(d_model=64, n_heads=8, n_kv_heads=n_kv, backend=backend))
    attn.init_weights(std=0.15)
    return attn.eval()


def _check_blocks(cache: PagedKVCache) -> None:
    """On-demand allocation: each row holds ceil(len / block_size) blocks, all distinct, none also free."""
    held = [b for table in cache.block_tables for b in table]
    assert len(held) == len(set(held)) and not set(held) & cache._free
    for row in range(cache.batch_size):
        assert len(cache.block_tables[row]) == math.ceil(cache.lengths[row] / cache.block_size)
    partly_filled = sum(1 for n in cache.lengths if n % cache.block_size)
    assert cache.reserved_bytes == len(held) * cache.block_nbytes
    assert (
        cache.reserved_bytes <= (sum(cache.lengths) // cache.block_size + partly_filled) * cache.block_nbytes
    )


@pytest.mark.parametrize("n_kv", [2, 1, 8])
def test_ragged_batch_equals_contiguous_caches_through_growth_and_freeing(n_kv):
    attn = _module(n_kv)
    g = torch.Generator().manual_seed(seeded(1))
    lengths = [5, 11, 2]
    paged = attn.new_paged_cache(n_blocks=40, block_size=BS, batch_size=3)
    assert (paged.n_kv_heads, paged.head_dim, paged.dtype) == (n_kv, 8, torch.float32)
    contiguous = [attn.new_cache(1, 64) for _ in lengths]
    with torch.no_grad():
        for row, n in enumerate(lengths):
            x = torch.randn(1, n, 64, generator=g)
            y_paged = attn(x, cache=paged.select([row]))
            y_ref = attn(x, cache=contiguous[row])
            torch.testing.assert_close(y_paged, y_ref, atol=1e-5, rtol=0)
            torch.testing.assert_close(y_paged, attn(x), atol=1e-5, rtol=0)  # prefill == no cache at all
        _check_blocks(paged)
        paged.select([0, 1, 2])
        for step in range(9):
            if step == 4:  # sequence 1 ends; its blocks return and a new prompt takes its row
                before = paged.n_free_blocks
                held = len(paged.block_tables[1])
                paged.free(1)
                assert paged.n_free_blocks == before + held and paged.lengths[1] == 0
                x = torch.randn(1, 7, 64, generator=g)
                contiguous[1] = attn.new_cache(1, 64)
                torch.testing.assert_close(
                    attn(x, cache=paged.select([1])), attn(x, cache=contiguous[1]), atol=1e-5, rtol=0
                )
                paged.select([0, 1, 2])
            x = torch.randn(3, 1, 64, generator=g)
            y = attn(x, cache=paged)
            y_ref = torch.cat([attn(x[i : i + 1], cache=contiguous[i]) for i in range(3)])
            torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=0)
            _check_blocks(paged)
    assert paged.lengths == [14, 7 + 5, 11]


def test_allocation_keeps_growing_rows_in_long_runs():
    cache = PagedKVCache(40, BS, 1, 2, batch_size=3)
    for row, n in enumerate((9, 5, 7)):
        cache.select([row]).update(torch.randn(1, 1, n, 2), torch.randn(1, 1, n, 2))
    cache.select([0, 1, 2])
    for _ in range(20):  # rows grow in lockstep, a new block each now and then
        cache.update(torch.randn(3, 1, 1, 2), torch.randn(3, 1, 1, 2))
    assert [len(cache.runs(r)) for r in range(3)] == [1, 1, 1]
    _check_blocks(cache)


def test_paged_decode_over_fragmented_blocks_equals_contiguous_bf16_and_fp32():
    for dtype, atol in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2)):
        g = torch.Generator().manual_seed(seeded(2))
        k = torch.randn(2, 2, 45, 16, generator=g).to(dtype)
        v = torch.randn(2, 2, 45, 16, generator=g).to(dtype)
        cache = PagedKVCache(24, BS, 2, 16, batch_size=2, dtype=dtype, placement="scattered")
        cache.select([0]).update(k[:1, :, :13], v[:1, :, :13])
        cache.select([1]).update(k[1:, :, :6], v[1:, :, :6])
        cache.select([0, 1])
        for t in range(6, 45):  # interleaved growth: row 1's blocks are scattered
            rows = [0, 1] if t >= 13 else [1]
            cache.select(rows).update(k[rows, :, t : t + 1], v[rows, :, t : t + 1])
        cache.select([0, 1])
        assert len(cache.runs(0)) == 12 and len(cache.runs(1)) == 12  # really fragmented
        q = torch.randn(2, 8, 1, 16, generator=g).to(dtype)
        for n_split in (None, 1, 3):
            out = paged_decode(q, cache, scale=0.25, n_split=n_split)
            ref = grouped_decode(q, k, v, scale=0.25, n_split=1)
            torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)


def test_out_of_blocks_raises_and_leaves_the_cache_intact():
    attn = _module()
    paged = PagedKVCache(5, BS, 2, 8, batch_size=2)
    with torch.no_grad():
        attn(torch.randn(1, 9, 64), cache=paged.select([0]))  # 3 blocks
        attn(torch.randn(1, 4, 64), cache=paged.select([1]))  # 1 block, full
        state = (list(paged.lengths), [list(t) for t in paged.block_tables], set(paged._free))
        pools = (paged.k.clone(), paged.v.clone())
        paged.select([0, 1])
        with pytest.raises(OutOfBlocksError, match="out of blocks"):
            attn(torch.randn(2, 4, 64), cache=paged)  # needs 1 + 1 blocks, 1 free
        assert (list(paged.lengths), [list(t) for t in paged.block_tables], set(paged._free)) == state
        assert torch.equal(paged.k, pools[0]) and torch.equal(paged.v, pools[1])
        attn(torch.randn(2, 3, 64), cache=paged)  # 9+3 fits in row 0's blocks; row 1 takes the last block
        assert paged.n_free_blocks == 0 and paged.lengths == [12, 7]
    assert isinstance(OutOfBlocksError("x"), ValueError)


def test_a_windowed_cache_out_of_blocks_keeps_the_blocks_it_would_have_given_back():
    """A sliding-window cache gives up the blocks before the window only once the new tokens fit: a refused update
    once gave them back all the same (the tables, `dropped` and the pool changed), and counted them as free in its
    message; and an update those blocks make room for takes them."""
    paged = PagedKVCache(4, 2, 1, 4, batch_size=2, window=2)
    k6, k1 = torch.randn(1, 1, 6, 4), torch.randn(1, 1, 1, 4)
    paged.select([0]).update(k6, k6)  # 3 blocks, 2 of them before the window
    paged.select([1]).update(k1, k1)  # the pool's last block

    def state() -> tuple:
        tables = [list(t) for t in paged.block_tables]
        return tables, list(paged.dropped), set(paged._free), paged.views()[0].lengths

    paged.select([0, 1])
    before = state()
    with pytest.raises(OutOfBlocksError, match="need 5 blocks, 0 of 4 are free and 2 fall out of the window"):
        paged.update(torch.randn(2, 1, 5, 4), torch.randn(2, 1, 5, 4))
    assert state() == before
    paged.update(torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4))  # 1 new block, of the 2 given back
    assert paged.dropped == [2, 0] and paged.lengths == [7, 2] and paged.n_free_blocks == 1
    assert paged.views()[0].lengths == (3, 2)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="block_size"):
        PagedKVCache(4, 0, 2, 8, batch_size=1)
    cache = PagedKVCache(4, BS, 2, 8, batch_size=2)
    with pytest.raises(ValueError, match="rows"):
        cache.select([0, 0])
    with pytest.raises(ValueError, match="rows"):
        cache.select([2])
    with pytest.raises(ValueError, match="n_kv_heads=2"):
        cache.update(torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8))
    with pytest.raises(TypeError, match="dtype"):
        cache.update(torch.randn(2, 2, 1, 8).double(), torch.randn(2, 2, 1, 8).double())
    with pytest.raises(ValueError, match="row"):
        cache.free(5)
    attn = _module()
    with pytest.raises(ValueError, match="batch of 1"):
        attn(torch.randn(1, 1, 64), cache=cache)  # two active rows
    with pytest.raises(ValueError, match="attn_mask"):
        attn(torch.randn(2, 1, 64), cache=cache, attn_mask=torch.ones(1, 1, dtype=torch.bool))


def test_mla_absorbed_over_a_paged_latent_cache_equals_contiguous_latent_caches():
    from attnlab import MLAConfig, MultiHeadLatentAttention

    torch.manual_seed(seeded(3))
    cfg = MLAConfig(
        d_model=64, n_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16
    )
    mla = MultiHeadLatentAttention(cfg)
    mla.init_weights(std=0.15)
    mla.eval()
    paged = mla.new_paged_cache(n_blocks=20, block_size=BS, batch_size=2)
    assert paged.nbytes == 20 * BS * cfg.cache_dim * 4  # latent rows only: values are a view of them
    contiguous = [mla.new_cache(1, 64) for _ in range(2)]
    g = torch.Generator().manual_seed(seeded(4))
    with torch.no_grad():
        for row, n in enumerate((6, 3)):
            x = torch.randn(1, n, 64, generator=g)
            torch.testing.assert_close(
                mla(x, cache=paged.select([row])), mla(x, cache=contiguous[row]), atol=1e-5, rtol=0
            )
        paged.select([0, 1])
        for _ in range(5):
            x = torch.randn(2, 1, 64, generator=g)
            ref = torch.cat([mla(x[i : i + 1], cache=contiguous[i]) for i in range(2)])
            torch.testing.assert_close(mla(x, cache=paged), ref, atol=1e-5, rtol=0)
        _check_blocks(paged)
        mla.mode = "naive"
        with pytest.raises(ValueError, match="absorbed"):
            mla(torch.randn(2, 1, 64), cache=paged)


def test_long_paged_prefill_in_query_blocks_equals_full_attention(monkeypatch):
    import attnlab.attention.decode as decode

    monkeypatch.setattr(decode, "QUERY_BLOCK", 3)  # 3-query blocks: the block edges are exercised
    attn = _module(2, backend="grouped")  # "auto" gives a paged prefill to SDPA
    paged = PagedKVCache(12, BS, 2, 8, batch_size=2)
    g = torch.Generator().manual_seed(seeded(5))
    with torch.no_grad():
        x0 = torch.randn(1, 6, 64, generator=g)
        attn(x0, cache=paged.select([1]))  # the other row first: row 0's blocks are not the first ones
        x = torch.randn(1, 17, 64, generator=g)
        torch.testing.assert_close(attn(x, cache=paged.select([0])), attn(x), atol=1e-5, rtol=0)
        y = torch.randn(1, 5, 64, generator=g)  # a second chunk of prompt continues the row
        full = attn(torch.cat((x, y), dim=1))[:, 17:]
        torch.testing.assert_close(attn(y, cache=paged), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_prefill_runs_sdpa_over_the_gathered_rows_and_equals_full_attention(monkeypatch, dtype):
    """ "auto" on a CPU: a paged call of several queries per row goes to SDPA over the gathered rows; a fresh
    prompt (every row as long as its new tokens) needs no mask (the plain causal rule), a continued prompt or a
    ragged batch has one; all equal attention without a cache."""
    import torch.nn.functional as F

    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(
        F,
        "scaled_dot_product_attention",
        lambda *a, **kw: calls.append(kw.get("attn_mask") is None) or sdpa(*a, **kw),
    )
    attn = _module(2).to(dtype)
    tol = {"atol": 1e-5, "rtol": 0} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    g = torch.Generator().manual_seed(seeded(6))
    with torch.no_grad():
        paged = PagedKVCache(16, BS, 2, 8, batch_size=2, dtype=dtype)
        x = torch.randn(1, 10, 64, generator=g).to(dtype)
        torch.testing.assert_close(attn(x, cache=paged.select([0])), attn(x), **tol)
        assert calls[0] is True  # a fresh prompt: causal, no mask
        y = torch.randn(1, 3, 64, generator=g).to(dtype)
        full = attn(torch.cat((x, y), dim=1))[:, 10:]
        calls.clear()
        torch.testing.assert_close(attn(y, cache=paged.select([0])), full, **tol)
        assert calls == [False]  # continuing a row: a mask of what each query may see
        # a ragged batch: rows of 13 and 4 tokens get 2 more each, in one call
        z0 = torch.randn(1, 4, 64, generator=g).to(dtype)
        attn(z0, cache=paged.select([1]))
        new = torch.randn(2, 2, 64, generator=g).to(dtype)
        got = attn(new, cache=paged.select([0, 1]))
        torch.testing.assert_close(got[:1], attn(torch.cat((x, y, new[:1]), dim=1))[:, 13:], **tol)
        torch.testing.assert_close(got[1:], attn(torch.cat((z0, new[1:]), dim=1))[:, 4:], **tol)
