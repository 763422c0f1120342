"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434; DeepSeek-V3, arXiv 2412.19437).

Shapes: x (B, T, d_model); per-head queries (B, n_heads, T, qk_nope_head_dim + qk_rope_head_dim);
cached rows (B, S, kv_lora_rank + qk_rope_head_dim), S = tokens held after this call.

Each token is compressed by ``wkv_a`` into a latent ``c`` (kv_lora_rank values, normalised by ``kv_norm``) and
one rotary key ``k_rope`` shared by all heads; only those are cached. ``wkv_b`` expands ``c`` into per-head
keys without position (``k_nope``) and values. With ``W_uk`` and ``W_uv`` the two parts of ``wkv_b``:

    score_h(t, s) = q_nope_h(t) . (W_uk_h c(s)) + q_rope_h(t) . k_rope(s)
                  = (W_uk_h^T q_nope_h(t)) . c(s) + q_rope_h(t) . k_rope(s)          (absorbed)
    out_h(t)      = sum_s p_h(t, s) W_uv_h c(s) = W_uv_h (sum_s p_h(t, s) c(s))

"naive" computes the first form (decompress every cached token, per head); "absorbed" the second: the
query is moved into latent space once, and attention runs as MQA over the cached rows with a single KV
head of width kv_lora_rank + qk_rope_head_dim, values being the latent itself.

