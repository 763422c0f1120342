"""MHA -> GQA/MQA conversion of one attention module: the GQA paper's three methods and a data-aware fit.

Shapes: projection weights per head ``(n, head_dim, d)`` where ``d`` is ``d_model`` (+1 when the module has
biases: the bias is carried as the last column, i.e. as the weight of an input coordinate that is always 1).
Source KV head ``j`` is read by query heads ``j * rep ... (j + 1) * rep - 1`` (``rep`` = source group size), and
new KV head ``g`` replaces source KV heads ``g * r ... (g + 1) * r - 1`` (``r`` = source KV heads merged into one).
So MHA -> GQA-``g`` merges consecutive heads, the layout of Hugging Face's ``repeat_kv``; ``permute_heads``
reorders heads first when other groups are wanted.

Methods (Ainslie et al. 2023, "GQA", section 2.1, compare the first three):
    "mean"    each new K/V head (weights and biases) is the mean of the heads it replaces.
    "first"   each new K/V head is the first head of its group.
    "random"  new K/V projections drawn at random (normal, the source matrix's std; zero biases).
    "fit"     data-aware: for each group, the shared projection ``B`` and per-head maps ``A_i`` minimising
              ``sum_i E_x || S_i^(1/2) (P_i - A_i B) x ||^2`` over calibration inputs ``x``, where ``P_i`` is
              head i's K (or V) projection and ``S_i`` weights errors by what reads them: the second moment of
              head i's queries for K (so the error is that of the attention scores) and ``Wo_i^T Wo_i`` for V
              (so it is that of the output). ``A_i`` is then folded into the readers, exactly: queries become
              ``A_i^T q`` (``wq`` rows) and the output projection ``Wo_i A_i`` (``wo`` columns). The optimum is a
              truncated eigendecomposition (a weighted joint PCA of the group's projections). With RoPE, ``A_i``
              on K must commute with every rotation, so it is restricted to one complex scalar per frequency
              pair (a rotation and scale of each 2-D plane), the pairs RoPE really turns (``head_rows``: the
              family's half-split or interleaved layout, partial rotary's unturned dims apart with a full
              matrix of their own); V and rope=False K get a full ``head_dim`` matrix.
              This generalises Procrustes alignment before averaging (arXiv 2412.20677: ``A_i`` orthogonal).
    "grouped-fit" "fit" after choosing which heads share a KV head by similarity instead of by index (as
              AsymGQA and QCQA do): groups are grown greedily to keep small the fraction of the weighted K
              and V energy that one shared head cannot carry, then heads are reordered with
              ``permute_heads`` (which leaves the function unchanged) so that each group is consecutive.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator

import torch

from ..attention.gqa import GroupedQueryAttention
from ..attention.rope import interleaved_to_half_split
from ..config import AttentionConfig

METHODS = ("mean", "first", "random", "fit", "grouped-fit")


def _check_target(attn: GroupedQueryAttention, n_kv_heads: int, method: str) -> int:
    if not isinstance(attn, GroupedQueryAttention):
        raise TypeError(f"attn must be a GroupedQueryAttention, got {type(attn).__name__}")
    if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, int):
        raise TypeError(f"n_kv_heads must be an int, got {n_kv_heads!r}")
    if n_kv_heads < 1 or attn.n_kv_heads % n_kv_heads:
        raise ValueError(
            f"n_kv_heads={n_kv_heads} must be >= 1 and divide the source's n_kv_heads={attn.n_kv_heads}"
        )
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    return attn.n_kv_heads // n_kv_heads


def _augmented(lin: torch.nn.Linear, n: int, head_dim: int) -> torch.Tensor:
    """(n, head_dim, d) float64 per-head weights of a projection, bias appended as a last column."""
    w = lin.weight.detach().double()
    if lin.bias is not None:
        w = torch.cat((w, lin.bias.detach().double()[:, None]), dim=1)
    return w.view(n, head_dim, -1)


def _store(lin: torch.nn.Linear, heads: torch.Tensor) -> None:
    """Write (n, head_dim, d) augmented per-head weights back into ``lin`` (inverse of ``_augmented``)."""
    w = heads.reshape(lin.weight.shape[0], -1)
    with torch.no_grad():
        if lin.bias is not None:
            lin.bias.copy_(w[:, -1])
            w = w[:, :-1]
        lin.weight.copy_(w)


def second_moment(
    x: torch.Tensor | Iterable[torch.Tensor], bias: bool, min_rows: int = 1, why: str = ""
) -> torch.Tensor:
    """E[x x^T] (d, d) in float64 over all rows of ``x`` (..., d_model), or of every tensor of an iterable of
    them (accumulated one at a time: only the (d, d) sum is kept); with ``bias`` x gets a trailing 1.
    Fewer than ``min_rows`` rows: a ValueError that gives ``why`` the reason."""
    total, n = None, 0
    for chunk in [x] if isinstance(x, torch.Tensor) else x:
        rows = chunk.detach().reshape(-1, chunk.shape[-1]).double()
        if bias:
            rows = torch.cat(
                (rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)), dim=1
            )
        total = rows.T @ rows if total is None else total + rows.T @ rows
        n += rows.shape[0]
    if total is None or not n:
        raise ValueError("calibration inputs are empty: no rows to take a second moment of")
    if not bool(torch.isfinite(total).all()):  # else eigh fails on it, naming nothing the caller knows
        raise ValueError(
            "calibration inputs hold NaN or inf values: the model overflows on the calibration text"
        )
    if n < min_rows:
        raise ValueError(f"calibration has {n} token rows, fewer than {min_rows}{why}")
    return total / n


def input_moment(
    calib: torch.Tensor | Iterable[torch.Tensor], cfg: AttentionConfig, min_rows: int = 1, why: str = ""
) -> torch.Tensor:
    """``second_moment`` of a module's calibration inputs, each (..., d_model) checked against ``cfg``."""

    def checked(chunks: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
        for x in chunks:
            if x.shape[-1] != cfg.d_model:
                raise ValueError(f"calib must be (..., d_model={cfg.d_model}), got {tuple(x.shape)}")
            yield x

    chunks = checked([calib] if isinstance(calib, torch.Tensor) else calib)
    return second_moment(chunks, cfg.bias, min_rows, why)


def permute_heads(attn: GroupedQueryAttention, perm: torch.Tensor | list[int]) -> GroupedQueryAttention:
    """A copy whose KV head ``j`` is the source's KV head ``perm[j]``, with its query heads and ``wo`` columns.

    Queries, keys and values move together (and the gains of q/k norms over all heads), so the output is unchanged
    (up to float summation order).
    """
    perm = torch.as_tensor(perm, dtype=torch.long)
    if sorted(perm.tolist()) != list(range(attn.n_kv_heads)):
        raise ValueError(f"perm must be a permutation of range({attn.n_kv_heads}), got {perm.tolist()}")
    rep, hd = attn.cfg.n_rep, attn.head_dim
    q_perm = (perm[:, None] * rep + torch.arange(rep)).reshape(-1)  # query heads follow their KV head
    out = copy.deepcopy(attn)

    def rows(p: torch.Tensor) -> torch.Tensor:  # weight rows of the heads in p, in p's order
        return (p[:, None] * hd + torch.arange(hd)).reshape(-1)

    with torch.no_grad():
        for lin, idx in ((out.wq, rows(q_perm)), (out.wk, rows(perm))):
            src = attn.wq if lin is out.wq else attn.wk
            lin.weight.copy_(src.weight[idx])
            if lin.bias is not None:
                lin.bias.copy_(src.bias[idx])
        idx = rows(perm)
        out.wv.weight.copy_(attn.wv.weight[idx])
        if out.wv.bias is not None:
            out.wv.bias.copy_(attn.wv.bias[idx])
        out.wo.weight.copy_(attn.wo.weight[:, rows(q_perm)])
        # q/k norms over all heads (OLMo 2) have one gain per value of every head: they move with their heads
        if attn.cfg.qk_norm == "full":
            out.q_norm.weight.copy_(attn.q_norm.weight[rows(q_perm)])
            out.k_norm.weight.copy_(attn.k_norm.weight[rows(perm)])
    return out


def _sqrt_and_inv_sqrt(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """S^(1/2) and S^(-1/2) of a PSD matrix, with a small ridge so directions never read stay finite."""
    evals, evecs = torch.linalg.eigh(s)
    evals = evals.clamp_min(0) + 1e-8 * evals.abs().max().clamp_min(1e-30)
    return (evecs * evals.sqrt()) @ evecs.T, (evecs * evals.rsqrt()) @ evecs.T


def head_rows(cfg: AttentionConfig) -> torch.Tensor:
    """The order of one head's q/k rows that the fits work in: the ``rotary_dim`` dims RoPE turns as
    half-split pairs (plane f at rows f and f + rotary_dim/2), then the dims it never turns. ``w[head_rows(cfg)]``
    of a half-split source is ``w`` itself; of an interleaved one (GLM, ChatGLM: pairs (2i, 2i + 1)) it is the
    named permutation ``interleaved_to_half_split``. A fixed order of rows changes no score, so the source's
    scores are unchanged."""
    if not cfg.rope:
        return torch.arange(cfg.head_dim)
    rotary = cfg.rotary_dim
    turned = interleaved_to_half_split(rotary) if cfg.rope_interleaved else torch.arange(rotary)
    return torch.cat((turned, torch.arange(rotary, cfg.head_dim)))


def joint_fit(
    p: torch.Tensor, s: torch.Tensor, c: torch.Tensor, rope: bool, rotary: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared ``B`` (head_dim, d) and maps ``A`` (r, head_dim, head_dim) with ``P_i ~ A_i B``; see module doc.

    ``p`` (r, head_dim, d): the projections to merge; ``s`` (r, head_dim, head_dim): PSD error weights;
    ``c`` (d, d): second moment of the inputs. ``rope``: restrict each ``A_i`` to commute with RoPE, whose
    ``rotary`` (default all) leading rows are half-split planes (``head_rows`` order); the rows after them never
    turn, so their block of ``A_i`` is a full matrix (fitted apart: no map between turned and unturned rows
    commutes with every rotation).
    """
    r, hd, _ = p.shape
    rotary = hd if rotary is None else rotary
    if rope and rotary < hd:
        b, a = torch.zeros_like(p[0]), p.new_zeros(r, hd, hd)
        b[:rotary], a[:, :rotary, :rotary] = _joint_fit_rope(p[:, :rotary], s[:, :rotary, :rotary], c)
        b[rotary:], a[:, rotary:, rotary:] = joint_fit(p[:, rotary:], s[:, rotary:, rotary:], c, rope=False)
        return b, a
    if rope:
        return _joint_fit_rope(p, s, c)
    roots = [_sqrt_and_inv_sqrt(s[i]) for i in range(r)]
    m = torch.cat([roots[i][0] @ p[i] for i in range(r)])  # (r * hd, d)
    _, evecs = torch.linalg.eigh(m @ c @ m.T)
    u = evecs[:, -hd:]  # the hd leading directions of the weighted, stacked projections
    b = u.T @ m
    a = torch.stack([roots[i][1] @ u[i * hd : (i + 1) * hd] for i in range(r)])
    return b, a


def _joint_fit_rope(p: torch.Tensor, s: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Half-split RoPE rotates the planes (f, f + hd/2); as a complex number z_f = x_f + i x_{f+hd/2} a key
    # becomes z_f e^{i theta}. Maps that commute with every rotation are complex scalars alpha per plane, and
    # the score Re(conj(q_f) alpha z_f) = Re(conj(conj(alpha) q_f) z_f) moves alpha onto the query.
    r, hd, d = p.shape
    half = hd // 2
    b = torch.zeros(hd, d, dtype=p.dtype, device=p.device)
    a = torch.zeros(r, hd, hd, dtype=p.dtype, device=p.device)
    cc = c.to(torch.complex128)
    for f in range(half):
        weight = (s[:, f, f] + s[:, f + half, f + half]).clamp_min(0).sqrt() + 1e-12  # E|q_f|, (r,)
        z = torch.complex(p[:, f], p[:, f + half])  # (r, d)
        m = weight[:, None] * z
        _, evecs = torch.linalg.eigh(m @ cc @ m.conj().T)
        u = evecs[:, -1]  # (r,) leading direction: one complex plane shared by the group
        bf = u.conj() @ m  # (d,)
        alpha = u / weight
        b[f], b[f + half] = bf.real, bf.imag
        a[:, f, f], a[:, f, f + half] = alpha.real, -alpha.imag
        a[:, f + half, f], a[:, f + half, f + half] = alpha.imag, alpha.real
    return b, a


def _fit_inputs(attn: GroupedQueryAttention, c: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-head projections and error weights (per source KV head, summed over the query heads reading it);
    ``c``: second moment of the calibration inputs (``input_moment``). Query and key rows in ``head_rows``
    order (the same order for both: no score changes)."""
    cfg, hd, n_kv = attn.cfg, attn.head_dim, attn.n_kv_heads
    rows = head_rows(cfg)
    wq = _augmented(attn.wq, cfg.n_heads, hd)[:, rows]
    wo = attn.wo.weight.detach().double().view(cfg.d_model, cfg.n_heads, hd).permute(1, 0, 2)  # (H, d, hd)
    return {
        "c": c,
        "wq": wq,
        "wo": wo,
        "wk": _augmented(attn.wk, n_kv, hd)[:, rows],
        "wv": _augmented(attn.wv, n_kv, hd),
        "sq": torch.einsum("hid,de,hje->hij", wq, c, wq).view(n_kv, cfg.n_rep, hd, hd).sum(1),
        "so": torch.einsum("hdi,hdj->hij", wo, wo).view(n_kv, cfg.n_rep, hd, hd).sum(1),
    }


def _gram(
    p: torch.Tensor, s: torch.Tensor, c: torch.Tensor, rotary: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gram matrices of all heads' weighted projections: what ``joint_fit`` decomposes, for every head at once.

    ``rotary`` leading rows turn (0: none): (rotary/2, n, n) complex, one per frequency plane; the other rows:
    (n * rows, n * rows) real.
    """
    n, hd, _ = p.shape
    half = rotary // 2
    diag = s.diagonal(dim1=1, dim2=2)[:, :rotary]  # (n, rotary)
    weight = (diag[:, :half] + diag[:, half:]).clamp_min(0).sqrt() + 1e-12  # as in _joint_fit_rope
    z = (torch.complex(p[:, :half], p[:, half:rotary]) * weight[..., None]).transpose(0, 1)  # (half, n, d)
    planes = z @ c.to(torch.complex128) @ z.conj().transpose(1, 2)
    if rotary == hd:
        return planes, p.new_zeros(0, 0)
    m = torch.cat([_sqrt_and_inv_sqrt(s[i, rotary:, rotary:])[0] @ p[i, rotary:] for i in range(n)])
    return planes, m @ c @ m.T


def _residual(gram: tuple[torch.Tensor, torch.Tensor], group: list[int], hd: int) -> float:
    """Weighted energy of the heads in ``group`` that one shared head cannot carry (``hd`` rows per head)."""
    planes, flat = gram
    sub = planes[:, group][:, :, group]
    turned = (sub.diagonal(dim1=1, dim2=2).real.sum() - torch.linalg.eigvalsh(sub)[:, -1].sum()).item()
    pd = hd - 2 * planes.shape[0]  # the rows that never turn
    if pd == 0:
        return turned
    rows = torch.cat([torch.arange(h * pd, (h + 1) * pd) for h in group])
    return turned + torch.linalg.eigvalsh(flat[rows][:, rows])[:-pd].sum().item()


def _total(gram: tuple[torch.Tensor, torch.Tensor]) -> float:
    return gram[0].diagonal(dim1=-2, dim2=-1).real.sum().item() + gram[1].diagonal().sum().item()


def similarity_groups(
    attn: GroupedQueryAttention, n_kv_heads: int, calib: torch.Tensor | Iterable[torch.Tensor]
) -> list[int]:
    """An order of the source KV heads whose consecutive runs (one per new KV head) merge with little loss."""
    r = _check_target(attn, n_kv_heads, "grouped-fit")
    return _similarity_order(attn, r, input_moment(calib, attn.cfg))


def _similarity_order(attn: GroupedQueryAttention, r: int, c: torch.Tensor) -> list[int]:
    st, hd = _fit_inputs(attn, c), attn.head_dim
    rotary = attn.cfg.rotary_dim if attn.cfg.rope else 0
    gk, gv = _gram(st["wk"], st["sq"], st["c"], rotary), _gram(st["wv"], st["so"], st["c"], 0)
    total_k, total_v = _total(gk), _total(gv)

    def cost(group: list[int]) -> float:  # K and V losses, each as a fraction of the layer's total
        return _residual(gk, group, hd) / total_k + _residual(gv, group, hd) / total_v

    left, order = list(range(attn.n_kv_heads)), []
    while left:
        group = [left.pop(0)]
        while len(group) < r:
            best = min(left, key=lambda j: cost([*group, j]))
            group.append(best)
            left.remove(best)
        order += group

    def lost(heads: list[int]) -> float:
        return sum(cost(heads[i : i + r]) for i in range(0, len(heads), r))

    # the greedy groups, unless the heads' own order loses less (greedy seeds each group with the first head left
    # and gives the last group what remains: on a QA checkpoint 1.042 of the layer's energy against the index
    # order's 1.028, where grouped-fit then lost to fit)
    return min((list(range(attn.n_kv_heads)), order), key=lost)


def mha_to_gqa(
    attn: GroupedQueryAttention,
    n_kv_heads: int,
    method: str = "mean",
    *,
    calib: torch.Tensor | Iterable[torch.Tensor] | None = None,
    seed: int = 0,
) -> GroupedQueryAttention:
    """A new module with ``n_kv_heads`` KV heads converted from ``attn`` (MHA or GQA); ``attn`` is not modified.

    ``calib``: inputs of this module on calibration data, required by "fit" and "grouped-fit": one tensor
    (..., d_model) or an iterable of them (e.g. batch by batch: only their second moment is kept).
    ``n_kv_heads`` equal to the source's returns an exact copy for every method (nothing is merged).
    """
    r = _check_target(attn, n_kv_heads, method)
    if r == 1:
        return copy.deepcopy(attn)
    if method in ("fit", "grouped-fit"):
        if calib is None:
            raise ValueError(
                f"method={method!r} needs calib: the module's inputs on calibration data (..., d_model)"
            )
        # Fewer rows than head_dim leave each head's error weight singular: the ridge alone then sets the maps,
        # which came out ~4,000x the source's weights and worse than "mean" (a one-word calibration text).
        why = f" (head_dim): {method!r} needs at least head_dim tokens of calibration; or use method 'mean'"
        c = input_moment(calib, attn.cfg, min_rows=attn.head_dim, why=why)
        if method == "grouped-fit":  # heads reordered (the function unchanged): each group consecutive
            attn = permute_heads(attn, _similarity_order(attn, r, c))
    weight = attn.wq.weight
    new = GroupedQueryAttention(attn.cfg.replace(n_kv_heads=n_kv_heads)).to(weight.device, weight.dtype)
    new.load_state_dict(
        {k: v for k, v in attn.state_dict().items() if k.startswith(("wq.", "wo.", "q_norm."))}, strict=False
    )
    n_src, hd = attn.n_kv_heads, attn.head_dim
    if attn.cfg.qk_norm == "head":  # one gain per head dim, shared by every KV head: kept
        new.k_norm.load_state_dict(attn.k_norm.state_dict())
    elif attn.cfg.qk_norm == "full":  # one gain per value of each KV head: pooled like the keys
        gains = attn.k_norm.weight.detach().view(n_src, hd)
        pooled = (
            gains.view(n_kv_heads, r, hd)[:, 0]
            if method == "first"
            else gains.view(n_kv_heads, r, hd).mean(1)
        )
        with torch.no_grad():
            new.k_norm.weight.copy_(pooled.reshape(-1))
    wk, wv = _augmented(attn.wk, n_src, hd), _augmented(attn.wv, n_src, hd)
    if method == "mean":
        _store(new.wk, wk.view(n_kv_heads, r, hd, -1).mean(1))
        _store(new.wv, wv.view(n_kv_heads, r, hd, -1).mean(1))
    elif method == "first":
        _store(new.wk, wk.view(n_kv_heads, r, hd, -1)[:, 0])
        _store(new.wv, wv.view(n_kv_heads, r, hd, -1)[:, 0])
    elif method == "random":
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for lin, src in ((new.wk, attn.wk), (new.wv, attn.wv)):
                std = src.weight.detach().float().std().item()
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * std)
                if lin.bias is not None:
                    lin.bias.zero_()
    else:  # "fit", or "grouped-fit" on the reordered heads
        _fit(attn, new, r, c)
    return new


def _fit(attn: GroupedQueryAttention, new: GroupedQueryAttention, r: int, c: torch.Tensor) -> None:
    """Fill ``new`` (wq, wk, wv, wo) by ``joint_fit`` per group; see the module docstring."""
    cfg, hd = attn.cfg, attn.head_dim
    rep = cfg.n_rep  # query heads per source KV head
    st = _fit_inputs(attn, c)
    c, wq, wk, wv, wo, sq, so = (st[k] for k in ("c", "wq", "wk", "wv", "wo", "sq", "so"))
    new_q, new_o = wq.clone(), wo.clone()
    new_k = torch.empty(new.n_kv_heads, hd, wk.shape[-1], dtype=wk.dtype)
    new_v = torch.empty(new.n_kv_heads, hd, wv.shape[-1], dtype=wv.dtype)
    for g in range(new.n_kv_heads):
        src = slice(g * r, (g + 1) * r)
        new_k[g], a_k = joint_fit(wk[src], sq[src], c, rope=cfg.rope, rotary=cfg.rotary_dim)
        new_v[g], a_v = joint_fit(wv[src], so[src], c, rope=False)
        for i, j in enumerate(range(g * r, (g + 1) * r)):
            for h in range(j * rep, (j + 1) * rep):
                new_q[h] = a_k[i].T @ wq[h]  # q' = A^T q keeps q' . (B x) = q . (A B x)
                new_o[h] = wo[h] @ a_v[i]  # Wo' = Wo A keeps Wo' (B x) = Wo (A B x)
    back = torch.argsort(head_rows(cfg))  # q/k rows from head_rows order to the module's
    _store(new.wq, new_q[:, back])
    _store(new.wk, new_k[:, back])
    _store(new.wv, new_v)
    with torch.no_grad():
        new.wo.weight.copy_(new_o.permute(1, 0, 2).reshape(cfg.d_model, -1))
