"""The attention math, behind one function and six backends chosen from one table.

Shapes (one convention for the whole package):
    q: (B, n_heads, T_q, D)       k: (B, n_kv_heads, T_k, D)       v: (B, n_kv_heads, T_k, D_v)
    output: (B, n_heads, T_q, D_v)
Query head ``h`` attends with KV head ``h // (n_heads // n_kv_heads)``. ``k`` and ``v`` may instead be the
``PagedView``s a ``PagedKVCache`` returns (each batch row with its own length, in blocks).

``attn_mask`` is boolean, True = attend (the rule of ``F.scaled_dot_product_attention``), broadcastable to
(B, n_heads, T_q, T_k). ``window`` (sliding-window attention: Mistral, Gemma 2/3, Phi-3) lets query ``i`` see only
the ``window`` positions ending at its own, ``T_k - T_q + i - window < j``: a decode step reads just the last
``window`` keys (a view, or for paged rows a start offset), a prefill adds the band to the mask. ``softcap`` (Gemma
2) turns each scaled score ``s`` into ``softcap * tanh(s / softcap)`` before the softmax; SDPA and the fused
kernel have no such step, so they refuse it. ``is_causal`` aligns the causal mask to the bottom right: query ``i``
sits at position ``T_k - T_q + i``, which is what a query block appended to a cache of ``T_k - T_q`` tokens needs (for
paged K/V: per row, with that row's length). (SDPA's own ``is_causal`` aligns to the top left, so it is only used
when ``T_q == T_k``.) When both are given, a key is attended only if both allow it. A query row with no key to attend
yields zeros, not NaN, whatever the masked-out keys and values hold (inf and NaN included); keys that no query
attends never reach an output.

``lengths`` ((B,) integer tensor on q's device; one query per row, contiguous K/V, no mask) says that row ``b``'s keys
are the first ``lengths[b]`` of buffers longer than that (a ``StaticKVCache``'s decode step, whose lengths stay on
the device so that a compiled step never reads them on the host), ``window`` counting back from there. A backend
that reads lengths (``fused``, ``triton_mla``) stops each row there; any other gets them as a mask
(``length_mask``).

Backends (each a ``backends.Backend`` declaring what it takes, registered in ``backends.BACKENDS`` below):
    "reference"  repeat each KV head for its group, explicit softmax in float32; written to be read. Takes anything.
    "sdpa"       ``F.scaled_dot_product_attention(enable_gqa=...)``; no soft-capping.
    "grouped"    no repetition: the queries of one group are stacked and multiplied against their unrepeated
                 KV head in one matmul, (B, n_kv_heads, group * T_q, D) @ (B, n_kv_heads, D, T_k); for one
                 query per head (decode) ``decode.grouped_decode``: split-K over the context, log-sum-exp merge;
                 over paged K/V ``decode.paged_decode``, which reads each run of blocks in place. Takes anything.
    "triton_mla" MLA's absorbed decode over its latent rows (contiguous or paged) as a Triton kernel
                 (``triton_mla``; CUDA, or a CPU under ``TRITON_INTERPRET=1``; one query per head, one KV head whose
                 values are the first columns of its keys; no mask, dropout, gradient, soft-capping or subclass).
    "fused"      the C++ decode operators of ``fused`` (CPU, float32/bfloat16, one query per head; no mask,
                 dropout, gradient, soft-capping or tensor subclass; built): scores, online softmax and weighted sum
                 in one pass over each KV block, paged rows all in one call, a static cache's rows each to its
                 length (``fused.static_decode``); and whole decoder-block steps.
    "flex"       ``flex`` (PyTorch's FlexAttention; CPU and CUDA, 16/32-bit floats, one query per head; no dropout,
                 gradient or tensor subclass): compiled on CUDA, eager elsewhere; paged rows read in place through a block mask
                 of the block table, masks and soft-capping as its mask_mod and score_mod.
    "flashinfer" ``flashinfer_decode``: FlashInfer's batch decode and prefill kernels (CUDA, bfloat16/float16, keys
                 and values of one width; no mask, dropout, gradient or tensor subclass; ``flashinfer-python``
                 installed): contiguous caches as one page per row, paged rows in place through a CSR page table.
                 Not yet run on a GPU: in no order of "auto" until ``benchmarks/gpu_check.py`` has measured it.
    "flashinfer_mla" the same module's ``mla_decode`` / ``paged_mla_decode``: MLA's absorbed decode over its latent
                 rows on FlashInfer's MLA kernels (CUDA, bfloat16/float16; no window, mask, soft-capping, dropout,
                 gradient or subclass); not yet run on a GPU either, and in no order of "auto".
    "auto"       the first backend of ``backends.AUTO`` for the device type and phase that takes the call.
``attend`` asks ``backends.choose`` once per call; a named backend that cannot take a call hands it on as "auto"
would. "reference" and "sdpa" read paged K/V through a gathered copy with a mask of each row's length (none when
every row is a fresh prompt of one length: then the plain causal rule). ``ATTNLAB_BACKENDS=1`` logs each choice.

Host syncs: a data-dependent branch (``bool(tensor)``) is free on a CPU in eager mode, and the kernels use it to
skip work nobody needs; on a GPU it stalls the stream and under ``torch.compile`` it breaks the graph, so there
(``_may_sync`` False) the same results come from branch-free code.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os

import torch
import torch.nn.functional as F

from ..cache import PagedView, autocast_dtype
from . import flashinfer_decode, flex, fused
from .backends import AUTO, Backend, Call, choose, register
from .decode import grouped_decode, paged_decode, score_operands, widened

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _autocast(q: torch.Tensor, k, v):
    """Under ``torch.autocast`` the operands in its dtype, as SDPA takes them there. Norms keep float32 gains under
    autocast, so a q/k norm (Qwen3, OLMo 2, Gemma 3) or MLA's latent norm gave float32 queries or keys beside
    bfloat16 values, and ``uptrain --dtype bf16`` of those families failed ("q, k, v must share a dtype")."""
    dt = autocast_dtype(q.device)
    if dt is None:
        return q, k, v

    def cast(t):
        return t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dt else t

    return cast(q), cast(k), cast(v)


def attend(
    q: torch.Tensor,
    k: torch.Tensor | PagedView,
    v: torch.Tensor | PagedView,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    backend: str = "auto",
    dropout_p: float = 0.0,
    window: int | None = None,
    softcap: float | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention for MHA/GQA/MQA shapes; see the module docstring."""
    q, k, v = _autocast(q, k, v)
    paged = isinstance(k, PagedView)
    if paged:
        _check_paged(q, k, v, attn_mask)
    else:
        _check_inputs(q, k, v, attn_mask, is_causal)
    _check_options(dropout_p, window, softcap)
    if not isinstance(is_causal, bool):
        raise TypeError(f"attend: is_causal must be True or False, got {is_causal!r}")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"attend: scale must be a finite number, got {scale!r}")
    if lengths is not None:
        _check_lengths(q, k, attn_mask, is_causal, lengths)
        call = call_of(q, k, v, None, dropout_p, softcap)._replace(lengths=True)
        chosen = choose(call, backend).backend
        if chosen.lengths:  # type: ignore[union-attr]
            return chosen.run(q, k, v, None, False, scale, dropout_p, window, softcap, lengths=lengths)  # type: ignore[union-attr]
        offset = 0
        if _may_sync(q):
            low, hi = _length_range(lengths, k.shape[2])
            # The slots some row attends, not the whole buffer: what the lengths kernel reads, and so what a FLOP
            # counter counts, with or without gradients (rows of one length).
            lo = 0 if window is None else max(0, low - window)
            if hi > lo:
                offset, k, v = lo, k[:, :, lo:hi], v[:, :, lo:hi]
        attn_mask = length_mask(lengths - offset, k.shape[2], window)
        return chosen.run(q, k, v, attn_mask, False, scale, dropout_p, None, softcap)  # type: ignore[union-attr]
    t_q = q.shape[2]
    if window is not None and not paged and k.shape[2] > window:
        if t_q == 1:  # a decode step: the window is the newest keys
            k, v = k[:, :, -window:], v[:, :, -window:]
            attn_mask = None if attn_mask is None else attn_mask[..., -window:]
        else:
            band = sliding_band(t_q, k.shape[2], window, q.device)
            attn_mask = band if attn_mask is None else attn_mask & band
    chosen = choose(call_of(q, k, v, attn_mask, dropout_p, softcap), backend).backend
    return chosen.run(q, k, v, attn_mask, is_causal, scale, dropout_p, window, softcap)  # type: ignore[union-attr]


