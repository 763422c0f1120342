"""Rotary position embeddings: which dims turn, how they pair, at which frequencies; and the positions they turn by.

A head vector ``x`` has ``rotary_dim`` dims that RoPE turns (all ``head_dim`` of them, or the first part: partial
rotary, as GPT-NeoX, Phi-4-mini and GLM do); the rest pass unchanged. The turned dims pair up as
``(x[i], x[i + rotary_dim/2])`` (half-split: Hugging Face Llama's ``rotate_half``) or, ``interleaved``, as
``(x[2i], x[2i + 1])`` (GLM, ChatGLM, Meta's original Llama checkpoints); pair ``i`` turns by the angle
``pos * inv_freq[i]``.

Frequencies: plain RoPE has ``inv_freq[i] = theta ** (-2i / rotary_dim)``. Scaled RoPE (``AttentionConfig.
rope_scaling``: llama3, yarn, linear, dynamic, longrope, ...) takes its frequencies, and the factor that yarn and
longrope multiply cos and sin by, from transformers' own ``ROPE_INIT_FUNCTIONS``, called with a minimal config
holding the same parameters, so attnlab computes what transformers computes rather than a re-derivation. Two of
them depend on the sequence: "longrope" switches to its long factors once a forward reaches past
``original_max_position_embeddings``, "dynamic" grows its base with the length; both are asked with the forward's
length (its largest position + 1), as transformers' ``dynamic_rope_update`` does, taken per row of a (B, T)
``positions``: a row of a left-padded or paged batch turns as it turns alone (transformers takes the batch's
largest position). Keys cached by forwards at most ``original_max_position_embeddings`` long hold the short
factors' angles, so a longrope sequence that grows past that length is recomputed (``switch_length``; transformers'
Phi-3 ``prepare_inputs_for_generation`` drops its cache there, and ``attnlab.generate`` prefills again).

Positions are explicit: ``token_positions`` takes the caller's ``position_ids`` (left padding, packed sequences)
or continues from a cache. The angles (``RopeAngles``) are computed once per model step by
``attnlab.model.Transformer`` and shared by its layers; a module called alone computes them itself.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# What a module's RoPE is: (rotary dim, theta, scaling parameters, interleaved pairs). Layers with equal specs share
# one set of angles per forward.
RopeSpec = tuple[int, float, tuple[tuple[str, Any], ...], bool]
_SEQUENCE_DEPENDENT = ("dynamic", "longrope")


@functools.lru_cache(maxsize=64)
def _scaled_frequencies(
    dim: int, theta: float, scaling: tuple[tuple[str, Any], ...], seq_len: int | None
) -> tuple[torch.Tensor, float]:
    """(inv_freq (dim/2,) float32, attention factor) of scaled RoPE, from transformers' ROPE_INIT_FUNCTIONS."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {k: (list(v) if isinstance(v, tuple) else v) for k, v in scaling}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"rope_type {kind!r} is not one transformers computes: {', '.join(ROPE_INIT_FUNCTIONS)}"
        )
    max_positions = params.pop("max_position_embeddings", None)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the shim's parameters are the checkpoint's, warned about at load
    try:
        shim = transformers.LlamaConfig(
            hidden_size=dim,
            num_attention_heads=1,
            head_dim=dim,
            max_position_embeddings=max_positions or 2048,
            rope_parameters=params | {"rope_type": kind, "rope_theta": theta},
        )
        extra = {"seq_len": seq_len} if kind in _SEQUENCE_DEPENDENT and seq_len is not None else {}
        inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](shim, "cpu", **extra)
    finally:
        transformers.logging.set_verbosity(verbosity)
    return inv_freq.float(), float(factor)


def inverse_frequencies(
    dim: int, theta: float, scaling: tuple[tuple[str, Any], ...] = (), seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq (dim/2,) float32 on the CPU, factor on cos and sin) for ``dim`` rotary dims; see the module
    docstring. ``seq_len``: the forward's length, for the sequence-dependent scalings."""
    kind = dict(scaling).get("rope_type", dict(scaling).get("type", "default"))
    if kind == "default":
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
    seq_len = seq_len if kind in _SEQUENCE_DEPENDENT else None
    return _scaled_frequencies(dim, theta, scaling, seq_len)


