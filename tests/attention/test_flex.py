"""The "flex" backend (PyTorch's FlexAttention) for GQA/MQA decode and paged decode, on the CPU (eager).

Oracles: attention in float64 over each row's own keys, gathered here from a block table this file shuffles
(independent of ``PagedView.gather`` and of the masks under test); SDPA; and greedy tokens of the default backend.
The eager path reads only the ``mask_mod``; a fused kernel (CUDA) reads only the blocks the ``BlockMask`` lists,
and those it lists as full without the ``mask_mod``: so the lists are checked on their own, slot by slot, against
the slots each row holds. Compiled FlexAttention is not run here (compiling takes ~10-20 s per shape on a CPU);
the CUDA test skips without a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnlab import AttentionConfig, ModelConfig
from attnlab.attention import flex
from attnlab.attention.backends import Call, choose, explain
from attnlab.attention.kernels import attend
from attnlab.cache import PagedView
from attnlab.generate import generate
from attnlab.model import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}  # n_heads, n_kv_heads
# float32: the eager path works in float32 as the oracle's float64, so only summation order differs. bfloat16
# (8 significant bits, relative rounding up to 2**-8 = 3.9e-3 per value): q, k, v are rounded on the way in, the
# probabilities are rounded to bfloat16 before the weighted sum and the output on the way out; 2e-2 of the output's
# scale is the project's bf16 bound elsewhere (tests/attention/test_kernels.py, benchmarks/gpu_check.py).
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _oracle(q, keys, values, *, softcap=None, window=None) -> torch.Tensor:
    """One decode step per row in float64: q (B, H, 1, D), keys[i] / values[i] (n_kv, n_i, D) row i's tokens."""
    out = []
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        if window is not None:
            k, v = k[:, -window:], v[:, -window:]
        if k.shape[1] == 0:
            out.append(torch.zeros(q.shape[1], 1, v.shape[-1], dtype=torch.float64))
            continue
        group = q.shape[1] // k.shape[0]
        kk, vv = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
        s = q[i].double() @ kk.transpose(-2, -1) * q.shape[-1] ** -0.5
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        out.append(torch.softmax(s, -1) @ vv)
    return torch.stack(out)


