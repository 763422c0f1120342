"""Analytic FLOPs of attention layers and whole models.

Conventions (DESIGN.md): a multiply-add is 2 FLOPs, so ``x @ W`` with x (m, k) and W (k, n) costs ``2 m k n``;
bias adds, RoPE, norms and residual adds are not counted (``torch.utils.flop_counter.FlopCounterMode`` does
not count them either). ``q_len`` new tokens attend to ``kv_len`` keys (``kv_len = q_len`` for a prefill
without cache, ``kv_len = cached + 1`` for one decode step); projections run on the new tokens only.

Softmax is reported apart and left out of ``total``: ``SOFTMAX_FLOPS`` per score (max, subtract, exp, sum,
divide). ``causal=False`` counts the whole score matrix, as FlopCounterMode and most kernels' counters do;
``causal=True`` counts only the (query, key) pairs the bottom-right causal mask lets through,
``q_len * kv_len - q_len * (q_len - 1) / 2``, which is what a kernel that skips masked blocks does.
``backward=True`` counts a training step, forward plus backward: each product ``A @ B`` needs ``dA`` and
``dB``, two products of the same size, so 3x the forward (every operand requires grad, as inside a model).

MLA (DeepSeek-V2, arXiv 2405.04434) has two ways to attend from its latent cache (see attention/mla.py):
naive decompresses K and V for all ``kv_len`` cached tokens with ``wkv_b`` and attends per head with head
dims (qk_nope + qk_rope, v_head_dim); absorbed moves each query into latent space (``W_uk^T q``), attends
over the cached rows with head dims (kv_lora_rank + qk_rope, kv_lora_rank), and maps the result back out
with ``W_uv``. Their FLOPs differ: naive pays ``wkv_b`` per cached token per step, absorbed pays wider scores.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import GATED_MLPS, AttentionConfig, MLAConfig, ModelConfig, check_int

SOFTMAX_FLOPS = 5


@dataclass(frozen=True)
class AttentionFlops:
    """FLOPs of one attention layer, by part. ``total`` excludes ``softmax``.

    q_proj: queries (MLA: ``wq`` or ``wq_a`` + ``wq_b``). k_proj, v_proj: keys and values of the new tokens
    (MLA naive: ``wkv_b`` over all cached tokens; absorbed: 0). latent_proj: MLA's ``wkv_a`` (the latent and the
    rotary key). absorb: MLA absorbed's ``W_uk^T q`` and ``W_uv y``. scores: ``q k^T``. values: ``p v``.
    out_proj: ``wo``.
    """

    q_proj: int = 0
    k_proj: int = 0
    v_proj: int = 0
    latent_proj: int = 0
    absorb: int = 0
    scores: int = 0
    values: int = 0
    out_proj: int = 0
    softmax: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "softmax")

    def scaled(self, factor: int) -> AttentionFlops:
        return AttentionFlops(**{f.name: getattr(self, f.name) * factor for f in dataclasses.fields(self)})

    def __add__(self, other: AttentionFlops) -> AttentionFlops:
        return AttentionFlops(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)}
        )


@dataclass(frozen=True)
class ModelFlops:
    """FLOPs of a whole model for ``q_len`` new tokens: attention summed over layers, MLP (and MoE router),
    LM head (logits for every new token, as ``attnlab.model.Transformer`` computes). ``total`` excludes softmax."""

    attention: AttentionFlops
    mlp: int
    router: int
    lm_head: int

    @property
    def softmax(self) -> int:
        return self.attention.softmax

    @property
    def total(self) -> int:
        return self.attention.total + self.mlp + self.router + self.lm_head


def _check_sizes(batch: int, q_len: int, kv_len: int, causal: bool) -> None:
    check_int("batch", batch)
    check_int("q_len", q_len)
    check_int("kv_len", kv_len)
    if q_len > kv_len:  # the keys include the new tokens' own (their K/V projections are counted on q_len)
        raise ValueError(
            f"kv_len counts the cached and the new tokens, so q_len <= kv_len; got q_len={q_len}, kv_len={kv_len}"
        )


def attended_pairs(q_len: int, kv_len: int, causal: bool, window: int | None = None) -> int:
    """(query, key) pairs that get a score: all of them, or those under the bottom-right causal mask.

    A sliding ``window``: a decode step scores only the last ``window`` keys (attnlab reads just those); with
    ``causal`` only the pairs inside each query's window count, a kernel's work when it skips masked blocks;
    without, a step of several tokens computes the whole masked matrix over the keys its cache hands it: the
    last ``window`` earlier keys (a sliding-window ``KVCache`` holds no more) and the new ones."""
    if window is not None and (q_len == 1 or causal):
        # query i sits at key position kv_len - q_len + i and sees min(window, that + 1) keys (or all, unmasked)
        # summed in closed form (a loop took seconds at 10^7 tokens): the first `below` queries see first + i
        # keys, fewer than the window, and the rest see the window
        first = kv_len - q_len + 1  # keys the first query sees without the window
        below = min(max(window - first, 0), q_len)
        return below * first + below * (below - 1) // 2 + (q_len - below) * window
    if window is not None:
        return q_len * (min(kv_len - q_len, window) + q_len)
    if not causal:
        return q_len * kv_len
    return q_len * kv_len - q_len * (q_len - 1) // 2


def attention_flops(
    cfg: AttentionConfig | MLAConfig,
    batch: int,
    q_len: int,
    kv_len: int,
    *,
    causal: bool = False,
    backward: bool = False,
) -> AttentionFlops:
    """FLOPs of one attention layer; see the module docstring for the conventions."""
    if not isinstance(cfg, (AttentionConfig, MLAConfig)):
        raise TypeError(f"cfg must be an AttentionConfig or MLAConfig, got {type(cfg).__name__}")
    _check_sizes(batch, q_len, kv_len, causal)
    b, t, h = batch, q_len, cfg.n_heads
    window = getattr(cfg, "window", None)
    pairs = b * h * attended_pairs(q_len, kv_len, causal, window)  # score elements over the batch and heads
    d = cfg.d_model
    if isinstance(cfg, AttentionConfig):
        hd, kvh = cfg.head_dim, cfg.n_kv_heads
        flops = AttentionFlops(
            q_proj=2 * b * t * d * h * hd,
            k_proj=2 * b * t * d * kvh * hd,
            v_proj=2 * b * t * d * kvh * hd,
            # Every query head scores against its (shared) KV head: sharing saves memory, not FLOPs.
            scores=2 * pairs * hd,
            values=2 * pairs * hd,
            out_proj=2 * b * t * h * hd * d,
            softmax=SOFTMAX_FLOPS * pairs,
        )
    else:  # MLAConfig
        if cfg.q_lora_rank:
            q_proj = 2 * b * t * (d * cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim)
        else:
            q_proj = 2 * b * t * d * h * cfg.qk_head_dim
        common = dict(
            q_proj=q_proj,
            latent_proj=2 * b * t * d * cfg.cache_dim,
            out_proj=2 * b * t * h * cfg.v_head_dim * d,
            softmax=SOFTMAX_FLOPS * pairs,
        )
        r = cfg.kv_lora_rank
        if cfg.mode_for(t, kv_len=kv_len, pairs=pairs // (b * h)) == "naive":
            flops = AttentionFlops(
                k_proj=2 * b * kv_len * r * h * cfg.qk_nope_head_dim,  # wkv_b on every cached latent
                v_proj=2 * b * kv_len * r * h * cfg.v_head_dim,
                scores=2 * pairs * cfg.qk_head_dim,
                values=2 * pairs * cfg.v_head_dim,
                **common,
            )
        else:
            flops = AttentionFlops(
                absorb=2 * b * h * t * (cfg.qk_nope_head_dim * r + r * cfg.v_head_dim),
                scores=2 * pairs * cfg.cache_dim,
                values=2 * pairs * r,
                **common,
            )
    return flops.scaled(3) if backward else flops


def mlp_flops_per_token(model_cfg: ModelConfig) -> tuple[int, int]:
    """(dense MLP FLOPs, MoE layer FLOPs without the router) for one token in one layer.

    SwiGLU runs three d_model x ffn_dim products, GELU two. An MoE token runs its ``n_active_experts`` routed
    experts and every shared expert, each an MLP of width ``moe_ffn_dim``.
    """
    n_mats = 3 if model_cfg.mlp in GATED_MLPS else 2
    d = model_cfg.d_model
    dense = 2 * n_mats * d * model_cfg.ffn_dim
    moe = 2 * n_mats * d * model_cfg.moe_ffn_dim * (model_cfg.n_active_experts + model_cfg.n_shared_experts)
    return dense, moe


def model_flops(
    model_cfg: ModelConfig,
    batch: int,
    q_len: int,
    kv_len: int | None = None,
    *,
    causal: bool = False,
    backward: bool = False,
) -> ModelFlops:
    """FLOPs of a whole model for ``q_len`` new tokens attending to ``kv_len`` keys (default ``q_len``: a
    prefill). One decode step is ``q_len=1, kv_len=context``. Same conventions as ``attention_flops``."""
    if not isinstance(model_cfg, ModelConfig):
        raise TypeError(f"model_cfg must be a ModelConfig, got {type(model_cfg).__name__}")
    kv_len = q_len if kv_len is None else kv_len
    attention = [
        attention_flops(attn, batch, q_len, kv_len, causal=causal) for attn in model_cfg.layer_attentions
    ]
    tokens = batch * q_len
    n_moe = model_cfg.n_layers - model_cfg.n_dense_layers if model_cfg.is_moe else 0
    dense, moe = mlp_flops_per_token(model_cfg)
    flops = ModelFlops(
        attention=sum(attention[1:], attention[0]),
        mlp=tokens * ((model_cfg.n_layers - n_moe) * dense + n_moe * moe),
        router=tokens * n_moe * 2 * model_cfg.d_model * model_cfg.n_experts,
        lm_head=2 * tokens * model_cfg.d_model * model_cfg.vocab_size,
    )
    if backward:
        flops = ModelFlops(
            attention=flops.attention.scaled(3),
            mlp=3 * flops.mlp,
            router=3 * flops.router,
            lm_head=3 * flops.lm_head,
        )
    return flops
