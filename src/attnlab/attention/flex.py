"""Decode attention through PyTorch's FlexAttention (``torch.nn.attention.flex_attention``; He et al. 2024,
arXiv 2412.05496): one query per head, GQA/MQA without repeating K/V (``enable_gqa=True``), a paged cache read in
place through a block mask built from its block table.

Shapes as in ``kernels``: q (B, n_heads, 1, D); contiguous k, v (B, n_kv_heads, T_k, D) with an optional boolean
mask broadcastable to (B, n_heads, 1, T_k) (True = attend: rows of different lengths are a key-padding mask); or a
paged pool (n_kv_heads, slots, D) with each row's runs of slots and length (a ``PagedView``'s fields).

Paged rows. The pool goes to FlexAttention as one batch row of keys, (1, n_kv_heads, slots, D), a view: query row
``b`` reads it through a ``BlockMask`` whose KV blocks are the cache's blocks, listing for row ``b`` exactly the
physical blocks of its block table (blocks wholly inside the row's attended span as "full", which a fused kernel
reads without evaluating the mask; its last, partly filled block and a window's first block as "partial"), and a
``mask_mod`` that maps a physical slot back to its position in row ``b`` (``table[b, slot // block]``: the
logical block, -1 for a block the row does not hold) and keeps positions in ``[lo[b], hi[b])``. Nothing is
gathered: the SDPA path copies every row into a (B, n_kv_heads, longest row, D) tensor first.

Where it runs. Compiled (``torch.compile(flex_attention)``) on CUDA, where the fused decode kernel splits the
context and stacks the queries of one KV head (its "group") in one tile. Eagerly everywhere else, as the correctness
oracle of the same masks: PyTorch's unfused implementation computes every score of the whole key tensor (for a
paged cache, of the whole pool) in float32, with K/V repeated per query head inside PyTorch, and rounds the
probabilities to the input dtype before the weighted sum; slower than SDPA, so no CPU order lists it. Compiling it
on a CPU works too (torch 2.13), but takes ~20 s per shape on this project's 2-core machines.

Masked-out slots: a fused kernel skips blocks the mask does not list, but within a listed block (and in the eager
path, everywhere) a masked key's value is multiplied by a zero probability, so inf or NaN there would reach the
output; ``kernels`` zeros the unattended keys of a masked contiguous call (as for SDPA), and on a CPU falls back to
the gathered copy when a paged output is not finite. On CUDA a paged row's last block may hold slots past its
length: the pool starts zeroed and only ever receives keys and values, so they are finite.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # PyTorch before 2.5
    BlockMask = flex_attention = None  # type: ignore[assignment,misc]

# The sparse block along queries: one block holds the step's single query (FlexAttention's default size).
Q_BLOCK = 128
# KV block of a contiguous cache's mask (FlexAttention's default; a paged cache uses its own block size).
KV_BLOCK = 128


def available() -> bool:
    return flex_attention is not None


def decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    attn_mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q (B, H, 1, D) over contiguous k, v (B, n_kv, T_k, D); ``attn_mask`` bool, broadcastable to (B, H, 1, T_k)."""
    if k.shape[2] == 0 or q.numel() == 0:
        return q.new_zeros(*q.shape[:3], v.shape[-1])
    block_mask = None if attn_mask is None else _mask_blocks(attn_mask, q.shape[0], q.shape[1], k.shape[2])
    return _run(q, k, v, block_mask, scale, softcap)


