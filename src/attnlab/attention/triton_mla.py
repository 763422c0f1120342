"""MLA's absorbed decode over its latent rows as a Triton kernel (GPU; on a CPU under ``TRITON_INTERPRET=1``).

Shapes: q (B, H, 1, R + P), the query moved into latent space and its rotary part; the cached rows, contiguous
(B, 1, S, R + P) or a ``PagedView`` whose pool is (1, slots, R + P); the values are the first R columns of each
row (``LatentCache``, ``PagedKVCache(values_in_keys=True)``); output (B, H, 1, R). R = kv_lora_rank, P =
qk_rope_head_dim.

Flash-decoding (split-K over the sequence; Dao et al., "Flash-Decoding for long-context inference", 2023): every
program takes one batch row, one chunk of its tokens and a group of heads, reads each token's row once for all the
heads of the group (the latent part is both the key and the value), and keeps an online softmax over the chunk in
float32; a second kernel merges the chunks of a row by their log-sum-exp. Up to 32 heads make one group: the
(heads x R) float32 accumulator lives in registers, and 32 x 512 is what 8 warps hold without spilling. DeepSeek-V2's
16 heads are one group (each row read once from memory); V3's 128 heads are four groups, launched next to each other
(the group is the fastest grid axis) so that all but the first read of a row come from L2.

Paged rows are read through a table of each row's slots (one int32 per token: 0.35% of a bfloat16 latent row of 576
values), built from the view's runs on the host side of the call.

This module imports triton at its top: ``kernels.py`` imports it only when the table picks its backend (a CUDA MLA
decode step with triton installed), so attnlab itself imports without triton. Under the interpreter bfloat16 is
stored but not computed (triton 3.5's interpreter multiplies bfloat16 bit patterns in ``tl.dot``), so the tiles
are widened to float32 before each product there (the products of bfloat16 values are exact in float32), and values
are rounded to bfloat16 to nearest by hand (its casts truncate): this computes what the GPU computes up to the order
of the sums.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..cache import PagedView

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
BLOCK_N = 32  # tokens per step of a program's loop
MAX_BLOCK_H = 32  # heads per program (see the module docstring)
MIN_CHUNK = 256  # tokens per program at least: fewer do not repay the partial results' write and merge
_SM_COUNT: dict[int, int] = {}

if INTERPRET:
    # The interpreter holds every scalar as a 1-element array and takes a loop bound's value with int(array), which
    # numpy 2.4 refuses for arrays of 1 dim (its 2.4.0 release notes; triton 3.5 to 3.9 unchanged): a loop bound
    # read from memory (a row's length) then fails. Read the one element instead; the GPU path is untouched.
    from triton.runtime import interpreter as _interpreter

    _patch_tensor = _interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor):
        _patch_tensor(tensor)
        tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])

    _interpreter._patch_lang_tensor = _patch_lang_tensor


@triton.jit
def _nearest_bf16(x):
    """float32 -> the nearest bfloat16 (ties to even), held in float32: the GPU's rounding, which the interpreter's
    own cast does not do (it truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _chunk_kernel(
    Q, KV, Slots, Lens, First, Out, Lse,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_sb,
    stride_ob, stride_oh, stride_oc, stride_lb, stride_lh,
    n_heads, seq_len, chunk, scale_log2,
    R: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, RAGGED: tl.constexpr, WIDEN: tl.constexpr,
    ROUND_BF16: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One (head group, chunk, batch row): the chunk's attention, normalised, and its log2-sum-exp2."""
    g, c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if PAGED or RAGGED:  # each row's first token and length from the device (RAGGED: contiguous buffers)
        first, length = tl.load(First + b), tl.load(Lens + b)
    else:
        first, length = 0, seq_len
    start = first + c * chunk
    end = tl.minimum(start + chunk, length)
    heads = g * BLOCK_H + tl.arange(0, BLOCK_H)
    cols, rope = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_P)
    live_h, live_r, live_p = heads < n_heads, cols < R, rope < P
    q_at = Q + b * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_at + cols[None, :], mask=live_h[:, None] & live_r[None, :], other=0.0)
    q_rope = tl.load(q_at + R + rope[None, :], mask=live_h[:, None] & live_p[None, :], other=0.0)
    if WIDEN:
        q_lat, q_rope = q_lat.to(tl.float32), q_rope.to(tl.float32)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)  # noqa: E741 (the softmax's denominator, by its usual name)
    acc = tl.zeros((BLOCK_H, BLOCK_R), tl.float32)
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        live_t = t < end
        if PAGED:
            rows = tl.load(Slots + b * stride_sb + t, mask=live_t, other=0).to(tl.int64) * stride_kt
        else:
            rows = b.to(tl.int64) * stride_kb + t.to(tl.int64) * stride_kt
        k_lat = tl.load(KV + rows[:, None] + cols[None, :], mask=live_t[:, None] & live_r[None, :], other=0.0)
        k_rope = tl.load(
            KV + rows[:, None] + R + rope[None, :], mask=live_t[:, None] & live_p[None, :], other=0.0
        )
        if WIDEN:
            k_lat, k_rope = k_lat.to(tl.float32), k_rope.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)
        s += tl.dot(q_rope, tl.trans(k_rope), input_precision=PRECISION)
        s = tl.where(live_t[None, :], s * scale_log2, float("-inf"))  # (BLOCK_H, BLOCK_N), log2 units
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)  # noqa: E741
        # p rounded to the cache's dtype, as the GPU's product takes it (a no-op in float32)
        if ROUND_BF16:
            p = _nearest_bf16(p)
        else:
            p = p.to(KV.dtype.element_ty).to(k_lat.dtype)
        acc = acc * alpha[:, None] + tl.dot(p, k_lat, input_precision=PRECISION)
        m = m_new
    seen = l > 0.0  # an empty chunk (a short row of the batch) weighs nothing in the merge
    out = acc / tl.where(seen, l, 1.0)[:, None]
    o_at = Out + b * stride_ob + heads[:, None] * stride_oh + c * stride_oc + cols[None, :]
    tl.store(o_at, out, mask=live_h[:, None] & live_r[None, :])
    lse = tl.where(seen, m + tl.log2(tl.where(seen, l, 1.0)), float("-inf"))
    tl.store(Lse + b * stride_lb + heads * stride_lh + c, lse, mask=live_h)