def _paged(n_kv, d, lengths, block, gen, *, spare=3, dtype=torch.float32):
    """A pool of shuffled blocks holding rows of ``lengths`` tokens (each block its own run; the free blocks and the
    slots past each row's end hold other numbers), and each row's tokens as the oracle reads them."""
    need = [-(-n // block) for n in lengths]
    n_blocks = sum(need) + spare
    pool_k = torch.randn(n_kv, n_blocks * block, d, generator=gen).to(dtype)
    pool_v = torch.randn(n_kv, n_blocks * block, d, generator=gen).to(dtype)
    order = torch.randperm(n_blocks, generator=gen).tolist()
    runs, keys, values = [], [], []
    for n, m in zip(lengths, need, strict=True):
        table, order = order[:m], order[m:]
        runs.append(tuple((b * block, min(block, n - j * block)) for j, b in enumerate(table)))
        slots = torch.tensor([b * block + o for b in table for o in range(block)][:n], dtype=torch.long)
        keys.append(pool_k[:, slots])
        values.append(pool_v[:, slots])
    runs, lengths = tuple(runs), tuple(lengths)
    return PagedView(pool_k, runs, lengths, block), PagedView(pool_v, runs, lengths, block), keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", HEADS)
def test_contiguous_decode_equals_float64_and_sdpa(variant, dtype):
    h, n_kv = HEADS[variant]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, n, 1 if n == h else 200, 32, generator=gen).to(dtype) for n in (h, n_kv, n_kv))
    got = attend(q, k, v, backend="flex")
    assert got.dtype == dtype and _err(got, _oracle(q, k, v)) < TOL[dtype]
    sdpa = F.scaled_dot_product_attention(q, k, v, enable_gqa=n_kv != h)
    assert _err(got, sdpa.double()) < TOL[dtype]


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("variant", HEADS)
def test_contiguous_rows_of_different_lengths_with_garbage_padding(variant, per_head):
    """A key-padding mask over a contiguous cache: rows of 300, 129 (one past a 128 block), 1 and 0 tokens, the
    padding holding inf and NaN; per query head, each head its own length."""
    h, n_kv = HEADS[variant]
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(4, h, 1, 16, generator=gen)
    k, v = torch.randn(4, n_kv, 300, 16, generator=gen), torch.randn(4, n_kv, 300, 16, generator=gen)
    lengths = torch.tensor([300, 129, 1, 0])
    if per_head:  # head j of row i sees lengths[i] - j keys (a query head's own span; KV heads are shared)
        n = (lengths[:, None] - torch.arange(h)).clamp_min(0)
        mask = torch.arange(300) < n[..., None, None]  # (B, H, 1, T_k)
    else:
        mask = (torch.arange(300) < lengths[:, None])[:, None, None]  # (B, 1, 1, T_k)
    padded_k, padded_v = k.clone(), v.clone()
    padded_k[1, :, 200:], padded_v[1, :, 150:], padded_v[2, :, 1:] = float("inf"), float("nan"), float("-inf")
    got = attend(q, padded_k, padded_v, attn_mask=mask, backend="flex")
    want = attend(q.double(), k.double(), v.double(), attn_mask=mask, backend="reference")
    assert torch.isfinite(got).all() and (got[3] == 0).all()  # a row with nothing to attend: zeros
    assert _err(got, want) < 1e-5


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block", [1, 4, 16, 128])
@pytest.mark.parametrize("variant", HEADS)
def test_paged_decode_over_shuffled_blocks_equals_each_row_alone(variant, block, window, softcap):
    h, n_kv = HEADS[variant]
    gen = torch.Generator().manual_seed(block)
    lengths = [37, 1, 4 * block, 2 * block + 1, 0]  # partial, one token, whole blocks, one past, empty
    k, v, keys, values = _paged(n_kv, 16, lengths, block, gen)
    q = torch.randn(len(lengths), h, 1, 16, generator=gen)
    got = attend(q, k, v, backend="flex", window=window, softcap=softcap)
    want = _oracle(q, keys, values, window=window, softcap=softcap)
    assert _err(got, want) < 1e-5 and (got[-1] == 0).all()


def test_paged_decode_in_bfloat16_and_with_an_unknown_block_size():
    gen = torch.Generator().manual_seed(2)
    k, v, keys, values = _paged(2, 32, [70, 9, 33], 8, gen, dtype=torch.bfloat16)
    q = torch.randn(3, 8, 1, 32, generator=gen).to(torch.bfloat16)
    want = _oracle(q, keys, values)
    assert _err(attend(q, k, v, backend="flex"), want) < TOL[torch.bfloat16]
    unknown = (
        PagedView(k.pool, k.runs, k.lengths),
        PagedView(v.pool, v.runs, v.lengths),
    )  # block from the runs
    assert _err(attend(q, *unknown, backend="flex"), want) < TOL[torch.bfloat16]


def test_non_finite_slots_of_other_rows_do_not_reach_a_row():
    gen = torch.Generator().manual_seed(3)
    k, v, keys, values = _paged(2, 16, [20, 7], 4, gen, spare=2)
    used = {s for row in k.runs for start, n in row for s in range(start, start + n)}
    free = [s for s in range(k.pool.shape[1]) if s not in used]
    k.pool[:, free], v.pool[:, free] = float("nan"), float("inf")
    q = torch.randn(2, 4, 1, 16, generator=gen)
    got = attend(q, k, v, backend="flex")
    assert _err(got, _oracle(q, keys, values)) < 1e-5


