"""GQA/MHA (Llama family; partial or interleaved rotary too) -> MLA in DeepSeek's layout, for one attention module.

Shapes: per-head projections (n, head_dim, d) as in ``convert.gqa`` (``d`` = d_model, +1 with biases).
A *plane* ``f`` (0 <= f < head_dim/2) is the pair of rows (f, f + head_dim/2) that half-split RoPE rotates
together, by the angle ``pos * theta ** (-2f / head_dim)``: plane 0 turns fastest. As a complex number
``z_f = x_f + i x_{f + head_dim/2}``, RoPE multiplies it by ``e^{i pos w_f}`` and the plane's share of a score is
``Re(conj(q_f) k_f e^{i (s - t) w_f})``.

DeepSeek's MLA caches a latent ``c`` (``kv_lora_rank`` values) and ONE rotary key of ``qk_rope_head_dim`` values
shared by all heads, rotated at the frequencies ``rope_theta' ** (-2j / qk_rope_head_dim)``, j < P =
qk_rope_head_dim/2. Those start at 1 and fall geometrically, so the source planes that can keep RoPE with their
own frequency are ``0, s, 2s, ..., (P-1)s`` for an integer stride ``s``, with ``rope_theta' = theta ** (s P /
(head_dim/2))`` (``rope_planes``). Which stride to use is ``convert.mla_model.choose_stride``'s job.

The conversion, per layer:

1. RoRoPE (TransMLA, Meng et al. 2025, arXiv 2502.07864): for each plane, a unitary mixing of the KV heads
   commutes with RoPE (every head's plane turns by the same angle), so the plane's keys of all KV heads can be
   written exactly as ``k_{g,f} = a_{g,f} k*_f + r_{g,f}``: a shared "virtual head" ``k*_f`` plus residuals,
   with ``k*_f`` the leading direction of the query-weighted keys (``convert.gqa.joint_fit`` with RoPE; the
   complex scalars ``a`` move onto the queries, exactly). ``rorope=False`` takes ``k*_f`` = the mean over KV
   heads instead (the naive baseline).
2. The kept planes' ``k*`` form the shared rotary key: exact. Everything else loses RoPE, which is the
   approximation: the residuals ``r`` of the kept planes and all of the other planes become position-free
   ("nope") keys (as MHA2MLA, Ji et al. 2025, arXiv 2502.14837, does for the planes it drops). Given how far
   back each head attends on calibration text (``distances``), a plane that loses RoPE keeps its *mean*
   rotation instead of none: its query is turned and shrunk by ``conj(E[e^{-i w_f D}])``
   (``mean_phase_queries``), the best position-free stand-in when the distance D is independent of the
   content. Slow planes keep nearly all of their scores, fast ones are damped instead of left unrotated.
3. The nope keys and the values of all KV heads are stacked and factored jointly into the latent: ``wkv_a`` =
   the ``kv_lora_rank`` leading directions of the stacked projections, ``wkv_b`` = the map back (SVD of the
   stacked projections, weighted by the second moment of calibration inputs when given, and by what reads each
   row: the queries for keys, ``wo`` for values, with ``weighting="readers"``). Exact at full rank.

Scaled RoPE (``AttentionConfig.rope_scaling``). The export keeps plain RoPE, which is what every engine
computes for a DeepSeek config (vLLM turns any other ``rope_type`` of one into its DeepSeek YaRN; llama.cpp
builds llama3's ``rope_freqs`` for the Llama architecture only). So a plane keeps RoPE only where the source
turns it at plain RoPE's frequency: "llama3" and "yarn" leave their fastest planes so (``plain_planes``: 29 of
Llama 3.1's 64, 24 of Qwen2.5's), and the kept planes ``0, s, ..., (P-1) s`` must lie among them
(``max_stride``'s ``planes``). Planes that lose RoPE keep their mean rotation at the source's actual, scaled
frequencies (``source_frequencies``). yarn's attention factor multiplies cos and sin, and so every score of a
source that turns every head dim by ``factor ** 2``: folded into ``wq``, exactly. "linear" (no plane at a plain
frequency), "dynamic" and "longrope" (frequencies that change with the sequence length) are refused
(``rope_obstacle``).

Partial and interleaved rotary (Phi-4-mini, GPT-NeoX, GLM, ChatGLM). Everything above counts planes over the
``rotary_dim`` dims RoPE turns, not the head: ``rotary_dim/2`` planes at ``theta ** (-2f / rotary_dim)``. The work
is done on each head's q/k rows in ``head_rows`` order: the turned dims first, as half-split planes (interleaved
pairs (2i, 2i + 1) moved there by ``interleaved_to_half_split``), then the dims RoPE never turns, which go to the
nope part as they are (no mean rotation: they never turned). Reordering a head's q and k rows alike changes no
score, so both are exact; the export writes DeepSeek's own rotary layout as for any source. yarn's factor scales
only the turned dims' share of a score, so only their query rows.

Exact cases (tested): a source without RoPE at full rank (any n_kv_heads; the rotary part is zero), a
one-KV-head source with every turned plane kept (``qk_rope_head_dim = rotary_dim``) at full rank, and, with llama3 or
yarn scaling, a one-KV-head source whose scaled planes carry no score, with its plain planes kept, at full
rank. With several KV heads only one virtual head per plane keeps RoPE, so no rank makes those exact. MLA's ``wq`` has no bias (DeepSeek's
layout), so a non-zero query bias is refused. The module is built with ``kv_norm=False``: keys and values stay
linear in the input, as in the source; ``convert.latent_norm`` adds DeepSeek's latent RMSNorm for export.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..attention.gqa import GroupedQueryAttention
from ..attention.mla import MultiHeadLatentAttention
from ..attention.rope import inverse_frequencies, plain_pairs
from ..config import ROPE_KEEPING_FAST_PLANES, ROPE_WITHOUT_PLAIN_PLANES, AttentionConfig, MLAConfig
from .gqa import _augmented, _sqrt_and_inv_sqrt, head_rows, input_moment, joint_fit

WEIGHTINGS = ("readers", "inputs")


def _check_int(name: str, value: object, low: int, high: int, why: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}] ({why}), got {value!r}")
    return value


def check_rope_dim(rope_dim: object, cfg: AttentionConfig, name: str = "rope_dim") -> int:
    """``rope_dim`` (qk_rope_head_dim) validated against the dims the source turns (``rotary_dim``: the rotary key
    can carry no other); returned as an int. ``name``: how the message names it (the CLI's ``--rope-dim``)."""
    if cfg.rope and cfg.rotary_dim < cfg.head_dim:
        high, why = (
            cfg.rotary_dim,
            f"RoPE turns {cfg.rotary_dim} of the source's head_dim={cfg.head_dim} dims",
        )
    else:
        high, why = max(cfg.head_dim, 2), f"the rotary key of a source with head_dim={cfg.head_dim}"
    value = _check_int(name, rope_dim, 2, high, why)
    if value % 2:
        raise ValueError(f"{name} must be even (RoPE turns pairs of dims), got {value}")
    return value


def max_stride(rotary_dim: int, rope_dim: int, planes: int | None = None) -> int:
    """The largest stride ``s`` for which planes ``0, s, ..., (rope_dim/2 - 1) s`` lie among the ``planes``
    fastest of the ``rotary_dim`` dims a head turns (default all ``rotary_dim/2``: ``plain_planes`` of a scaled
    source); 0 if none does."""
    n_planes, limit = rope_dim // 2, rotary_dim // 2 if planes is None else planes
    if n_planes > limit:
        return 0
    return (limit - 1) // (n_planes - 1) if n_planes > 1 else 1


def rope_planes(
    rotary_dim: int, rope_dim: int, stride: int, name: str = "stride", planes: int | None = None
) -> torch.Tensor:
    """Source planes that keep RoPE: ``0, stride, ..., (rope_dim/2 - 1) * stride`` (long tensor), among the
    ``planes`` fastest of the ``rotary_dim/2`` a head turns (``max_stride``)."""
    high = max_stride(rotary_dim, rope_dim, planes)
    why = f"{rope_dim // 2} planes of a head turning {rotary_dim} dims"
    if planes is not None and planes < rotary_dim // 2:
        why += f", among its {planes} planes at plain RoPE frequencies"
    _check_int(name, stride, 1, high, why)
    return torch.arange(rope_dim // 2) * stride


def plain_planes(cfg: AttentionConfig) -> int:
    """How many planes, fastest first, the source turns at plain RoPE's frequencies: the ones that can keep
    RoPE exactly in a plain-RoPE export (every plane without scaling)."""
    return plain_pairs(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)


def source_frequencies(cfg: AttentionConfig) -> tuple[torch.Tensor, float]:
    """(rotary_dim/2,) float64 frequencies of the source's planes as it turns them (scaled, from transformers'
    ROPE_INIT_FUNCTIONS), and the factor its RoPE multiplies cos and sin by (yarn; 1 otherwise)."""
    inv_freq, factor = inverse_frequencies(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
    return inv_freq.double(), factor


def rope_obstacle(cfg: AttentionConfig) -> str | None:
    """Why the conversion cannot take ``cfg``'s RoPE, naming ``rope_parameters.rope_type``; None if it can."""
    if not cfg.rope or not cfg.rope_scaling:
        return None
    kind = cfg.rope_type
    if kind in ROPE_WITHOUT_PLAIN_PLANES:
        return f"rope_parameters.rope_type={kind!r}: {ROPE_WITHOUT_PLAIN_PLANES[kind]}"
    if kind not in ROPE_KEEPING_FAST_PLANES:
        taken = " or ".join(ROPE_KEEPING_FAST_PLANES)
        return f"rope_parameters.rope_type={kind!r}: the MLA conversion takes plain, {taken} RoPE"
    if plain_planes(cfg) == 0:
        return (
            f"rope_parameters.rope_type={kind!r} scales every plane, the fastest included, so none can keep "
            "RoPE in a plain-RoPE DeepSeek export"
        )
    return None


def default_rope_dim(cfg: AttentionConfig) -> int:
    """qk_rope_head_dim when none is asked for: every plane that can keep RoPE exactly (rotary_dim for plain
    RoPE, the plain band of a scaled one), or 2 (a zero rotary part) without RoPE."""
    return 2 * plain_planes(cfg) if cfg.rope and not rope_obstacle(cfg) else 2


def stride_limit(cfg: AttentionConfig, rope_dim: int, name: str = "rope_dim") -> int:
    """The largest stride whose ``rope_dim/2`` kept planes the source turns at plain RoPE frequencies; raises
    ValueError naming ``name`` (the CLI's ``--rope-dim``) when even stride 1 would keep a scaled plane."""
    plain = plain_planes(cfg)
    high = max_stride(cfg.rotary_dim, rope_dim, plain)
    if high == 0:
        raise ValueError(
            f"{name}={rope_dim} would keep {rope_dim // 2} rotary planes, but rope_type {cfg.rope_type!r} "
            f"scales every plane from {plain} on, and a DeepSeek export turns planes 0..{plain - 1} exactly "
            f"(plain RoPE): {name} must be at most {2 * plain}"
        )
    return high


def plane_rows(planes: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Rows of a head in the converter's order (``head_rows``) holding ``planes``: all first halves, then all
    second halves."""
    return torch.cat((planes, planes + rotary_dim // 2))


def mla_rope_theta(theta: float, rotary_dim: int, rope_dim: int, stride: int) -> float:
    """The MLA rope_theta whose j-th frequency is the source's frequency of plane ``j * stride``:
    ``theta' ** (-2j / rope_dim) = theta ** (-2 j stride / rotary_dim)``."""
    return float(theta ** (stride * rope_dim / rotary_dim))


def full_rank(cfg: AttentionConfig, rope_dim: int) -> int:
    """The latent size at which the factorisation is exact: the rows of the stacked nope keys and values, or
    the inputs (d_model, +1 with biases) if fewer, since a larger latent would hold nothing more."""
    rows = cfg.n_kv_heads * (_nope_dim(cfg, rope_dim) + cfg.head_dim)
    return min(rows, cfg.d_model + (1 if cfg.bias else 0))


def _nope_dim(cfg: AttentionConfig, rope_dim: int) -> int:
    # With one KV head the kept planes are carried whole by the rotary key: no residual is left to keep.
    return cfg.head_dim - rope_dim if cfg.rope and cfg.n_kv_heads == 1 else cfg.head_dim


def check_target(
    cfg: AttentionConfig,
    kv_lora_rank: object,
    rope_dim: object,
    stride: object = 1,
    names: dict[str, str] | None = None,
) -> int:
    """Validate an MLA target for a source with attention ``cfg`` before any work; returns the rope_dim
    (``None`` -> ``default_rope_dim``). Raises ValueError naming the bad value, by its name in ``names`` (keys
    "kv_lora_rank", "rope_dim", "stride"; the CLI passes its flags) or else by the argument's, or naming the
    ``rope_type`` the conversion cannot take (``rope_obstacle``)."""
    names = {"kv_lora_rank": "kv_lora_rank", "rope_dim": "rope_dim", "stride": "stride"} | (names or {})
    obstacle = rope_obstacle(cfg)
    if obstacle:
        raise ValueError(obstacle)
    # what an MLA layer (MLAConfig) has no field for: converted, the layer would silently compute another model
    for field, value, what in (("window", cfg.window, "sliding window"), ("softcap", cfg.softcap, "logit soft-capping"),
                               ("qk_norm", None if cfg.qk_norm == "none" else cfg.qk_norm, "q/k norms")):  # fmt: skip
        if value is not None:
            raise ValueError(
                f"the source's {field}={value!r} cannot be converted to MLA: an MLA layer has no {what}"
            )
    if rope_dim is None:
        rope_dim = default_rope_dim(cfg)
    rope_dim = check_rope_dim(rope_dim, cfg, names["rope_dim"])
    if cfg.rope:
        stride_limit(cfg, rope_dim, names["rope_dim"])
        rope_planes(cfg.rotary_dim, rope_dim, stride, names["stride"], plain_planes(cfg))
    high = full_rank(cfg, rope_dim)
    _check_int(names["kv_lora_rank"], kv_lora_rank, 1, high, "the rank of the stacked nope keys and values")
    return rope_dim


def _latent_basis(m: torch.Tensor, c: torch.Tensor, rank: int) -> torch.Tensor:
    """The ``rank`` leading left singular vectors of ``m C^(1/2)`` (rows of ``m``), most important first."""
    evals, evecs = torch.linalg.eigh(c)
    root = evecs * evals.clamp_min(0).sqrt()  # C = root root^T
    u, _, _ = torch.linalg.svd(m @ root, full_matrices=False)
    return u[:, :rank]


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


def shared_rotary_keys(
    attn: GroupedQueryAttention, c: torch.Tensor, rorope: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per plane of the dims RoPE turns, the virtual head ``k*`` (rotary_dim, d) and the maps ``a``
    (n_kv_heads, rotary_dim, rotary_dim), rows in ``head_rows`` order (half-split pairs).

    ``a[g] @ k*`` is KV head g's share of the virtual head (one complex scalar per plane, so it commutes with
    RoPE); ``rorope``: the leading query-weighted direction per plane, else the mean over KV heads.
    """
    cfg, hd, n_kv = attn.cfg, attn.head_dim, attn.n_kv_heads
    turned = head_rows(cfg)[: cfg.rotary_dim]
    wk = _augmented(attn.wk, n_kv, hd)[:, turned]
    r = len(turned)
    eye = torch.eye(r, dtype=wk.dtype).expand(n_kv, r, r)
    if n_kv == 1:
        return wk[0], eye.clone()
    if not rorope:
        return wk.mean(0), eye.clone()
    wq = _augmented(attn.wq, attn.n_heads, hd)[:, turned]
    sq = torch.einsum("hid,de,hje->hij", wq, c, wq).view(n_kv, cfg.n_rep, r, r).sum(1)
    return joint_fit(wk, sq, c, rope=True)


def gqa_to_mla(
    attn: GroupedQueryAttention,
    kv_lora_rank: int,
    *,
    rope_dim: int | None = None,
    stride: int = 1,
    calib: torch.Tensor | Iterable[torch.Tensor] | None = None,
    rorope: bool = True,
    weighting: str = "readers",
    distances: torch.Tensor | None = None,
) -> MultiHeadLatentAttention:
    """An MLA module (DeepSeek layout, ``kv_norm=False``) approximating ``attn``; see the module docstring.

    ``rope_dim``: qk_rope_head_dim (default: ``default_rope_dim``). ``stride``: source planes
    ``0, stride, 2 stride, ...`` keep RoPE. ``calib``: inputs of ``attn`` on calibration data, one tensor
    (..., d_model) or an iterable of them (only their second moment is kept); weights the virtual heads and the
    factorisation (without it every input direction counts alike).
    ``attn`` is not modified.
    """
    if not isinstance(attn, GroupedQueryAttention):
        raise TypeError(f"attn must be a GroupedQueryAttention, got {type(attn).__name__}")
    cfg, hd, n_kv = attn.cfg, attn.head_dim, attn.n_kv_heads
    if attn.wq.bias is not None and bool(attn.wq.bias.detach().ne(0).any()):
        raise ValueError("gqa_to_mla: MLA's wq has no bias, and this module's query bias is non-zero")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}; got {weighting!r}")
    rope_dim = check_target(cfg, kv_lora_rank, rope_dim, stride)
    nope = _nope_dim(cfg, rope_dim)
    rows = n_kv * (nope + hd)
    d_in = cfg.d_model + (1 if cfg.bias else 0)
    c = input_moment(calib, cfg) if calib is not None else torch.eye(d_in, dtype=torch.float64)
    # Dampen (as GPTQ does): directions the calibration never visits keep a small weight, so that a latent of
    # full rank is exact for every input, not only on the calibration span.
    c = c + 1e-6 * c.diagonal().mean() * torch.eye(d_in, dtype=c.dtype)

    # q/k rows in ``head_rows`` order: the turned dims as half-split planes first, then the dims never turned
    order = head_rows(cfg)
    wq = _augmented(attn.wq, cfg.n_heads, hd)[:, order]  # (H, hd, d_in); its bias column is zero (checked)
    wk, wv = _augmented(attn.wk, n_kv, hd)[:, order], _augmented(attn.wv, n_kv, hd)
    kv_of_head = torch.arange(cfg.n_heads) // cfg.n_rep
    if cfg.rope:
        r = cfg.rotary_dim
        inv_freq, factor = source_frequencies(cfg)
        # yarn multiplies cos and sin by ``factor``: every turned dim's share of a score is times factor^2
        wq = torch.cat((wq[:, :r] * factor**2, wq[:, r:]), dim=1)
        k_star, a = shared_rotary_keys(attn, c, rorope)
        kept = plane_rows(rope_planes(r, rope_dim, stride, planes=plain_planes(cfg)), r)
        k_rope = k_star[kept]  # (rope_dim, d_in): the shared rotary key
        q_turned = torch.einsum("hji,hjd->hid", a[kv_of_head], wq[:, :r])  # a^T q keeps a^T q . k* = q . a k*
        q_rope = q_turned[:, kept]
        k_nope = wk.clone()
        k_nope[:, kept] -= torch.einsum("gij,jd->gid", a, k_star)[:, kept]  # residuals of the kept planes
        m_rot = None if distances is None else mean_rotation(distances, inv_freq)
        # the dims RoPE never turns are position-free already: nope keys and queries as they are, exactly
        if m_rot is not None:
            wq = torch.cat((mean_phase_queries(wq[:, :r], m_rot), wq[:, r:]), dim=1)
        nope_rows = torch.arange(hd) if nope == hd else _complement(kept, hd)
        k_nope, q_nope = k_nope[:, nope_rows], wq[:, nope_rows]
        theta = mla_rope_theta(cfg.rope_theta, r, rope_dim, stride)
    else:
        k_rope = torch.zeros(rope_dim, d_in, dtype=wq.dtype)  # MLA always has a rotary part: left at zero
        q_rope = torch.zeros(cfg.n_heads, rope_dim, d_in, dtype=wq.dtype)
        k_nope, q_nope, theta = wk, wq, cfg.rope_theta

    m = torch.cat((k_nope, wv), dim=1)  # (n_kv, nope + hd, d_in): per KV head its nope key rows, then values
    root, inv_root = _row_weights(attn, q_nope, c, nope, weighting)
    weighted = (root @ m).reshape(rows, d_in)
    u = _latent_basis(weighted, c, kv_lora_rank)  # (rows, rank)
    w_b = (inv_root @ u.view(n_kv, nope + hd, kv_lora_rank))[kv_of_head]  # (H, nope + hd, rank)

    mla_cfg = MLAConfig(
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=hd,
        rope_theta=theta,
        bias=cfg.bias or cfg.has_out_bias,
        backend=cfg.backend,
        kv_norm=False,
    )
    weight = attn.wq.weight
    mla = MultiHeadLatentAttention(mla_cfg).to(weight.device, weight.dtype)
    # MLA scales scores by qk_head_dim^-1/2, the source by its softmax scale (hd^-1/2 unless set)
    scale = cfg.softmax_scale * mla_cfg.qk_head_dim**0.5
    q = torch.cat((q_nope, q_rope), dim=1)[..., : cfg.d_model] * scale  # the zero query-bias column dropped
    _set(mla.wq, q.reshape(-1, cfg.d_model))
    _set(mla.wkv_a, torch.cat((u.T @ weighted, k_rope)))
    _set(mla.wkv_b, w_b.reshape(-1, kv_lora_rank))
    wo = attn.wo.weight.detach().double()
    if attn.wo.bias is not None:
        wo = torch.cat((wo, attn.wo.bias.detach().double()[:, None]), dim=1)
    _set(mla.wo, wo)
    return mla


def mean_rotation(distances: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """(H, head_dim/2) complex ``m = E[e^{-i w_f D}]``: the mean rotation plane f of head h sees, over the
    distances ``D = t - s`` where that head attends (``distances`` (H, K): weight of D = 0..K-1), at the
    frequencies ``w`` = ``inv_freq`` (head_dim/2,) the source turns its planes by (``source_frequencies``: a
    scaled RoPE's slow planes turn slower than plain RoPE's)."""
    w = distances.double() / distances.double().sum(-1, keepdim=True).clamp_min(1e-300)
    angle = -inv_freq.double()[None, :] * torch.arange(w.shape[1], dtype=torch.float64)[:, None]  # (K, hd/2)
    return torch.complex(w @ angle.cos(), w @ angle.sin())


def mean_phase_queries(wq: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Queries (H, hd, d) whose planes are turned and shrunk by ``conj(m)`` (``mean_rotation``).

    A plane that loses RoPE contributes ``Re(conj(q) k e^{-i w D})`` at distance ``D`` in the source; averaged
    over the distances where the head attends that is ``Re(conj(q) k m) = Re(conj(conj(m) q) k)``: ``m`` is
    close to 1 for slow planes (RoPE barely mattered there) and small for fast ones (their rotated products
    average out). Putting ``conj(m)`` on the query keeps the nope key shared by all heads.
    """
    half = wq.shape[1] // 2
    re, im = m.real[..., None], m.imag[..., None]
    x1, x2 = wq[:, :half], wq[:, half:]
    # conj(m) (x1 + i x2) = (re x1 + im x2) + i (re x2 - im x1)
    return torch.cat((re * x1 + im * x2, re * x2 - im * x1), dim=1)


def _complement(rows: torch.Tensor, n: int) -> torch.Tensor:
    keep = torch.ones(n, dtype=torch.bool)
    keep[rows] = False
    return torch.arange(n)[keep]


def _row_weights(
    attn: GroupedQueryAttention, q_nope: torch.Tensor, c: torch.Tensor, nope: int, weighting: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head, ``S^(1/2)`` and ``S^(-1/2)`` (n_kv, nope + hd, nope + hd) for the stacked rows.

    "readers": a key row's error is weighted by the queries that read it (the error of the scores, times the
    softmax scale), a value row's by ``wo`` (the error of the output); "inputs": all rows alike.
    """
    cfg, hd, n_kv = attn.cfg, attn.head_dim, attn.n_kv_heads
    size = nope + hd
    if weighting == "inputs":
        eye = torch.eye(size, dtype=torch.float64).expand(n_kv, size, size)
        return eye, eye
    sk = torch.einsum("hid,de,hje->hij", q_nope, c, q_nope) / hd  # (H, nope, nope)
    sk = sk.view(n_kv, cfg.n_rep, nope, nope).sum(1)
    wo = attn.wo.weight.detach().double().view(cfg.d_model, cfg.n_heads, hd).permute(1, 0, 2)
    sv = torch.einsum("hdi,hdj->hij", wo, wo).view(n_kv, cfg.n_rep, hd, hd).sum(1)
    root = torch.zeros(n_kv, size, size, dtype=torch.float64)
    inv = torch.zeros_like(root)
    for g in range(n_kv):
        for block, s in ((slice(0, nope), sk[g]), (slice(nope, size), sv[g])):
            if s.numel():
                root[g, block, block], inv[g, block, block] = _sqrt_and_inv_sqrt(s)
    return root, inv