@triton.jit
def _merge_kernel(
    Part, Lse, Y, n_chunks,
    stride_pb, stride_ph, stride_pc, stride_lb, stride_lh, stride_yb, stride_yh,
    R: tl.constexpr, BLOCK_R: tl.constexpr, ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """One (batch row, head): the chunks' outputs weighed by 2^lse, online; zeros when no chunk saw a token."""
    b, h = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, BLOCK_R)
    live = cols < R
    m = float("-inf")
    total = 0.0
    acc = tl.zeros((BLOCK_R,), tl.float32)
    for c in range(0, n_chunks):
        lse = tl.load(Lse + b * stride_lb + h * stride_lh + c)
        if lse > float("-inf"):
            part = tl.load(Part + b * stride_pb + h * stride_ph + c * stride_pc + cols, mask=live, other=0.0)
            m_new = tl.maximum(m, lse)
            alpha, w = tl.exp2(m - m_new), tl.exp2(lse - m_new)
            acc = acc * alpha + w * part
            total = total * alpha + w
            m = m_new
    y = acc / tl.where(total > 0.0, total, 1.0)
    if ROUND_BF16:
        y = _nearest_bf16(y)
    tl.store(Y + b * stride_yb + h * stride_yh + cols, y.to(Y.dtype.element_ty), mask=live)


