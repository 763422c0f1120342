"""One forward path for every cache, and backends chosen in one place.

Every cache (contiguous, latent, paged, paged latent; paged with its blocks scattered) implements the ``Cache``
protocol and goes through the same module code and ``attend``; each must give what the contiguous cache gives,
under every backend (paged K/V reach "reference" and "sdpa" as a gathered copy, "grouped" in place). Dropout
applies on every path. (Which backend runs is the backend table's answer: tests/attention/test_backends.py.) The
kernels contain no host sync that ``torch.compile`` would break a graph on, and their sync-free form (GPU, compile)
keeps every masking guarantee of the eager CPU form.
"""

from __future__ import annotations

import pytest
import torch

import attnlab.attention.kernels as kernels
from attnlab import AttentionConfig, GroupedQueryAttention, MLAConfig, MultiHeadLatentAttention
from attnlab.attention.decode import grouped_decode
from attnlab.attention.kernels import attend
from attnlab.cache import Cache, KVCache, LatentCache, PagedKVCache, PagedView

pytestmark = pytest.mark.usefixtures("one_thread")
BACKENDS = ("reference", "sdpa", "grouped", "auto")
GQA = AttentionConfig(d_model=48, n_heads=6, n_kv_heads=2, head_dim=8)
MLA = MLAConfig(d_model=48, n_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
LENGTHS = (5, 9, 2)  # a ragged batch: each row prefilled on its own, then decoded together


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a.double() - b.double()).abs().max().item()


def _module(kind: str, backend: str) -> GroupedQueryAttention | MultiHeadLatentAttention:
    torch.manual_seed(0)
    if kind == "gqa":
        module = GroupedQueryAttention(GQA.replace(backend=backend))
    else:
        module = MultiHeadLatentAttention(MLA.replace(backend=backend))
    module.init_weights(std=0.2)
    return module.eval()