def call_of(
    q: torch.Tensor,
    k: torch.Tensor | PagedView,
    v: torch.Tensor | PagedView,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    softcap: float | None = None,
) -> Call:
    """What an ``attend`` call with these operands asks of a backend."""
    paged = isinstance(k, PagedView)
    kt, vt = (k.pool, v.pool) if paged else (k, v)  # type: ignore[union-attr]
    return Call(
        device=q.device.type,
        dtype=q.dtype,
        phase="decode" if q.shape[2] == 1 else "prefill",
        paged=paged,
        mask=attn_mask is not None,
        dropout=dropout_p > 0.0,
        grad=_differentiated(q, kt, vt),
        softcap=softcap is not None,
        subclass=type(q) not in _PLAIN or type(kt) not in _PLAIN or type(vt) not in _PLAIN,
        # MLA's absorbed form: one KV head, the values a view of the keys' first columns, rows of unit stride (the
        # latent kernels read whole rows). The shape tests first: a GQA call pays no more than them.
        latent=kt.shape[-3] == 1
        and vt.shape[-1] <= kt.shape[-1]
        and kt.stride(-1) == 1
        and fused._first_columns(vt, kt),
        wide=vt.shape[-1] > kt.shape[-1],
        counting=_flop_counting(),
    )


def _differentiated(*tensors: torch.Tensor) -> bool:
    """Whether a call needs a backend with derivatives: gradients to record, or a forward-mode tangent to carry
    (``torch.func.jvp``, ``forward_ad``), which the kernels refuse."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return True
    return fused.tangents_on() and any(fused._differentiated(t, False, True) for t in tensors)


def _flop_counting() -> bool:
    """Whether torch's FlopCounterMode is on (a dispatch mode on the stack, read only when there is one)."""
    if torch.compiler.is_compiling() or not torch._C._len_torch_dispatch_stack():
        return False
    from torch.utils import flop_counter
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    # the mode on the stack: FlopCounterMode's inner _FlopCounterMode, or FlopCounterMode itself in older torch
    mode = getattr(flop_counter, "_FlopCounterMode", flop_counter.FlopCounterMode)
    return any(isinstance(m, mode) for m in _get_current_dispatch_mode_stack())


