"""The norms of the decoder, of MLA's latent and query, and of q/k norms: RMSNorm (with Gemma's ``1 + w`` gain as an
option) and LayerNorm (``torch.nn.LayerNorm``: a gain and a bias)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * gain, in float32, gain = ``offset + weight``.

    ``offset`` 0 (Llama, Qwen, DeepSeek): the normalised x is cast back to the input dtype, then scaled by the
    weight, as Llama's RMSNorm. ``offset`` 1 (Gemma's ``(1 + w)``, whose weights are stored as w), or
    ``gain_float32`` (OLMo 2's ``(w * x).to(dtype)``): the gain is applied in float32 before the cast, as theirs. In
    float32 both are the same arithmetic; in bfloat16 they round differently.
    """

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0, gain_float32: bool = False) -> None:
        super().__init__()
        self.eps, self.offset, self.gain_float32 = eps, offset, gain_float32
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x if x.dtype == torch.float64 else x.float()  # float64 keeps its precision
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset or self.gain_float32:
            return (xf * (self.offset + self.weight.float())).to(x.dtype)
        if torch.is_grad_enabled() or self.weight.dtype != x.dtype:
            return self.weight * xf.to(x.dtype)
        return xf.to(x.dtype).mul_(self.weight)  # inference: in place (xf is a new buffer either way)


def make_norm(kind: str, dim: int, eps: float, offset: float = 0.0, gain_float32: bool = False) -> nn.Module:
    """The norm of ``kind`` ("rmsnorm" or "layernorm") over ``dim`` values."""
    if kind == "layernorm":
        if offset or gain_float32:
            raise ValueError(
                f"a LayerNorm has no gain offset or float32 gain; got norm_offset={offset}, "
                f"norm_gain_float32={gain_float32}"
            )
        return nn.LayerNorm(dim, eps=eps)
    if kind != "rmsnorm":
        raise ValueError(f"norm must be rmsnorm or layernorm; got {kind!r}")
    return RMSNorm(dim, eps=eps, offset=offset, gain_float32=gain_float32)