def _run_ragged(module, make_cache, steps: int = 4) -> list[torch.Tensor]:
    """Outputs of prefilling each row of a ragged batch alone, then ``steps`` decode steps of the whole batch and
    a 2-token chunk, through caches made by ``make_cache(rows)`` (one cache for every row, or one per row)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randn(1, n, 48, generator=g) for n in LENGTHS]
    steps_x = [torch.randn(len(LENGTHS), t, 48, generator=g) for t in [1] * steps + [2]]
    caches = make_cache()
    outs = []
    with torch.no_grad():
        if isinstance(caches, list):  # one contiguous cache per row: the reference
            outs += [module(p, cache=c) for p, c in zip(prompts, caches, strict=True)]
            for x in steps_x:
                outs.append(torch.cat([module(x[i : i + 1], cache=c) for i, c in enumerate(caches)]))
        else:
            outs += [module(p, cache=caches.select([i])) for i, p in enumerate(prompts)]
            caches.select(list(range(len(LENGTHS))))
            outs += [module(x, cache=caches) for x in steps_x]
    return outs


@pytest.mark.parametrize("placement", ["contiguous", "scattered"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_every_cache_through_the_one_path_equals_the_contiguous_cache(kind, backend, placement):
    module = _module(kind, backend)
    reference = _run_ragged(module, lambda: [module.new_cache(1, 32) for _ in LENGTHS])

    def paged():
        cache = module.new_paged_cache(n_blocks=24, block_size=2, batch_size=len(LENGTHS))
        cache.placement = placement
        return cache

    got = _run_ragged(module, paged)
    for a, b in zip(got, reference, strict=True):
        assert _err(a, b) <= 1e-5


def test_every_cache_implements_the_protocol():
    gqa, mla = _module("gqa", "auto"), _module("mla", "auto")
    caches = [
        gqa.new_cache(2, 8),
        mla.new_cache(2, 8),
        gqa.new_paged_cache(4, 2, 2),
        mla.new_paged_cache(4, 2, 2),
    ]
    assert [type(c) for c in caches] == [KVCache, LatentCache, PagedKVCache, PagedKVCache]
    for cache in caches:
        assert isinstance(cache, Cache)
        assert len(cache) == 0 and cache.positions(3).tolist() in ([0, 1, 2], [[0, 1, 2], [0, 1, 2]])
    # append hands attend what it reads: live views of a contiguous cache, PagedViews of a paged one.
    k, v = caches[0].append(torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8))
    assert k.shape == v.shape == (2, 2, 3, 8) and k.data_ptr() == caches[0].k.data_ptr()
    rows, values = caches[1].append(torch.randn(2, 1, 3, 20), None)
    assert (
        rows.shape == (2, 1, 3, 20) and values.shape == (2, 1, 3, 16) and values.data_ptr() == rows.data_ptr()
    )
    pk, _ = caches[2].append(torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8))
    assert isinstance(pk, PagedView) and pk.shape == (2, 2, 3, 8) and pk.lengths == (3, 3)
    assert caches[2].positions(1).tolist() == [[3], [3]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_dropout_applies_on_the_paged_path(kind, backend):
    cfg = (GQA if kind == "gqa" else MLA).replace(backend=backend, dropout=0.5)
    module = (GroupedQueryAttention if kind == "gqa" else MultiHeadLatentAttention)(cfg)
    module.init_weights(std=0.2)
    x = torch.randn(2, 3, 48)
    with torch.no_grad():
        outs = {}
        for training in (False, True):
            module.train(training)
            for name in ("first", "second"):
                paged = module.new_paged_cache(n_blocks=8, block_size=2, batch_size=2)
                outs[training, name] = module(x, cache=paged)
    assert torch.equal(outs[False, "first"], outs[False, "second"])  # eval is deterministic
    assert _err(outs[True, "first"], outs[False, "first"]) > 1e-3
    assert _err(outs[True, "first"], outs[True, "second"]) > 1e-3


def test_decode_dropout_drops_the_same_weights_as_the_reference():
    # grouped_decode stacks the queries of a KV group in the order of the reference's heads, so with the same
    # seed F.dropout draws the same mask: the kernels then agree exactly, dropout included.
    q, k, v = torch.randn(2, 6, 1, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    results = []
    for backend in ("grouped", "reference"):
        torch.manual_seed(5)
        results.append(attend(q, k, v, backend=backend, dropout_p=0.4))
    assert _err(*results) <= 1e-5
    assert _err(results[0], attend(q, k, v)) > 1e-3


# ------------------------------------------------------------------------------------------ host syncs


def _no_graph_break(fn, *args):
    """Run ``fn`` compiled with ``fullgraph=True`` (any graph break raises) on the eager backend (no codegen)."""
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="eager")(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernels_compile_without_graph_breaks(dtype):
    q, k, v = (torch.randn(2, h, t, 16, dtype=dtype) for h, t in ((8, 1), (2, 33), (2, 33)))
    mask = torch.rand(2, 1, 1, 33, generator=torch.Generator().manual_seed(0)) > 0.3
    mask[0] = False  # a dead row: the branch that used to sync
    eager = attend(q, k, v, attn_mask=mask)
    compiled = _no_graph_break(lambda q, k, v, m: attend(q, k, v, attn_mask=m), q, k, v, mask)
    assert _err(compiled, eager) == 0.0
    split = _no_graph_break(lambda q, k, v: grouped_decode(q, k, v, scale=0.25, n_split=3), q, k, v)
    assert _err(split, grouped_decode(q, k, v, scale=0.25)) <= 2e-2 if dtype == torch.bfloat16 else 1e-5
    prefill = torch.randn(2, 8, 5, 16, dtype=dtype)
    for backend in ("grouped", "sdpa", "reference"):
        fn = lambda q, k, v, m, b=backend: attend(q, k, v, attn_mask=m, is_causal=True, backend=b)  # noqa: E731
        _no_graph_break(fn, prefill, k, v, mask)


def test_module_decode_steps_compile_without_graph_breaks():
    gqa, mla = _module("gqa", "auto"), _module("mla", "auto")
    with torch.no_grad():
        for module, cache in (
            (gqa, gqa.new_cache(2, 16)),
            (gqa, gqa.new_paged_cache(8, 4, 2)),
            (mla, mla.new_cache(2, 16)),
            (mla, mla.new_paged_cache(8, 4, 2)),
        ):
            module(torch.randn(2, 5, 48), cache=cache)
            _no_graph_break(lambda x, m=module, c=cache: m(x, cache=c), torch.randn(2, 1, 48))
            assert len(cache) == 6


@pytest.mark.parametrize("fill", [float("inf"), float("nan")])
@pytest.mark.parametrize("t_q", [4, 1])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sync_free_form_keeps_the_masking_guarantees(backend, t_q, fill, monkeypatch):
    q, k, v = (torch.randn(2, h, t, 8, requires_grad=True) for h, t in ((4, t_q), (2, 6), (2, 6)))
    mask = torch.ones(2, 4, t_q, 6, dtype=torch.bool)
    mask[..., 4:] = False  # padding that no query attends, holding inf or NaN below
    mask[0, 1, 0] = False  # a fully masked row
    with torch.no_grad():
        k_dirty, v_dirty = k.clone(), v.clone()
        k_dirty[..., 4:, :] = fill
        v_dirty[..., 4:, :] = fill
    expected = attend(q, k, v, attn_mask=mask, backend="reference")  # clean inputs, eager CPU form
    monkeypatch.setattr(kernels, "_may_sync", lambda t: False)
    for keys, values in ((k, v), (k_dirty.requires_grad_(), v_dirty.requires_grad_())):
        out = attend(q, keys, values, attn_mask=mask, backend=backend)
        assert torch.equal(out[0, 1, 0], torch.zeros(8))
        assert _err(out, expected) <= 1e-5
        out.square().sum().backward()
        assert torch.isfinite(q.grad).all()
        q.grad = None