def _listed_slots(block_mask, n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, slots) bool: the slots a fused kernel attends (full blocks whole, partial blocks where the mask_mod
    allows), and (B, H) the number of partial blocks in which the mask_mod allows nothing."""
    bm = block_mask
    b, h = bm.kv_num_blocks.shape[:2]
    block = bm.BLOCK_SIZE[1]
    seen = torch.zeros(b, h, n_slots, dtype=torch.bool)
    wasted = torch.zeros(b, h, dtype=torch.long)
    for i in range(b):
        for j in range(h):
            for full, num, idx in ((True, bm.full_kv_num_blocks, bm.full_kv_indices), (False, bm.kv_num_blocks, bm.kv_indices)):  # fmt: skip
                for blk in idx[i, j, 0, : num[i, j, 0]].tolist():
                    slots = torch.arange(blk * block, min(n_slots, (blk + 1) * block))
                    if full:
                        seen[i, j, slots] = True
                        continue
                    allowed = bm.mask_mod(torch.tensor(i), torch.tensor(j), torch.tensor(0), slots)
                    seen[i, j, slots] |= allowed
                    wasted[i, j] += int(not allowed.any())
    return seen, wasted


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("block", [2, 8])
def test_the_paged_block_lists_cover_exactly_each_rows_slots(block, window):
    """What a fused kernel reads: listed blocks only, full ones without the mask_mod. It must be each row's own
    attended slots, no other, and no block listed for nothing."""
    gen = torch.Generator().manual_seed(4)
    lengths = [23, 8, 1, 17]
    k, _, _, _ = _paged(1, 4, lengths, block, gen)
    bm = flex._paged_blocks(k.runs, k.lengths, block, k.pool.shape[1], window, torch.device("cpu"), False)
    expected = torch.zeros(len(lengths), 1, k.pool.shape[1], dtype=torch.bool)
    for i, (row, n) in enumerate(zip(k.runs, lengths, strict=True)):
        slots = [s for start, m in row for s in range(start, start + m)]
        expected[i, 0, slots[0 if window is None else max(0, n - window) :]] = True
    seen, wasted = _listed_slots(bm, k.pool.shape[1])
    assert torch.equal(seen, expected) and (wasted == 0).all()
    if window is None:  # whole blocks are read without the mask (a window of 6 covers no whole block of 8)
        assert bm.full_kv_num_blocks[:, 0, 0].tolist() == [n // block for n in lengths]


def test_the_block_lists_of_a_padding_mask_cover_exactly_its_keys():
    lengths = torch.tensor([300, 129, 128, 0])
    mask = (torch.arange(300) < lengths[:, None])[:, None, None]
    bm = flex._mask_blocks(mask, 4, 8, 300)
    seen, wasted = _listed_slots(bm, 300)
    assert torch.equal(seen, mask[:, :, 0]) and (wasted == 0).all()
    assert bm.full_kv_num_blocks[:, 0, 0].tolist() == [2, 1, 1, 0]


def test_a_cuda_decode_chooses_flex_and_says_why_the_others_were_skipped():
    choice = choose(Call("cuda", torch.bfloat16, "decode", paged=True))
    assert choice.backend.name == "flex" and choice.skipped == (("triton_mla", "reads MLA latent rows only"),)
    assert explain(Call("cuda", torch.bfloat16, "decode", paged=True)).startswith(
        "flex for a cuda bfloat16 paged decode (asked: auto)"
    )
    choice = choose(Call("cuda", torch.float32, "decode", dropout=True))
    assert choice.backend.name == "sdpa" and dict(choice.skipped)["flex"] == "takes no dropout"
    choice = choose(Call("cuda", torch.float64, "decode", grad=True))
    assert choice.backend.name == "sdpa" and dict(choice.skipped)["flex"].startswith(
        "takes bfloat16, float16"
    )
    choice = choose(Call("cuda", torch.bfloat16, "prefill", paged=True), "flex")
    assert choice.backend.name == "sdpa" and dict(choice.skipped) == {"flex": "computes decode only"}
    cpu = choose(Call("cpu", torch.float32, "decode", mask=True))  # the CPU order is unchanged: no flex in it
    assert cpu.backend.name == "grouped" and "flex" not in dict(cpu.skipped)
    assert choose(Call("mps", torch.float32, "decode"), "flex").skipped == (
        ("flex", "runs on cpu, cuda only"),
    )


@pytest.mark.parametrize("variant", ["gqa", "mqa"])
def test_greedy_tokens_with_flex_equal_the_default_backend(monkeypatch, variant):
    """A tiny model's greedy generation, ragged (paged cache) and equal-length (contiguous) batches: the same
    tokens with every decode step's attention on flex as with the default backend."""
    calls = []
    for name in ("decode", "paged_decode"):
        real = getattr(flex, name)
        monkeypatch.setattr(
            flex, name, lambda *a, _real=real, _n=name, **kw: calls.append(_n) or _real(*a, **kw)
        )
    n_kv = {"gqa": 2, "mqa": 1}[variant]
    models = {}
    for backend in ("auto", "flex"):
        attn = AttentionConfig(d_model=64, n_heads=4, n_kv_heads=n_kv, backend=backend)
        cfg = ModelConfig(vocab_size=101, n_layers=2, attention=attn, ffn_dim=96, max_seq_len=128)
        models[backend] = Transformer(cfg)
        models[backend].init_weights(std=0.3, seed=0)
        models[backend].eval()
    gen = torch.Generator().manual_seed(5)
    for lengths in ([7, 30, 1], [12, 12]):
        rows = [torch.randint(0, 101, (n,), generator=gen).tolist() for n in lengths]
        calls.clear()
        want = generate(models["auto"], rows, 12, block_size=4)
        assert calls == []
        got = generate(models["flex"], rows, 12, block_size=4)
        assert got.tokens == want.tokens
        assert set(calls) == {"paged_decode" if got.cache == "paged" else "decode"} and len(calls) >= 2 * 11


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: compiled FlexAttention runs on CUDA"
)
def test_compiled_flex_on_cuda_equals_float64():
    gen = torch.Generator().manual_seed(6)
    k, v, keys, values = _paged(2, 64, [300, 17, 128], 16, gen, dtype=torch.bfloat16)
    q = torch.randn(3, 8, 1, 64, generator=gen).to(torch.bfloat16)
    on = [PagedView(t.pool.cuda(), t.runs, t.lengths, t.block_size) for t in (k, v)]
    got = attend(q.cuda(), *on, backend="flex").cpu()
    assert _err(got, _oracle(q, keys, values)) < TOL[torch.bfloat16]
    kc = torch.randn(3, 2, 300, 64, generator=gen).to(torch.bfloat16)
    vc = torch.randn(3, 2, 300, 64, generator=gen).to(torch.bfloat16)
    mask = (torch.arange(300) < torch.tensor([300, 129, 1])[:, None])[:, None, None]
    got = attend(q.cuda(), kc.cuda(), vc.cuda(), attn_mask=mask.cuda(), backend="flex").cpu()
    want = attend(q.double(), kc.double(), vc.double(), attn_mask=mask, backend="reference")
    assert _err(got, want) < TOL[torch.bfloat16]