def _dense(kernel):
    """A backend's ``run`` around ``kernel(q, k, v, attn_mask, is_causal, scale, dropout_p, softcap)`` over tensors:
    paged K/V gathered first, and masked-out slots kept from reaching the output."""

    def run(q, k, v, attn_mask, is_causal, scale, dropout_p, window, softcap):
        if isinstance(k, PagedView):
            k, v, attn_mask = _gathered(q, k, v, is_causal, window)
            is_causal = is_causal and attn_mask is None
        if attn_mask is not None and not _may_sync(q):
            # Masked-out slots may hold anything (padding, an unused cache slot: inf, NaN), but 0 * inf is NaN in
            # any matmul: without a host sync to test the output, zero the keys and values no query attends, up
            # front.
            k, v = _zero_unattended(k, v, attn_mask)
        out = kernel(q, k, v, attn_mask, is_causal, scale, dropout_p, softcap)
        if attn_mask is not None and _may_sync(q) and not bool(torch.isfinite(out).all()):
            # The same, only when needed: it costs nothing when the output is finite, which is always the case
            # when the attended values are.
            k, v = _zero_unattended(k, v, attn_mask)
            out = kernel(q, k, v, attn_mask, is_causal, scale, dropout_p, softcap)
        return out

    return run


def _reference_kernel(q, k, v, attn_mask, is_causal, scale, dropout_p, softcap):
    mask = combined_mask(attn_mask, is_causal, q.shape[2], k.shape[2], q.device)
    return _reference(q, k, v, mask, scale, dropout_p, softcap)


def _sdpa_kernel(q, k, v, attn_mask, is_causal, scale, dropout_p, softcap):
    return _sdpa(q, k, v, attn_mask, is_causal, scale, dropout_p)


def _grouped_kernel(q, k, v, attn_mask, is_causal, scale, dropout_p, softcap):
    mask = combined_mask(attn_mask, is_causal, q.shape[2], k.shape[2], q.device)
    if q.shape[2] == 1:  # decode: the cache-as-left-operand split-K kernel
        return grouped_decode(q, k, v, scale=scale, mask=mask, dropout_p=dropout_p, softcap=softcap)
    return _grouped(q, k, v, mask, scale, dropout_p, softcap)


