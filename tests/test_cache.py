"""KV caches: bytes allocated, length, reset, in-place updates, and a failed update that changes nothing."""

from __future__ import annotations

import pytest
import torch

from attnlab import (
    AttentionConfig,
    GroupedQueryAttention,
    KVCache,
    LatentCache,
    MLAConfig,
    MultiHeadLatentAttention,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(("dtype", "element_size"), [(torch.float32, 4), (torch.bfloat16, 2)])
@pytest.mark.parametrize(("n_heads", "n_kv_heads", "head_dim"), [(8, 8, 16), (8, 2, 40), (6, 1, 96)])
def test_kv_cache_nbytes(n_heads, n_kv_heads, head_dim, dtype, element_size):
    attn = GroupedQueryAttention(
        AttentionConfig(d_model=48, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim)
    ).to(dtype)
    b, s = 3, 17
    cache = attn.new_cache(batch_size=b, max_seq_len=s)
    assert cache.k.dtype == cache.v.dtype == dtype
    assert cache.k.shape == cache.v.shape == (b, n_kv_heads, s, head_dim)
    assert cache.nbytes == 2 * b * n_kv_heads * s * head_dim * element_size
    # An explicit dtype overrides the weights'.
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    assert attn.new_cache(b, s, dtype=other).nbytes == 2 * b * n_kv_heads * s * head_dim * (6 - element_size)


@pytest.mark.parametrize(("dtype", "element_size"), [(torch.float32, 4), (torch.bfloat16, 2)])
def test_latent_cache_nbytes(dtype, element_size):
    cfg = MLAConfig(
        d_model=32, n_heads=4, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=8
    )
    mla = MultiHeadLatentAttention(cfg).to(dtype)
    cache = mla.new_cache(batch_size=2, max_seq_len=11)
    assert cache.kv.dtype == dtype
    assert cache.nbytes == 2 * 11 * (24 + 6) * element_size
    # Per token it is independent of n_heads: that is the point of MLA.
    wide = MultiHeadLatentAttention(cfg.replace(n_heads=16)).to(dtype)
    assert wide.new_cache(batch_size=2, max_seq_len=11).nbytes == cache.nbytes


def test_len_update_and_reset():
    cache = KVCache(2, 3, 8, 4)
    assert len(cache) == 0
    k1, v1 = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    k, v = cache.update(k1, v1)
    assert len(cache) == 5 and torch.equal(k, k1) and torch.equal(v, v1)
    k2, v2 = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    k, v = cache.update(k2, v2)
    assert len(cache) == 6
    assert torch.equal(k, torch.cat((k1, k2), dim=2)) and torch.equal(v, torch.cat((v1, v2), dim=2))
    assert k.data_ptr() == cache.k.data_ptr()  # a view of the preallocated buffer, not a copy
    cache.reset()
    assert len(cache) == 0
    k, _ = cache.update(k2, v2)
    assert k.shape == (2, 3, 1, 4) and torch.equal(k, k2)


def _small_module(kind: str) -> GroupedQueryAttention | MultiHeadLatentAttention:
    if kind == "gqa":
        return GroupedQueryAttention(AttentionConfig(d_model=16, n_heads=4, n_kv_heads=2))
    mla = MLAConfig(
        d_model=16, n_heads=2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4
    )
    return MultiHeadLatentAttention(mla)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_batch_is_fixed_at_creation(kind):
    # Issue 8: filled with batch 2, stepped with batch 1, then batch 2 again, row 1 used to attend to a slot it
    # never wrote. Any batch other than the cache's is refused, and the cache is left as it was.
    module = _small_module(kind)
    cache = module.new_cache(batch_size=2, max_seq_len=8)
    with torch.no_grad():
        module(torch.randn(2, 3, 16), cache=cache)
        snap = _snapshot(cache)
        for b in (1, 0, 3):
            with pytest.raises(ValueError, match=rf"batch of {b} but the cache was made for batch_size=2"):
                module(torch.randn(b, 1, 16), cache=cache)
            _assert_unchanged(cache, snap)
        module(torch.randn(2, 1, 16), cache=cache)
    assert len(cache) == 4


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_empty_inputs_give_empty_outputs(kind):
    # T = 0 or B = 0 used to fail inside a reshape; now they are empty results, and T = 0 leaves a cache as it was.
    module = _small_module(kind)
    with torch.no_grad():
        assert module(torch.randn(2, 0, 16)).shape == (2, 0, 16)
        assert module(torch.randn(0, 3, 16)).shape == (0, 3, 16)
        cache = module.new_cache(batch_size=2, max_seq_len=8)
        module(torch.randn(2, 3, 16), cache=cache)
        snap = _snapshot(cache)
        assert module(torch.randn(2, 0, 16), cache=cache).shape == (2, 0, 16)
        _assert_unchanged(cache, snap)
        paged = module.new_paged_cache(n_blocks=4, block_size=4, batch_size=2)
        if kind == "mla":
            module.mode = "absorbed"
        assert module(torch.randn(2, 0, 16), cache=paged).shape == (2, 0, 16) and len(paged) == 0


def test_reset_then_reuse_equals_a_fresh_cache():
    attn = GroupedQueryAttention(AttentionConfig(d_model=16, n_heads=4, n_kv_heads=2)).eval()
    x, other = torch.randn(1, 5, 16), torch.randn(1, 7, 16)
    with torch.no_grad():
        fresh = attn.new_cache(1, 8)
        expected = [attn(x[:, :3], cache=fresh), attn(x[:, 3:], cache=fresh)]
        reused = attn.new_cache(1, 8)
        attn(other, cache=reused)
        reused.reset()
        got = [attn(x[:, :3], cache=reused), attn(x[:, 3:], cache=reused)]
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


def _snapshot(cache):
    tensors = (cache.k, cache.v) if isinstance(cache, KVCache) else (cache.kv,)
    return len(cache), [t.clone() for t in tensors]


def _assert_unchanged(cache, snapshot):
    length, tensors = snapshot
    assert len(cache) == length
    now = (cache.k, cache.v) if isinstance(cache, KVCache) else (cache.kv,)
    for before, after in zip(tensors, now, strict=True):
        assert torch.equal(before, after)


def test_failed_kv_update_leaves_the_cache_unchanged():
    cache = KVCache(2, 2, 6, 4)
    cache.update(torch.randn(2, 2, 4, 4), torch.randn(2, 2, 4, 4))
    snap = _snapshot(cache)
    bad = [
        (
            ValueError,
            r"KVCache overflow: 4 tokens held \+ 3 new > max_seq_len=6",
            (2, 2, 3, 4),
            torch.float32,
        ),
        (ValueError, "batch of 3 but the cache was made for batch_size=2", (3, 2, 1, 4), torch.float32),
        (
            TypeError,
            "k has dtype torch.bfloat16, the cache holds torch.float32",
            (2, 2, 1, 4),
            torch.bfloat16,
        ),
        (ValueError, r"n_kv_heads=2, head_dim=4\); got k \(2, 1, 1, 4\)", (2, 1, 1, 4), torch.float32),
        (ValueError, r"n_kv_heads=2, head_dim=4\); got k \(2, 2, 1, 5\)", (2, 2, 1, 5), torch.float32),
    ]
    for error, match, shape, dtype in bad:
        with pytest.raises(error, match=match):
            cache.update(torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype))
        _assert_unchanged(cache, snap)
    with pytest.raises(ValueError, match=r"got k \(2, 2, 1, 4\), v \(2, 2, 2, 4\)"):
        cache.update(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 2, 4))
    with pytest.raises(TypeError, match=r"k has dtype torch.float32 but v has torch.bfloat16"):
        cache.update(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4, dtype=torch.bfloat16))
    _assert_unchanged(cache, snap)
    cache.update(torch.randn(2, 2, 2, 4), torch.randn(2, 2, 2, 4))  # exactly full is fine
    assert len(cache) == 6


