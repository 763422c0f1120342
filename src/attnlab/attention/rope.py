"""Rotary position embeddings in the half-split layout.

A head vector ``x`` of even length ``D`` is rotated as pairs ``(x[i], x[i + D/2])`` by the angle
``pos * theta ** (-2i / D)``: the layout of Hugging Face Llama (``rotate_half``). Meta's original checkpoints
pair ``(x[2i], x[2i + 1])`` instead (interleaved); ``attnlab.hf`` converts between the two with
``interleaved_to_half_split``, which permutes rows of ``wq``/``wk``.
"""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (T, dim) for integer ``positions`` of shape (T,), computed in float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (T, dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, dim): both halves of a pair share an angle
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (..., T, dim) by the angles in ``cos``/``sin`` (T, dim); returns x's dtype.

    The arithmetic runs in float32 so that bfloat16 activations lose no precision in the rotation.
    """
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def interleaved_to_half_split(dim: int) -> torch.Tensor:
    """Index permutation ``p`` such that ``w_half = w_interleaved[p]`` for one head's ``dim`` rows.

    Interleaved pairs are rows (2i, 2i+1); half-split pairs are rows (i, i + dim/2). Taking the even rows
    first and then the odd rows moves each interleaved pair onto a half-split pair.
    """
    if dim % 2:
        raise ValueError(f"rotary dim must be even, got {dim}")
    return torch.cat((torch.arange(0, dim, 2), torch.arange(1, dim, 2)))