def _grouped_run(q, k, v, attn_mask, is_causal, scale, dropout_p, window, softcap):
    if isinstance(k, PagedView):  # read in place, run by run
        return paged_decode(
            q, k, v, scale=scale, is_causal=is_causal, dropout_p=dropout_p, window=window, softcap=softcap
        )
    return _grouped_dense(q, k, v, attn_mask, is_causal, scale, dropout_p, window, softcap)


_grouped_dense = _dense(_grouped_kernel)


def _flex_kernel(q, k, v, attn_mask, is_causal, scale, dropout_p, softcap):
    # One query per head (the backend computes decode only) sees every key: is_causal changes nothing.
    return flex.decode(q, k, v, scale=scale, attn_mask=attn_mask, softcap=softcap)


_flex_dense = _dense(_flex_kernel)


def _flex_run(q, k, v, attn_mask, is_causal, scale, dropout_p, window, softcap):
    if not isinstance(k, PagedView):
        return _flex_dense(q, k, v, attn_mask, is_causal, scale, dropout_p, window, softcap)
    out = flex.paged_decode(
        q,
        k.pool,
        v.pool,
        k.runs,
        k.lengths,
        scale=scale,
        block_size=k.block_size,
        window=window,
        softcap=softcap,
    )
    if _may_sync(q) and not bool(torch.isfinite(out).all()):
        # The eager path multiplies every slot of the pool by its (zero) probability: a non-finite value in a slot
        # that is not the row's own would reach the output. The gathered copy reads each row's slots alone.
        return _flex_dense(q, k, v, attn_mask, is_causal, scale, dropout_p, window, softcap)
    return out


def _fused_run(q, k, v, attn_mask, is_causal, scale, dropout_p, window, softcap, lengths=None):
    if lengths is not None:  # a static cache's buffers: each row to its length, its window a start offset
        return fused.static_decode(q, k, v, lengths, scale=scale, window=window)
    if isinstance(k, PagedView):  # every row in one call, its window a start offset
        return fused.paged_decode(q, k.pool, v.pool, k.runs, k.lengths, scale=scale, window=window)
    return fused.decode(q, k, v, scale=scale)


def _triton_mla_run(q, k, v, attn_mask, is_causal, scale, dropout_p, window, softcap, lengths=None):
    from . import triton_mla  # imports triton: only when this backend runs

    if lengths is not None and _may_sync(lengths):  # the kernel reads them unchecked (fused checks its own)
        _length_range(lengths, k.shape[2])
    return triton_mla.decode(q, k, v.shape[-1], scale=scale, window=window, lengths=lengths)


def _flashinfer_run(q, k, v, attn_mask, is_causal, scale, dropout_p, window, softcap):
    if isinstance(k, PagedView):
        return flashinfer_decode.paged_decode(
            q, k.pool, v.pool, k.runs, k.lengths, scale=scale, block_size=k.block_size, window=window,
            softcap=softcap, causal=is_causal,
        )  # fmt: skip
    return flashinfer_decode.decode(q, k, v, scale=scale, window=window, softcap=softcap, causal=is_causal)


def _flashinfer_mla_run(q, k, v, attn_mask, is_causal, scale, dropout_p, window, softcap):
    if isinstance(k, PagedView):
        return flashinfer_decode.paged_mla_decode(
            q, k.pool, k.runs, k.lengths, v.shape[-1], scale=scale, block_size=k.block_size, window=window
        )
    return flashinfer_decode.mla_decode(q, k, v.shape[-1], scale=scale, window=window)


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


# What the native decode kernels take: one query per head, nothing beside the plain product (no mask, dropout,
# gradient, soft-capping or tensor subclass)
_PLAIN_DECODE = dict(
    phases=frozenset({"decode"}), mask=False, dropout=False, grad=False, softcap=False, subclass=False
)