def test_failed_latent_update_leaves_the_cache_unchanged():
    cache = LatentCache(2, 4, 6, 2)
    cache.update(torch.randn(2, 3, 8))
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match=r"LatentCache overflow: 3 tokens held \+ 2 new > max_seq_len=4"):
        cache.update(torch.randn(2, 2, 8))
    with pytest.raises(ValueError, match=r"batch of 5 but the cache was made for batch_size=2"):
        cache.update(torch.randn(5, 1, 8))
    with pytest.raises(TypeError, match=r"kv has dtype torch.float64, the cache holds torch.float32"):
        cache.update(torch.randn(2, 1, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"kv_lora_rank \+ qk_rope_head_dim = 8; got 7"):
        cache.update(torch.randn(2, 1, 7))
    _assert_unchanged(cache, snap)


@pytest.mark.parametrize("field", ["batch_size", "n_kv_heads", "max_seq_len", "head_dim"])
def test_kv_cache_sizes_are_validated(field):
    sizes = {"batch_size": 1, "n_kv_heads": 2, "max_seq_len": 8, "head_dim": 4}
    with pytest.raises(ValueError, match=rf"KVCache.{field} must be >= 1, got 0"):
        KVCache(**(sizes | {field: 0}))
    with pytest.raises(TypeError, match=rf"KVCache.{field} must be an int, got 2.0"):
        KVCache(**(sizes | {field: 2.0}))


def test_latent_cache_sizes_are_validated():
    with pytest.raises(ValueError, match=r"LatentCache.kv_lora_rank must be >= 1, got 0"):
        LatentCache(1, 8, 0, 2)
    with pytest.raises(TypeError, match=r"LatentCache.max_seq_len must be an int, got True"):
        LatentCache(1, True, 4, 2)


@torch.no_grad()
def test_a_sliding_layer_caches_at_most_its_window_and_the_paged_cache_gives_blocks_back():
    """Issue 30: a sliding layer's KVCache is a ring of the window's size, and its PagedKVCache returns the blocks
    that fall out of the window, so that a pool of a window's blocks per row decodes any length (without giving
    blocks back, row 0's 35 tokens alone would need 9 blocks of the 6). Oracle: the same weights without a window,
    run on the last ``window`` tokens alone at their own positions (RoPE is relative), for every decoded token."""
    torch.manual_seed(0)
    window, block_size, steps, lengths = 6, 4, 30, (5, 3)
    cfg = AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, window=window)
    attn, full = GroupedQueryAttention(cfg).eval(), GroupedQueryAttention(cfg.replace(window=None)).eval()
    attn.init_weights(std=0.2)
    full.load_state_dict(attn.state_dict())
    xs = [torch.randn(1, n + steps, 32) for n in lengths]

    def oracle(row: int, t: int) -> torch.Tensor:
        start = max(0, t + 1 - window)
        return full(xs[row][:, start : t + 1], position_ids=torch.arange(start, t + 1))[0, -1]

    spans = (window - 1) // block_size + 2  # the blocks a window of tokens can touch
    paged = attn.new_paged_cache(len(lengths) * spans, block_size, len(lengths))
    rings = [attn.new_cache(1, 64) for _ in lengths]
    assert [r.capacity for r in rings] == [window, window] and rings[0].nbytes == 2 * 2 * window * 8 * 4
    for row, n in enumerate(lengths):
        attn(xs[row][:, :n], cache=paged.select([row]))
        attn(xs[row][:, :n], cache=rings[row])
    for step in range(steps):
        positions = [n + step for n in lengths]
        x = torch.cat([xs[r][:, t : t + 1] for r, t in enumerate(positions)])
        got = attn(x, cache=paged.select([0, 1]))[:, -1]
        for row, t in enumerate(positions):
            want = oracle(row, t)
            torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(
                attn(x[row : row + 1], cache=rings[row])[0, -1], want, rtol=1e-5, atol=1e-5
            )
            assert len(paged.block_tables[row]) <= spans and paged.lengths[row] == t + 1
        assert paged.n_free_blocks == paged.n_blocks - sum(len(t) for t in paged.block_tables)
    assert (
        sum(paged.dropped) >= (lengths[0] + steps) // block_size - spans
    )  # blocks given back and taken again


