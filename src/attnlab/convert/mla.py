"""GQA -> MLA: keys and values of all KV heads factorised jointly through one latent (MHA2MLA, TransMLA).

Shapes: per-head projections (n, head_dim, d) as in ``convert.gqa`` (``d`` = d_model, +1 with biases).

An MLA layer caches ``c = W_a x`` (``kv_lora_rank`` values) and one rotary key shared by all heads;
``wkv_b`` expands ``c`` into per-head keys and values. Stack every KV head's key and value projections into
``M`` (2 n_kv head_dim, d) and take its leading ``rank`` directions ``U`` (weighted by the second moment of
calibration inputs when given, else plain SVD): ``W_a = U^T M`` and ``wkv_b = U`` (rows of each query head's
KV head). When ``rank`` reaches the rank of ``M`` the factorisation is exact. The converted module has
``kv_norm=False``: DeepSeek's RMSNorm on the latent is not a linear map, so no weights could reproduce it.

RoPE cannot be folded into a latent: in DeepSeek's decoupled layout only one rotary key, shared by all heads,
is rotated. So:
    rope=False   keys and values both go through the latent (``qk_nope_head_dim = head_dim``); the required
                 rotary part (2 dims) is zero. Exact at full rank.
    rope=True    the rotary key is the source's single KV head's key (``qk_rope_head_dim = head_dim``, no
                 ``nope`` part) and only values go through the latent. Exact at full rank for MQA sources;
                 with several KV heads the keys are first merged into one (``mha_to_gqa(..., 1)``, "fit"
                 with calibration data, else "mean") and that merge is the only approximation.
MLA's ``wq`` has no bias (DeepSeek's layout), so a source with a non-zero query bias is refused.
"""

from __future__ import annotations

import torch

from ..attention.gqa import GroupedQueryAttention
from ..attention.mla import MultiHeadLatentAttention
from ..config import MLAConfig
from .gqa import _augmented, mha_to_gqa, second_moment


def _latent_basis(m: torch.Tensor, c: torch.Tensor, rank: int) -> torch.Tensor:
    """The ``rank`` leading directions (rows of ``m`` space) of ``m`` weighted by input moment ``c``."""
    _, evecs = torch.linalg.eigh(m @ c @ m.T)
    return evecs[:, -rank:].flip(-1)  # (rows, rank), most important first


def _set(lin: torch.nn.Linear, w: torch.Tensor) -> None:
    """Write float64 weights (out, d) or (out, d + 1) (bias as last column) into ``lin``."""
    with torch.no_grad():
        if lin.bias is not None:
            if w.shape[1] == lin.weight.shape[1] + 1:
                lin.bias.copy_(w[:, -1])
                w = w[:, :-1]
            else:
                lin.bias.zero_()
        lin.weight.copy_(w)


def gqa_to_mla(
    attn: GroupedQueryAttention, rank: int, *, calib: torch.Tensor | None = None
) -> MultiHeadLatentAttention:
    """An MLA module with latent size ``rank`` computing (exactly, where the module docstring says so) ``attn``.

    ``calib`` (..., d_model): inputs of ``attn`` on calibration data; weights the factorisation and, with RoPE
    and several KV heads, the merge of the keys.
    """
    if not isinstance(attn, GroupedQueryAttention):
        raise TypeError(f"attn must be a GroupedQueryAttention, got {type(attn).__name__}")
    cfg, hd = attn.cfg, attn.head_dim
    if attn.wq.bias is not None and bool(attn.wq.bias.detach().ne(0).any()):
        raise ValueError("gqa_to_mla: MLA's wq has no bias, and this module's query bias is non-zero")
    value_rows = cfg.n_kv_heads * hd
    full = value_rows if cfg.rope else 2 * value_rows
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= full:
        raise ValueError(
            f"rank must be an int in [1, {full}] (the full rank of the cached K/V), got {rank!r}"
        )
    d_in = cfg.d_model + (1 if cfg.bias else 0)
    c = second_moment(calib, cfg.bias) if calib is not None else torch.eye(d_in, dtype=torch.float64)

    if cfg.rope:
        keys = mha_to_gqa(attn, 1, "fit" if calib is not None else "mean", calib=calib)
        m = _augmented(attn.wv, cfg.n_kv_heads, hd).reshape(value_rows, -1)
        nope, rope = 0, hd
    else:
        keys = attn
        wk, wv = _augmented(attn.wk, cfg.n_kv_heads, hd), _augmented(attn.wv, cfg.n_kv_heads, hd)
        m = torch.cat((wk, wv), dim=1).reshape(full, -1)  # per KV head: its key rows, then its value rows
        nope, rope = hd, 2  # MLA always has a rotary part; it is left at zero
    u = _latent_basis(m, c, rank)  # (rows of m, rank)
    mla_cfg = MLAConfig(
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        kv_lora_rank=rank,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=hd,
        rope_theta=cfg.rope_theta,
        bias=cfg.bias,
        backend=cfg.backend,
        kv_norm=False,
    )
    weight = attn.wq.weight
    mla = MultiHeadLatentAttention(mla_cfg).to(weight.device, weight.dtype)
    kv_of_head = torch.arange(cfg.n_heads) // cfg.n_rep
    wq = keys.wq.weight.detach().double().view(cfg.n_heads, hd, cfg.d_model)
    if cfg.rope:
        k_rope = _augmented(keys.wk, 1, hd)[0]  # (hd, d): the one rotary key
        _set(mla.wkv_a, torch.cat((u.T @ m, k_rope)))
        _set(mla.wq, wq.reshape(-1, cfg.d_model))
        wkv_b = u.view(cfg.n_kv_heads, hd, rank)[kv_of_head]  # (H, v_head_dim, rank)
    else:
        _set(mla.wkv_a, torch.cat((u.T @ m, torch.zeros(rope, m.shape[1], dtype=m.dtype))))
        # MLA scales scores by (nope + rope)^-1/2; the source by head_dim^-1/2.
        scale = ((nope + rope) / hd) ** 0.5
        q = torch.cat((wq * scale, torch.zeros(cfg.n_heads, rope, cfg.d_model, dtype=wq.dtype)), dim=1)
        _set(mla.wq, q.reshape(-1, cfg.d_model))
        wkv_b = u.view(cfg.n_kv_heads, 2 * hd, rank)[kv_of_head]  # (H, nope + v_head_dim, rank)
    _set(mla.wkv_b, wkv_b.reshape(-1, rank))
    wo = attn.wo.weight.detach().double()
    if attn.wo.bias is not None:
        wo = torch.cat((wo, attn.wo.bias.detach().double()[:, None]), dim=1)
    _set(mla.wo, wo)
    return mla