register(Backend("reference", _dense(_reference_kernel)))
register(Backend("sdpa", _dense(_sdpa_kernel), softcap=False))
register(Backend("grouped", _grouped_run))
register(
    Backend(
        "fused",
        _fused_run,
        devices=frozenset({"cpu"}),
        dtypes=frozenset({torch.float32, torch.bfloat16}),
        **_PLAIN_DECODE,
        wide=False,  # the kernels read values of at most the keys' width (csrc/ops.cpp, check_cache)
        lengths=True,  # a static cache's rows: each read to its length (fused.static_decode)
        block_rows=fused.LINEAR_MAX_ROWS,
        available=fused.available,
    )
)
register(
    Backend(
        "flex",
        _flex_run,
        devices=frozenset({"cpu", "cuda"}),  # compiled on CUDA, eager elsewhere (see attention/flex.py)
        dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
        phases=frozenset({"decode"}),
        dropout=False,
        grad=False,  # FlexAttention has no backward on a CPU (torch 2.13), and none was tested on CUDA
        subclass=False,
        counting=False,  # eager FlexAttention under FlopCounterMode raises a TypeError in torch (2.13, CPU)
        available=flex.available,
    )
)
register(
    Backend(
        "triton_mla",
        _triton_mla_run,
        # On a CPU only under Triton's interpreter (TRITON_INTERPRET=1), which the tests use: named, never by "auto".
        devices=frozenset(
            {"cuda", "cpu"} if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else {"cuda"}
        ),
        dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
        **_PLAIN_DECODE,
        latent_only=True,
        lengths=True,  # a static cache's rows: each program stops at its row's length, read on the device
        available=functools.cache(_triton_importable),
    )
)

register(
    Backend(
        "flashinfer",
        _flashinfer_run,
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16, torch.float16}),
        mask=False,
        dropout=False,
        grad=False,
        subclass=False,
        latent=False,  # its kernels take keys and values of one width
        wide=False,
        available=flashinfer_decode.available,
    )
)
register(
    Backend(
        "flashinfer_mla",
        _flashinfer_mla_run,
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16, torch.float16}),
        **_PLAIN_DECODE,
        latent_only=True,
        available=flashinfer_decode.available,
    )
)

# "auto", by device type and phase. CPU, measured on this project's machines (docs/performance.md): for one query
# per head the fused C++ kernel (one pass over the cache, online softmax) beats the grouped kernel and SDPA in
# float32 and, far more, in bfloat16 (whose library matmuls are slow here), and reads paged rows in place, all rows in
# one call; where it cannot run, the grouped kernel. For prefill SDPA's fused flash kernel wins, paged rows gathered
# (over the grouped kernel's blocks of queries, by far in bfloat16). Any other device: SDPA, whose fused kernels read
# each KV head once without repeating it and never sync with the host, while the grouped kernels loop in Python over
# (batch, KV head) pairs for 16-bit dtypes; paged K/V are then gathered into one contiguous copy. CUDA decode: first
# FlexAttention, compiled, NOT MEASURED YET (no GPU was lent when it was added; benchmarks/gpu_check.py times it beside
# SDPA): it reads paged rows in place through a block mask of the block table, where SDPA copies every row first, and
# stacks each KV head's query group in one tile; then SDPA (dropout, tensor subclasses), then grouped. The dtype does
# not change the order on either device today; the backends' dtypes decide where one cannot run. Soft-capping:
# FlexAttention's score_mod for a CUDA decode, else the grouped kernel.
AUTO[("cpu", "decode")] = ("fused", "grouped")
AUTO[("cpu", "prefill")] = ("sdpa", "grouped")
AUTO[("*", "decode")] = AUTO[("*", "prefill")] = ("sdpa", "grouped")
# CUDA decode over MLA's latent rows: our Triton kernel first (attention/triton_mla.py: split-K, each row read once
# per group of heads, paged rows in place), which takes latent calls only; SDPA would read the latent twice (as keys
# and as values) and gather paged rows first. Not yet timed on a GPU either (benchmarks/gpu_check.py has the rows);
# chosen by design.
AUTO[("cuda", "decode")] = ("triton_mla", "flex", "sdpa", "grouped")


def sliding_band(t_q: int, t_k: int, window: int, device: torch.device) -> torch.Tensor:
    """(T_q, T_k) bool: query ``i`` (at key position ``T_k - T_q + i``) may see key ``j`` no more than ``window - 1``
    positions before it (the causal rule, for keys after it, is ``is_causal``'s)."""
    newest = torch.arange(t_k - t_q, t_k, device=device)[:, None]
    return torch.arange(t_k, device=device)[None, :] > newest - window