def plain_pairs(dim: int, theta: float, scaling: tuple[tuple[str, Any], ...] = ()) -> int:
    """How many pairs, fastest first, turn at plain RoPE's frequencies ``theta ** (-2i / dim)`` under
    ``scaling`` (all ``dim/2`` without one): "llama3" and "yarn" leave their high-frequency band as it was,
    "linear" scales every pair. Read off transformers' frequencies, not re-derived: a pair counts only where its
    float32 value is the plain one (both scalings select the plain value there, bit for bit). Sequence-dependent
    scalings are read at their base length."""
    plain, _ = inverse_frequencies(dim, theta)
    scaled, _ = inverse_frequencies(dim, theta, scaling)
    same = torch.cat((scaled == plain, torch.zeros(1, dtype=torch.bool)))
    return int(same.int().argmin())


def switch_length(scaling: tuple[tuple[str, Any], ...]) -> int | None:
    """The forward length past which ``scaling`` turns every position by other angles (longrope: its
    ``original_max_position_embeddings``), so that keys cached by shorter forwards are stale; None where the angles
    of a position do not jump with the length (plain and fixed scalings; "dynamic", which transformers lets drift)."""
    params = dict(scaling)
    if params.get("rope_type") != "longrope":
        return None
    return int(
        params.get("original_max_position_embeddings") or params.get("max_position_embeddings") or 2048
    )


def rope_cos_sin(
    positions: torch.Tensor,
    dim: int,
    theta: float,
    dtype: torch.dtype = torch.float32,
    scaling: tuple[tuple[str, Any], ...] = (),
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (..., T, dim) for integer ``positions`` of shape (..., T), computed in float32, laid out
    as ``apply_rope`` pairs the dims (half-split, or ``interleaved``)."""
    seq_len = None
    if dict(scaling).get("rope_type") in _SEQUENCE_DEPENDENT and positions.numel():
        if positions.ndim == 2 and positions.shape[0] > 1:
            lengths = positions.amax(-1) + 1  # a host sync, for these two scalings only (as transformers)
            if bool((lengths != lengths[0]).any()):  # rows of different lengths: each at its own frequencies
                rows = [rope_cos_sin(p[None], dim, theta, dtype, scaling, interleaved) for p in positions]
                return torch.cat([c for c, _ in rows]), torch.cat([s for _, s in rows])
        seq_len = int(positions.max()) + 1
    inv_freq, factor = inverse_frequencies(dim, theta, scaling, seq_len)
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)  # (..., T, dim/2)
    if interleaved:
        emb = freqs.repeat_interleave(2, dim=-1)  # pair (2i, 2i + 1) shares angle i
    else:
        emb = torch.cat((freqs, freqs), dim=-1)  # pair (i, i + dim/2) shares angle i
    cos, sin = emb.cos(), emb.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


def _turned(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Each pair (a, b) of ``x`` (float32) as (-b, a): the quarter turn that sin multiplies."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``x`` (..., T, head_dim) by the angles in ``cos``/``sin``; the
    other dims pass unchanged. Returns x's dtype.

    ``cos``/``sin`` are (T, dim), one position per token for every row, or (B, T, dim), per row; for ``x`` of
    (B, heads, T, head_dim) the latter apply to every head. The arithmetic runs in float32 so that bfloat16
    activations lose no precision in the rotation.
    """
    if cos.ndim == 3 and x.ndim == 4:  # per-row angles, shared by the heads
        cos, sin = cos[:, None], sin[:, None]
    dim = cos.shape[-1]
    if dim < x.shape[-1]:  # partial rotary: turn the first dims, keep the rest
        turned = apply_rope(x[..., :dim], cos, sin, interleaved)
        return torch.cat((turned, x[..., dim:]), dim=-1)
    xf = x if x.dtype == torch.float64 else x.float()  # float64 keeps its precision
    rotated = _turned(xf, interleaved)
    out = xf * cos
    if torch.is_grad_enabled() or out.shape != rotated.shape:
        return (out + rotated * sin).to(x.dtype)
    return out.add_(rotated.mul_(sin)).to(x.dtype)  # inference: the same sums in place, two buffers fewer


class RopeAngles:
    """The cos/sin of one forward's token ``positions`` (..., T), computed once per ``RopeSpec`` and shared by every
    layer that asks for them (layers may differ: Gemma 3's sliding layers use another theta than its global ones,
    and a model mid-conversion mixes GQA and MLA layers)."""

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions
        self._angles: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(
        self, dim: int, theta: float, scaling: tuple[tuple[str, Any], ...] = (), interleaved: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (..., T, dim) float32."""
        key = (dim, theta, scaling, interleaved)
        if key not in self._angles:
            self._angles[key] = rope_cos_sin(
                self.positions, dim, theta, scaling=scaling, interleaved=interleaved
            )
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