@torch.no_grad()
def test_a_flex_layer_is_counted_by_the_backend_after_it():
    """Eager FlexAttention raises a TypeError under torch's FlopCounterMode (torch 2.13); a layer configured for
    flex (as "auto" orders it first for CUDA decode) failed under count_flops, after its cache had taken the token.
    Under a counter flex declines, and the next backend in the order runs and is counted."""
    from torch.utils.flop_counter import FlopCounterMode

    from attnlab import GroupedQueryAttention
    from attnlab.bench import count_flops

    torch.manual_seed(0)
    cfg = AttentionConfig(d_model=128, n_heads=8, n_kv_heads=2, backend="flex")
    layer = GroupedQueryAttention(cfg).eval()
    other = GroupedQueryAttention(cfg.replace(backend="grouped")).eval()
    other.load_state_dict(layer.state_dict())
    caches = [layer.new_cache(2, 32), other.new_cache(2, 32)]
    x = torch.randn(2, 9, 128)
    for attn, cache in zip((layer, other), caches, strict=True):
        attn(x, cache=cache)
    step = torch.randn(2, 1, 128)
    with count_flops() as counted:
        got = layer(step, cache=caches[0])
    with count_flops() as want:
        ref = other(step, cache=caches[1])
    assert counted.total == want.total > 0 and len(caches[0]) == 10
    assert _err(got, ref) < 1e-5
    with FlopCounterMode(display=False):
        layer(step, cache=caches[0])
    call = Call(device="cpu", dtype=torch.float32, phase="decode", counting=True)
    assert "flex: takes no FLOP counting (FlopCounterMode)" in explain(call, "flex")
    assert choose(call._replace(counting=False), "flex").backend.name == "flex"