def _may_sync(t: torch.Tensor) -> bool:
    """Whether a data-dependent branch is cheap here: eager mode on a CPU (see the module docstring)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def _gathered(
    q: torch.Tensor, k: PagedView, v: PagedView, is_causal: bool, window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Paged K/V as contiguous (B, n_kv_heads, longest row, D) copies, and the mask (B, 1, T_q, longest row) of
    the keys each query may see: those of its row, with ``is_causal`` none after its own position, with a
    ``window`` none ``window`` or more before it. The mask is None when every row holds the longest row's tokens and
    needs no more than the plain causal rule (every row a fresh prompt of one length, shorter than the window):
    flash kernels skip the blocks above the diagonal only without a mask."""
    kc, vc = k.gather(), v.gather()
    t_q, s = q.shape[2], kc.shape[2]
    if all(n == s for n in k.lengths) and (not is_causal or t_q == s) and (window is None or s <= window):
        return kc, vc, None
    lengths = torch.tensor(k.lengths, device=q.device)  # a host-to-device copy, not a sync
    # (B, T_q): the position of each query; the new tokens are the last T_q of their row.
    at = lengths[:, None] - t_q + torch.arange(t_q, device=q.device)
    keys = torch.arange(s, device=q.device)
    mask = keys <= (at if is_causal else lengths[:, None] - 1)[..., None]  # (B, T_q, S)
    if window is not None:
        mask &= keys > (at - window)[..., None]
    return kc, vc, mask[:, None]


