"""Decode-time attention: few queries against a long cache, read once, never repeated per query head.

Shapes: q (B, n_heads, T_q, D); k (B, n_kv_heads, S, D); v (B, n_kv_heads, S, D_v); out (B, n_heads, T_q, D_v).
Query head ``h`` reads KV head ``h // group``, group = n_heads // n_kv_heads.

The ``group * T_q`` queries that share a KV head become one matrix, so each KV head is one matmul that reads
its keys once. float32: one batched matmul with the cache as the *left* operand, ``K (S, D) @ Q^T (D, rows)``;
on this CPU (MKL, torch 2.13) ``Q @ K^T`` with a long ``K^T`` was measured up to 10x slower. bfloat16: the
batched matmul copies operands whose batch stride is not ``S * D`` (and a live view has stride
``max_seq_len * D``), so each (batch, KV head) pair gets its own 2-D matmul on its slice, which is not copied.
The live prefix of a preallocated cache (``KVCache.update`` returns ``k[:, :, :len]``) is a strided view whose
(B, n_kv_heads) axes still merge into one batch axis, so ``reshape`` below never copies it (tested).

The context may be cut into chunks ("split-K", as flash-decoding, Dao et al. 2023): each chunk yields its
unnormalised output ``o_c``, its row maximum ``m_c`` and its exp-sum ``l_c``; the chunks are merged exactly with
``out = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c``, ``M = max_c m_c``. A chunk is also how the paged cache
is read: one chunk per run of physically consecutive blocks, so no block is ever gathered into a copy. On this
2-core CPU the library matmul already spreads one chunk over both cores and every extra chunk costs ~10 more
ops, so by default a context is one chunk up to ``CHUNK_TOKENS`` (4 chunks at 4096 tokens measured 15-60%
slower), and an unmasked single chunk takes a 3-op path (matmul, fused softmax, matmul).
Dropout (training) drops attention weights after the softmax, as ``F.dropout`` on the probabilities would: in a
chunk it multiplies the weights of ``o_c`` and leaves ``l_c`` alone, so ``o / l`` is the dropped, rescaled sum.
Scores, softmax and the merge are float32; for bfloat16 storage the two matmuls read bfloat16 and accumulate in
float32 inside the library (their outputs are rounded to bfloat16 once). A query row with no key to attend gets
zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache import PagedView

# Context tokens per chunk that ``default_split`` aims at. The library matmuls already use every core within a
# chunk, so on a CPU chunks only bound the float32 score buffer (and give paged runs their shape); a GPU
# port would instead size them to fill the streaming multiprocessors when B * n_kv_heads is small.
CHUNK_TOKENS = 8192
# Queries per block when a paged row is prefilled (T_q > 1): the score buffer is n_heads * QUERY_BLOCK * chunk.
QUERY_BLOCK = 128


def default_split(s: int) -> int:
    """How many chunks ``grouped_decode`` cuts a context of ``s`` tokens into by default."""
    return max(1, -(-s // CHUNK_TOKENS))


def grouped_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    mask: torch.Tensor | None = None,
    n_split: int | None = None,
    out: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention for (B, n_heads, T_q, D) queries over an unrepeated cache; see the module docstring.

    ``mask`` is boolean (True = attend), broadcastable to (B, n_heads, T_q, S). ``n_split`` cuts the context into
    that many chunks merged by log-sum-exp; None picks ``default_split``.
    ``out`` (B, n_heads, T_q, D_v), if given, receives the result. ``dropout_p``: attention dropout (training).
    """
    b, n_heads, t_q, d = q.shape
    n_kv, s = k.shape[1], k.shape[2]
    group = n_heads // n_kv
    rows = group * t_q
    q_t = q.reshape(b * n_kv, rows, d).transpose(1, 2)  # (B*n_kv, D, rows); q is tiny, a copy is harmless
    k3 = k.reshape(b * n_kv, s, d)  # a view for contiguous caches and for their live prefix
    v3 = v.reshape(b * n_kv, s, v.shape[-1])
    m3 = _grouped_mask(mask, b, n_kv, group, t_q, s)  # (B*n_kv, rows, S) or None
    if n_split is None:
        n_split = default_split(s)
    bounds = chunk_bounds(s, n_split)
    if m3 is None and len(bounds) == 1:
        result = whole_attention(q_t, k3, v3, scale, dropout_p, softcap)
        result = result.to(q.dtype).view(b, n_heads, t_q, v.shape[-1])
    else:
        state = None
        for lo, hi in bounds:
            mc = None if m3 is None else m3[..., lo:hi]
            part = partial_attention(q_t, k3[:, lo:hi], v3[:, lo:hi], scale, mc, dropout_p, softcap)
            state = part if state is None else merge(state, part)
        if state is None:  # no keys at all: every row attends to nothing
            result = q.new_zeros(b, n_heads, t_q, v.shape[-1])
        else:
            result = finish(state, q.dtype).view(b, n_heads, t_q, v.shape[-1])  # from (B*n_kv, rows, D_v)
    if out is None:
        return result
    out.copy_(result)
    return out


