"""KV caches: preallocated buffers that an attention module fills in place, behind one small protocol.

Every cache (``KVCache``, ``LatentCache``, ``PagedKVCache``, ``StaticKVCache``; MLA pages its latent rows in a
``PagedKVCache`` and keeps them static in a ``StaticKVCache``, both with ``values_in_keys``) implements ``Cache``:
an attention module asks it for the positions of its new tokens (``positions``), writes their keys and values once per call (``append``) and hands what ``append`` returns to
``attnlab.attention.attend``. A contiguous cache returns live views (B, n_kv_heads, len, D) of its buffers, so a
step costs time proportional to the live length, not to ``max_seq_len``; a paged cache returns ``PagedView``s
(its pool and each row's runs of blocks), which ``attend`` reads in place. The module has one forward path.

All sequences of a batch share one length in ``KVCache`` and ``LatentCache``, and every call must pass the batch
the cache was made for; ``PagedKVCache`` is the cache for ragged batches. A call with no new tokens (T = 0)
changes nothing. A failed write leaves a cache exactly as it was.

``StaticKVCache`` is the cache of a decode step captured once and replayed (a CUDA graph, ``torch.compile`` with
static shapes): its length is a tensor on the cache's device, advanced in place by ``append``, and ``append`` always
returns the whole buffers. No shape and no Python value changes from one step to the next. A decode step hands
attention the rows' lengths (the fused C++ and Triton MLA kernels read each row only to its length; other backends
take them as a mask over every slot); several new tokens are masked by ``visible``.
"""

from __future__ import annotations

import contextlib
import copy
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from .config import check_int


@dataclass(frozen=True)
class PagedView:
    """Keys (or values) of a ``PagedKVCache``'s active rows, as attention reads them, without a copy.

    ``pool`` (n_kv_heads, n_blocks * block_size, D) is a view of the cache's pool. Batch row ``i`` holds
    ``lengths[i]`` tokens: the slices ``pool[:, start : start + n]`` of its ``runs[i]``, in order. ``block_size``:
    the cache's block size (every run but a row's last starts and ends on a multiple of it), so that a reader can
    tile the pool in the cache's own blocks (the FlexAttention backend's block mask); 0 when not known.
    """

    pool: torch.Tensor
    runs: tuple[tuple[tuple[int, int], ...], ...]
    lengths: tuple[int, ...]
    block_size: int = 0

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, n_kv_heads, longest row, D): the shape of the contiguous tensor this view stands for."""
        return (len(self.lengths), self.pool.shape[0], max([0, *self.lengths]), self.pool.shape[-1])

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.dtype

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def gather(self) -> torch.Tensor:
        """A contiguous copy (B, n_kv_heads, longest row, D); slots past a row's length hold zeros."""
        b, n_kv, s, d = self.shape
        out = self.pool.new_zeros(b, n_kv, s, d)
        for i, row in enumerate(self.runs):
            at = 0
            for start, n in row:
                out[i, :, at : at + n] = self.pool[:, start : start + n]
                at += n
        return out


KV = torch.Tensor | PagedView