def _zero_unattended(
    k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``k``, ``v`` with zeros at the keys that no query of any head reading them attends to."""
    b, n_kv, t_k = k.shape[0], k.shape[1], k.shape[2]
    m = attn_mask.reshape(
        (1,) * (4 - attn_mask.ndim) + tuple(attn_mask.shape)
    )  # (b | 1, H | 1, T_q | 1, T_k)
    used = m.any(dim=2)  # (b | 1, H | 1, T_k)
    if used.shape[1] != 1:  # query heads -> the KV head they read (consecutive heads share one)
        used = used.unflatten(1, (n_kv, used.shape[1] // n_kv)).any(dim=2)
    used = used.expand(b, n_kv, t_k)[..., None]
    return k.masked_fill(~used, 0.0), v.masked_fill(~used, 0.0)


def combined_mask(
    attn_mask: torch.Tensor | None, is_causal: bool, t_q: int, t_k: int, device: torch.device
) -> torch.Tensor | None:
    """One boolean mask (True = attend) from a user mask and the bottom-right causal rule; None if all True."""
    if not is_causal or t_q == 1:  # a single query at the end of the sequence may see every key
        return attn_mask
    causal = torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(diagonal=t_k - t_q)
    return causal if attn_mask is None else attn_mask & causal


def _check_tensor(name: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != 4:
        raise ValueError(f"{name} must have 4 dims (B, heads, T, D), got shape {tuple(t.shape)}")


def _check_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool
) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    _check_heads(q, k.shape, v.shape, k.dtype, v.dtype)
    _check_devices(q, k, v)
    t_q, t_k = q.shape[2], k.shape[2]
    if v.shape[2] != t_k:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} disagree on heads or length")
    if is_causal and t_q > t_k:
        raise ValueError(f"is_causal needs T_q <= T_k, got T_q={t_q}, T_k={t_k}")
    check_mask("attend", attn_mask, (q.shape[0], q.shape[1], t_q, t_k))


def _check_lengths(
    q: torch.Tensor, k: object, attn_mask: torch.Tensor | None, is_causal: bool, lengths: torch.Tensor
) -> None:
    if isinstance(k, PagedView) or attn_mask is not None or is_causal or q.shape[2] != 1:
        raise ValueError(
            "attend: lengths are for one query per row over contiguous buffers, without attn_mask or is_causal; got "
            f"{'paged K/V' if isinstance(k, PagedView) else f'{q.shape[2]} queries per row'}"
            f"{', attn_mask' if attn_mask is not None else ''}{', is_causal' if is_causal else ''}"
        )
    if (
        not isinstance(lengths, torch.Tensor)
        or lengths.dtype.is_floating_point
        or lengths.dtype == torch.bool
    ):
        raise TypeError(
            f"attend: lengths must be an integer tensor, got {getattr(lengths, 'dtype', type(lengths))}"
        )
    if tuple(lengths.shape) != (q.shape[0],) or lengths.device != q.device:
        raise ValueError(
            f"attend: lengths must be ({q.shape[0]},) on {q.device} (one per batch row), got "
            f"{tuple(lengths.shape)} on {lengths.device}"
        )


def _length_range(lengths: torch.Tensor, slots: int) -> tuple[int, int]:
    """The shortest and longest of ``lengths`` (0, 0 for none), after refusing what the lengths kernel refuses, on
    the masked path too (a length past the buffer attended every slot, a negative one none); called where reading
    the lengths costs no host sync."""
    if not lengths.numel():
        return 0, 0
    low, high = (int(x) for x in lengths.aminmax())
    if low < 0 or high > slots:
        row = int(((lengths < 0) | (lengths > slots)).nonzero()[0, 0])
        raise ValueError(
            f"attend: lengths[{row}] is {int(lengths[row])}, outside 0 .. {slots} (the buffer's slots)"
        )
    return low, high


def length_mask(lengths: torch.Tensor, t_k: int, window: int | None = None) -> torch.Tensor:
    """(B, 1, 1, t_k) bool: row b's first ``lengths[b]`` keys (with a ``window``, the last ``window`` of them)."""
    slots = torch.arange(t_k, device=lengths.device)
    end = lengths[:, None, None, None]
    seen = slots < end
    return seen if window is None else seen & (slots >= end - window)


def _check_options(dropout_p: float, window: int | None, softcap: float | None) -> None:
    """``AttentionConfig``'s rules for the same fields: a window of 0 once attended to nothing in a prefill and to
    everything in a decode step, a soft-cap of 0 gave uniform weights."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"attend: dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"attend: window must be None or an int >= 1, got {window!r}")
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < math.inf
    ):
        raise ValueError(f"attend: softcap must be None or a finite number > 0, got {softcap!r}")


def _check_heads(q: torch.Tensor, k_shape, v_shape, k_dtype: torch.dtype, v_dtype: torch.dtype) -> None:
    if not (q.dtype == k_dtype == v_dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k_dtype}, {v_dtype}")
    if not q.dtype.is_floating_point:
        raise TypeError(f"q, k, v must be floating point, got {q.dtype}")
    b, n_heads, _, d = q.shape
    if min(n_heads, k_shape[1], d, v_shape[3]) < 1:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k_shape)} and v {tuple(v_shape)} need at least one head and one dim each"
        )
    if k_shape[0] != b or v_shape[0] != b:
        raise ValueError(f"batch sizes differ: q {b}, k {k_shape[0]}, v {v_shape[0]}")
    if v_shape[1] != k_shape[1]:
        raise ValueError(f"k {tuple(k_shape)} and v {tuple(v_shape)} disagree on heads or length")
    if n_heads % k_shape[1]:
        raise ValueError(f"query heads ({n_heads}) must be a multiple of KV heads ({k_shape[1]})")
    if k_shape[3] != d:
        raise ValueError(f"q and k head dims differ: {d} vs {k_shape[3]}")


def _check_paged(q: torch.Tensor, k: PagedView, v: object, attn_mask: torch.Tensor | None) -> None:
    _check_tensor("q", q)
    if not isinstance(v, PagedView):
        raise TypeError(f"paged keys need paged values (a PagedView), got {type(v).__name__}")
    if attn_mask is not None:
        raise ValueError(
            "attend: attn_mask is not supported with a PagedKVCache (each row has its own length)"
        )
    _check_heads(q, k.shape, v.shape, k.dtype, v.dtype)
    _check_devices(q, k.pool, v.pool)


def _check_devices(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def check_mask(owner: str, attn_mask: torch.Tensor | None, target: tuple[int, int, int, int]) -> None:
    """``attn_mask`` must be None or a bool tensor that broadcasts to ``target`` = (B, n_heads, T_q, T_k).

    The modules call this before writing their cache, so that a bad mask leaves the cache as it was.
    """
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype != torch.bool:
        got = attn_mask.dtype if isinstance(attn_mask, torch.Tensor) else type(attn_mask).__name__
        raise TypeError(f"{owner}: attn_mask must be a bool tensor (True = attend), got {got}")
    shape = tuple(attn_mask.shape)
    if len(shape) > 4 or any(s not in (1, t) for s, t in zip(shape[::-1], target[::-1], strict=False)):
        raise ValueError(
            f"{owner}: attn_mask of shape {shape} does not broadcast to (B, n_heads, T_q, T_k)={target}"
        )


def _zero_dead_rows(out: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Rows whose mask attends to nothing get zeros (softmax over an empty set is undefined), whatever the
    masked-out keys and values hold."""
    if mask is None:
        return out
    alive = mask.any(dim=-1, keepdim=True)  # (..., T_q, 1)
    if _may_sync(out) and bool(alive.all()):
        return out
    return out.masked_fill(~alive, 0.0)


def _reference(q, k, v, mask, scale, dropout_p, softcap=None):
    n_rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(n_rep, dim=1)  # head h reads KV head h // n_rep
    v = v.repeat_interleave(n_rep, dim=1)
    scores = (widened(q) @ widened(k).transpose(-2, -1)) * scale  # (B, n_heads, T_q, T_k)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if mask is not None:
        probs = probs.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)  # NaN rows -> 0
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return _zero_dead_rows((probs @ widened(v)).to(q.dtype), mask)  # 0 * inf in a masked slot is NaN