@pytest.mark.parametrize("window", [None, 4])
def test_a_left_padded_batch_decodes_past_a_window_as_each_row_alone(window):
    """The mask over every position so far, (T, len(cache) + T), was refused once a window's ring had wrapped:
    left-padded decoding of a Mistral- or Gemma-like model stopped at the window. It is read at the ring's slots."""
    from attnlab import ModelConfig
    from attnlab.model import Transformer

    cfg = ModelConfig(vocab_size=97, n_layers=2, attention=AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2,
                      window=window), ffn_dim=48, max_seq_len=64)  # fmt: skip
    model = Transformer(cfg).eval()
    model.init_weights(std=0.5, seed=0)
    rows = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    pad = [6 - len(r) for r in rows]
    seen = torch.tensor([[False] * p + [True] * len(r) for p, r in zip(pad, rows, strict=True)])
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    caches = model.new_caches(2, 64)
    with torch.no_grad():
        logits = model(torch.tensor([[0] * p + r for p, r in zip(pad, rows, strict=True)]), caches=caches,
                       attn_mask=seen[:, None, None, :] & causal, position_ids=(seen.cumsum(-1) - 1).clamp(min=0))  # fmt: skip
        chunks = [1, 1, 1, 1, 1, 3, 1]  # past the window one token at a time, then several at once
        for n in chunks:
            new = torch.randint(0, 97, (2, n), generator=torch.Generator().manual_seed(len(rows[0])))
            rows = [r + new[i].tolist() for i, r in enumerate(rows)]
            seen = torch.cat((seen, torch.ones(2, n, dtype=torch.bool)), 1)
            band = torch.ones(n, seen.shape[1], dtype=torch.bool).tril(seen.shape[1] - n)
            positions = torch.tensor([[len(r) - n + j for j in range(n)] for r in rows])
            logits = model(
                new, caches=caches, attn_mask=seen[:, None, None, :] & band, position_ids=positions
            )
            for i, r in enumerate(rows):
                torch.testing.assert_close(logits[i], model(torch.tensor([r]))[0, -n:], rtol=1e-4, atol=1e-4)