def decode(
    q: torch.Tensor,
    k: torch.Tensor | PagedView,
    value_dim: int,
    *,
    scale: float,
    window: int | None = None,
    chunk: int | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (B, H, 1, R + P) over latent rows ``k`` (contiguous (B, 1, S, R + P) with unit last stride, or a
    ``PagedView``), values their first ``value_dim`` = R columns -> (B, H, 1, R) in q's dtype. ``window``: each
    paged row attends to its last ``window`` tokens only (contiguous rows come already cut by ``attend``, but for
    ``lengths``). ``chunk``: tokens per program (default: enough chunks to fill the GPU twice over, at least
    ``MIN_CHUNK``). ``lengths`` ((B,) integers on q's device; contiguous rows): row b's tokens are its first
    ``lengths[b]`` of the S (a static cache's buffers): the grid is cut for all S, which keeps every launch the same
    for a CUDA graph, and a chunk past its row's length ends at once and weighs nothing in the merge."""
    paged = isinstance(k, PagedView)
    if paged and lengths is not None:
        raise ValueError("triton_mla.decode: lengths are for contiguous rows (a PagedView carries its own)")
    kv = k.pool if paged else k
    b, n_heads, _, width = q.shape
    r, p = value_dim, width - value_dim
    if kv.shape[-3] != 1 or kv.shape[-1] != width or kv.stride(-1) != 1:
        raise ValueError(
            f"triton_mla.decode: latent rows must be one KV head of width {width} with unit last stride; got "
            f"shape {tuple(kv.shape)}, strides {kv.stride()}"
        )
    if b == 0 or n_heads == 0:  # no program to launch (the grid's split would divide by zero)
        return q.new_zeros(b, n_heads, 1, r)
    q = q if q.stride(-1) == 1 else q.contiguous()
    if paged:
        slots, lens, first = _slot_table(k, window, q.device)
        longest = max([0, *k.lengths]) if window is None else min(window, max([0, *k.lengths]))
        stride_kb, stride_kt, seq_len = 0, kv.stride(1), 0
    else:
        slots = lens = first = kv  # unread: PAGED and RAGGED are off
        longest = seq_len = kv.shape[2]
        stride_kb, stride_kt = kv.stride(0), kv.stride(2)
        if lengths is not None:  # computed on the device: no host sync, nothing a CUDA graph must not hold
            lens = lengths.to(torch.int32)
            first = torch.zeros_like(lens) if window is None else (lens - window).clamp_min(0)
    block_h = min(MAX_BLOCK_H, max(16, triton.next_power_of_2(n_heads)))
    groups = triton.cdiv(n_heads, block_h)
    if chunk is None:
        chunk = _chunk(longest, b * groups, q.device)
    n_chunks = max(1, triton.cdiv(longest, chunk))
    part = torch.empty(b, n_heads, n_chunks, r, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, n_heads, n_chunks, dtype=torch.float32, device=q.device)
    block_r = triton.next_power_of_2(r)
    round_bf16 = INTERPRET and q.dtype == torch.bfloat16
    _chunk_kernel[(groups, n_chunks, b)](
        q, kv, slots, lens, first, part, lse,
        q.stride(0), q.stride(1), stride_kb, stride_kt, slots.stride(0) if paged else 0,
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        n_heads, seq_len, chunk, scale * 1.4426950408889634,  # log2(e): the kernel works in powers of 2
        R=r, P=p, BLOCK_R=block_r, BLOCK_P=max(16, triton.next_power_of_2(p)), BLOCK_H=block_h,
        BLOCK_N=BLOCK_N, PAGED=paged, RAGGED=lengths is not None, WIDEN=INTERPRET and q.dtype != torch.float32, ROUND_BF16=round_bf16,
        PRECISION="ieee" if q.dtype == torch.float32 else None,  # float32: no TF32 rounding
        num_warps=4 if block_h <= 16 else 8, num_stages=2,
    )  # fmt: skip
    y = torch.empty(b, n_heads, 1, r, dtype=q.dtype, device=q.device)
    _merge_kernel[(b, n_heads)](
        part, lse, y, n_chunks,
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), y.stride(0), y.stride(1),
        R=r, BLOCK_R=block_r, ROUND_BF16=round_bf16,
    )  # fmt: skip
    return y


def _chunk(longest: int, programs_per_chunk: int, device: torch.device) -> int:
    """Tokens per program: enough chunks that the grid fills every SM twice, none shorter than ``MIN_CHUNK``,
    a multiple of ``BLOCK_N``. (A guess until timed on a GPU: see docs/performance.md.)"""
    if device.type == "cuda" and torch.compiler.is_compiling():
        # a traced step (a static cache's compiled decode) asks the device nothing, which could break its graph:
        # the count an eager call saw, else an H100's 132
        sms = _SM_COUNT.get(device.index if device.index is not None else 0, 132)
    elif device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _SM_COUNT:
            _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
        sms = _SM_COUNT[index]
    else:
        sms = 4  # the interpreter: a few chunks, so that the merge is exercised
    splits = max(1, min(triton.cdiv(longest, MIN_CHUNK), triton.cdiv(2 * sms, programs_per_chunk)))
    return triton.cdiv(triton.cdiv(max(longest, 1), splits), BLOCK_N) * BLOCK_N


def _slot_table(
    k: PagedView, window: int | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, longest row) int32: the pool slot of each row's tokens, in order (from its runs; past the row's end
    zeros, never read); (B,) int32 each row's length; (B,) int32 its first token read (a ``window``'s start)."""
    runs = [run for row in k.runs for run in row]  # every row's runs, rows in order
    lens = torch.tensor(k.lengths, dtype=torch.int32, device=device)
    total = sum(k.lengths)
    slots = torch.zeros(len(k.lengths), max([1, *k.lengths]), dtype=torch.int32, device=device)
    if runs:
        # The rows' tokens one after another, token g in run j at slot start_j + (g - first token of run j)
        starts, sizes = torch.tensor(runs, device=device).unbind(1)
        g = torch.arange(total, device=device)
        slot = (starts - (torch.cumsum(sizes, 0) - sizes)).repeat_interleave(sizes, output_size=total) + g
        row = torch.arange(len(k.lengths), device=device).repeat_interleave(lens.long(), output_size=total)
        row_first = torch.cumsum(lens, 0) - lens
        slots[row, g - row_first[row]] = slot.to(torch.int32)
    first = torch.zeros_like(lens) if window is None else (lens - window).clamp_min(0)
    return slots, lens, first