def _grouped(q, k, v, mask, scale, dropout_p, softcap=None):
    b, n_heads, t_q, d = q.shape
    n_kv_heads, t_k = k.shape[1], k.shape[2]
    group = n_heads // n_kv_heads
    qg = q.reshape(b, n_kv_heads, group * t_q, d)  # a view when q is contiguous (always true for T_q == 1)
    qs, ks = score_operands(qg, k)
    scores = widened(torch.matmul(qs, ks.transpose(-2, -1))) * scale  # (B, n_kv_heads, group * T_q, T_k)
    if softcap is not None:  # before the mask: tanh would turn a masked -inf into -softcap
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        # Split the mask's head axis (1 or n_heads) the way the queries were split.
        m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
        m = m.unsqueeze(1) if m.shape[1] == 1 else m.unflatten(1, (n_kv_heads, group))
        scores = scores.view(b, n_kv_heads, group, t_q, t_k).masked_fill(~m, float("-inf"))
        scores = scores.view(b, n_kv_heads, group * t_q, t_k)
    probs = torch.softmax(scores, dim=-1)
    if mask is not None and not (_may_sync(probs) and bool(mask.any(dim=-1).all())):
        # Rows that attend to nothing are NaN after the softmax: as zeros they give zero outputs, and no NaN
        # reaches v's gradient (which masking the output afterwards would not prevent).
        probs = probs.nan_to_num(0.0)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    out = torch.matmul(probs.to(v.dtype), v).view(b, n_heads, t_q, v.shape[-1])
    return _zero_dead_rows(out, mask)  # 0 * inf in a masked slot is NaN


def _sdpa(q, k, v, attn_mask, is_causal, scale, dropout_p):
    # A CUDA decode step (one query) without cuDNN's attention, which SDPA prefers on Hopper but which builds a plan
    # per new key length, on the host: 1.2 ms of CPU time per call on an H100 (torch 2.11, torch.profiler), over half
    # the host time of a 30-layer model's decode steps; flash and memory-efficient attention launch at once. The
    # switch is the global flag, flipped and restored around the call (two C calls; `sdpa_kernel`'s context manager
    # cost ~40 us a call there).
    if q.is_cuda and q.shape[2] == 1 and torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        try:
            return _sdpa_any(q, k, v, attn_mask, is_causal, scale, dropout_p)
        finally:
            torch.backends.cuda.enable_cudnn_sdp(True)
    return _sdpa_any(q, k, v, attn_mask, is_causal, scale, dropout_p)


def _sdpa_any(q, k, v, attn_mask, is_causal, scale, dropout_p):
    t_q, t_k = q.shape[2], k.shape[2]
    enable_gqa = q.shape[1] != k.shape[1]
    if is_causal and attn_mask is None and t_q == t_k:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p, enable_gqa=enable_gqa
        )
    mask = combined_mask(attn_mask, is_causal, t_q, t_k, q.device)
    if mask is not None and mask.ndim < 2:  # SDPA rejects a 1-D key mask (T_k,) that broadcasts fine
        mask = mask.expand(t_q, t_k)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout_p, enable_gqa=enable_gqa
    )
    return _zero_dead_rows(out, mask)