def paged_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    runs: tuple[tuple[tuple[int, int], ...], ...],
    lengths: tuple[int, ...],
    *,
    scale: float,
    block_size: int = 0,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q (B, H, 1, D) over paged rows: pools (n_kv, slots, D); row ``i`` holds ``lengths[i]`` tokens, the slots
    ``[start, start + n)`` of its ``runs[i]`` in order; ``block_size`` the cache's (0: found from the runs); with a
    ``window`` each row attends to its last ``window`` tokens."""
    slots = k_pool.shape[1]
    if slots == 0 or q.numel() == 0 or max(lengths, default=0) == 0:
        return q.new_zeros(*q.shape[:3], v_pool.shape[-1])
    block = block_size or _block_of(runs, slots)
    block_mask = _paged_blocks(runs, lengths, block, slots, window, q.device, _needs_grad(q, k_pool, v_pool))
    return _run(q, k_pool[None], v_pool[None], block_mask, scale, softcap)


def _run(q, k, v, block_mask, scale, softcap) -> torch.Tensor:
    score_mod = None if softcap is None else _softcapped(softcap)
    if torch.compiler.is_compiling():  # in a compiled graph (a static cache's step): compiled with it
        return flex_attention(
            q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=True
        )
    if q.device.type == "cuda":
        return _compiled()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=True)
    with warnings.catch_warnings():  # eager on purpose (see the module docstring), not by mistake
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile", UserWarning)
        return flex_attention(
            q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=True
        )


@functools.cache
def _compiled():
    return torch.compile(flex_attention)


def _softcapped(softcap: float):
    def score_mod(score, b, h, q_idx, kv_idx):  # FlexAttention hands it the scaled score
        return torch.tanh(score / softcap) * softcap

    return score_mod


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _block_of(runs, slots: int) -> int:
    """A block size that tiles every run: the greatest common divisor of the runs' starts, of every run's length but
    each row's last (which may end in a partly filled block), and of the pool's size."""
    bounds = [
        x for row in runs for i, (start, n) in enumerate(row) for x in (start, n if i < len(row) - 1 else 0)
    ]
    return math.gcd(slots, *bounds)


def _from_flags(partial: torch.Tensor, full: torch.Tensor, kv_block: int, kv_len: int, mask_mod, grad: bool):
    """A decode step's ``BlockMask`` from (B | 1, H | 1, n_blocks) flags: the blocks to read with the mask
    (``partial``) and without it (``full``), each listed first in block order (a stable sort, no host sync)."""

    def listed(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = flags.sum(-1, dtype=torch.int32)[..., None]  # (B, H, 1): one block of queries
        order = torch.sort(flags.to(torch.int8), dim=-1, descending=True, stable=True).indices
        return num, order.to(torch.int32)[..., None, :]  # (B, H, 1, n_blocks)

    return BlockMask.from_kv_blocks(
        *listed(partial),
        *listed(full),
        BLOCK_SIZE=(Q_BLOCK, kv_block),
        mask_mod=mask_mod,
        seq_lengths=(1, kv_len),
        compute_q_blocks=grad,  # the query-major lists serve the backward pass only
    )


def _mask_blocks(attn_mask: torch.Tensor, b: int, h: int, t_k: int) -> BlockMask:
    """The ``BlockMask`` of a boolean mask broadcastable to (B, H, 1, T_k), which its ``mask_mod`` indexes."""
    m = attn_mask.reshape((1,) * (4 - attn_mask.ndim) + tuple(attn_mask.shape))[:, :, -1]  # (B|1, H|1, T_k|1)
    m = m.expand(m.shape[0], m.shape[1], t_k)
    n = -(-t_k // KV_BLOCK)
    tiles = torch.nn.functional.pad(m, (0, n * KV_BLOCK - t_k)).unflatten(-1, (n, KV_BLOCK))
    full = tiles.all(-1)
    whole = m.expand(b, h, t_k)

    def mask_mod(b_idx, h_idx, q_idx, kv_idx):
        return whole[b_idx, h_idx, kv_idx]

    return _from_flags(tiles.any(-1) & ~full, full, KV_BLOCK, t_k, mask_mod, attn_mask.requires_grad)


@functools.lru_cache(maxsize=16)  # every layer of a step asks for the same rows: their tables are built once
def _paged_blocks(runs, lengths, block: int, slots: int, window, device, grad: bool) -> BlockMask:
    n_blocks = -(-slots // block)
    table = [[-1] * n_blocks for _ in runs]  # physical block -> logical block, per row
    partial = [[False] * n_blocks for _ in runs]
    full = [[False] * n_blocks for _ in runs]
    lo = [0 if window is None else max(0, n - window) for n in lengths]  # the attended positions [lo, hi)
    for i, row in enumerate(runs):
        at = 0
        for start, n in row:
            for j in range(0, n, block):
                phys, first = (start + j) // block, at + j
                table[i][phys] = first // block
                inside = first >= lo[i] and first + block <= lengths[i]
                full[i][phys] = inside
                partial[i][phys] = not inside and first < lengths[i] and first + block > lo[i]
            at += n
    table_t = torch.tensor(table, dtype=torch.int32, device=device)  # host-to-device copies, no sync
    lo_t = torch.tensor(lo, dtype=torch.int32, device=device)
    hi_t = torch.tensor(lengths, dtype=torch.int32, device=device)
    partial_t = torch.tensor(partial, device=device)[:, None]  # (B, 1, n_blocks): every head alike
    full_t = torch.tensor(full, device=device)[:, None]

    def mask_mod(b, h, q_idx, kv_idx):
        # A block the row does not hold maps to logical block -1: negative positions, below every lo.
        position = table_t[b, kv_idx // block] * block + kv_idx % block
        return (position >= lo_t[b]) & (position < hi_t[b])

    return _from_flags(partial_t, full_t, block, slots, mask_mod, grad)
