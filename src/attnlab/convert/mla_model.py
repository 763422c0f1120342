"""Whole-model GQA/MHA -> MLA conversion, the choice of rotary planes, DeepSeek's latent norm, and error reports.

A model is a ``Transformer``-like object as in ``convert.model`` (``layers[i].attention``, ``cfg.with_attention``);
calibration batches are token ids (B, T) or ``(ids, mask)`` pairs, right-padded (see ``convert.model``).

Which planes keep RoPE (``planes``), one stride for the whole model because a DeepSeek config has one
``rope_theta`` (see ``convert.mla``). With llama3 or yarn scaling every choice keeps its planes among those
the source turns at plain RoPE frequencies (``convert.mla.plain_planes``), which alone stay exact:
    "first"    stride 1: the ``rope_dim/2`` fastest-turning planes (MHA2MLA's "high-frequency" baseline; the
               slowest planes cannot be kept in DeepSeek's layout, whose rotary frequencies start at 1).
    "uniform"  the largest stride: kept planes spread evenly over the frequency range.
    "norm"     (the default) MHA2MLA's criterion (Ji et al. 2025, arXiv 2502.14837): each plane's contribution to the
               attention scores, ``sum_h rms|q'_{h,f}| * rms|k*_f|`` over calibration inputs (q' and k* the
               queries and shared key after RoRoPE, i.e. the part a rotary plane can carry); every layer's
               scores are normalised to sum to 1, and the stride whose kept planes collect the most wins.
    "error"    the same, with each head's share scaled by ``sqrt(1 - |m|^2)``: what the plane would still
               cost without RoPE once turned by its mean rotation ``m`` (step 2 of ``convert.mla``), so that a
               slow plane, which barely turns over the distances a head attends to, counts little even when
               its norm is large. A heuristic: on a small trained model it chose worse than "norm" once.
    an int     that stride.

Layers are converted in order, each calibrated on the inputs it receives from the already converted layers
below it (as ``convert_model`` does), so a layer's factorisation also absorbs the error of the earlier ones.
Every function here that reads calibration inputs layer by layer does it in one pass (``convert.model.calibrate``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from ..attention.gqa import GroupedQueryAttention
from ..attention.mla import MultiHeadLatentAttention
from ..attention.rope import apply_rope, rope_cos_sin
from .gqa import _augmented, input_moment
from .latent_norm import fold_latent_norm
from .mla import (
    check_rope_dim,
    default_rope_dim,
    gqa_to_mla,
    head_rows,
    mean_rotation,
    plain_planes,
    rope_obstacle,
    shared_rotary_keys,
    source_frequencies,
    stride_limit,
)
from .model import Batch, Progress, calibrate, check_batches

PLANES = ("error", "norm", "first", "uniform")


def _attentions(model: nn.Module, kind: type) -> list:
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        if not isinstance(layer.attention, kind):
            raise TypeError(
                f"layers.{i}.attention is a {type(layer.attention).__name__}, not {kind.__name__}"
            )
    return [layer.attention for layer in layers]


def plane_scores(
    attn: GroupedQueryAttention,
    calib: torch.Tensor | Iterable[torch.Tensor] | None,
    rorope: bool = True,
    distances: torch.Tensor | None = None,
) -> torch.Tensor:
    """(rotary_dim/2,) contribution of each plane to the scores (module docstring); ``calib`` None: unit
    inputs. With ``distances`` (the "error" criterion) each head's share is scaled by ``sqrt(1 - |m|^2)``, the
    spread of the rotations it sees around their mean ``m`` (``convert.mla.mean_rotation``)."""
    cfg, hd, r = attn.cfg, attn.head_dim, attn.cfg.rotary_dim
    d_in = cfg.d_model + (1 if cfg.bias else 0)
    c = input_moment(calib, cfg) if calib is not None else torch.eye(d_in, dtype=torch.float64)
    k_star, a = shared_rotary_keys(attn, c, rorope)
    wq = _augmented(attn.wq, cfg.n_heads, hd)[:, head_rows(cfg)[:r]]  # the turned rows, as half-split planes
    q = torch.einsum("hji,hjd->hid", a[torch.arange(cfg.n_heads) // cfg.n_rep], wq)  # queries after RoRoPE

    def plane_rms(w: torch.Tensor) -> torch.Tensor:  # (..., r, d_in) -> (..., r/2): sqrt E|plane|^2
        energy = torch.einsum("...id,de,...ie->...i", w, c, w).clamp_min(0)
        return (energy[..., : r // 2] + energy[..., r // 2 :]).sqrt()

    q_rms = plane_rms(q)  # (H, hd/2)
    if distances is not None:
        m = mean_rotation(distances, source_frequencies(cfg)[0])
        q_rms = q_rms * (1 - m.abs().square()).clamp_min(0).sqrt()
    return q_rms.sum(0) * plane_rms(k_star)


@torch.no_grad()
def choose_stride(
    model: nn.Module,
    rope_dim: int,
    planes: str | int | None = None,
    *,
    calib: Sequence[Batch] | None = None,
    rorope: bool = True,
    progress: Progress | None = None,
) -> int:
    """The stride of the planes that keep RoPE in every layer (module docstring); ``planes`` None: "norm"
    (on the weights alone when no calibration is given). ``progress(done, total)`` is called after each layer
    that is measured (none for a fixed choice)."""
    if calib is not None:  # a bare tensor once raised "Boolean value of Tensor ... is ambiguous"
        check_batches(calib, "calib", model)
    if planes is None:
        planes = "norm"
    attns = _attentions(model, GroupedQueryAttention)
    cfg = attns[0].cfg
    if not cfg.rope:
        return 1
    rope_dim = check_rope_dim(rope_dim, cfg)
    obstacle = rope_obstacle(cfg)
    if obstacle:
        raise ValueError(obstacle)
    high = stride_limit(cfg, rope_dim)
    if isinstance(planes, int) and not isinstance(planes, bool):
        if not 1 <= planes <= high:
            plain = plain_planes(cfg)
            band = f" (its {plain} planes at plain RoPE frequencies)" if plain < cfg.rotary_dim // 2 else ""
            turned = f"head_dim={cfg.head_dim}"
            if cfg.rotary_dim < cfg.head_dim:
                turned = f"the {cfg.rotary_dim} dims RoPE turns of head_dim={cfg.head_dim}"
            raise ValueError(
                f"planes (a stride) must be in [1, {high}] for rope_dim={rope_dim} of {turned}{band}, got {planes}"
            )
        return planes
    if planes not in PLANES:
        raise ValueError(f"planes must be one of {', '.join(PLANES)} or an int stride; got {planes!r}")
    if planes == "first":
        return 1
    if planes == "uniform":
        return high
    if planes == "error" and not calib:
        raise ValueError("planes='error' needs calib: the attention distances come from calibration text")
    total = torch.zeros(cfg.rotary_dim // 2, dtype=torch.float64)
    for i, inputs in enumerate(calibrate(model, calib) if calib else [None] * len(attns)):
        distances = attention_distances(attns[i], inputs) if inputs and planes == "error" else None
        scores = plane_scores(attns[i], inputs.rows() if inputs else None, rorope, distances)
        total += scores / scores.sum().clamp_min(1e-300)
        if progress is not None:
            progress(i + 1, len(attns))
    n_planes = rope_dim // 2
    kept = [total[torch.arange(n_planes) * s].sum().item() for s in range(1, high + 1)]
    return 1 + max(range(high), key=lambda i: kept[i])


@torch.no_grad()
def convert_model_to_mla(
    model: nn.Module,
    kv_lora_rank: int,
    rope_dim: int | None = None,
    *,
    calib: Sequence[Batch] | None = None,
    planes: str | int | None = None,
    rorope: bool = True,
    weighting: str = "readers",
    mean_phase: bool = True,
    progress: Progress | None = None,
) -> nn.Module:
    """A copy of ``model`` whose attention layers are MLA (``gqa_to_mla``, ``kv_norm=False``); ``model`` is not
    modified. ``rope_dim`` defaults to every plane that can keep RoPE exactly (``convert.mla.default_rope_dim``,
    head_dim for plain RoPE). ``mean_phase`` (with calibration): planes that lose RoPE are turned by the mean
    rotation each head sees (``mean_phase_queries``) instead of none. ``progress(done, total)`` is called after each layer."""
    if calib is not None:  # [] was taken as no calibration, silently
        check_batches(calib, "calib", model)
    attns = _attentions(model, GroupedQueryAttention)
    cfg = attns[0].cfg
    if rope_dim is None:
        rope_dim = default_rope_dim(cfg)
    stride = choose_stride(model, rope_dim, planes, calib=calib, rorope=rorope)
    out = copy.deepcopy(model).eval()
    n = len(out.layers)
    for i, inputs in enumerate(calibrate(out, calib) if calib else [None] * n):
        layer = out.layers[i]
        distances = (
            attention_distances(layer.attention, inputs) if inputs and mean_phase and cfg.rope else None
        )
        layer.attention = gqa_to_mla(
            layer.attention,
            kv_lora_rank,
            rope_dim=rope_dim,
            stride=stride,
            calib=inputs.rows() if inputs else None,
            rorope=rorope,
            weighting=weighting,
            distances=distances,
        )
        if progress is not None:
            progress(i + 1, n)
    out.cfg = out.cfg.with_attention(out.layers[0].attention.cfg)
    return out


@torch.no_grad()
def fold_latent_norms(
    model: nn.Module, calib: Sequence[Batch], *, balance: bool = True, progress: Progress | None = None
) -> tuple[nn.Module, list[dict]]:
    """A copy of an MLA model (``kv_norm=False``) with DeepSeek's latent norm in every layer
    (``fold_latent_norm``), each layer calibrated on the inputs the already folded layers give it; and the
    per-layer statistics. The fit needs every input row of one layer at a time (N x d_model values)."""
    check_batches(calib, "calib", model)
    _attentions(model, MultiHeadLatentAttention)
    out = copy.deepcopy(model).eval()
    stats = []
    for i, inputs in enumerate(calibrate(out, calib)):
        layer = out.layers[i]
        layer.attention, layer_stats = fold_latent_norm(
            layer.attention, torch.cat(list(inputs.rows())), balance=balance
        )
        stats.append(layer_stats)
        if progress is not None:
            progress(i + 1, len(out.layers))
    out.cfg = out.cfg.with_attention(out.layers[0].attention.cfg)
    return out, stats


@torch.no_grad()
def with_nope_dim(model: nn.Module) -> nn.Module:
    """``model`` with at least one no-RoPE dim per head in every MLA layer: a copy where a layer has none, else
    ``model`` itself.

    A one-KV-head source converted with every head dim rotary has no nope part (``qk_nope_head_dim`` 0), which
    transformers runs but llama.cpp refuses to load (``llama_model_deepseek2::load_arch_tensors`` asserts
    ``qk_nope_head_dim >= 1``). The added dim has zero query rows and zero key rows in ``wkv_b``, so it adds 0 to
    every score, and the queries are scaled by ``sqrt((rope + 1) / rope)`` for the softmax scale that counts it: the
    same model, up to the float32 rounding of RoPE's arithmetic on the rescaled queries."""
    layers = _attentions(model, MultiHeadLatentAttention)
    if all(a.cfg.qk_nope_head_dim > 0 for a in layers):
        return model
    out = copy.deepcopy(model).eval()
    for layer in out.layers:
        old = layer.attention
        cfg = old.cfg
        if cfg.qk_nope_head_dim > 0:
            continue
        if cfg.q_lora_rank:
            raise ValueError("with_nope_dim: compressed queries (q_lora_rank) are not padded")
        new = MultiHeadLatentAttention(cfg.replace(qk_nope_head_dim=1)).to(old.wq.weight.dtype)
        kept = {k: v for k, v in old.state_dict().items() if k not in ("wq.weight", "wkv_b.weight")}
        new.load_state_dict(kept, strict=False)  # norms, wkv_a, wo (and their biases) as they were
        h = cfg.n_heads
        wq = (
            old.wq.weight.view(h, cfg.qk_rope_head_dim, -1) * ((cfg.qk_head_dim + 1) / cfg.qk_head_dim) ** 0.5
        )
        new.wq.weight.copy_(
            torch.cat((wq.new_zeros(h, 1, wq.shape[-1]), wq), dim=1).reshape(new.wq.weight.shape)
        )
        w_b = old.wkv_b.weight.view(h, cfg.v_head_dim, -1)  # per head: no key rows, then the value rows
        new.wkv_b.weight.copy_(
            torch.cat((w_b.new_zeros(h, 1, w_b.shape[-1]), w_b), dim=1).reshape(-1, w_b.shape[-1])
        )
        new.mode = old.mode
        layer.attention = new
    out.cfg = out.cfg.with_attention(out.layers[0].attention.cfg)
    return out


