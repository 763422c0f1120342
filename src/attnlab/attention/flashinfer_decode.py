"""Attention through FlashInfer's batch decode and prefill kernels (Ye et al. 2025, arXiv 2501.01005; the
``flashinfer-python`` package, CUDA only): GQA/MQA without repeating K/V, a paged cache read in place through its
block table; a decode step (one query per row) on its decode kernels, several queries per row (a prefill, causal
or not) on its prefill kernels.

Shapes as in ``kernels``: q (B, n_heads, T_q, D); contiguous k, v (B, n_kv_heads, T_k, D); or a paged pool
(n_kv_heads, slots, D) with each row's runs of slots and length (a ``PagedView``'s fields).

Layout. FlashInfer reads K/V as pages, (pages, n_kv_heads, page_size, D) in its "HND" layout, through a CSR table:
row ``b``'s pages are ``indices[indptr[b] : indptr[b + 1]]``, all full but the last, which holds
``last_page_len[b]`` tokens (``page_table``). It reads the tensors' strides, so both of attnlab's caches are pages
without a copy:
- a paged pool (n_kv_heads, n_blocks * block, D) is (n_blocks, n_kv_heads, block, D) once its slot axis is split
  into blocks and the block axis put first (a view); each run of a row's slots is a run of whole blocks;
- a contiguous cache (B, n_kv_heads, T_k, D) is already (pages, n_kv_heads, page_size, D): one page per batch row,
  of T_k tokens, row ``b`` reading page ``b`` whole.

MLA. DeepSeek's absorbed decode (``mla_decode``, ``paged_mla_decode``) goes to FlashInfer's
``BatchMLAPagedAttentionWrapper``, which takes the latent rows as two caches, the compressed part (pages, page_size,
rank) and the rotary part (pages, page_size, rope): both are column slices of attnlab's latent rows (rank + rope
values a token), read through their strides, and the queries likewise; its plan takes each row's token count
instead of its last page's. It has no window and no soft-capping.

Planning. A wrapper's ``plan`` schedules the work of a batch on the host (and cannot run in a CUDA graph or under
``torch.compile``); a model's layers attend over the same rows in one step, so each wrapper (decode, prefill, MLA)
of a device keeps its last plan and plans again only when the rows (a paged cache's runs and lengths, or a
contiguous cache's batch and length), the shapes, the dtype, the scale, the window or the soft-cap change; the
page table is built only then.

Status: written against FlashInfer's documented API (``flashinfer.decode``, ``flashinfer.prefill``,
``flashinfer.mla``, 2026-08) and tested on a CPU through a stand-in module that computes what that API specifies
(tests/attention/test_flashinfer.py); not yet run on a GPU, so no backend order lists these: they run when named
(``backend="flashinfer"``, ``"flashinfer_mla"``), and ``benchmarks/gpu_check.py`` checks and times their decode
beside SDPA, FlexAttention and the Triton MLA kernel.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import torch

Table = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor
]  # FlashInfer's page table: indptr, indices, a count per row

WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's documented workspace for its split-K scheduling


def available() -> bool:
    """FlashInfer installed and a CUDA device present (its kernels are CUDA only)."""
    return torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


def page_table(runs: tuple[tuple[tuple[int, int], ...], ...], lengths: tuple[int, ...], block: int) -> Table:
    """FlashInfer's CSR page table (int32 on the CPU: indptr (B + 1,), indices, last_page_len (B,)) of a paged
    cache's rows: the blocks of each row's runs of slots, in order. Every row must hold a token (FlashInfer's last
    page holds 1 to ``block``), and its runs must start on a block boundary and all but its last end on one (a
    ``PagedKVCache``'s do)."""
    if block <= 0:
        raise ValueError(f"page_table: the cache's block size must be known (> 0), got {block}")
    indptr, indices, last = [0], [], []
    for b, (row, n) in enumerate(zip(runs, lengths, strict=True)):
        if n <= 0:
            raise ValueError(f"page_table: row {b} holds no token; FlashInfer's rows hold at least one")
        held = 0
        for i, (start, count) in enumerate(row):
            if start % block:
                raise ValueError(
                    f"page_table: row {b} has a run starting at slot {start}, not a multiple of {block}"
                )
            if count % block and i < len(row) - 1:  # FlashInfer's pages are full but a row's last
                raise ValueError(f"page_table: row {b}'s run at slot {start} ends inside a block of {block}")
            indices.extend(range(start // block, (start + count + block - 1) // block))
            held += count
        if held != n:
            raise ValueError(f"page_table: row {b}'s runs hold {held} slots, its length is {n}")
        indptr.append(len(indices))
        last.append(n - (indptr[-1] - indptr[-2] - 1) * block)
    as_int = dict(dtype=torch.int32)
    return torch.tensor(indptr, **as_int), torch.tensor(indices, **as_int), torch.tensor(last, **as_int)


def _one_page_per_row(b: int, t_k: int) -> Table:
    """The table of a contiguous cache: row ``b`` reads page ``b``, all ``t_k`` of its tokens (the last page's count
    and the row's count alike)."""
    i32 = dict(dtype=torch.int32)
    return torch.arange(b + 1, **i32), torch.arange(b, **i32), torch.full((b,), t_k, **i32)


def pages(pool: torch.Tensor, block: int) -> torch.Tensor:
    """A pool (n_kv_heads, n_blocks * block, D) as FlashInfer's HND pages (n_blocks, n_kv_heads, block, D), a view."""
    n_kv, slots, d = pool.shape
    if slots % block:
        raise ValueError(f"pages: a pool of {slots} slots is not whole blocks of {block}")
    return pool.view(n_kv, slots // block, block, d).transpose(0, 1)


_wrappers: dict[tuple, list] = {}  # (kind, device) -> [wrapper, the key of its last plan]


def _planned(kind: str, device: torch.device, key: tuple, make, plan):
    """The wrapper of ``kind`` on ``device`` (made by ``make(workspace)`` once), planned for ``key`` (by
    ``plan(wrapper)``) unless its last plan was for the same key."""
    slot = _wrappers.get((kind, device))
    if slot is None:
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        slot = _wrappers[(kind, device)] = [make(workspace), None]
    if slot[1] != key:
        plan(slot[0])
        slot[1] = key
    return slot[0]


def _run(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    rows: tuple,
    table: Callable[[], Table],
    *,
    scale: float,
    window: int | None,
    softcap: float | None,
    causal: bool = False,
) -> torch.Tensor:
    """q (B, H, T_q, D) over pages (pages, n_kv, page_size, D): (B, H, T_q, D). ``rows`` says which pages each row
    reads (the runs of a paged cache, or one page per row), ``table()`` makes FlashInfer's table of them, called
    only when a plan is made. One query per row goes to the decode wrapper; several to the prefill wrapper, each
    row's queries its last T_q positions (with ``causal``, query i of a row of n tokens sees keys up to n - T_q + i:
    FlashInfer's causal mask is aligned to the bottom right when there are more keys than queries)."""
    if k_pages.shape[-1] != v_pages.shape[-1] or k_pages.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"flashinfer: queries, keys and values must have one width, got {q.shape[-1]}, {k_pages.shape[-1]} "
            f"and {v_pages.shape[-1]}"
        )
    import flashinfer  # an optional dependency (attnlab[gpu]): imported when this backend runs

    b, h, t_q, d = q.shape
    n_kv, page_size = k_pages.shape[1], k_pages.shape[2]
    device = q.device
    window_left = -1 if window is None else window - 1
    key = (rows, h, n_kv, d, page_size, q.dtype, k_pages.dtype, scale, window, softcap, t_q, causal)
    common = dict(pos_encoding_mode="NONE", window_left=window_left, logits_soft_cap=softcap, q_data_type=q.dtype,
                  kv_data_type=k_pages.dtype, sm_scale=scale)  # fmt: skip

    def plan_decode(wrapper) -> None:
        indptr, indices, last = (t.to(device) for t in table())
        wrapper.plan(indptr, indices, last, h, n_kv, d, page_size, **common)

    def plan_prefill(wrapper) -> None:
        indptr, indices, last = (t.to(device) for t in table())
        queries = torch.arange(0, b * t_q + 1, t_q, dtype=torch.int32, device=device)
        wrapper.plan(queries, indptr, indices, last, h, n_kv, d, page_size, causal=causal, **common)

    if t_q == 1:
        make = functools.partial(flashinfer.BatchDecodeWithPagedKVCacheWrapper, kv_layout="HND")
        wrapper = _planned("decode", device, key, make, plan_decode)
        return wrapper.run(q[:, :, 0], (k_pages, v_pages)).unsqueeze(2)
    make = functools.partial(flashinfer.BatchPrefillWithPagedKVCacheWrapper, kv_layout="HND")
    wrapper = _planned("prefill", device, key, make, plan_prefill)
    out = wrapper.run(q.transpose(1, 2).reshape(b * t_q, h, d), (k_pages, v_pages))
    return out.view(b, t_q, h, d).transpose(1, 2)


def _run_mla(
    q: torch.Tensor, pages_: torch.Tensor, rows: tuple, table: Callable[[], Table], rank: int, *, scale: float,
    window: int | None,
) -> torch.Tensor:  # fmt: skip
    """q (B, H, 1, rank + rope) over latent pages (pages, page_size, rank + rope), ``rows`` and ``table`` as
    ``_run``'s (the table's last column: each row's token count): (B, H, 1, rank)."""
    if window is not None:
        raise ValueError(f"flashinfer_mla: FlashInfer's MLA kernels take no window, got window={window}")
    import flashinfer  # an optional dependency (attnlab[gpu]): imported when this backend runs

    b, h = q.shape[0], q.shape[1]
    page_size, rope = pages_.shape[1], pages_.shape[-1] - rank
    key = (rows, h, rank, rope, page_size, q.dtype, pages_.dtype, scale)
    device = q.device

    def plan(wrapper) -> None:
        indptr, indices, tokens = (t.to(device) for t in table())
        queries = torch.arange(b + 1, dtype=torch.int32, device=device)
        wrapper.plan(
            queries, indptr, indices, tokens, h, rank, rope, page_size, False, scale, q.dtype, pages_.dtype
        )

    wrapper = _planned("mla", device, key, flashinfer.mla.BatchMLAPagedAttentionWrapper, plan)
    q1 = q[:, :, 0]
    return wrapper.run(q1[..., :rank], q1[..., rank:], pages_[..., :rank], pages_[..., rank:]).unsqueeze(2)


def decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """q (B, H, T_q, D) over contiguous k, v (B, n_kv, T_k, D): each batch row one page of T_k tokens (``causal``:
    the queries are the row's last T_q positions)."""
    b, _, t_k, _ = k.shape
    if t_k == 0 or q.numel() == 0:
        return q.new_zeros(*q.shape[:3], v.shape[-1])
    if k.stride() != v.stride() or k.stride(-1) != 1:  # FlashInfer reads one set of strides for both
        k, v = k.contiguous(), v.contiguous()
    table = functools.partial(_one_page_per_row, b, t_k)
    return _run(
        q, k, v, ("one page a row", b, t_k), table, scale=scale, window=window, softcap=softcap, causal=causal
    )


def paged_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    runs: tuple[tuple[tuple[int, int], ...], ...],
    lengths: tuple[int, ...],
    *,
    scale: float,
    block_size: int,
    window: int | None = None,
    softcap: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """q (B, H, T_q, D) over a paged pool (n_kv, slots, D), row ``b`` its ``runs[b]`` of slots, read in place."""
    k_pages, v_pages = pages(k_pool, block_size), pages(v_pool, block_size)
    table = functools.partial(page_table, runs, lengths, block_size)
    rows = ("runs", runs, lengths, block_size)
    return _run(q, k_pages, v_pages, rows, table, scale=scale, window=window, softcap=softcap, causal=causal)


def mla_decode(
    q: torch.Tensor, rows: torch.Tensor, rank: int, *, scale: float, window: int | None = None
) -> torch.Tensor:
    """q (B, H, 1, rank + rope) over contiguous latent rows (B, 1, T_k, rank + rope), values their first ``rank``
    columns: (B, H, 1, rank). Each batch row is one page of T_k tokens."""
    b, _, t_k, _ = rows.shape
    if t_k == 0 or q.numel() == 0:
        return q.new_zeros(*q.shape[:3], rank)
    table = functools.partial(_one_page_per_row, b, t_k)  # one page: its last page's count is the row's
    return _run_mla(q, rows[:, 0], ("one page a row", b, t_k), table, rank, scale=scale, window=window)


def paged_mla_decode(
    q: torch.Tensor,
    pool: torch.Tensor,
    runs: tuple[tuple[tuple[int, int], ...], ...],
    lengths: tuple[int, ...],
    rank: int,
    *,
    scale: float,
    block_size: int,
    window: int | None = None,
) -> torch.Tensor:
    """q (B, H, 1, rank + rope) over a paged pool of latent rows (1, slots, rank + rope), read in place."""

    def table() -> Table:
        indptr, indices, _ = page_table(runs, lengths, block_size)
        return indptr, indices, torch.tensor(lengths, dtype=torch.int32)

    pages_ = pages(pool, block_size)[:, 0]  # (blocks, block, rank + rope)
    rows = ("runs", runs, lengths, block_size)
    return _run_mla(q, pages_, rows, table, rank, scale=scale, window=window)
