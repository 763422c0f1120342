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
"""

from __future__ import annotations

import torch
from torch import nn

from ..cache import LatentCache, PagedKVCache
from ..config import MLAConfig
from .decode import paged_decode
from .gqa import check_input, local_weight, merge_heads, positions_for, split_heads
from .kernels import attend, check_mask
from .norm import RMSNorm
from .rope import apply_rope, rope_cos_sin


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, cfg: MLAConfig) -> None:
        super().__init__()
        if not isinstance(cfg, MLAConfig):
            raise TypeError(f"cfg must be an MLAConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.mode = cfg.mode  # "naive" or "absorbed"; may be switched on a built module
        h, d = cfg.n_heads, cfg.d_model
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(d, cfg.q_lora_rank, bias=cfg.bias)
            self.q_norm = RMSNorm(cfg.q_lora_rank)
            self.wq_b = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(d, h * cfg.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.bias)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank) if cfg.kv_norm else nn.Identity()
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.wo = nn.Linear(h * cfg.v_head_dim, d, bias=cfg.bias)

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
    ) -> LatentCache:
        weight = self.wkv_a.weight
        return LatentCache(
            batch_size,
            max_seq_len,
            self.cfg.kv_lora_rank,
            self.cfg.qk_rope_head_dim,
            dtype=dtype or weight.dtype,
            device=device if device is not None else weight.device,
        )

    def new_paged_cache(
        self, n_blocks: int, block_size: int, batch_size: int, dtype: torch.dtype | None = None
    ) -> PagedKVCache:
        """A paged cache of latent rows for ragged batches (absorbed mode): one KV "head" of width
        kv_lora_rank + qk_rope_head_dim whose first kv_lora_rank values are also the values."""
        weight = self.wkv_a.weight
        return PagedKVCache(
            n_blocks,
            block_size,
            1,
            self.cfg.cache_dim,
            batch_size=batch_size,
            dtype=dtype or weight.dtype,
            device=weight.device,
            values_in_keys=True,
            value_dim=self.cfg.kv_lora_rank,
        )

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.q_lora_rank:
            return self.wq_b(self.q_norm(self.wq_a(x)))
        return self.wq(x)

    def forward(
        self,
        x: torch.Tensor,
        *,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = True,
        cache: LatentCache | None = None,
    ) -> torch.Tensor:
        """``x`` (B, T, d_model) -> (B, T, d_model); same calling rules as ``GroupedQueryAttention``."""
        cfg = self.cfg
        check_input("MultiHeadLatentAttention", x, cfg.d_model, self.wkv_a.weight)
        if self.mode not in ("naive", "absorbed"):
            raise ValueError(
                f"MultiHeadLatentAttention.mode must be 'naive' or 'absorbed', got {self.mode!r}"
            )
        b, t, _ = x.shape
        q = split_heads(self._queries(x), cfg.qk_head_dim)  # (B, H, T, qk_head_dim)
        q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        c, k_rope = self.wkv_a(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)

        if isinstance(cache, PagedKVCache):
            return self._forward_paged(q_nope, q_rope, c, k_rope, attn_mask, is_causal, cache)
        start = len(cache) if cache is not None else 0
        check_mask("MultiHeadLatentAttention", attn_mask, (b, q.shape[1], t, start + t))
        cos, sin = rope_cos_sin(positions_for(start, t, x.device), cfg.qk_rope_head_dim, cfg.rope_theta)
        q_rope = apply_rope(q_rope, cos, sin)
        row = torch.cat((self.kv_norm(c), apply_rope(k_rope, cos, sin)), dim=-1)  # (B, T, cache_dim)
        rows = cache.update(row) if cache is not None else row  # (B, S, cache_dim)

        common = dict(
            attn_mask=attn_mask,
            is_causal=is_causal,
            scale=cfg.softmax_scale,
            backend=cfg.backend,
            dropout_p=cfg.dropout if self.training else 0.0,
        )
        if self.mode == "absorbed":
            y = self._absorbed(q_nope, q_rope, rows, common)
        else:
            y = self._naive(q_nope, q_rope, rows, common)
        return self.wo(merge_heads(y))  # y: (B, H, T, v_head_dim)

    def _split_wkv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_uk (H, qk_nope_head_dim, kv_lora_rank) and W_uv (H, v_head_dim, kv_lora_rank), as views; H is this
        rank's heads when ``wkv_b`` is sharded."""
        cfg = self.cfg
        w = local_weight(self.wkv_b).view(-1, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]

    def _naive(self, q_nope, q_rope, rows, common):
        cfg = self.cfg
        latent, k_rope = rows.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = split_heads(self.wkv_b(latent), cfg.qk_nope_head_dim + cfg.v_head_dim)  # (B, H, S, nope + v)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rope[:, None].expand(-1, kv.shape[1], -1, -1)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        return attend(q, k, v, **common)

    def _absorbed(self, q_nope, q_rope, rows, common):
        w_uk, w_uv = self._split_wkv_b()
        q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk)  # the query moved into latent space
        q = torch.cat((q_latent, q_rope), dim=-1)  # (B, H, T, kv_lora_rank + qk_rope_head_dim)
        k = rows[:, None]  # (B, 1, S, cache_dim): one KV head shared by all query heads
        v = rows[:, None, :, : self.cfg.kv_lora_rank]  # values are the latent itself
        y_latent = attend(q, k, v, **common)  # (B, H, T, kv_lora_rank)
        return torch.einsum("bhtr,hvr->bhtv", y_latent, w_uv)

    def _forward_paged(self, q_nope, q_rope, c, k_rope, attn_mask, is_causal, cache: PagedKVCache):
        """Absorbed attention over a paged latent cache; each row of a ragged batch from its own length."""
        cfg = self.cfg
        b, _, t, _ = q_nope.shape
        if attn_mask is not None or self.mode != "absorbed" or b != len(cache.active):
            raise ValueError(
                "MultiHeadLatentAttention with a PagedKVCache needs mode='absorbed', no attn_mask and one input "
                f"row per active cache row; got mode={self.mode!r}, batch {b}, active rows {cache.active}"
            )
        positions = cache.positions(t, q_nope.device).reshape(-1)  # (B * T,)
        cos, sin = rope_cos_sin(positions, cfg.qk_rope_head_dim, cfg.rope_theta)
        cos, sin = cos.view(b, t, cos.shape[-1]), sin.view(b, t, sin.shape[-1])
        q_rope = apply_rope(q_rope, cos[:, None], sin[:, None])
        cache.update(torch.cat((self.kv_norm(c), apply_rope(k_rope, cos, sin)), dim=-1)[:, None], None)
        w_uk, w_uv = self._split_wkv_b()
        q = torch.cat((torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk), q_rope), dim=-1)
        y = paged_decode(q, cache, scale=cfg.softmax_scale, is_causal=is_causal)  # (B, H, T, kv_lora_rank)
        y = torch.einsum("bhtr,hvr->bhtv", y, w_uv)
        return self.wo(merge_heads(y))
