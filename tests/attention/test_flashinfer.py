"""The "flashinfer" backend (``attention/flashinfer_decode.py``) on a CPU: its page tables against the paged views
they describe, and its calls into FlashInfer through a stand-in ``flashinfer`` module that computes what FlashInfer's
documented API specifies (``BatchDecodeWithPagedKVCacheWrapper``: HND pages, a CSR page table, ``window_left``,
``logits_soft_cap``, ``sm_scale``), checked against a float64 oracle. FlashInfer itself runs on CUDA only: its own
kernels are checked by ``benchmarks/gpu_check.py`` on a GPU."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
from test_flex import HEADS, _err, _oracle, _paged

from attnlab.attention import flashinfer_decode
from attnlab.attention.backends import AUTO, BACKENDS, Call, choose
from attnlab.attention.kernels import attend

pytestmark = pytest.mark.usefixtures("one_thread")


class _Wrapper:
    """FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` as its documentation specifies it, in PyTorch: ``plan``
    keeps the table and the options, ``run`` attends each row over the tokens of its pages."""

    plans = 0

    def __init__(self, workspace: torch.Tensor, kv_layout: str):
        assert kv_layout == "HND" and workspace.dtype == torch.uint8
        self.planned = None

    def plan(
        self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **options
    ):
        assert indptr.dtype == indices.dtype == last_page_len.dtype == torch.int32
        assert options["pos_encoding_mode"] == "NONE"
        type(self).plans += 1
        self.planned = (
            indptr,
            indices,
            last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            options,
        )

    def run(self, q, paged_kv_cache):
        indptr, indices, last, h, n_kv, d, page_size, options = self.planned
        k_cache, v_cache = paged_kv_cache  # (pages, n_kv, page_size, D)
        assert q.shape[1:] == (h, d) and k_cache.shape[1:] == (n_kv, page_size, d)
        assert k_cache.stride() == v_cache.stride() and q.dtype == options["q_data_type"]
        out = []
        for b in range(q.shape[0]):
            pages = indices[indptr[b] : indptr[b + 1]].tolist()
            n = (len(pages) - 1) * page_size + int(last[b])
            k = torch.cat([k_cache[p] for p in pages], 1)[:, :n].double().repeat_interleave(h // n_kv, 0)
            v = torch.cat([v_cache[p] for p in pages], 1)[:, :n].double().repeat_interleave(h // n_kv, 0)
            if options["window_left"] >= 0:
                k, v = k[:, -(options["window_left"] + 1) :], v[:, -(options["window_left"] + 1) :]
            s = (q[b].double()[:, None] @ k.transpose(-1, -2))[:, 0] * options["sm_scale"]
            if options["logits_soft_cap"]:
                s = options["logits_soft_cap"] * torch.tanh(s / options["logits_soft_cap"])
            out.append((torch.softmax(s, -1)[:, None] @ v)[:, 0])
        return torch.stack(out).to(q.dtype)


class _PrefillWrapper:
    """FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` as documented: row b's queries are
    ``q[qo_indptr[b] : qo_indptr[b + 1]]``, the last of its n tokens; causal (aligned to the bottom right), a left
    window counted from each query's position, soft-capping."""

    def __init__(self, workspace: torch.Tensor, kv_layout: str):
        assert kv_layout == "HND"
        self.planned = None

    def plan(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             **opts):  # fmt: skip
        assert opts["pos_encoding_mode"] == "NONE" and qo_indptr.dtype == torch.int32
        self.planned = (
            qo_indptr,
            indptr,
            indices,
            last_page_len,
            num_qo_heads // num_kv_heads,
            page_size,
            opts,
        )

    def run(self, q, paged_kv_cache):
        qo, indptr, indices, last, group, page_size, opts = self.planned
        k_cache, v_cache = paged_kv_cache
        out = []
        for b in range(len(indptr) - 1):
            pages = indices[indptr[b] : indptr[b + 1]].tolist()
            n = (len(pages) - 1) * page_size + int(last[b])
            k = torch.cat([k_cache[p] for p in pages], 1)[:, :n].double().repeat_interleave(group, 0)
            v = torch.cat([v_cache[p] for p in pages], 1)[:, :n].double().repeat_interleave(group, 0)
            qb = q[qo[b] : qo[b + 1]].double().transpose(0, 1)  # (H, T, D)
            s = qb @ k.transpose(-1, -2) * opts["sm_scale"]
            if opts["logits_soft_cap"]:
                s = opts["logits_soft_cap"] * torch.tanh(s / opts["logits_soft_cap"])
            pos = torch.arange(n - qb.shape[1], n)[:, None]  # each query's position among the row's tokens
            seen = torch.ones(qb.shape[1], n, dtype=torch.bool)
            if opts["causal"]:
                seen &= torch.arange(n)[None] <= pos
            if opts["window_left"] >= 0:
                seen &= torch.arange(n)[None] >= pos - opts["window_left"]
            out.append((torch.softmax(s.masked_fill(~seen, float("-inf")), -1) @ v).transpose(0, 1))
        return torch.cat(out).to(q.dtype)