def test_a_cache_whose_window_is_not_the_layers_is_refused_before_it_is_written():
    """A cache keeping fewer tokens than the layer reads lost keys silently (0.34 off a full-attention layer); one
    keeping more hands a single query its ring out of order, which the layer's window then cuts by slot."""
    from attnlab import PagedKVCache

    layer = GroupedQueryAttention(AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2)).eval()
    sliding = GroupedQueryAttention(AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2, window=4)).eval()
    x = torch.randn(1, 3, 64)
    for attn, cache, says in [
        (layer, KVCache(1, 2, 16, 16, window=4), r"keeps the last 4 tokens \(window=4\) but the layer attends to "
         r"every token; make the cache with window=None"),
        (layer, PagedKVCache(8, 2, 2, 16, batch_size=1, window=4), r"attends to every token"),
        (sliding, KVCache(1, 2, 16, 16, window=8), r"keeps the last 8 tokens .* attends to the last 4; make the "
         r"cache with window=4"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=says):
            attn(x, cache=cache)
        assert len(cache) == 0 if not cache.paged else cache.lengths == [0]
    sliding(x, cache=KVCache(1, 2, 16, 16))  # a cache of every token: the layer applies its window itself
    sliding(x, cache=KVCache(1, 2, 16, 16, window=4))


def test_rows_on_another_device_are_refused_before_they_are_written():
    from attnlab import PagedKVCache

    # the copy into a cache on another device succeeded and attention refused after it: the cache had advanced
    gqa = GroupedQueryAttention(AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2)).eval()
    mla = MultiHeadLatentAttention(
        MLAConfig(
            d_model=64, n_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16
        )
    ).eval()
    for attn, owner in [(gqa, "KVCache: k"), (mla, "LatentCache: kv")]:
        cache = attn.new_cache(1, 8, device="meta")  # a stand-in for a GPU's: the copy into it works the same
        with pytest.raises(ValueError, match=rf"{owner} is on cpu, the cache on meta"):
            attn(torch.randn(1, 3, 64), cache=cache)
        assert len(cache) == 0
    static = gqa.new_cache(1, 8, device="meta", static=True)
    with pytest.raises(ValueError, match=r"StaticKVCache: k is on cpu, the cache on meta"):
        static.append(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16))
    paged = PagedKVCache(4, 4, 2, 16, batch_size=1, device="meta")
    with pytest.raises(ValueError, match=r"PagedKVCache: k is on cpu, the cache on meta"):
        gqa(torch.randn(1, 3, 64), cache=paged)
    assert paged.lengths == [0]


@pytest.mark.parametrize("dtype", [torch.int32, "bfloat16", None])
def test_a_cache_of_a_dtype_that_holds_no_keys_is_refused_when_made(dtype):
    from attnlab import PagedKVCache, StaticKVCache

    with pytest.raises(TypeError, match=r"KVCache.dtype must be a floating-point torch.dtype, got"):
        KVCache(1, 2, 8, 16, dtype=dtype)
    with pytest.raises(TypeError, match=r"LatentCache.dtype must be a floating-point"):
        LatentCache(1, 8, 16, 8, dtype=dtype)
    with pytest.raises(TypeError, match=r"StaticKVCache.dtype must be a floating-point"):
        StaticKVCache(1, 2, 8, 16, dtype=dtype)
    with pytest.raises(TypeError, match=r"PagedKVCache.dtype must be a floating-point"):
        PagedKVCache(4, 4, 2, 16, batch_size=1, dtype=dtype)


