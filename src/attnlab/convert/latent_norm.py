"""DeepSeek's latent RMSNorm (``kv_a_layernorm``) on a converted MLA layer, and what it costs.

A DeepSeek checkpoint always normalises the latent: ``c~ = w * c / rms(c)``. A layer converted from a Llama
(``gqa_to_mla``, ``kv_norm=False``) has no such norm: its keys and values are linear in ``c``. No weights make
``w * c / rms(c)`` equal ``c`` for every token, because ``rms(c)`` varies from token to token; but for any
invertible ``A`` the latent ``A c`` with ``wkv_b A^-1`` computes the same keys and values, so the norm costs
only as much as ``rms(A c)`` varies. ``fold_latent_norm`` therefore

1. picks ``A`` making ``||A c||^2`` as constant as possible over calibration tokens: a diagonal one,
   ``A^2 = diag(p)`` with ``p >= 0`` minimising ``sum_t (sum_i p_i c_ti^2 - 1)^2`` (a small non-negative least
   squares problem), then, starting from it, a general one (L-BFGS on the same objective, its singular values
   clipped to a condition number of 100 so that ``wkv_b A^-1`` loses no precision); whichever of ``I``,
   diagonal and general changes the latent least on calibration tokens is kept, scaled so the typical
   ``rms(A c)`` is 1 (far above the norm's eps);
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
    # On a CPU gelsd (SVD): the CPU default, gelsy, gave a different solution from call to call on the same inputs
    # (MKL, 1e-8 relative), so that a conversion's bytes changed from run to run. CUDA has gels alone (its default).
    driver = "gelsd" if gram.device.type == "cpu" else None
    for _ in range(3 * n):
        grad = rhs - gram @ p  # minus half the gradient
        candidates = torch.where(~free & (grad > tol * scale))[0]
        if not len(candidates):
            break
        free[candidates[grad[candidates].argmax()]] = True
        while True:
            s = torch.zeros_like(p)
            idx = torch.where(free)[0]
            s[idx] = torch.linalg.lstsq(gram[idx][:, idx], rhs[idx, None], driver=driver).solution[:, 0]
            if bool((s[idx] > 0).all()):
                p = s
                break
            bad = idx[s[idx] <= 0]
            alpha = (p[bad] / (p[bad] - s[bad]).clamp_min(1e-300)).min()
            p = p + alpha * (s - p)
            free &= p > 0
    return p


def _error(latent: torch.Tensor, a: torch.Tensor, eps: float) -> tuple[float, float]:
    """(rho, relative latent error) of the latent ``A c`` (``latent`` (N, L) rows c, ``a`` (L, L))."""
    n = (latent @ a.T).square().sum(-1)  # ||A c_t||^2
    r = (n / latent.shape[1] + eps).sqrt()
    rho = ((n / r).sum() / (n / r.square()).sum()).item()
    err = ((n * (rho / r - 1).square()).sum() / n.sum().clamp_min(1e-300)).sqrt().item()
    return rho, err


def _unit_rms(latent: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``a`` scaled so that the mean square of the entries of ``A c`` over tokens is 1."""
    return a / (latent @ a.T).square().mean().sqrt().clamp_min(1e-300)


def _diagonal(latent: torch.Tensor) -> torch.Tensor | None:
    """diag(sqrt(p)), p >= 0 minimising sum_t (sum_i p_i c_ti^2 - 1)^2; None if every p_i is 0."""
    sq = latent.square()
    p = _nnls(sq.T @ sq / len(sq), sq.mean(0))
    if not bool((p > 0).any()):
        return None
    # A coordinate given weight 0 is still read by wkv_b: keep it, at a small weight.
    return torch.diag(p.clamp_min(p.max().item() * 1e-4).sqrt())