@runtime_checkable
class Cache(Protocol):
    """What an attention module asks of a cache.

    ``positions(t, device)``: the positions of ``t`` new tokens, (t,) when every row continues from the same
    length, (B, t) when each row continues from its own. ``append(k, v)``: write the new keys and values
    (B, n_kv_heads, T, D) of the batch's rows (``v`` None for a cache whose values are part of its keys) and
    return the keys and values attention reads: tensors over every held token, or ``PagedView``s. ``paged``:
    whether those are ``PagedView``s (``attend`` then takes no ``attn_mask``). ``static``: whether ``append``
    returns whole buffers of fixed size, whose ``visible(t, window)`` mask the modules attend with instead of the
    causal rule (``StaticKVCache``; a cache without the attribute counts as not static).
    """

    paged: bool
    static: bool  # StaticKVCache: ``append`` returns whole buffers, masked by ``visible``

    def __len__(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def reset(self) -> None: ...

    def positions(self, t: int, device: torch.device | str | None = None) -> torch.Tensor: ...

    def append(self, k: torch.Tensor, v: torch.Tensor | None) -> tuple[KV, KV]: ...


class _Cache:
    """Position bookkeeping shared by the contiguous caches: how many tokens are held and whether more fit."""

    paged = False
    static = False
    batch_size: int
    max_seq_len: int
    dtype: torch.dtype
    pos: int

    def __len__(self) -> int:
        return self.pos

    def reset(self) -> None:
        """Forget the held tokens (the buffers are reused, not cleared)."""
        self.pos = 0

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` tokens (drop a rejected draft, or a timed step of a benchmark)."""
        check_int(f"{type(self).__name__}.crop length", length, minimum=0)
        if length > self.pos:
            raise ValueError(f"{type(self).__name__}.crop: length {length} > {self.pos} tokens held")
        self.pos = length

    def positions(self, t: int, device: torch.device | str | None = None) -> torch.Tensor:
        """(t,) positions of ``t`` new tokens: every row continues from ``len(self)``."""
        return torch.arange(self.pos, self.pos + t, device=device)

    def claim(self, batch: int, n_new: int, dtype: torch.dtype) -> int:
        """Reserve the next ``n_new`` slots of every row for a caller that writes them itself (the fused decode
        step of ``attnlab.model.Block``); returns the first slot. Raises, changing nothing, where ``append`` would."""
        return self._reserve(batch, n_new, dtype, "k")[0]

    def _reserve(self, batch: int, n_new: int, dtype: torch.dtype, name: str) -> tuple[int, int]:
        owner = type(self).__name__
        _check_rows(owner, self.batch_size, self.dtype, batch, dtype, name)
        if self.pos + n_new > self.max_seq_len:
            raise ValueError(
                f"{owner} overflow: {self.pos} tokens held + {n_new} new > max_seq_len={self.max_seq_len}"
            )
        start = self.pos
        self.pos += n_new
        return start, self.pos


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype of ``torch.autocast`` on ``device``'s type where it is on, else None (the meta device has none)."""
    kind = device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return None


def placement(
    weight: torch.Tensor, dtype: torch.dtype | None, device: torch.device | str | None
) -> tuple[torch.dtype, torch.device | str]:
    """A module's new cache's dtype and device: those given, else the weights' device and the dtype of its
    projections' output: the weights' dtype, or under ``torch.autocast`` on the weights' device autocast's (a float32
    model's keys are bfloat16 there: a cache of the weights' dtype refused every step)."""
    return dtype or autocast_dtype(
        weight.device
    ) or weight.dtype, device if device is not None else weight.device


def _autocast_rows(dtype: torch.dtype, *rows: torch.Tensor | None) -> list[torch.Tensor | None]:
    """New rows in the cache's ``dtype`` under ``torch.autocast`` (where autocast's ops give its dtype, but a norm
    keeps float32: a q/k norm's keys, MLA's latent rows; and a cache made outside autocast holds the weights'), as
    attention casts its operands there (``kernels._autocast``). Outside autocast, as given: another dtype is
    refused."""
    out = []
    for x in rows:
        if x is not None and x.dtype != dtype and x.is_floating_point() and autocast_dtype(x.device):
            x = x.to(dtype)
        out.append(x)
    return out


def _check_rows(
    owner: str, batch_size: int, dtype: torch.dtype, batch: int, got: torch.dtype, name: str
) -> None:
    """A write of ``batch`` rows of ``got`` (the tensor ``name``) into a cache made for ``batch_size`` rows of
    ``dtype``: refused when either differs."""
    if batch != batch_size:
        # A smaller batch would leave the other rows' slots unwritten, and a later full batch would attend to them
        # as if they held tokens: a cache's batch is fixed when it is made.
        raise ValueError(
            f"{owner}: batch of {batch} but the cache was made for batch_size={batch_size}; a cache's batch is fixed "
            "(make a new cache, or use PagedKVCache for sequences that come and go)"
        )
    if got != dtype:
        raise TypeError(f"{owner}: {name} has dtype {got}, the cache holds {dtype}")


def _check_sizes(owner: str, **sizes: int) -> None:
    for name, value in sizes.items():
        check_int(f"{owner}.{name}", value)


def _check_dtype(owner: str, dtype: object) -> None:
    """A cache holds floating-point keys and values: an integer dtype would fail only at the first write."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{owner}.dtype must be a floating-point torch.dtype, got {dtype!r}")


def _check_device(owner: str, held: torch.Tensor, **new: torch.Tensor | None) -> None:
    """New rows on another device than the cache's buffer ``held``: refused before anything is written (a copy
    across devices would succeed and attention refuse after it)."""
    for name, x in new.items():
        if x is not None and x.device != held.device:
            raise ValueError(
                f"{owner}: {name} is on {x.device}, the cache on {held.device}; move one of them"
            )


def _values(owner: str, k: torch.Tensor, values_in_keys: bool, value_dim: int | None) -> torch.Tensor:
    """The value buffer beside the key buffer ``k``: with ``values_in_keys`` (MLA's latent rows) a view of the keys'
    first ``value_dim`` columns (default: all of them), else zeros of the keys' shape."""
    if not values_in_keys:
        return torch.zeros_like(k)
    head_dim = k.shape[-1]
    value_dim = head_dim if value_dim is None else value_dim
    _check_sizes(owner, value_dim=value_dim)
    if value_dim > head_dim:
        raise ValueError(
            f"{owner}.value_dim={value_dim} > head_dim={head_dim}: the values are the first columns of each row"
        )
    return k[..., :value_dim]


class _ValueBuffer:
    """``v`` of a cache whose value buffer may be the first columns of its keys (``values_in_keys``): sliced from
    ``k`` at each use, never kept as a view. A compiled step then takes one buffer, not two inputs that alias
    (torch's on-disk graph cache gave a graph compiled for the aliased pair of one batch size to another and failed
    its stride check: an MLA ``generate --compile`` after another process had compiled one); and a pickled cache
    stays one buffer (the kept view became a copy of its own, which later updates of the keys never reached)."""

    k: torch.Tensor

    def _set_values(self, owner: str, values_in_keys: bool, value_dim: int | None) -> None:
        values = _values(owner, self.k, values_in_keys, value_dim)
        self._value_dim, self._v = values.shape[-1], None if values_in_keys else values

    @property
    def v(self) -> torch.Tensor:
        """The value buffer; with ``values_in_keys`` the keys' first ``value_dim`` columns."""
        return self.k[..., : self._value_dim] if self._v is None else self._v


class KVCache(_Cache):
    """Keys and values for MHA/GQA/MQA.

    Layout: ``k`` and ``v`` are (batch_size, n_kv_heads, capacity, head_dim); token ``t`` of sequence ``b`` for KV
    head ``h`` lives at ``k[b, h, t]``, or with a ``window`` (a sliding-window layer, whose queries never see more
    than the last ``window`` tokens) at ``k[b, h, t % capacity]``: a ring of ``capacity = min(window, max_seq_len)``
    slots, so the layer's cache holds at most the window. Keys are stored after RoPE. Every update passes all
    ``batch_size`` rows.

    What ``update`` returns is what attention reads: the live slots in token order, or, once the ring has wrapped,
    for one new token the whole ring (exactly the window, in ring order, which a single query does not mind) and for
    several the kept tokens then the new ones in order (a copy), which the attention masks with its band.
    """

    def __init__(
        self,
        batch_size: int,
        n_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        window: int | None = None,
    ) -> None:
        _check_sizes(
            "KVCache",
            batch_size=batch_size,
            n_kv_heads=n_kv_heads,
            max_seq_len=max_seq_len,
            head_dim=head_dim,
        )
        _check_dtype("KVCache", dtype)
        if window is not None:
            _check_sizes("KVCache", window=window)
        self.batch_size, self.max_seq_len = batch_size, max_seq_len
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.dtype, self.window = dtype, window
        self.capacity = max_seq_len if window is None else min(window, max_seq_len)
        shape = (batch_size, n_kv_heads, self.capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.pos = 0

    @property
    def nbytes(self) -> int:
        """Bytes allocated: 2 * B * n_kv_heads * capacity * head_dim * element_size."""
        return self.k.nbytes + self.v.nbytes

    @property
    def wrapped(self) -> bool:
        """Whether tokens were dropped from the ring (the slots no longer hold tokens 0, 1, ... in order)."""
        return self.pos > self.capacity

    def crop(self, length: int) -> None:
        if self.wrapped and length < self.pos:
            # (it named a token the ring still held: the refusal is for what the ring holds beyond it)
            raise ValueError(
                f"KVCache.crop: this cache's ring of {self.capacity} slots (a window of {self.window}) has wrapped, "
                f"{self.pos} tokens in: its slots of the tokens from {length} on would be read again until written "
                "over, so it cannot be cropped; a StaticKVCache (a window is a mask over all its slots) can"
            )
        super().crop(length)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k``, ``v`` (B, n_kv_heads, T, head_dim); return the keys and values attention reads (see the
        class docstring): the live (B, n_kv_heads, len, head_dim) until a window's ring wraps."""
        k, v = _autocast_rows(self.dtype, k, v)
        b, h, t, d = k.shape
        if v is None or (h, d) != (self.n_kv_heads, self.head_dim) or v.shape != k.shape:
            raise ValueError(
                f"KVCache holds (n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}); "
                f"got k {tuple(k.shape)}, v {None if v is None else tuple(v.shape)}"
            )
        if v.dtype != k.dtype:  # the write below would cast v silently
            raise TypeError(f"KVCache: k has dtype {k.dtype} but v has {v.dtype}")
        held = min(self.pos, self.capacity)  # before this update
        _check_device("KVCache", self.k, k=k, v=v)
        start, end = self._reserve(b, t, k.dtype, "k")
        if end <= self.capacity:  # no token dropped yet: slot = position
            self.k[:, :, start:end] = k
            self.v[:, :, start:end] = v
            return self.k[:, :, :end], self.v[:, :, :end]
        if t == 1:  # a decode step over a full ring: the newest token takes the oldest one's slot
            self.k[:, :, start % self.capacity] = k[:, :, 0]
            self.v[:, :, start % self.capacity] = v[:, :, 0]
            return self.k, self.v
        order = (
            torch.arange(start - held, start, device=self.k.device) % self.capacity
        )  # kept tokens, in order
        keys, values = torch.cat((self.k[:, :, order], k), 2), torch.cat((self.v[:, :, order], v), 2)
        keep = min(self.capacity, keys.shape[2])
        slots = torch.arange(end - keep, end, device=self.k.device) % self.capacity
        self.k[:, :, slots] = keys[:, :, -keep:]
        self.v[:, :, slots] = values[:, :, -keep:]
        return keys, values

    append = update  # the ``Cache`` protocol: the live keys and values are what attention reads

    def key_positions(self, t: int) -> torch.Tensor | None:
        """The positions of the keys that the last ``update`` (of ``t`` tokens) returned, in the order it returned
        them; None while they are 0, 1, ..., len - 1. A mask over every position so far (``attn_mask``'s
        (T, len(cache) + T)) is read at these columns once a window's ring has wrapped."""
        end = self.pos
        if end <= self.capacity:
            return None
        if t == 1:  # the whole ring: slot s holds the latest position p <= end - 1 with p = s (mod capacity)
            slots = torch.arange(self.capacity, device=self.k.device)
            return end - 1 - (end - 1 - slots) % self.capacity
        held = min(end - t, self.capacity)
        return torch.arange(end - t - held, end, device=self.k.device)


class LatentCache(_Cache):
    """MLA's cache: the normalised KV latent and the shared rotary key, nothing per head.

    Layout: one buffer ``kv`` of (batch_size, max_seq_len, kv_lora_rank + qk_rope_head_dim); the first
    ``kv_lora_rank`` values of a token are its latent ``c_kv`` (after ``kv_norm``), the rest its rotary key
    (after RoPE). Keeping both in one row lets absorbed attention score a token with a single dot product.
    Through ``append`` it is a cache of one KV "head" whose values are the first ``kv_lora_rank`` entries of
    its keys.
    """

    def __init__(
        self,
        batch_size: int,
        max_seq_len: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        _check_sizes(
            "LatentCache",
            batch_size=batch_size,
            max_seq_len=max_seq_len,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
        )
        _check_dtype("LatentCache", dtype)
        self.batch_size, self.max_seq_len = batch_size, max_seq_len
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.dtype = dtype
        self.kv = torch.zeros(
            batch_size, max_seq_len, kv_lora_rank + qk_rope_head_dim, dtype=dtype, device=device
        )
        self.pos = 0

    @property
    def nbytes(self) -> int:
        """Bytes allocated: B * max_seq_len * (kv_lora_rank + qk_rope_head_dim) * element_size."""
        return self.kv.nbytes

    def update(self, kv: torch.Tensor) -> torch.Tensor:
        """Append ``kv`` (B, T, kv_lora_rank + qk_rope_head_dim); return the live (B, len, same)."""
        (kv,) = _autocast_rows(self.dtype, kv)
        b, t, d = kv.shape
        if d != self.kv.shape[-1]:
            raise ValueError(
                f"LatentCache holds rows of kv_lora_rank + qk_rope_head_dim = {self.kv.shape[-1]}; got {d}"
            )
        _check_device("LatentCache", self.kv, kv=kv)
        start, end = self._reserve(b, t, kv.dtype, "kv")
        self.kv[:, start:end] = kv
        return self.kv[:, :end]

    def append(self, k: torch.Tensor, v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Append rows ``k`` (B, 1, T, kv_lora_rank + qk_rope_head_dim) (``v`` must be None: the values are the
        latent part of the rows); return keys (B, 1, len, same) and values (B, 1, len, kv_lora_rank), views."""
        if v is not None or k.ndim != 4 or k.shape[1] != 1:
            raise ValueError(
                f"LatentCache.append takes rows (B, 1, T, {self.kv.shape[-1]}) and v=None; got k "
                f"{tuple(k.shape)}, v {None if v is None else tuple(v.shape)}"
            )
        rows = self.update(k[:, 0])[:, None]
        return rows, rows[..., : self.kv_lora_rank]


class StaticKVCache(_ValueBuffer):
    """Keys and values in buffers whose every slot attention reads at every call, for a decode step that is captured
    once and replayed (a CUDA graph, or ``torch.compile(dynamic=False)`` compiling it once for all lengths).

    Layout: ``k`` and ``v`` are (batch_size, n_kv_heads, max_seq_len, head_dim), token ``t`` of row ``b`` for KV head
    ``h`` at ``k[b, h, t]`` (keys after RoPE), as in ``KVCache``. With ``values_in_keys=True`` (MLA's latent rows: one
    "head" whose first ``value_dim`` values are the values) only ``k`` is stored and ``v`` is a view of it.

    ``length`` is a tensor on the cache's device, each row's number of tokens (rows may differ: ``row(i)`` is row
    ``i`` alone, to prefill the prompts of a ragged batch one by one). ``append`` writes each row at its length and
    advances it in place, so a step reads no Python number that changes between steps, and returns the whole
    buffers. The attention modules replace their causal rule and window with the cache's: a decode step (one token
    per row) passes ``length`` to ``attend(lengths=)``, which the fused C++ and Triton MLA kernels read to stop each
    row at its length; several tokens are masked by ``visible(t, window)``, the (B, 1, T, max_seq_len) bool mask of
    the slots each of the ``t`` newest tokens of a row may see (the causal rule, and a sliding window when given).
    Either way the unwritten slots never count. The cost of the fixed shapes: a backend that takes the lengths as a
    mask computes over all ``max_seq_len`` slots, written or not, so size the cache to what a run needs. ``len()`` reads
    the longest row's length back (a host sync on a GPU). Writing past ``max_seq_len`` raises a ValueError on a CPU
    outside ``torch.compile``; elsewhere the index is checked by the device (no host sync).

    The buffers and ``length`` are marked as static addresses for ``torch.compile``
    (``torch._dynamo.mark_static_address``), which lets a CUDA graph replay mutate them in place.
    """

    paged = False
    static = True

    def __init__(
        self,
        batch_size: int,
        n_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        values_in_keys: bool = False,
        value_dim: int | None = None,
    ) -> None:
        _check_sizes(
            "StaticKVCache",
            batch_size=batch_size,
            n_kv_heads=n_kv_heads,
            max_seq_len=max_seq_len,
            head_dim=head_dim,
        )
        _check_dtype("StaticKVCache", dtype)
        if value_dim is not None and not values_in_keys:
            raise ValueError("StaticKVCache: value_dim is for values_in_keys=True only")
        self.batch_size, self.max_seq_len = batch_size, max_seq_len
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.dtype, self.values_in_keys = dtype, values_in_keys
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self._set_values("StaticKVCache", values_in_keys, value_dim)
        self.length = torch.zeros(batch_size, dtype=torch.int64, device=self.k.device)
        self._slots = torch.arange(max_seq_len, device=self.k.device)
        self._rows = torch.arange(batch_size, device=self.k.device)[:, None]
        for t in (self.k, self._v, self.length, self._slots, self._rows):
            if t is not None:
                torch._dynamo.mark_static_address(t)

    def __len__(self) -> int:
        """The longest row's length."""
        return int(self.length.max())

    @property
    def nbytes(self) -> int:
        """Bytes allocated: B * n_kv_heads * max_seq_len * head_dim * element_size, twice without values_in_keys."""
        return self.k.nbytes * (1 if self.values_in_keys else 2)

    def row(self, i: int) -> StaticKVCache:
        """Row ``i`` alone: a cache of batch 1 over this one's buffers and length (views, written in place)."""
        check_int("StaticKVCache.row", i, minimum=0)
        if i >= self.batch_size:
            raise ValueError(f"StaticKVCache.row: row {i} of a batch of {self.batch_size}")
        one = copy.copy(self)
        one.batch_size = 1
        one.k, one.length = self.k[i : i + 1], self.length[i : i + 1]
        one._v = None if self._v is None else self._v[i : i + 1]
        one._rows = self._rows[:1]
        return one

    def reset(self) -> None:
        """Forget the held tokens (the buffers are reused, not cleared)."""
        self.length.zero_()

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` tokens of every row."""
        check_int("StaticKVCache.crop length", length, minimum=0)
        if length > self.max_seq_len:
            raise ValueError(f"StaticKVCache.crop: length {length} > max_seq_len={self.max_seq_len}")
        self.length.clamp_(max=length)

    def rewind(self, n: int) -> None:
        """Forget the newest ``n`` tokens of every row (on the device: no sync); a row keeps at least none."""
        check_int("StaticKVCache.rewind n", n, minimum=0)
        self.length.sub_(n).clamp_(min=0)

    def positions(self, t: int, device: torch.device | str | None = None) -> torch.Tensor:
        """(B, t) positions of ``t`` new tokens of each row, from ``length``: computed on the device, never read back."""
        return (self.length[:, None] + self._slots[:t]).to(device if device is not None else self.k.device)

    def visible(self, t: int, window: int | None = None) -> torch.Tensor:
        """(B, 1, t, max_seq_len) bool: the slots that each of a row's ``t`` newest tokens (the last ``append``'s) may
        see, those at or before its position and, with a ``window``, fewer than ``window`` positions before it."""
        newest = (self.length[:, None] - t + self._slots[:t])[:, None, :, None]
        seen = self._slots <= newest
        return seen if window is None else seen & (self._slots > newest - window)

    def append(self, k: torch.Tensor, v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` (B, n_kv_heads, T, head_dim; ``v`` None with ``values_in_keys``) at each row's length and
        advance it; return the whole buffers (B, n_kv_heads, max_seq_len, head_dim / value_dim)."""
        k, v = _autocast_rows(self.dtype, k, v)
        b, h, t, d = k.shape
        if (
            (v is None) != self.values_in_keys
            or (h, d) != (self.n_kv_heads, self.head_dim)
            or (v is not None and v.shape != k.shape)
        ):
            wants = "v=None" if self.values_in_keys else "v of k's shape"
            raise ValueError(
                f"StaticKVCache holds (n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}) and takes "
                f"{wants}; got k {tuple(k.shape)}, v {None if v is None else tuple(v.shape)}"
            )
        for name, x in (("k", k), ("v", v)):
            if x is not None:
                _check_rows("StaticKVCache", self.batch_size, self.dtype, b, x.dtype, name)
        _check_device("StaticKVCache", self.k, k=k, v=v)
        # the overflow check reads the lengths back: free on a CPU outside a compiled graph, else left to the device
        if self.k.device.type == "cpu" and not torch.compiler.is_compiling():
            held = len(self)
            if held + t > self.max_seq_len:
                raise ValueError(
                    f"StaticKVCache overflow: {held} tokens held + {t} new > max_seq_len={self.max_seq_len}"
                )
        slots = self.positions(t)  # (B, t); the indexed dims come first: (B, t, n_kv_heads, head_dim)
        self.k[self._rows, :, slots] = k.transpose(1, 2)
        if v is not None:
            self.v[self._rows, :, slots] = v.transpose(1, 2)
        self.length.add_(t)
        return self.k, self.v


