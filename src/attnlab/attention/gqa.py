"""Grouped-query attention: one module for MHA (n_kv_heads == n_heads), GQA and MQA (n_kv_heads == 1).

Shapes: x (B, T, d_model); q (B, n_heads, T, head_dim); k, v (B, n_kv_heads, T, head_dim).
The module does the projections, the q/k norms (``cfg.qk_norm``: per head, as Qwen3 and Gemma 3, or over all
heads, as OLMo 2; before RoPE), RoPE and the cache; ``attend`` does the math, with the config's softmax scale,
logit soft-capping and sliding window, over whatever the cache hands it (one forward path for every cache). Head counts are read from the projections' widths, never from the config:
a module whose ``wq``/``wk``/``wv`` rows and ``wo`` columns were cut to a subset of the heads (tensor parallelism)
runs unchanged and computes those heads' share of the output.
"""

from __future__ import annotations

import torch
from torch import nn

from ..cache import Cache, KVCache, PagedKVCache, StaticKVCache, autocast_dtype, placement
from ..config import AttentionConfig
from .kernels import attend, check_mask
from .linear import Linear, project
from .norm import RMSNorm
from .rope import RopeAngles, RopeSpec, apply_rope, token_positions


def check_input(owner: str, x: torch.Tensor, d_model: int, weight: torch.Tensor) -> None:
    """The checks every attention forward makes on its input."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{owner}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != 3 or x.shape[-1] != d_model:
        raise ValueError(f"{owner}: x must be (B, T, d_model={d_model}), got shape {tuple(x.shape)}")
    # under autocast the projections cast their input (a float32 norm output beside bfloat16 weights is its rule)
    if x.dtype != weight.dtype and not autocast_dtype(x.device):
        raise TypeError(f"{owner}: x has dtype {x.dtype} but the weights are {weight.dtype}")


def check_step(
    owner: str,
    attn_mask: torch.Tensor | None,
    q: torch.Tensor,
    cache: Cache | None,
    window: int | None,
    all_heads: int | None = None,
) -> None:
    """The checks made before anything is written to the cache, so that a bad call leaves it as it was;
    ``window``: the layer's sliding window (None: it attends to every token); ``all_heads``: the layer's query
    heads, of which a module sharded by ``apply_tp`` holds a share (q's)."""
    b, n_heads, t, _ = q.shape  # the heads this module holds
    kept = getattr(cache, "window", None)  # a cache that drops tokens older than its window
    # a cache keeping fewer tokens drops keys the layer reads; one keeping more hands a decode step its ring out of
    # order, which the layer's window would cut by slot
    if kept is not None and kept != window:
        reads = "every token" if window is None else f"the last {window}"
        wants = (
            "window=None" if window is None else f"window={window} (as the layer's new_cache does) or None"
        )
        raise ValueError(
            f"{owner}: the cache keeps the last {kept} tokens (window={kept}) but the layer attends to {reads}; "
            f"make the cache with {wants}"
        )
    if attn_mask is None:  # nothing to check, and no length to read (a StaticKVCache's is on its device)
        return
    if cache is not None and cache.paged:
        raise ValueError(
            f"{owner}: attn_mask is not supported with a PagedKVCache (each row has its own length)"
        )
    if getattr(cache, "static", False):  # a cache of the protocol from before ``static`` reads as False
        raise ValueError(
            f"{owner}: attn_mask is not supported with a StaticKVCache (its own mask covers every slot)"
        )
    if all_heads not in (None, n_heads) and attn_mask.ndim >= 3 and attn_mask.shape[-3] != 1:
        # masks per head: which of them are this rank's is not known here, and one of the rank's own count would
        # mask other heads on each rank
        raise ValueError(
            f"{owner}: attn_mask of shape {tuple(attn_mask.shape)} has a mask per head, but this module is sharded "
            f"by apply_tp and computes {n_heads} of the layer's {all_heads} heads on each rank: give one mask for "
            "every head, of shape (B, 1, T_q, T_k)"
        )
    check_mask(owner, attn_mask, (b, n_heads, t, (0 if cache is None else len(cache)) + t))


def _mask_of_keys(attn_mask: torch.Tensor | None, cache: Cache, t: int) -> torch.Tensor | None:
    """``attn_mask`` over every position so far, read at the columns of the keys a window's ring handed back."""
    positions = getattr(cache, "key_positions", None)
    if attn_mask is None or positions is None or attn_mask.shape[-1] == 1:
        return attn_mask
    columns = positions(t)
    return attn_mask if columns is None else attn_mask.index_select(-1, columns.to(attn_mask.device))


def cache_rule(
    cache: Cache | None, t: int, attn_mask: torch.Tensor | None, is_causal: bool, window: int | None
) -> dict:
    """``attend``'s keywords attn_mask, is_causal, window and lengths over what ``cache.append`` returned: over a
    ``StaticKVCache``'s whole buffers a decode step reads each row's length (kept on the device), several tokens
    are masked by their ``visible`` slots (the causal rule and the window in one mask); any other cache's keys
    follow the caller's rule."""
    if getattr(cache, "static", False):
        if t == 1:
            return dict(attn_mask=None, is_causal=False, window=window, lengths=cache.length)  # type: ignore[union-attr]
        return dict(attn_mask=cache.visible(t, window), is_causal=False, window=None, lengths=None)  # type: ignore[union-attr]
    return dict(attn_mask=attn_mask, is_causal=is_causal, window=window, lengths=None)


def local_weight(linear: nn.Linear) -> torch.Tensor:
    """The part of ``linear.weight`` this process holds (a DTensor's local shard; a plain weight as it is)."""
    w = linear.weight
    return w.to_local() if hasattr(w, "to_local") else w


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(B, T, heads * head_dim) -> (B, heads, T, head_dim); heads from the width (a sharded module has fewer),
    spelled out so that empty inputs (B = 0 or T = 0), which ``view(B, T, -1, D)`` cannot infer, work too."""
    b, t, width = x.shape
    return x.view(b, t, width // head_dim, head_dim).transpose(1, 2)


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    """(B, heads, T, D) -> (B, T, heads * D), the inverse of ``split_heads``."""
    b, h, t, d = y.shape
    return y.transpose(1, 2).reshape(b, t, h * d)


class GroupedQueryAttention(nn.Module):
    def __init__(self, cfg: AttentionConfig) -> None:
        super().__init__()
        if not isinstance(cfg, AttentionConfig):
            raise TypeError(f"cfg must be an AttentionConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.head_dim = cfg.head_dim
        self.wq = Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.bias)
        self.wk = Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.bias)
        self.wv = Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.bias)
        self.wo = Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.has_out_bias)
        if cfg.qk_norm != "none":  # "head": one gain per head dim, shared by the heads; "full": one per value
            per_head = cfg.qk_norm == "head"
            q_dim = cfg.head_dim if per_head else cfg.n_heads * cfg.head_dim
            k_dim = cfg.head_dim if per_head else cfg.n_kv_heads * cfg.head_dim
            gain = dict(eps=cfg.norm_eps, offset=cfg.norm_offset, gain_float32=cfg.norm_gain_float32)
            self.q_norm = RMSNorm(q_dim, **gain)
            self.k_norm = RMSNorm(k_dim, **gain)

    @property
    def n_heads(self) -> int:
        """Query heads this module computes: all of them, or this rank's share once sharded by ``apply_tp``."""
        return local_weight(self.wq).shape[0] // self.head_dim

    @property
    def n_kv_heads(self) -> int:
        """KV heads this module computes and caches (this rank's, once sharded)."""
        return local_weight(self.wk).shape[0] // self.head_dim

    def init_weights(self, std: float = 0.02, out_std: float | None = None) -> None:
        """Normal(0, std) projections (the output projection may get a depth-scaled ``out_std``), zero biases."""
        for lin in (self.wq, self.wk, self.wv, self.wo):
            nn.init.normal_(lin.weight, mean=0.0, std=out_std if (lin is self.wo and out_std) else std)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        if self.cfg.qk_norm != "none":  # a gain of 1 whatever the offset
            for norm in (self.q_norm, self.k_norm):
                nn.init.constant_(norm.weight, 1.0 - norm.offset)

    def new_cache(
        self,
        batch_size: int,
        max_seq_len: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        *,
        static: bool = False,
    ) -> KVCache | StaticKVCache:
        """A cache for this module's KV heads (a ring of the window's size for a sliding-window layer), or with
        ``static`` one of fixed shapes for compiled decode steps (``StaticKVCache``: a window is a mask over every
        slot, not a ring); dtype and device default to the weights' (the dtype: autocast's under it)."""
        dtype, device = placement(self.wq.weight, dtype, device)
        if static:
            return StaticKVCache(
                batch_size, self.n_kv_heads, max_seq_len, self.head_dim, dtype=dtype, device=device
            )
        return KVCache(
            batch_size,
            self.n_kv_heads,
            max_seq_len,
            self.head_dim,
            dtype=dtype,
            device=device,
            window=self.cfg.window,
        )

    def new_paged_cache(
        self,
        n_blocks: int,
        block_size: int,
        batch_size: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> PagedKVCache:
        """A block-table cache for ragged batches (``PagedKVCache``; a sliding-window layer's gives blocks back once
        they fall out of the window); dtype and device default to the weights' (the dtype: autocast's under it)."""
        dtype, device = placement(self.wq.weight, dtype, device)
        return PagedKVCache(
            n_blocks,
            block_size,
            self.n_kv_heads,
            self.head_dim,
            batch_size=batch_size,
            dtype=dtype,
            device=device,
            window=self.cfg.window,
        )

    @property
    def rope_spec(self) -> RopeSpec | None:
        """(rotary dim, theta, scaling, interleaved) of this module's RoPE, None without: layers with equal specs
        share their angles."""
        cfg = self.cfg
        return (cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rope_interleaved) if cfg.rope else None

    def forward(
        self,
        x: torch.Tensor,
        *,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = True,
        cache: Cache | None = None,
        position_ids: torch.Tensor | None = None,
        rope: RopeAngles | None = None,
    ) -> torch.Tensor:
        """``x`` (B, T, d_model) -> (B, T, d_model).

        With a cache, the new tokens are written to it and attend to everything cached before them;
        ``attn_mask`` then covers (T, len(cache) + T) keys. Positions: ``position_ids`` (T,) or (B, T) if given
        (left padding, packed sequences), else following the cache, else 0 .. T - 1. ``rope``: the angles of those
        positions, when the caller shares them between layers (``Transformer`` does); it overrides the rest.
        """
        check_input("GroupedQueryAttention", x, self.cfg.d_model, self.wq.weight)
        b, t, _ = x.shape
        q, k, v = project(x, self.wq, self.wk, self.wv)
        if self.cfg.qk_norm == "full":  # over all heads' values at once, before they are split (OLMo 2)
            q, k = self.q_norm(q), self.k_norm(k)
        q = split_heads(q, self.head_dim)  # (B, n_heads, T, head_dim)
        k = split_heads(k, self.head_dim)  # (B, n_kv_heads, T, head_dim)
        v = split_heads(v, self.head_dim)
        check_step("GroupedQueryAttention", attn_mask, q, cache, self.cfg.window, self.cfg.n_heads)
        if self.cfg.qk_norm == "head":  # each head on its own (Qwen3, Gemma 3)
            q, k = self.q_norm(q), self.k_norm(k)
        if self.cfg.rope:
            if rope is None:
                rope = RopeAngles(token_positions(position_ids, cache, b, t, x.device))
            cos, sin = rope.get(*self.rope_spec)
            interleaved = self.cfg.rope_interleaved
            q, k = apply_rope(q, cos, sin, interleaved), apply_rope(k, cos, sin, interleaved)
        if cache is not None:
            k, v = cache.append(k, v)  # everything held: live views, paged views, or a static cache's buffers
            attn_mask = _mask_of_keys(attn_mask, cache, t)
        y = attend(
            q,
            k,
            v,
            **cache_rule(cache, t, attn_mask, is_causal, self.cfg.window),
            scale=self.cfg.softmax_scale,  # per head (head_dim ** -0.5), not per model width, unless set
            backend=self.cfg.backend,
            dropout_p=self.cfg.dropout if self.training else 0.0,
            softcap=self.cfg.softcap,
        )
        return self.wo(merge_heads(y))