class _MLAWrapper:
    """FlashInfer's ``mla.BatchMLAPagedAttentionWrapper`` as documented: the compressed and rotary caches
    (pages, page_size, width) through a CSR page table and each row's token count; values the compressed rows."""

    def __init__(self, workspace: torch.Tensor):
        self.planned = None

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type):  # fmt: skip
        assert qo_indptr.tolist() == list(range(len(kv_len_arr) + 1)) and not causal  # one query per row
        self.planned = (
            kv_indptr,
            kv_indices,
            kv_len_arr,
            num_heads,
            head_dim_ckv,
            head_dim_kpe,
            page_size,
            sm_scale,
        )

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache):
        indptr, indices, tokens, h, ckv, kpe, page_size, scale = self.planned
        assert q_nope.shape[1:] == (h, ckv) and q_pe.shape[1:] == (h, kpe)
        assert ckv_cache.shape[1:] == (page_size, ckv) and kpe_cache.shape[1:] == (page_size, kpe)
        out = []
        for b in range(q_nope.shape[0]):
            pages = indices[indptr[b] : indptr[b + 1]].tolist()
            c = torch.cat([ckv_cache[p] for p in pages])[: int(tokens[b])].double()
            r = torch.cat([kpe_cache[p] for p in pages])[: int(tokens[b])].double()
            s = (q_nope[b].double() @ c.T + q_pe[b].double() @ r.T) * scale
            out.append(torch.softmax(s, -1) @ c)
        return torch.stack(out).to(q_nope.dtype)