The mode is the config's (``cfg.mode``, also readable and settable as ``module.mode``) unless a call passes
``mode=``; "auto" (the default) picks one of the two per call by FLOPs (``MLAConfig.mode_for``): absorbed for
decode steps, naive for prefill. Both modes read the same cache through ``attend``; over a paged cache only
"absorbed" runs (naive decompresses a contiguous latent). Head counts are read from the weights (``wq``/``wq_b``, ``wkv_b``, ``wo``), so
a module sharded by heads runs unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from ..cache import Cache, LatentCache, PagedKVCache, StaticKVCache, placement
from ..config import MLA_MODES, MLAConfig
from .gqa import cache_rule, check_input, check_step, local_weight, merge_heads, split_heads
from .kernels import attend
from .linear import Linear, project
from .norm import RMSNorm
from .rope import RopeAngles, apply_rope, token_positions


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, cfg: MLAConfig) -> None:
        super().__init__()
        if not isinstance(cfg, MLAConfig):
            raise TypeError(f"cfg must be an MLAConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        h, d = cfg.n_heads, cfg.d_model
        if cfg.q_lora_rank:
            self.wq_a = Linear(d, cfg.q_lora_rank, bias=cfg.bias)
            self.q_norm = RMSNorm(cfg.q_lora_rank)
            self.wq_b = Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        else:
            self.wq = Linear(d, h * cfg.qk_head_dim, bias=False)
        self.wkv_a = Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.bias)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank) if cfg.kv_norm else nn.Identity()
        self.wkv_b = Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.wo = Linear(h * cfg.v_head_dim, d, bias=cfg.bias)

    @property
    def mode(self) -> str:
        """ "auto", "naive" or "absorbed": the mode a call uses unless it passes ``mode=`` (kept in ``cfg`` only)."""
        return self.cfg.mode

    @mode.setter
    def mode(self, value: str) -> None:
        self.cfg = self.cfg.replace(mode=_check_mode(value))

    @property
    def n_heads(self) -> int:
        """Query heads this module computes: all of them, or this rank's share once sharded by ``apply_tp``."""
        return local_weight(self.wo).shape[1] // self.cfg.v_head_dim

    def init_weights(self, std: float = 0.02, out_std: float | None = None) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=out_std if (module is self.wo and out_std) else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def new_cache(
        self,
        batch_size: int,
        max_seq_len: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        *,
        static: bool = False,
    ) -> LatentCache | StaticKVCache:
        """A cache of latent rows (``LatentCache``), or with ``static`` one of fixed shapes for compiled decode steps
        (``StaticKVCache`` of one KV "head" of width kv_lora_rank + qk_rope_head_dim whose first kv_lora_rank values
        are also the values); dtype and device default to the weights' (the dtype: autocast's under it)."""
        dtype, device = placement(self.wkv_a.weight, dtype, device)
        cfg = self.cfg
        if static:
            return StaticKVCache(
                batch_size, 1, max_seq_len, cfg.cache_dim, dtype=dtype, device=device, values_in_keys=True,
                value_dim=cfg.kv_lora_rank,
            )  # fmt: skip
        return LatentCache(
            batch_size, max_seq_len, cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype=dtype, device=device
        )

    def new_paged_cache(
        self,
        n_blocks: int,
        block_size: int,
        batch_size: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> PagedKVCache:
        """A paged cache of latent rows for ragged batches (absorbed mode): one KV "head" of width
        kv_lora_rank + qk_rope_head_dim whose first kv_lora_rank values are also the values; dtype and device default
        to the weights'."""
        dtype, device = placement(self.wkv_a.weight, dtype, device)
        return PagedKVCache(
            n_blocks,
            block_size,
            1,
            self.cfg.cache_dim,
            batch_size=batch_size,
            dtype=dtype,
            device=device,
            values_in_keys=True,
            value_dim=self.cfg.kv_lora_rank,
        )

    @property
    def rope_spec(self) -> tuple[int, float]:
        """(rotary dim, theta): the shared rotary key and each head's rotary query part."""
        return (self.cfg.qk_rope_head_dim, self.cfg.rope_theta)

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries (B, T, H * qk_head_dim) and the compressed key-value rows (B, T, kv_lora_rank + rope dim):
        the two projections of ``x`` read in one pass."""
        if self.cfg.q_lora_rank:
            q, kv = project(x, self.wq_a, self.wkv_a)
            return self.wq_b(self.q_norm(q)), kv
        return project(x, self.wq, self.wkv_a)

    def forward(
        self,
        x: torch.Tensor,
        *,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = True,
        cache: Cache | None = None,
        position_ids: torch.Tensor | None = None,
        rope: RopeAngles | None = None,
        mode: str | None = None,
    ) -> torch.Tensor:
        """``x`` (B, T, d_model) -> (B, T, d_model); same calling rules as ``GroupedQueryAttention``, and
        ``mode`` ("auto", "naive" or "absorbed") for this call only (default: ``self.mode``)."""
        cfg = self.cfg
        check_input("MultiHeadLatentAttention", x, cfg.d_model, self.wkv_a.weight)
        b, t, _ = x.shape
        paged = cache is not None and cache.paged  # absorbed, whatever the counts
        # keys before this call; a StaticKVCache's count is a tensor (a compiled step must not read it), so it is
        # taken at its capacity, which decodes absorbed as any long cache does
        held = 0 if cache is None or paged else getattr(cache, "pos", None)
        held = cache.max_seq_len - t if held is None else held
        scored = t * (held + t) - (t * (t - 1) // 2 if is_causal else 0)
        mode = cfg.mode_for(
            t, paged, _check_mode(cfg.mode if mode is None else mode), kv_len=held + t, pairs=scored
        )
        q, kv = self._projections(x)
        q = split_heads(q, cfg.qk_head_dim)  # (B, H, T, qk_head_dim)
        q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        c, k_rope = kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        check_step("MultiHeadLatentAttention", attn_mask, q, cache, None, self.cfg.n_heads)
        if cache is not None and cache.paged and mode != "absorbed":
            raise ValueError(
                f"MultiHeadLatentAttention with a PagedKVCache needs mode='absorbed' (naive decompresses a "
                f"contiguous latent cache); got mode={mode!r}"
            )
        if rope is None:
            rope = RopeAngles(token_positions(position_ids, cache, b, t, x.device))
        cos, sin = rope.get(*self.rope_spec)
        q_rope = apply_rope(q_rope, cos, sin)
        # (B, 1, T, cache_dim): the rows a cache holds, one KV "head" shared by every query head
        rows = torch.cat((self.kv_norm(c), apply_rope(k_rope, cos, sin)), dim=-1)[:, None]
        if cache is not None:
            keys, values = cache.append(rows, None)  # values: the latent part of the held rows
        else:
            keys, values = rows, rows[..., : cfg.kv_lora_rank]
        common = dict(
            **cache_rule(cache, t, attn_mask, is_causal, None),
            scale=cfg.softmax_scale,
            backend=cfg.backend,
            dropout_p=cfg.dropout if self.training else 0.0,
        )
        if mode == "absorbed":
            y = self._absorbed(q_nope, q_rope, keys, values, common)
        else:
            y = self._naive(q_nope, q_rope, keys, common)
        return self.wo(merge_heads(y))  # y: (B, H, T, v_head_dim)

    def _split_wkv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_uk (H, qk_nope_head_dim, kv_lora_rank) and W_uv (H, v_head_dim, kv_lora_rank), as views; H is this
        rank's heads when ``wkv_b`` is sharded."""
        cfg = self.cfg
        w = local_weight(self.wkv_b).view(-1, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]

    def _naive(self, q_nope, q_rope, keys, common):
        cfg = self.cfg
        latent, k_rope = keys[:, 0].split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)  # (B, S, ...)
        kv = split_heads(self.wkv_b(latent), cfg.qk_nope_head_dim + cfg.v_head_dim)  # (B, H, S, nope + v)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rope[:, None].expand(-1, kv.shape[1], -1, -1)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        return attend(q, k, v, **common)

    def _absorbed(self, q_nope, q_rope, keys, values, common):
        w_uk, w_uv = self._split_wkv_b()
        q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk)  # the query moved into latent space
        q = torch.cat((q_latent, q_rope), dim=-1)  # (B, H, T, kv_lora_rank + qk_rope_head_dim)
        y_latent = attend(q, keys, values, **common)  # (B, H, T, kv_lora_rank): one KV head for all
        return _latent_to_values(y_latent, w_uv)


def _latent_to_values(y: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """y (B, H, T, r) times every head's W_uv (H, v, r) transposed -> (B, H, T, v).

    The einsum hands the CPU matmul W_uv transposed; float32 BLAS reads it as it lies, but the bfloat16 matmul
    copies it first (16 heads x 128 x 512: 680 us of a decode step, against 120 us for the product itself), so in
    bfloat16 W_uv multiplies y's transpose in its stored layout, one batched product over the heads."""
    if y.dtype != torch.bfloat16 or y.device.type != "cpu" or type(y) is not torch.Tensor:
        return torch.einsum("bhtr,hvr->bhtv", y, w_uv)
    b, h, t, r = y.shape
    out = torch.bmm(w_uv, y.permute(1, 3, 0, 2).reshape(h, r, b * t))  # (H, v, B T)
    return out.view(h, -1, b, t).permute(2, 0, 3, 1)


def _check_mode(mode: object) -> str:
    if mode not in MLA_MODES:
        raise ValueError(f"MultiHeadLatentAttention.mode must be 'auto', 'naive' or 'absorbed', got {mode!r}")
    return mode
