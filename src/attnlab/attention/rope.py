"""Rotary position embeddings in the half-split layout, and the positions they rotate by.

A head vector ``x`` of even length ``D`` is rotated as pairs ``(x[i], x[i + D/2])`` by the angle
``pos * theta ** (-2i / D)``: the layout of Hugging Face Llama (``rotate_half``). Meta's original checkpoints
pair ``(x[2i], x[2i + 1])`` instead (interleaved); ``attnlab.hf`` converts between the two with
``interleaved_to_half_split``, which permutes rows of ``wq``/``wk``.

Positions are explicit: ``token_positions`` takes the caller's ``position_ids`` (left padding, packed sequences)
or continues from a cache. The angles (``RopeAngles``) are computed once per model step by
``attnlab.model.Transformer`` and shared by its layers; a module called alone computes them itself.
"""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (..., T, dim) for integer ``positions`` of shape (..., T), computed in float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # (..., T, dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., T, dim): both halves of a pair share an angle
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (..., T, dim) by the angles in ``cos``/``sin``; returns x's dtype.

    ``cos``/``sin`` are (T, dim), one position per token for every row, or (B, T, dim), per row; for ``x`` of
    (B, heads, T, dim) the latter apply to every head. The arithmetic runs in float32 so that bfloat16
    activations lose no precision in the rotation.
    """
    if cos.ndim == 3 and x.ndim == 4:  # per-row angles, shared by the heads
        cos, sin = cos[:, None], sin[:, None]
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    out = xf * cos
    if torch.is_grad_enabled() or out.shape != rotated.shape:
        return (out + rotated * sin).to(x.dtype)
    return out.add_(rotated.mul_(sin)).to(x.dtype)  # inference: the same sums in place, two buffers fewer


class RopeAngles:
    """The cos/sin of one forward's token ``positions`` (..., T), computed once per (rotary dim, theta) and shared
    by every layer that asks for them (a model mid-conversion mixes GQA and MLA layers, whose dims differ)."""

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions
        self._angles: dict[tuple[int, float], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (..., T, dim) float32."""
        key = (dim, theta)
        if key not in self._angles:
            self._angles[key] = rope_cos_sin(self.positions, dim, theta)
        return self._angles[key]


def token_positions(
    position_ids: torch.Tensor | None, cache, batch: int, t: int, device: torch.device
) -> torch.Tensor:
    """Positions of ``t`` new tokens: ``position_ids`` (T,) or (B, T) if given, else following the cache
    (``cache.positions``: each row from its own length in a paged cache), else ``0 .. t - 1``."""
    if position_ids is None:
        if cache is None:
            return torch.arange(t, device=device)
        positions = cache.positions(t, device)
        if positions.ndim == 2 and positions.shape[0] != batch:  # a paged cache: one row per active sequence
            raise ValueError(
                f"batch of {batch} but the cache's active rows hold {positions.shape[0]} sequences"
            )
        return positions
    if not isinstance(position_ids, torch.Tensor) or position_ids.dtype not in (torch.int64, torch.int32):
        got = position_ids.dtype if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
        raise TypeError(f"position_ids must be an integer tensor, got {got}")
    if position_ids.shape not in ((t,), (1, t), (batch, t)):
        raise ValueError(
            f"position_ids must be (T,) or (B, T) = ({batch}, {t}), got shape {tuple(position_ids.shape)}"
        )
    return position_ids.to(device)


def interleaved_to_half_split(dim: int) -> torch.Tensor:
    """Index permutation ``p`` such that ``w_half = w_interleaved[p]`` for one head's ``dim`` rows.

    Interleaved pairs are rows (2i, 2i+1); half-split pairs are rows (i, i + dim/2). Taking the even rows
    first and then the odd rows moves each interleaved pair onto a half-split pair.
    """
    if dim % 2:
        raise ValueError(f"rotary dim must be even, got {dim}")
    return torch.cat((torch.arange(0, dim, 2), torch.arange(1, dim, 2)))