def _general(latent: torch.Tensor, start: torch.Tensor, max_cond: float, steps: int) -> torch.Tensor:
    """Any ``A`` (from ``start``) making ``rms(A c_t)`` nearly 1: L-BFGS on the squared deviation of its
    square, then singular values clipped to ``max_cond`` so that ``wkv_b A^-1`` stays well conditioned."""
    a = start.clone().requires_grad_(True)
    opt = torch.optim.LBFGS(
        [a], max_iter=steps, line_search_fn="strong_wolfe", tolerance_grad=1e-12, tolerance_change=1e-15
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = ((latent @ a.T).square().mean(-1) - 1).square().mean()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    u, s, vh = torch.linalg.svd(a.detach())
    return (u * s.clamp_min(s.max() / max_cond)) @ vh


@torch.no_grad()
def fold_latent_norm(
    mla: MultiHeadLatentAttention,
    calib: torch.Tensor,
    *,
    balance: bool = True,
    max_cond: float = 100.0,
    general_up_to: int = 512,
    steps: int = 200,
) -> tuple[MultiHeadLatentAttention, dict]:
    """A copy of ``mla`` (``kv_norm=False``) with DeepSeek's latent RMSNorm, and statistics of what it costs.

    ``calib`` (..., d_model): inputs of the layer on calibration data. ``balance``: look for a map ``A`` of the
    latent that makes its RMS nearly constant (module docstring): diagonal, and for latents of at most
    ``general_up_to`` values also a general one (``steps`` L-BFGS iterations, condition number at most
    ``max_cond``); the one with the smallest error on ``calib`` is kept, ``A = I`` included. Returns
    ``(module, stats)`` with ``latent_error`` (relative change of the latent over ``calib``), ``rms_spread``
    (std / mean of the latent's RMS over tokens) and ``balance`` ("none", "diagonal" or "general").
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
    eps = RMSNorm(1).eps
    candidates = {"none": torch.eye(rank, dtype=torch.float64)}
    if balance:
        diagonal = _diagonal(latent)
        if diagonal is not None:
            candidates["diagonal"] = diagonal
            if rank <= general_up_to:
                rows = latent[:: max(1, len(latent) // 4096)]  # a fit on at most ~4k tokens bounds its cost
                candidates["general"] = _general(rows, _unit_rms(rows, diagonal), max_cond, steps)
    candidates = {k: _unit_rms(latent, a) for k, a in candidates.items()}  # typical rms(A c) = 1
    kind = "none"
    for name, cand in candidates.items():  # a more general map only when it is clearly better
        new, old = _error(latent, cand, eps)[1], _error(latent, candidates[kind], eps)[1]
        # where the simpler map is exact already (error ~1e-16), rounding alone can make the other look 1 % better:
        # an absolute margin keeps that from deciding (it once did, in a full run of the test suite)
        if new < 0.99 * old and old - new > 1e-9:
            kind = name
    a = candidates[kind]
    rho, err = _error(latent, a, eps)
    rms = ((latent @ a.T).square().mean(-1) + eps).sqrt()

    out = MultiHeadLatentAttention(cfg.replace(kv_norm=True)).to(
        mla.wkv_a.weight.device, mla.wkv_a.weight.dtype
    )
    out.load_state_dict(mla.state_dict(), strict=False)  # everything but kv_norm.weight, overwritten below
    dtype = mla.wkv_a.weight.dtype
    w_a = mla.wkv_a.weight.detach().double()
    out.wkv_a.weight[:rank] = (a @ w_a[:rank]).to(dtype)
    if out.wkv_a.bias is not None:
        out.wkv_a.bias[:rank] = (a @ mla.wkv_a.bias.detach().double()[:rank]).to(dtype)
    out.wkv_b.weight.copy_(torch.linalg.solve(a.T, mla.wkv_b.weight.detach().double().T).T.to(dtype))
    out.kv_norm.weight.fill_(rho)
    stats = {
        "latent_error": err,
        "rms_spread": (rms.std() / rms.mean()).item() if len(rms) > 1 else 0.0,
        "balance": kind,
    }
    return out, stats