def chunk_bounds(s: int, n_split: int) -> list[tuple[int, int]]:
    """``n_split`` near-equal, non-empty [lo, hi) chunks of ``range(s)`` (fewer when s < n_split)."""
    n = max(1, min(n_split, s))
    step = max(1, -(-s // n))
    return [(lo, min(lo + step, s)) for lo in range(0, s, step)]


def _scores(q_t: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None = None) -> torch.Tensor:
    """Scaled scores (N, R, S_c) float32 of q_t (N, D, R) against k (N, S_c, D), K read once; soft-capped to
    ``softcap * tanh(scores / softcap)`` when ``softcap`` is given (Gemma 2)."""
    scores = _scaled_scores(q_t, k, scale)
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def score_operands(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The operands of the q·k products: float16 ones widened to float32, as SDPA's CPU kernel computes them. In
    float16 a product can pass its largest value, 65504, where the scaled score is small (64 dims of 40: 102400,
    scaled 12800), and large scores keep a few bits (an error of 0.05 against SDPA's 6e-4); scaling the queries
    first overflows them instead when the scale is above 1. bfloat16 has float32's range and is kept."""
    return (q.float(), k.float()) if k.dtype == torch.float16 else (q, k)


def _scaled_scores(q_t: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    q_t, k = score_operands(q_t, k)
    if k.dtype == torch.float32:
        # (N, S_c, R) with the cache as the left operand, scaled inside the matmul; viewed as (N, R, S_c).
        return torch.baddbmm(k.new_empty(()), k, q_t, beta=0.0, alpha=scale).transpose(1, 2)
    # bfloat16/float16 batched matmuls copy operands whose batch stride is not S_c * D (the live view of a
    # cache, a chunk of it); a 2-D matmul per (batch, KV head) reads each slice where it lies.
    if _needs_grad(q_t, k):  # out= is not differentiable
        return widened(torch.stack([q_t[i].T @ k[i].T for i in range(k.shape[0])])) * scale
    scores = torch.empty(k.shape[0], q_t.shape[2], k.shape[1], dtype=k.dtype, device=k.device)
    for i in range(k.shape[0]):
        torch.mm(q_t[i].T, k[i].T, out=scores[i])
    return widened(scores).mul_(scale)


def _weighted_values(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p (N, R, S_c) float32 @ v (N, S_c, D_v) -> (N, R, D_v) float32, V read once in its own dtype."""
    if v.dtype == torch.float32:
        return torch.bmm(p, v)
    probs = p.to(v.dtype)
    if _needs_grad(probs, v):
        return widened(torch.stack([probs[i] @ v[i] for i in range(v.shape[0])]))
    o = torch.empty(v.shape[0], p.shape[1], v.shape[-1], dtype=v.dtype, device=v.device)
    for i in range(v.shape[0]):
        torch.mm(probs[i], v[i], out=o[i])
    return widened(o)


def widened(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or as it is when wider: the scores and sums of a float64 call keep float64's precision."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def whole_attention(
    q_t: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    dropout_p: float = 0.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Unmasked attention in one chunk, q_t (N, D, R) -> (N, R, D_v) float32: three ops for float32.

    The common decode case; with a single chunk there is nothing to merge, so the fused softmax replaces the
    (o, m, l) bookkeeping (on a CPU each extra op is a parallel region of its own).
    """
    probs = torch.softmax(_scores(q_t, k, scale, softcap), dim=-1)
    return _weighted_values(F.dropout(probs, p=dropout_p) if dropout_p > 0.0 else probs, v)


def partial_attention(
    q_t: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    dropout_p: float = 0.0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk: q_t (N, D, R), k (N, S_c, D), v (N, S_c, D_v), mask (N or 1, R, S_c) -> (o, m, l).

    ``o`` (N, R, D_v) float32 is the unnormalised output, ``m`` (N, R, 1) the row maximum of the scaled scores
    (-inf for a row that attends to nothing here), ``l`` (N, R, 1) the sum of ``exp(score - m)``; dropout, if
    any, applies to the weights of ``o`` only (see the module docstring).
    """
    scores = _scores(q_t, k, scale, softcap)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    # (N, R, 1); a stabiliser only: o / l does not depend on it, so no gradient flows through it
    m = scores.detach().amax(dim=-1, keepdim=True)
    if mask is not None:
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # dead rows: exp(-inf - 0) = 0, no NaN
    scores = torch.exp(scores - m) if scores.requires_grad else scores.sub_(m).exp_()
    l = scores.sum(dim=-1, keepdim=True)  # noqa: E741 - the usual name in the flash-attention papers
    o = _weighted_values(F.dropout(scores, p=dropout_p) if dropout_p > 0.0 else scores, v)
    if mask is not None:
        m = torch.where(l > 0, m, torch.full_like(m, float("-inf")))
    return o, m, l


def merge(
    a: tuple[torch.Tensor, torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Combine two chunks' (o, m, l) into the (o, m, l) of their union (log-sum-exp rescaling)."""
    (o_a, m_a, l_a), (o_b, m_b, l_b) = a, b
    m = torch.maximum(m_a, m_b)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_a, w_b = torch.exp(m_a - m_safe), torch.exp(m_b - m_safe)  # exp(-inf) = 0 for an empty side
    return o_a * w_a + o_b * w_b, m, l_a * w_a + l_b * w_b


def finish(state: tuple[torch.Tensor, torch.Tensor, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Normalise a merged (o, m, l); rows that attended to nothing (l == 0) become zeros."""
    o, _, l = state  # noqa: E741
    return (o / l.clamp_min(torch.finfo(torch.float32).tiny)).masked_fill_(l == 0, 0.0).to(dtype)


def _grouped_mask(mask: torch.Tensor | None, b: int, n_kv: int, group: int, t_q: int, s: int):
    """A mask broadcastable to (B, n_heads, T_q, S) as (B * n_kv, group * T_q, S), the stacked query rows."""
    if mask is None:
        return None
    m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape)).expand(b, n_kv * group, t_q, s)
    return m.reshape(b * n_kv, group * t_q, s)  # copies only a broadcast mask (bool, B * n_heads * S bytes)


def paged_decode(
    q: torch.Tensor,
    k,
    v: PagedView | None = None,
    *,
    scale: float,
    is_causal: bool = True,
    n_split: int | None = None,
    dropout_p: float = 0.0,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of (B, n_heads, T_q, D) queries over paged keys and values ``k``, ``v`` (``PagedView``s; or ``k``
    a ``PagedKVCache`` and ``v`` None: its active rows).

    The new tokens are the last ``T_q`` of each row (already written); with ``is_causal`` query ``i`` of a row
    of length ``L`` sees keys ``0 .. L - T_q + i``, and with a ``window`` none more than ``window - 1`` before it. Each run of consecutive blocks is one view of the pool,
    attended as a chunk and merged by log-sum-exp; rows of different lengths never see each other's padding.
    """
    if not isinstance(k, PagedView):
        k, v = k.views()
    b, n_heads, t_q, d = q.shape
    n_kv = k.pool.shape[0]
    group = n_heads // n_kv
    out = q.new_empty(b, n_heads, t_q, v.pool.shape[-1])
    for i, (runs, length) in enumerate(zip(k.runs, k.lengths, strict=True)):
        for q_lo in range(0, t_q, QUERY_BLOCK):  # a long prefill in blocks of queries: bounded score buffers
            q_hi = min(t_q, q_lo + QUERY_BLOCK)
            n_q = q_hi - q_lo
            q_t = q[i, :, q_lo:q_hi].reshape(n_kv, group * n_q, d).transpose(1, 2)  # (n_kv, D, group * n_q)
            # The newest key each stacked query row may see (rows are head-major: query index = row % n_q).
            last_pos = (length - t_q + q_lo + torch.arange(group * n_q, device=q.device) % n_q)[:, None]
            oldest = (
                0 if window is None else length - t_q + q_lo - window + 1
            )  # the block's first query's oldest key
            if (
                t_q == 1
                and len(runs) == 1
                and (n_split or 1) == 1
                and runs[0][1] <= CHUNK_TOKENS
                and oldest <= 0
            ):
                span = slice(runs[0][0], runs[0][0] + runs[0][1])
                y = whole_attention(q_t, k.pool[:, span], v.pool[:, span], scale, dropout_p, softcap)
                out[i] = y.to(q.dtype).view(n_heads, 1, -1)
                continue
            state, seen = None, 0
            for start, n_tokens in runs:
                if is_causal and seen > length - t_q + q_hi - 1:
                    break  # every later key is in the future of every query of this block
                if seen + n_tokens <= oldest:  # every key of the run is out of every query's window
                    seen += n_tokens
                    continue
                # keys of the run before every query's window: not scored (a decode step reads the last `window`
                # keys, as the contiguous cache and the cost model do; they were scored and masked)
                skip = max(0, oldest - seen)
                split = default_split(n_tokens - skip) if n_split is None else n_split
                for lo, hi in ((skip + lo, skip + hi) for lo, hi in chunk_bounds(n_tokens - skip, split)):
                    mask = None
                    keys = torch.arange(seen + lo, seen + hi, device=q.device)
                    if is_causal and t_q > 1:
                        mask = (keys[None, :] <= last_pos)[None]  # (1, group * n_q, S_c)
                    if window is not None:
                        seen_by = (keys[None, :] > last_pos - window)[None]  # within each query's window
                        mask = seen_by if mask is None else mask & seen_by
                    span = slice(start + lo, start + hi)
                    part = partial_attention(
                        q_t, k.pool[:, span], v.pool[:, span], scale, mask, dropout_p, softcap
                    )
                    state = part if state is None else merge(state, part)
                seen += n_tokens
            if state is None:  # an empty row attends to nothing
                out[i, :, q_lo:q_hi] = 0
            else:
                out[i, :, q_lo:q_hi] = finish(state, q.dtype).view(n_heads, n_q, -1)
    return out