def test_a_wrapped_ring_refuses_a_crop_saying_why_and_crops_before_it_wraps():
    # the refusal said the ring "no longer holds token 9", which it held (tokens 6-9 of 10 in 4 slots)
    cache = KVCache(1, 2, 32, 8, window=4)
    cache.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    cache.crop(2)  # not wrapped yet: cropped
    assert len(cache) == 2
    cache.update(torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8))
    with pytest.raises(ValueError, match=r"ring of 4 slots \(a window of 4\) has wrapped, 10 tokens in"):
        cache.crop(9)
    assert len(cache) == 10


@pytest.mark.parametrize("layer", ["gqa q/k norm", "mla"])
@pytest.mark.parametrize("kind", ["contiguous", "static", "paged"])
def test_under_autocast_every_cache_takes_the_rows_its_layer_makes(layer, kind):
    """A float32 model under bfloat16 autocast: its caches take autocast's dtype, but a q/k norm's keys (Qwen 3,
    OLMo 2) and MLA's latent rows leave their float32 norms in float32, and every cache refused them ("k has dtype
    torch.float32, the cache holds torch.bfloat16"). A decode step over the cache equals the whole forward."""
    torch.manual_seed(0)
    if layer == "mla":
        module = MultiHeadLatentAttention(
            MLAConfig(
                d_model=64, n_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16
            )
        )
    else:
        module = GroupedQueryAttention(AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2, qk_norm="head"))
    module.init_weights(std=0.2)
    module.eval()
    x = torch.randn(1, 7, 64)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        if kind == "paged":
            cache = module.new_paged_cache(4, 4, 1)
        else:
            cache = module.new_cache(1, 16, static=kind == "static")
        assert cache.dtype == torch.bfloat16
        module(x[:, :6], cache=cache)
        step = module(x[:, 6:], cache=cache)
        whole = module(x)
    torch.testing.assert_close(step.float(), whole[:, 6:].float(), rtol=0.03, atol=0.03)


@pytest.mark.parametrize("kind", ["paged", "static"])
def test_a_pickled_latent_cache_decodes_as_the_original(kind):
    # MLA's paged cache kept its values as a view of the keys, which pickle made a copy of its own: later updates
    # wrote the keys only, and the unpickled cache attended to stale values (outputs 0.19 apart)
    import pickle

    torch.manual_seed(0)
    mla = MultiHeadLatentAttention(
        MLAConfig(
            d_model=64, n_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8
        )
    ).eval()
    x = torch.randn(2, 7, 64)
    with torch.no_grad():
        cache = mla.new_paged_cache(8, 4, 2) if kind == "paged" else mla.new_cache(2, 16, static=True)
        mla(x[:, :5], cache=cache)
        copied = pickle.loads(pickle.dumps(cache))
        for t in (5, 6):
            want, got = mla(x[:, t : t + 1], cache=cache), mla(x[:, t : t + 1], cache=copied)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert copied.v.untyped_storage().data_ptr() == copied.k.untyped_storage().data_ptr()


def test_paged_select_takes_numpy_and_tensor_integers_and_names_bad_rows():
    # a beam search's argsort gives NumPy or tensor integers: "rows must be distinct, in [0, 3): [np.int64(0)]"
    import numpy as np

    cache = GroupedQueryAttention(AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2)).new_paged_cache(
        8, 4, 3
    )
    assert cache.select([np.int64(2), 0]).active == [2, 0]
    assert cache.select(torch.tensor([1, 2])).active == [1, 2]
    # booleans are a mask, not rows: tensor([False, True]) selected rows 0 and 1
    for bad in ([0, 0], [3], [], [1.0], torch.tensor([[0]]), [-1], [True], torch.tensor([False, True])):
        with pytest.raises(
            ValueError, match=r"PagedKVCache.select: rows must be distinct integers in \[0, 3\)"
        ):
            cache.select(bad)
    assert cache.active == [1, 2]


def test_new_paged_cache_takes_a_device_as_new_cache_does():
    # its docstring said the device defaults to the weights', but it took none (TypeError on device=)
    gqa = GroupedQueryAttention(AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2))
    mla = MultiHeadLatentAttention(
        MLAConfig(d_model=32, n_heads=4, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    )
    for attn in (gqa, mla):
        assert attn.new_paged_cache(4, 4, 2, device="meta").k.device.type == "meta"
        assert attn.new_paged_cache(4, 4, 2).k.device.type == "cpu"
    assert gqa.new_cache(2, 8, device="meta").k.is_meta and mla.new_cache(2, 8, device="meta").kv.is_meta
