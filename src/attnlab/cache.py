"""KV caches: preallocated buffers that an attention module fills in place.

A cache owns its position (``len(cache)``, the number of tokens it holds). An attention module's forward
calls ``update`` once per call: the new tokens are written at ``len(cache)`` and the live prefix is returned,
so a step costs time proportional to the live length, not to ``max_seq_len``. All sequences of a batch share
one length here; ``PagedKVCache`` (later) is the cache for ragged batches.
"""

from __future__ import annotations

import torch


def _check_sizes(owner: str, **sizes: int) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{owner}.{name} must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"{owner}.{name} must be >= 1, got {value}")


class _Cache:
    """Position bookkeeping shared by the caches: how many tokens are held and whether more fit."""

    batch_size: int
    max_seq_len: int
    pos: int

    def __len__(self) -> int:
        return self.pos

    def reset(self) -> None:
        """Forget the held tokens (the buffers are reused, not cleared)."""
        self.pos = 0

    def _reserve(self, batch: int, n_new: int, dtype: torch.dtype, name: str) -> tuple[int, int]:
        owner = type(self).__name__
        if batch > self.batch_size:
            raise ValueError(
                f"{owner}: batch of {batch} is larger than the cache's batch_size={self.batch_size}"
            )
        if dtype != self.dtype:
            raise TypeError(f"{owner}: {name} has dtype {dtype}, the cache holds {self.dtype}")
        if self.pos + n_new > self.max_seq_len:
            raise ValueError(
                f"{owner} overflow: {self.pos} tokens held + {n_new} new > max_seq_len={self.max_seq_len}"
            )
        start = self.pos
        self.pos += n_new
        return start, self.pos


class KVCache(_Cache):
    """Keys and values for MHA/GQA/MQA.

    Layout: ``k`` and ``v`` are (batch_size, n_kv_heads, max_seq_len, head_dim); token ``t`` of sequence ``b``
    for KV head ``h`` lives at ``k[b, h, t]``. Keys are stored after RoPE. A batch smaller than
    ``batch_size`` uses the first rows.
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
    ) -> None:
        _check_sizes(
            "KVCache",
            batch_size=batch_size,
            n_kv_heads=n_kv_heads,
            max_seq_len=max_seq_len,
            head_dim=head_dim,
        )
        self.batch_size, self.max_seq_len = batch_size, max_seq_len
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.dtype = dtype
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.pos = 0

    @property
    def nbytes(self) -> int:
        """Bytes allocated: 2 * B * n_kv_heads * max_seq_len * head_dim * element_size."""
        return self.k.nbytes + self.v.nbytes

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k``, ``v`` (B, n_kv_heads, T, head_dim); return the live (B, n_kv_heads, len, head_dim)."""
        b, h, t, d = k.shape
        if (h, d) != (self.n_kv_heads, self.head_dim) or v.shape != k.shape:
            raise ValueError(
                f"KVCache holds (n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}); "
                f"got k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        start, end = self._reserve(b, t, k.dtype, "k")
        self.k[:b, :, start:end] = k
        self.v[:b, :, start:end] = v
        return self.k[:b, :, :end], self.v[:b, :, :end]


class LatentCache(_Cache):
    """MLA's cache: the normalised KV latent and the shared rotary key, nothing per head.

    Layout: one buffer ``kv`` of (batch_size, max_seq_len, kv_lora_rank + qk_rope_head_dim); the first
    ``kv_lora_rank`` values of a token are its latent ``c_kv`` (after ``kv_norm``), the rest its rotary key
    (after RoPE). Keeping both in one row lets absorbed attention score a token with a single dot product.
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
        b, t, d = kv.shape
        if d != self.kv.shape[-1]:
            raise ValueError(
                f"LatentCache holds rows of kv_lora_rank + qk_rope_head_dim = {self.kv.shape[-1]}; got {d}"
            )
        start, end = self._reserve(b, t, kv.dtype, "kv")
        self.kv[:b, start:end] = kv
        return self.kv[:b, :end]