@torch.no_grad()
def attention_distances(attn: nn.Module, seqs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """(n_heads, T) attention mass each head puts on keys 0, 1, ..., T-1 tokens back (T the longest batch),
    summed over the real query tokens of ``seqs``: (inputs (B, T, d_model), mask (B, T) bool) pairs, as
    ``convert.model.LayerInputs`` gives them."""
    total = torch.zeros(attn.cfg.n_heads, 0, dtype=torch.float64)
    for x, mask in seqs:
        scores = attention_scores(attn, x)  # (B, H, T, T)
        t = x.shape[1]
        allowed = torch.ones(t, t, dtype=torch.bool, device=x.device).tril() & mask[:, None, None, :]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
        probs = probs * mask[:, None, :, None]  # padded queries count for nothing
        hist = torch.stack([probs.diagonal(-d, -2, -1).sum((0, 2)) for d in range(t)], dim=1)  # (H, T)
        total = torch.nn.functional.pad(total, (0, max(0, t - total.shape[1])))
        total[:, :t] += hist.double()
    return total


@torch.no_grad()
def layer_errors(
    source: nn.Module,
    converted: nn.Module,
    batches: Sequence[Batch],
    progress: Progress | None = None,
) -> list[dict]:
    """Per layer, how far the converted attention is from the source's on the SAME inputs (those the source
    model gives the layer): ``output_error`` = ||y' - y|| / ||y|| over real tokens, and ``score_error`` = the
    same for the pre-softmax scores (scaled logits) of every head over causal pairs of real tokens.
    ``progress(done, total)`` is called after each layer."""
    check_batches(batches, "batches", source)
    src_attns = _attentions(source, GroupedQueryAttention)
    if len(converted.layers) != len(src_attns):
        raise ValueError(f"converted has {len(converted.layers)} layers, the source {len(src_attns)}")
    report = []
    for i, inputs in enumerate(calibrate(source, batches)):
        src, dst = src_attns[i], converted.layers[i].attention
        num = {"output": 0.0, "score": 0.0}
        den = {"output": 0.0, "score": 0.0}
        for x, mask in inputs:
            y, y_new = src(x), dst(x)
            num["output"] += (y_new - y)[mask].double().square().sum().item()
            den["output"] += y[mask].double().square().sum().item()
            s, s_new = attention_scores(src, x), attention_scores(dst, x)
            t = x.shape[1]
            pairs = (
                mask[:, None, :, None] & mask[:, None, None, :] & torch.ones(t, t, dtype=torch.bool).tril()
            )
            num["score"] += (s_new - s)[pairs.expand_as(s)].double().square().sum().item()
            den["score"] += s[pairs.expand_as(s)].double().square().sum().item()
        report.append({f"{k}_error": (num[k] / max(den[k], 1e-300)) ** 0.5 for k in num})
        if progress is not None:
            progress(i + 1, len(src_attns))
    return report


def attention_scores(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Scaled pre-softmax scores (B, n_heads, T, T) of a GQA or MLA module on ``x`` (B, T, d_model), positions
    0..T-1, computed here from the weights (an independent reading of the two modules' score formulas)."""
    b, t, _ = x.shape
    pos = torch.arange(t, device=x.device)
    if isinstance(attn, GroupedQueryAttention):
        hd = attn.head_dim
        q = attn.wq(x).view(b, t, -1, hd).transpose(1, 2)
        k = attn.wk(x).view(b, t, -1, hd).transpose(1, 2).repeat_interleave(attn.cfg.n_rep, dim=1)
        if attn.cfg.rope:  # at the module's own frequencies, scaled ones included (and yarn's factor)
            dim, theta, scaling, interleaved = attn.rope_spec
            cos, sin = rope_cos_sin(pos, dim, theta, scaling=scaling, interleaved=interleaved)
            q, k = apply_rope(q, cos, sin, interleaved), apply_rope(k, cos, sin, interleaved)
        return q @ k.transpose(-1, -2) * attn.cfg.softmax_scale
    cfg = attn.cfg
    q, kv = attn._projections(x)
    q = q.reshape(b, t, -1, cfg.qk_head_dim).transpose(1, 2)
    q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
    c, k_rope = kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    k_nope = (
        attn.wkv_b(attn.kv_norm(c)).view(b, t, cfg.n_heads, -1)[..., : cfg.qk_nope_head_dim].transpose(1, 2)
    )
    cos, sin = rope_cos_sin(pos, cfg.qk_rope_head_dim, cfg.rope_theta)
    q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope, cos, sin)
    return (
        q_nope @ k_nope.transpose(-1, -2) + q_rope @ k_rope[:, None].transpose(-1, -2)
    ) * cfg.softmax_scale


@torch.no_grad()
def logit_distance(a: nn.Module, b: nn.Module, batches: Sequence[Batch]) -> dict:
    """How far model ``b``'s next-token distribution is from ``a``'s over the real tokens of ``batches``:
    ``max_abs`` logit difference, ``rel_rms`` (||l_b - l_a|| / ||l_a - mean||, logits centred per token) and
    ``kl`` (mean KL(p_a || p_b), nats per token)."""
    return logit_distances({"a": a, "b": b}, [("a", "b")], batches)[("a", "b")]


LOGIT_BYTES = 64 << 20  # float32 logits per model a forward pass may hold (rows of a batch at a time)
_ROWS = 64  # tokens per float64 step of the comparison


def logit_distances(
    models: dict[str, nn.Module],
    pairs: Sequence[tuple[str, str]],
    batches: Sequence[Batch],
    progress: Progress | None = None,
) -> dict[tuple[str, str], dict]:
    """``logit_distance`` of each pair of ``models`` (by name) at once: each model runs once on each batch, a few
    rows at a time (at most ``LOGIT_BYTES`` of logits), and the comparison runs in float64 over 64 tokens at a
    time. Comparing three models pairwise ran six forward passes and held the logits of whole batches in float64
    (a 65,536-token vocabulary and 16 lines of 128 tokens: 1.07 GB a tensor, 7.9 GB at the peak).
    ``progress(done, total)`` after each batch."""
    names = list(models)
    if not names or any(x not in models or y not in models for x, y in pairs):
        raise ValueError(f"logit_distances: pairs {list(pairs)} must name models among {names}")
    check_batches(batches, "batches", models[names[0]])
    vocabs = {getattr(getattr(m, "cfg", None), "vocab_size", None) for m in models.values()}
    if len(vocabs) != 1:
        raise ValueError(
            f"logit_distance: the models' vocabularies differ ({', '.join(map(str, vocabs))} tokens)"
        )
    (vocab,) = vocabs
    acc = {pair: [0.0, 0.0, 0.0, 0.0, 0] for pair in pairs}  # max_abs, num, den, kl, n
    for done, batch in enumerate(batches, 1):
        ids, mask = batch if isinstance(batch, tuple) else (batch, torch.ones_like(batch))
        step = max(1, LOGIT_BYTES // (4 * ids.shape[1] * (vocab or 1)))
        for r in range(0, len(ids), step):
            keep = mask[r : r + step].bool()
            logits = {name: models[name](ids[r : r + step])[keep] for name in names}
            for t in range(0, len(logits[names[0]]), _ROWS):
                # each model's float64 logits, log-probabilities, probabilities and centred square sum once a
                # chunk, whichever pairs read them
                part = {name: logits[name][t : t + _ROWS].double() for name in names}
                log_p = {name: part[name].log_softmax(-1) for name in names}
                p_of: dict[str, torch.Tensor] = {}
                spread: dict[str, float] = {}
                for (x, y), total in acc.items():
                    la, lb = part[x], part[y]
                    if x not in p_of:
                        p_of[x] = log_p[x].exp()
                        spread[x] = (la - la.mean(-1, keepdim=True)).square().sum().item()
                    diff = lb - la
                    total[0] = max(total[0], diff.abs().max().item())
                    total[1] += diff.square().sum().item()
                    total[2] += spread[x]
                    total[3] += (p_of[x] * (log_p[x] - log_p[y])).sum().item()
                    total[4] += len(la)
            del logits
        if progress is not None:
            progress(done, len(batches))
    return {
        pair: {"max_abs": m, "rel_rms": (num / max(den, 1e-300)) ** 0.5, "kl": kl / max(n, 1)}
        for pair, (m, num, den, kl, n) in acc.items()
    }