@pytest.fixture
def stand_in(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = _Wrapper
    module.BatchPrefillWithPagedKVCacheWrapper = _PrefillWrapper
    module.mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=_MLAWrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(flashinfer_decode, "WORKSPACE_BYTES", 64)
    monkeypatch.setattr(flashinfer_decode, "_wrappers", {})
    monkeypatch.setattr(_Wrapper, "plans", 0)
    return module


@pytest.mark.parametrize("block", [16, 5])
def test_the_page_table_lists_each_rows_blocks_in_order(block):
    gen = torch.Generator().manual_seed(block)
    k, _, keys, _ = _paged(2, 8, [37, 1, block, 2 * block + 3], block, gen)
    indptr, indices, last = flashinfer_decode.page_table(k.runs, k.lengths, block)
    pages = flashinfer_decode.pages(k.pool, block)
    assert pages.shape == (k.pool.shape[1] // block, 2, block, 8) and pages.data_ptr() == k.pool.data_ptr()
    for b, want in enumerate(keys):  # the rows read back through the table equal the tokens the view holds
        row = torch.cat([pages[p] for p in indices[indptr[b] : indptr[b + 1]].tolist()], 1)
        n = (indptr[b + 1] - indptr[b] - 1) * block + last[b]
        assert 1 <= last[b] <= block and torch.equal(row[:, :n], want)


def test_bad_tables_are_refused_by_name():
    with pytest.raises(ValueError, match="block size must be known"):
        flashinfer_decode.page_table((((0, 4),),), (4,), 0)
    with pytest.raises(ValueError, match="row 1 holds no token"):
        flashinfer_decode.page_table((((0, 4),), ()), (4, 0), 4)
    with pytest.raises(ValueError, match="starting at slot 2, not a multiple of 4"):
        flashinfer_decode.page_table((((2, 2),),), (2,), 4)
    with pytest.raises(ValueError, match="row 0's run at slot 0 ends inside a block of 4"):
        flashinfer_decode.page_table((((0, 3), (4, 2)),), (5,), 4)
    with pytest.raises(ValueError, match="runs hold 4 slots, its length is 5"):
        flashinfer_decode.page_table((((0, 4),),), (5,), 4)
    with pytest.raises(ValueError, match="not whole blocks of 4"):
        flashinfer_decode.pages(torch.zeros(1, 6, 2), 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (7, None), (None, 5.0)])
@pytest.mark.parametrize("variant", HEADS)
def test_paged_and_contiguous_decode_equal_float64(stand_in, variant, window, softcap, dtype):
    heads, n_kv = HEADS[variant]
    gen = torch.Generator().manual_seed(heads + n_kv)
    k, v, keys, values = _paged(n_kv, 16, [33, 1, 16, 50], 16, gen, dtype=dtype)
    q = torch.randn(4, heads, 1, 16, generator=gen).to(dtype)
    want = _oracle(q, keys, values, softcap=softcap, window=window)
    got = flashinfer_decode.paged_decode(
        q, k.pool, v.pool, k.runs, k.lengths, scale=16**-0.5, block_size=16, window=window, softcap=softcap
    )
    assert got.shape == (4, heads, 1, 16) and got.dtype == dtype and _err(got, want) < 2e-2
    # a contiguous cache (a view of a longer buffer): one page per row
    buf_k = torch.randn(4, n_kv, 64, 16, generator=gen).to(dtype)
    buf_v = torch.randn(4, n_kv, 64, 16, generator=gen).to(dtype)
    ck, cv = buf_k[:, :, :40], buf_v[:, :, :40]
    want = _oracle(q, list(ck), list(cv), softcap=softcap, window=window)
    got = flashinfer_decode.decode(q, ck, cv, scale=16**-0.5, window=window, softcap=softcap)
    assert _err(got, want) < 2e-2


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (5, None), (None, 5.0)])
@pytest.mark.parametrize("variant", ["gqa", "mqa"])
def test_a_causal_prefill_over_pages_equals_each_row_alone(stand_in, variant, window, softcap):
    # 6 new tokens a row over rows of 33, 6, 16 and 50 tokens: the queries are each row's last 6 positions
    heads, n_kv = HEADS[variant]
    gen = torch.Generator().manual_seed(2)
    k, v, keys, values = _paged(n_kv, 16, [33, 6, 16, 50], 16, gen, dtype=torch.bfloat16)
    q = torch.randn(4, heads, 6, 16, generator=gen).to(torch.bfloat16)
    got = flashinfer_decode.paged_decode(q, k.pool, v.pool, k.runs, k.lengths, scale=0.25, block_size=16,
                                         window=window, softcap=softcap, causal=True)  # fmt: skip
    assert got.shape == (4, heads, 6, 16)
    for b in range(4):  # the reference backend over the row's own tokens, in float64
        want = attend(q[b : b + 1].double(), keys[b][None].double(), values[b][None].double(), is_causal=True,
                      scale=0.25, window=window, softcap=softcap, backend="reference")  # fmt: skip
        assert _err(got[b : b + 1], want) < 2e-2, b
    ck, cv = torch.stack(keys[:1] * 2), torch.stack(values[:1] * 2)  # contiguous: one page per row
    want = attend(q[:2].double(), ck.double(), cv.double(), is_causal=True, scale=0.25, window=window,
                  softcap=softcap, backend="reference")  # fmt: skip
    got = flashinfer_decode.decode(q[:2], ck, cv, scale=0.25, window=window, softcap=softcap, causal=True)
    assert _err(got, want) < 2e-2