class OutOfBlocksError(ValueError):
    """A ``PagedKVCache`` has too few free blocks for an update; the cache is left exactly as it was."""


PLACEMENTS = ("contiguous", "scattered")


class PagedKVCache(_ValueBuffer):
    """Keys and values in fixed-size blocks with a block table per sequence (vLLM's PagedAttention, Kwon et al.
    2023, arXiv 2309.06180), for batches whose sequences have different lengths.

    Layout: ``k`` and ``v`` are pools of (n_kv_heads, n_blocks, block_size, head_dim). Token ``t`` of the sequence
    in batch row ``r`` lives in block ``block_tables[r][t // block_size]`` at offset ``t % block_size``. Keys are
    stored after RoPE. Blocks are taken from the pool only when a row needs them, so a row holds
    ``ceil(length / block_size)`` blocks: at most one of them partly filled. ``free(row)`` returns its blocks.

    ``placement="contiguous"`` (the default): a row's next block is, when free, the one physically after its last
    block; attention then reads each run of consecutive blocks as a single strided view (see
    ``attnlab.attention.decode.paged_decode``), never a copy. ``placement="scattered"`` takes the highest free block
    every time, so that every block is a run of its own: the worst case, for benchmarks and tests.
    ``update`` appends to the rows in ``active`` (all rows by default; ``select(rows)`` narrows it, e.g. to prefill
    one prompt of a ragged batch).

    With ``values_in_keys=True`` (MLA's absorbed form: the value of a token is the first ``value_dim`` entries of
    its cached row) only ``k`` is stored and ``v`` is a view of it.

    With a ``window`` (a sliding-window layer, whose queries see at most the last ``window`` tokens) blocks that fall
    out of every future query's window go back to the pool: before an update, each row gives up its blocks whose
    tokens all lie before the window of the first new token. A row then holds about ``window / block_size`` blocks
    whatever its length; its views cover its kept tokens, and attention masks those out of each query's window.
    """

    paged = True
    static = False

    def __init__(
        self,
        n_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        batch_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        values_in_keys: bool = False,
        value_dim: int | None = None,
        placement: str = "contiguous",
        window: int | None = None,
    ) -> None:
        if window is not None:
            _check_sizes("PagedKVCache", window=window)
        self.window = window
        _check_sizes(
            "PagedKVCache",
            n_blocks=n_blocks,
            block_size=block_size,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            batch_size=batch_size,
        )
        _check_dtype("PagedKVCache", dtype)
        if placement not in PLACEMENTS:
            raise ValueError(
                f"PagedKVCache.placement must be one of {', '.join(PLACEMENTS)}; got {placement!r}"
            )
        self.n_blocks, self.block_size = n_blocks, block_size
        self.n_kv_heads, self.head_dim, self.batch_size = n_kv_heads, head_dim, batch_size
        self.dtype = dtype
        self.placement = placement
        shape = (n_kv_heads, n_blocks, block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.values_in_keys = values_in_keys
        self._set_values("PagedKVCache", values_in_keys, value_dim)
        self.lengths = [0] * batch_size  # tokens each row has seen
        self.dropped = [0] * batch_size  # blocks each row gave up (a window's): its table starts after them
        self.block_tables: list[list[int]] = [[] for _ in range(batch_size)]
        self._free = set(range(n_blocks))
        self.active = list(range(batch_size))

    def __len__(self) -> int:
        """The longest active row's length."""
        return max([0, *(self.lengths[r] for r in self.active)])

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool (allocated up front)."""
        return self.k.nbytes if self.values_in_keys else self.k.nbytes + self.v.nbytes

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block, keys and values."""
        return self.nbytes // self.n_blocks

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the blocks held by sequences: at most one partly filled block per sequence."""
        return (self.n_blocks - len(self._free)) * self.block_nbytes

    @property
    def n_free_blocks(self) -> int:
        return len(self._free)

    def select(self, rows: Sequence[int] | torch.Tensor) -> PagedKVCache:
        """Make ``rows`` (distinct batch rows: Python, NumPy or tensor integers, as an ``argsort`` of a beam search
        gives them) the ones the next forward reads and writes, in the order of its inputs' rows."""
        picked: list[int] = []
        listed: list = []
        if not isinstance(rows, torch.Tensor) or rows.ndim == 1:
            with contextlib.suppress(TypeError):
                listed = list(rows)
        # booleans are a mask, not rows (a tensor([False, True]) selected rows 0 and 1): refused
        if not any(
            isinstance(r, bool) or str(getattr(r, "dtype", "")) in ("bool", "torch.bool") for r in listed
        ):
            with contextlib.suppress(TypeError):
                picked = [operator.index(r) for r in listed]
        valid = all(0 <= r < self.batch_size for r in picked) and len(picked) == len(listed)
        if not picked or len(set(picked)) != len(picked) or not valid:
            raise ValueError(
                f"PagedKVCache.select: rows must be distinct integers in [0, {self.batch_size}): {rows}"
            )
        self.active = picked
        return self

    def positions(self, t: int, device: torch.device | str | None = None) -> torch.Tensor:
        """(len(active), t) positions of ``t`` new tokens appended to each active row."""
        start = torch.tensor([self.lengths[r] for r in self.active], device=device)
        return start[:, None] + torch.arange(t, device=device)

    def free(self, row: int) -> None:
        """End row ``row``'s sequence: its blocks go back to the pool and its length to 0."""
        if not isinstance(row, int) or not 0 <= row < self.batch_size:
            raise ValueError(f"PagedKVCache.free: row must be in [0, {self.batch_size}), got {row!r}")
        self._free.update(self.block_tables[row])
        self.block_tables[row] = []
        self.lengths[row] = 0
        self.dropped[row] = 0

    def reset(self) -> None:
        for row in range(self.batch_size):
            self.free(row)
        self.active = list(range(self.batch_size))

    def update(self, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Append ``k``, ``v`` (len(active), n_kv_heads, T, head_dim) to the active rows (``v`` None when
        ``values_in_keys``).

        Raises ``OutOfBlocksError`` before writing anything when the pool cannot hold the new tokens.
        """
        k, v = _autocast_rows(self.dtype, k, v)
        b, h, t, d = k.shape
        if b != len(self.active):
            raise ValueError(f"PagedKVCache: batch of {b} but the active rows are {self.active}")
        if (v is None) != self.values_in_keys:
            raise ValueError(
                "PagedKVCache: pass v=None exactly when the cache was built with values_in_keys=True"
            )
        v = k if v is None else v
        if (h, d) != (self.n_kv_heads, self.head_dim) or v.shape != k.shape:
            raise ValueError(
                f"PagedKVCache holds (n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}) for "
                f"{len(self.active)} active rows; got k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        if k.dtype != self.dtype or v.dtype != self.dtype:
            raise TypeError(f"PagedKVCache: k, v dtypes {k.dtype}, {v.dtype}; the cache holds {self.dtype}")
        _check_device("PagedKVCache", self.k, k=k, v=v)
        bs = self.block_size
        # a window's rows give up the blocks before the first new token's window, which no query reads again;
        # counted first and given up only once the new tokens fit (a refused update changes nothing)
        drop = [0] * len(self.active)
        if self.window is not None:
            for i, r in enumerate(self.active):
                oldest = self.lengths[r] - self.window + 1
                drop[i] = min(len(self.block_tables[r]), max(0, oldest // bs - self.dropped[r]))
        need = [
            -(-(self.lengths[r] + t) // bs) - self.dropped[r] - len(self.block_tables[r]) for r in self.active
        ]
        if sum(need) > len(self._free) + sum(drop):
            raise OutOfBlocksError(
                f"PagedKVCache out of blocks: {t} new tokens for rows {self.active} need {sum(need)} blocks, "
                f"{len(self._free)} of {self.n_blocks} are free"
                f"{f' and {sum(drop)} fall out of the window' if sum(drop) else ''} (block_size={bs}); free "
                "finished sequences or build the cache with more n_blocks"
            )
        for r, n in zip(self.active, drop, strict=True):
            self._free.update(self.block_tables[r][:n])
            del self.block_tables[r][:n]
            self.dropped[r] += n
        for row, n_new in zip(self.active, need, strict=True):
            for j in range(n_new):
                self.block_tables[row].append(self._take(self.block_tables[row], n_new - j))
        for i, row in enumerate(self.active):
            table, pos, first = self.block_tables[row], self.lengths[row], self.dropped[row]
            done = 0
            while done < t:  # one slice per block touched: a decode step writes one token in one block
                block, offset = table[(pos + done) // bs - first], (pos + done) % bs
                n = min(bs - offset, t - done)
                self.k[:, block, offset : offset + n] = k[i, :, done : done + n]
                if not self.values_in_keys:
                    self.v[:, block, offset : offset + n] = v[i, :, done : done + n]
                done += n
            self.lengths[row] = pos + t

    def append(self, k: torch.Tensor, v: torch.Tensor | None) -> tuple[PagedView, PagedView]:
        """``update``, then the active rows' keys and values as ``PagedView``s (the ``Cache`` protocol)."""
        self.update(k, v)
        return self.views()

    def views(self) -> tuple[PagedView, PagedView]:
        """The active rows' keys and values as attention reads them: pools and runs of consecutive blocks."""
        bs = self.block_size
        runs = tuple(tuple((block * bs, n) for block, n in self.runs(r)) for r in self.active)
        lengths = tuple(self.lengths[r] - self.dropped[r] * bs for r in self.active)  # the tokens kept
        # (n_kv, n_blocks * block_size, D) views: a run of consecutive blocks is a slice of them
        k, v = self.k.flatten(1, 2), self.v.flatten(1, 2)
        return PagedView(k, runs, lengths, bs), PagedView(v, runs, lengths, bs)

    def runs(self, row: int) -> list[tuple[int, int]]:
        """Row ``row``'s kept tokens as (first block, n_tokens) runs of physically consecutive blocks."""
        bs = self.block_size
        table, length = self.block_tables[row], self.lengths[row] - self.dropped[row] * bs
        out: list[tuple[int, int]] = []
        for i, block in enumerate(table):
            n = min(bs, length - i * bs)
            if out and block == out[-1][0] + out[-1][1] // bs and out[-1][1] % bs == 0:
                out[-1] = (out[-1][0], out[-1][1] + n)
            else:
                out.append((block, n))
        return out

    def _take(self, table: list[int], wanted: int) -> int:
        """A free block for a row that still needs ``wanted`` blocks now.

        Contiguous placement: the block after the row's last one if it is free (the run goes on); otherwise a new
        run starts inside the longest free run, centred so that the ``wanted`` blocks fit and both this row and
        whichever row ends just before the gap keep free blocks to grow into (worst fit: runs stay long, attention
        does fewer matmuls); a gap that starts at block 0 has no row before it and is filled from its start.
        Blocks are only placed, never reserved ahead. Scattered placement: the highest free block.
        """
        if self.placement == "scattered":
            block = max(self._free)
        elif table and table[-1] + 1 in self._free:
            block = table[-1] + 1
        else:
            start, length = self._longest_free_run()
            block = start + (max(0, length - wanted) // 2 if start > 0 else 0)  # nothing left of block 0
        self._free.remove(block)
        return block

    def _longest_free_run(self) -> tuple[int, int]:
        best, best_len, start, prev = -1, 0, -1, -2
        for block in sorted(self._free):
            if block != prev + 1:
                start = block
            prev = block
            if block - start + 1 > best_len:
                best, best_len = start, block - start + 1
        return best, best_len
