"""Modules sharded by heads (what tensor parallelism does) run unchanged and compute their heads' share.

A shard keeps the ``wq``/``wk``/``wv`` rows (MLA: ``wq``/``wq_b`` and ``wkv_b`` rows) of its heads and the matching
``wo`` columns; the latent projection ``wkv_a`` and the norms are replicated, and ``wo``'s bias is added by one
shard only. The module reads its head counts from those weights, so the sum of the shards' outputs is the whole
module's output, with and without a cache (each shard caching only its own KV heads).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from attnlab import AttentionConfig, GroupedQueryAttention, MLAConfig, MultiHeadLatentAttention

pytestmark = pytest.mark.usefixtures("one_thread")


def _cut(linear: nn.Linear, rows: slice | None = None, cols: slice | None = None, keep_bias: bool = True):
    weight = linear.weight.detach()
    linear.weight = nn.Parameter(weight[rows] if rows is not None else weight[:, cols])
    if linear.bias is not None:
        bias = linear.bias.detach()
        linear.bias = nn.Parameter(bias[rows] if rows is not None else (bias if keep_bias else 0 * bias))


def _per_head(rank: int, world: int, n: int, width: int) -> slice:
    """Rows of shard ``rank`` of ``world`` in a weight of ``n`` heads of ``width`` rows each."""
    per = n // world
    return slice(rank * per * width, (rank + 1) * per * width)


def shard_gqa(attn: GroupedQueryAttention, rank: int, world: int) -> GroupedQueryAttention:
    cfg, shard = attn.cfg, copy.deepcopy(attn)
    q_rows = _per_head(rank, world, cfg.n_heads, cfg.head_dim)
    kv_rows = _per_head(rank, world, cfg.n_kv_heads, cfg.head_dim)
    _cut(shard.wq, rows=q_rows)
    _cut(shard.wk, rows=kv_rows)
    _cut(shard.wv, rows=kv_rows)
    _cut(shard.wo, cols=q_rows, keep_bias=rank == 0)
    return shard


def shard_mla(mla: MultiHeadLatentAttention, rank: int, world: int) -> MultiHeadLatentAttention:
    cfg, shard = mla.cfg, copy.deepcopy(mla)
    _cut(
        shard.wq_b if cfg.q_lora_rank else shard.wq, rows=_per_head(rank, world, cfg.n_heads, cfg.qk_head_dim)
    )
    _cut(shard.wkv_b, rows=_per_head(rank, world, cfg.n_heads, cfg.qk_nope_head_dim + cfg.v_head_dim))
    _cut(shard.wo, cols=_per_head(rank, world, cfg.n_heads, cfg.v_head_dim), keep_bias=rank == 0)
    return shard


def _steps(module, x, cache=None, mask=None):
    """A prefill of 4 tokens, then one token at a time."""
    outs = [module(x[:, :4], cache=cache, attn_mask=mask)]
    outs += [module(x[:, i : i + 1], cache=cache) for i in range(4, x.shape[1])]
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("world", [2, 3])
def test_gqa_sharded_by_heads_sums_to_the_whole(world):
    torch.manual_seed(0)
    attn = GroupedQueryAttention(AttentionConfig(d_model=48, n_heads=6, n_kv_heads=3 if world == 3 else 2,
                                                 head_dim=8, bias=True)).eval()  # fmt: skip
    with torch.no_grad():
        for lin in (attn.wq, attn.wk, attn.wv, attn.wo):
            lin.bias.normal_()
    shards = [shard_gqa(attn, r, world) for r in range(world)]
    assert [(s.n_heads, s.n_kv_heads) for s in shards] == [(6 // world, attn.n_kv_heads // world)] * world
    x = torch.randn(2, 7, 48)
    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    mask[1, ..., 0] = False  # a padded first token in the second sequence
    with torch.no_grad():
        assert (sum(s(x) for s in shards) - attn(x)).abs().max() <= 1e-5
        caches = [s.new_cache(2, 7) for s in shards]
        assert all(c.n_kv_heads == attn.n_kv_heads // world for c in caches)
        whole = _steps(attn, x, attn.new_cache(2, 7), mask)
        parts = [_steps(s, x, c, mask) for s, c in zip(shards, caches, strict=True)]
        assert (sum(parts) - whole).abs().max() <= 1e-5


@pytest.mark.parametrize("q_lora_rank", [0, 12])
@pytest.mark.parametrize("mode", ["naive", "absorbed"])
def test_mla_sharded_by_heads_sums_to_the_whole(mode, q_lora_rank):
    torch.manual_seed(0)
    cfg = MLAConfig(d_model=32, n_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                    q_lora_rank=q_lora_rank, bias=True, mode=mode)  # fmt: skip
    mla = MultiHeadLatentAttention(cfg).eval()
    with torch.no_grad():
        for p in mla.parameters():
            p.normal_(0.0, 0.3)
    shards = [shard_mla(mla, r, 2) for r in range(2)]
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        assert (sum(s(x) for s in shards) - mla(x)).abs().max() <= 1e-5
        whole = _steps(mla, x, mla.new_cache(2, 6))
        parts = [_steps(s, x, s.new_cache(2, 6)) for s in shards]
        assert (sum(parts) - whole).abs().max() <= 1e-5
        paged = [s.new_paged_cache(8, 2, 2) for s in shards]
        if mode == "absorbed":
            assert (
                sum(_steps(s, x, c) for s, c in zip(shards, paged, strict=True)) - whole
            ).abs().max() <= 1e-5
