"""DeepSeek's latent RMSNorm (``kv_a_layernorm``) on a converted MLA layer, and what it costs.

A DeepSeek checkpoint always normalises the latent: ``c~ = w * c / rms(c)``. A layer converted from a Llama
(``gqa_to_mla``, ``kv_norm=False``) has no such norm: its keys and values are linear in ``c``. No weights make
``w * c / rms(c)`` equal ``c`` for every token, because ``rms(c)`` varies from token to token; but for any
invertible ``A`` the latent ``A c`` with ``wkv_b A^-1`` computes the same keys and values, so the norm costs
only as much as ``rms(A c)`` varies. ``fold_latent_norm`` therefore

1. picks a diagonal ``A`` (in the latent's principal basis) making ``||A c||^2`` as constant as possible over
   calibration tokens: ``A^2 = diag(p)``, ``p >= 0`` minimising ``sum_t (sum_i p_i c_ti^2 - 1)^2`` (a small
   non-negative least-squares problem), kept only if it beats ``A = I`` on the measure below, then scaled so the
   typical ``rms(A c)`` is 1 (far above the norm's eps);
2. sets the norm weight to the constant ``rho`` that maps that typical RMS back, ``rho = argmin sum_t ||A c_t
   (rho / rms(A c_t) - 1)||^2``, and folds ``A^-1`` into ``wkv_b``.

Each token's keys (nope part) and values are then scaled by ``rho / rms(A c_t)`` instead of 1; the rotary key
is untouched. ``latent_error`` (the relative size of that change over calibration tokens) is reported, and the
model-level cost is measured by ``convert.mla_model.logit_distance``.
"""

from __future__ import annotations

import torch

from ..attention.mla import MultiHeadLatentAttention
from ..attention.norm import RMSNorm


def _nnls(gram: torch.Tensor, rhs: torch.Tensor, tol: float = 1e-12) -> torch.Tensor:
    """argmin_{p >= 0} p^T gram p - 2 rhs^T p (Lawson & Hanson's active-set method, on the normal equations)."""
    n = rhs.numel()
    p = torch.zeros(n, dtype=gram.dtype)
    free = torch.zeros(n, dtype=torch.bool)
    scale = rhs.abs().max().clamp_min(1e-300)
    for _ in range(3 * n):
        grad = rhs - gram @ p  # minus half the gradient
        candidates = torch.where(~free & (grad > tol * scale))[0]
        if not len(candidates):
            break
        free[candidates[grad[candidates].argmax()]] = True
        while True:
            s = torch.zeros_like(p)
            idx = torch.where(free)[0]
            s[idx] = torch.linalg.lstsq(gram[idx][:, idx], rhs[idx, None]).solution[:, 0]
            if bool((s[idx] > 0).all()):
                p = s
                break
            bad = idx[s[idx] <= 0]
            alpha = (p[bad] / (p[bad] - s[bad]).clamp_min(1e-300)).min()
            p = p + alpha * (s - p)
            free &= p > 0
    return p


def _error(sq: torch.Tensor, p: torch.Tensor, eps: float) -> tuple[float, float]:
    """(rho, relative latent error) for squared latent coordinates ``sq`` (N, L) scaled by ``p``."""
    n = sq @ p  # ||A c_t||^2
    r = (n / sq.shape[1] + eps).sqrt()
    rho = ((n / r).sum() / (n / r.square()).sum()).item()
    err = ((n * (rho / r - 1).square()).sum() / n.sum().clamp_min(1e-300)).sqrt().item()
    return rho, err


@torch.no_grad()
def fold_latent_norm(
    mla: MultiHeadLatentAttention, calib: torch.Tensor, *, balance: bool = True
) -> tuple[MultiHeadLatentAttention, dict]:
    """A copy of ``mla`` (``kv_norm=False``) with DeepSeek's latent RMSNorm, and statistics of what it costs.

    ``calib`` (..., d_model): inputs of the layer on calibration data. ``balance``: try the diagonal rescaling
    of the latent (module docstring); without it ``A = I``. Returns ``(module, stats)`` with stats
    ``latent_error`` (relative change of the latent over ``calib``), ``rms_spread`` (std / mean of the latent's
    RMS over tokens) and ``balanced`` (whether the rescaling was kept).
    """
    if not isinstance(mla, MultiHeadLatentAttention):
        raise TypeError(f"mla must be a MultiHeadLatentAttention, got {type(mla).__name__}")
    cfg = mla.cfg
    if cfg.kv_norm:
        raise ValueError("fold_latent_norm: this module already has its latent norm (cfg.kv_norm=True)")
    if calib.shape[-1] != cfg.d_model or calib.numel() == 0:
        raise ValueError(f"calib must be non-empty (..., d_model={cfg.d_model}), got {tuple(calib.shape)}")
    rank = cfg.kv_lora_rank
    x = calib.detach().reshape(-1, cfg.d_model).to(mla.wkv_a.weight.dtype)
    latent = mla.wkv_a(x)[:, :rank].double()  # (N, rank)
    sq = latent.square()
    eps = RMSNorm(1).eps
    p = torch.ones(rank, dtype=torch.float64)
    p = p / (sq @ p).mean() * rank  # typical rms = 1
    _, err = _error(sq, p, eps)
    balanced = False
    if balance:
        fitted = _nnls(sq.T @ sq / len(sq), sq.mean(0))
        if bool((fitted > 0).any()):
            # A latent coordinate given weight 0 is still read by wkv_b: keep it, at a tiny weight.
            fitted = fitted.clamp_min(fitted.max().item() * 1e-6)
            fitted = fitted / (sq @ fitted).mean() * rank
            _, fitted_err = _error(sq, fitted, eps)
            if fitted_err < err:
                p, err, balanced = fitted, fitted_err, True
    rho, err = _error(sq, p, eps)
    a = p.sqrt()
    rms = ((sq @ p) / rank + eps).sqrt()

    out = MultiHeadLatentAttention(cfg.replace(kv_norm=True)).to(
        mla.wkv_a.weight.device, mla.wkv_a.weight.dtype
    )
    out.load_state_dict(mla.state_dict(), strict=False)  # everything but kv_norm.weight, overwritten below
    out.mode = mla.mode
    dtype = mla.wkv_a.weight.dtype
    scale = torch.cat((a, torch.ones(cfg.qk_rope_head_dim, dtype=torch.float64))).to(dtype)
    out.wkv_a.weight.mul_(scale[:, None])
    if out.wkv_a.bias is not None:
        out.wkv_a.bias.mul_(scale)
    out.wkv_b.weight.div_(a.to(dtype)[None, :])
    out.kv_norm.weight.fill_(rho)
    stats = {
        "latent_error": err,
        "rms_spread": (rms.std() / rms.mean()).item() if len(rms) > 1 else 0.0,
        "balanced": balanced,
    }
    return out, stats
