"""RMSNorm, shared by MLA's latent/query norms and the decoder."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 (as Llama and DeepSeek do)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if torch.is_grad_enabled() or self.weight.dtype != x.dtype:
            return self.weight * xf.to(x.dtype)
        return xf.to(x.dtype).mul_(self.weight)  # inference: in place (xf is a new buffer either way)