def test_the_plan_is_made_again_only_when_the_table_changes(stand_in):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 8, generator=gen).to(torch.bfloat16)
    k = torch.randn(2, 2, 12, 8, generator=gen).to(torch.bfloat16)
    for _ in range(3):  # a model's layers in one step: one table
        flashinfer_decode.decode(q, k, k, scale=0.3)
    assert _Wrapper.plans == 1
    flashinfer_decode.decode(q, k[:, :, :11], k[:, :, :11], scale=0.3)  # the next step's lengths
    flashinfer_decode.decode(q, k[:, :, :11], k[:, :, :11], scale=0.3, window=4)
    assert _Wrapper.plans == 3
    with pytest.raises(ValueError, match="one width, got 8, 8 and 6"):
        flashinfer_decode.decode(q, k, k[..., :6], scale=0.3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mla_decode_over_latent_rows_equals_float64(stand_in, dtype):
    # DeepSeek's absorbed decode: every head's query against the one latent head (rank 32 + rope 8 here), values
    # the latent part; paged rows from a shuffled pool and contiguous rows of a longer buffer
    rank, width, heads = 32, 40, 6
    gen = torch.Generator().manual_seed(1)
    k, _, keys, _ = _paged(1, width, [33, 1, 16, 50], 16, gen, dtype=dtype)
    q = torch.randn(4, heads, 1, width, generator=gen).to(dtype)
    values = [r[..., :rank] for r in keys]
    want = torch.stack(
        [
            _oracle(
                q[i : i + 1].double(), [keys[i].expand(heads, -1, -1)], [values[i].expand(heads, -1, -1)]
            )[0]
            for i in range(4)
        ]
    )
    got = flashinfer_decode.paged_mla_decode(
        q, k.pool, k.runs, k.lengths, rank, scale=width**-0.5, block_size=16
    )
    assert got.shape == (4, heads, 1, rank) and got.dtype == dtype and _err(got, want) < 2e-2
    rows = torch.randn(4, 1, 64, width, generator=gen).to(dtype)[:, :, :40]
    want = torch.stack(
        [
            _oracle(
                q[i : i + 1].double(),
                [rows[i].expand(heads, -1, -1)],
                [rows[i, ..., :rank].expand(heads, -1, -1)],
            )[0]
            for i in range(4)
        ]
    )
    assert _err(flashinfer_decode.mla_decode(q, rows, rank, scale=width**-0.5), want) < 2e-2
    with pytest.raises(ValueError, match="take no window, got window=8"):
        flashinfer_decode.mla_decode(q, rows, rank, scale=width**-0.5, window=8)


def test_the_table_runs_it_when_named_on_cuda_and_never_by_auto(monkeypatch):
    backend = BACKENDS["flashinfer"]
    monkeypatch.setitem(BACKENDS, "flashinfer", dataclasses.replace(backend, available=lambda: True))
    named = choose(Call("cuda", torch.bfloat16, "decode", paged=True), "flashinfer")
    assert named.backend.name == "flashinfer"
    # not measured on a GPU yet
    assert all("flashinfer" not in order and "flashinfer_mla" not in order for order in AUTO.values())
    refusals = {
        Call("cuda", torch.bfloat16, "decode", latent=True): "reads no MLA latent rows",
        Call("cuda", torch.float32, "decode"): "takes bfloat16, float16 only",
        Call("cuda", torch.bfloat16, "decode", mask=True): "takes no masks",
        Call("cuda", torch.bfloat16, "decode", lengths=True): "takes no row lengths or masks",
        Call("cpu", torch.bfloat16, "decode"): "runs on cuda only",
    }
    for call, why in refusals.items():
        choice = choose(call, "flashinfer")
        assert choice.backend.name != "flashinfer" and dict(choice.skipped)["flashinfer"] == why
    softcapped = choose(Call("cuda", torch.bfloat16, "decode", softcap=True), "flashinfer")
    assert softcapped.backend.name == "flashinfer"  # FlashInfer's logits_soft_cap
    assert (
        choose(Call("cuda", torch.bfloat16, "prefill", paged=True), "flashinfer").backend.name == "flashinfer"
    )
    mla = dataclasses.replace(BACKENDS["flashinfer_mla"], available=lambda: True)
    monkeypatch.setitem(BACKENDS, "flashinfer_mla", mla)
    assert (
        choose(Call("cuda", torch.bfloat16, "decode", paged=True, latent=True), "flashinfer_mla").backend
        is mla
    )
    assert mla.refuses(Call("cuda", torch.bfloat16, "decode")) == "reads MLA latent rows only"
    assert (
        mla.refuses(Call("cuda", torch.bfloat16, "decode", latent=True, softcap=True))
        == "takes no soft-capping"
    )


def test_without_a_gpu_it_is_not_available():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert not flashinfer_decode.available()
    assert BACKENDS["flashinfer"].refuses(Call("cuda", torch.bfloat16, "decode")) == "not available here"
