"""Our modules against independent implementations with copied weights.

Oracles: Hugging Face ``LlamaAttention`` (MHA/GQA/MQA with RoPE), ``torch.nn.MultiheadAttention`` (no RoPE,
with biases) and Hugging Face ``DeepseekV3Attention`` (MLA). Each runs without a cache and with one: a prefill,
single-token decode steps, then a multi-token chunk appended to the cache (the bottom-right causal case).
Tolerance: max abs error <= 1e-5 in float32.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

from attnlab import AttentionConfig, GroupedQueryAttention, MLAConfig, MultiHeadLatentAttention
from attnlab.attention.rope import interleaved_to_half_split

TOL = 1e-5
pytestmark = pytest.mark.usefixtures("one_thread")
BACKENDS = ("reference", "sdpa", "grouped", "auto")
# (T_new per call): a prefill, three single-token decode steps, then a 2-token chunk.
STEPS = (4, 1, 1, 1, 2)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a.double() - b.double()).abs().max().item()


def _hf_mask(t_q: int, t_k: int) -> torch.Tensor:
    """HF's additive float mask (1, 1, T_q, T_k): 0 where attended, finfo.min elsewhere (bottom-right causal)."""
    allowed = torch.ones(t_q, t_k, dtype=torch.bool).tril(diagonal=t_k - t_q)
    return torch.zeros(1, 1, t_q, t_k).masked_fill(~allowed, torch.finfo(torch.float32).min)


def _hf_mask_or_none(impl: str, t_q: int, t_k: int) -> torch.Tensor | None:
    # A single query needs no mask; HF's sdpa path turns mask=None with T_q == T_k > 1 into is_causal=True,
    # so that path is exercised too. Eager attention applies no causal rule of its own: it always gets a mask.
    if t_q == 1 or (impl == "sdpa" and t_q == t_k):
        return None
    return _hf_mask(t_q, t_k)


# ---------------------------------------------------------------------------------------------- Llama


LLAMA_CONFIGS = {
    "mha": AttentionConfig(d_model=32, n_heads=4, rope_theta=500.0),
    "gqa": AttentionConfig(d_model=48, n_heads=6, n_kv_heads=2, head_dim=8, bias=True),
    "mqa": AttentionConfig(d_model=32, n_heads=4, n_kv_heads=1, head_dim=16, rope_theta=10000.0),
}


def _llama_pair(cfg: AttentionConfig, impl: str, backend: str):
    hf_cfg = LlamaConfig(
        hidden_size=cfg.d_model,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        attention_bias=cfg.bias,
        max_position_embeddings=64,
        attn_implementation=impl,
    )
    assert hf_cfg.rope_parameters["rope_type"] == "default"
    hf = LlamaAttention(hf_cfg, layer_idx=0).eval()
    ours = GroupedQueryAttention(cfg.replace(backend=backend)).eval()
    with torch.no_grad():
        for mine, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            src, dst = getattr(hf, theirs), getattr(ours, mine)
            dst.weight.copy_(src.weight)
            if cfg.bias:
                src.bias.normal_()  # larger than nn.Linear's init, so that a bias left uncopied shows
                dst.bias.copy_(src.bias)
    return hf, ours, LlamaRotaryEmbedding(hf_cfg)


def _llama_call(hf, rotary, x, start, impl, cache=None):
    t = x.shape[1]
    cos, sin = rotary(x, torch.arange(start, start + t)[None])
    mask = _hf_mask_or_none(impl, t, start + t)
    return hf(x, position_embeddings=(cos, sin), attention_mask=mask, past_key_values=cache)[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", sorted(LLAMA_CONFIGS))
def test_gqa_equals_hf_llama_attention(name, impl, backend):
    cfg = LLAMA_CONFIGS[name]
    hf, ours, rotary = _llama_pair(cfg, impl, backend)
    x = torch.randn(2, sum(STEPS), cfg.d_model)
    with torch.no_grad():
        # Without a cache: the whole sequence in one call.
        assert _err(ours(x), _llama_call(hf, rotary, x, 0, impl)) <= TOL
        # With caches: the same tokens fed in STEPS chunks to both.
        hf_cache, cache, start = DynamicCache(), ours.new_cache(batch_size=2, max_seq_len=16), 0
        for t in STEPS:
            chunk = x[:, start : start + t]
            expected = _llama_call(hf, rotary, chunk, start, impl, hf_cache)
            assert _err(ours(chunk, cache=cache), expected) <= TOL, f"chunk at {start}"
            start += t
            assert len(cache) == start == hf_cache.get_seq_length()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    b=st.integers(1, 3),
    n_kv=st.integers(1, 3),
    group=st.integers(1, 4),
    head_dim=st.sampled_from([8, 40, 80, 96, 128, 192]),
    prefill=st.integers(1, 6),
    steps=st.integers(1, 3),
    impl=st.sampled_from(["eager", "sdpa"]),
    backend=st.sampled_from(BACKENDS),
    seed=st.integers(0, 2**16),
)
def test_property_gqa_equals_hf_llama(b, n_kv, group, head_dim, prefill, steps, impl, backend, seed):
    torch.manual_seed(seed)
    n_heads = n_kv * group
    # HF insists on hidden_size % n_heads == 0 even with an explicit head_dim, hence d_model = 8 * n_heads.
    cfg = AttentionConfig(d_model=8 * n_heads, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim)
    hf, ours, rotary = _llama_pair(cfg, impl, backend)
    x = torch.randn(b, prefill + steps, cfg.d_model)
    with torch.no_grad():
        assert _err(ours(x), _llama_call(hf, rotary, x, 0, impl)) <= TOL
        hf_cache, cache = DynamicCache(), ours.new_cache(batch_size=b, max_seq_len=prefill + steps)
        start = 0
        for t in (prefill,) + (1,) * steps:
            chunk = x[:, start : start + t]
            assert (
                _err(ours(chunk, cache=cache), _llama_call(hf, rotary, chunk, start, impl, hf_cache)) <= TOL
            )
            start += t


# ---------------------------------------------------------------------------- nn.MultiheadAttention


def _torch_mha_pair(d_model: int, n_heads: int, backend: str):
    ref = nn.MultiheadAttention(d_model, n_heads, bias=True, batch_first=True).eval()
    cfg = AttentionConfig(d_model=d_model, n_heads=n_heads, rope=False, bias=True, backend=backend)
    ours = GroupedQueryAttention(cfg).eval()
    with torch.no_grad():
        ref.in_proj_bias.normal_()
        ref.out_proj.bias.normal_()
        for i, lin in enumerate((ours.wq, ours.wk, ours.wv)):  # in_proj rows are [q; k; v]
            lin.weight.copy_(ref.in_proj_weight[i * d_model : (i + 1) * d_model])
            lin.bias.copy_(ref.in_proj_bias[i * d_model : (i + 1) * d_model])
        ours.wo.weight.copy_(ref.out_proj.weight)
        ours.wo.bias.copy_(ref.out_proj.bias)
    return ref, ours


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_rope_with_bias_equals_torch_multihead_attention(backend):
    ref, ours = _torch_mha_pair(d_model=24, n_heads=3, backend=backend)
    x = torch.randn(3, 6, 24)
    t = x.shape[1]
    with torch.no_grad():
        # torch's bool mask marks what may NOT be attended: the opposite of ours.
        future = torch.ones(t, t, dtype=torch.bool).triu(diagonal=1)
        expected = ref(x, x, x, attn_mask=future, need_weights=False)[0]
        assert _err(ours(x), expected) <= TOL
        assert _err(ours(x, is_causal=False), ref(x, x, x, need_weights=False)[0]) <= TOL
        # A padding mask: batch row b attends only to its first lengths[b] keys.
        lengths = torch.tensor([6, 4, 2])
        pad = torch.arange(t)[None, :] >= lengths[:, None]  # (B, T_k), True = padding
        expected = ref(x, x, x, key_padding_mask=pad, need_weights=False)[0]
        got = ours(x, attn_mask=~pad[:, None, None, :], is_causal=False)
        assert _err(got, expected) <= TOL


# ------------------------------------------------------------------------------------- DeepSeek-V3


def _mla_pair(q_lora_rank: int, rope_interleave: bool, mode: str, impl: str, bias: bool, backend: str):
    cfg = MLAConfig(
        d_model=32,
        n_heads=4,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        q_lora_rank=q_lora_rank,
        rope_theta=1000.0,
        bias=bias,
        mode=mode,
        backend=backend,
    )
    hf_cfg = DeepseekV3Config(
        hidden_size=cfg.d_model,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads,  # the default (128) is DeepSeek-V3's, not "same as n_heads"
        q_lora_rank=q_lora_rank or None,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},  # no yarn, no mscale
        rope_interleave=rope_interleave,
        attention_bias=bias,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        attn_implementation=impl,
    )
    hf = DeepseekV3Attention(hf_cfg, layer_idx=0).eval()
    assert hf.scaling == cfg.softmax_scale  # no mscale folded in
    ours = MultiHeadLatentAttention(cfg).eval()
    # The attention's own norms use DeepseekV3RMSNorm's default eps; ours is 1e-6 as well.
    norms = [(hf.kv_a_layernorm, ours.kv_norm)]
    if q_lora_rank:
        norms.append((hf.q_a_layernorm, ours.q_norm))
    for theirs, mine in norms:
        assert theirs.variance_epsilon == mine.eps == 1e-6

    # HF's interleaved RoPE reads pairs (2i, 2i+1) and writes them half-split; permuting the rope rows of the
    # weights that produce q_rope and k_rope gives our half-split RoPE the same inputs.
    perm = interleaved_to_half_split(cfg.qk_rope_head_dim) if rope_interleave else None

    def q_rows(w: torch.Tensor) -> torch.Tensor:
        w = w.view(cfg.n_heads, cfg.qk_head_dim, -1).clone()
        if perm is not None:
            w[:, cfg.qk_nope_head_dim :] = w[:, cfg.qk_nope_head_dim :][:, perm]
        return w.view(cfg.n_heads * cfg.qk_head_dim, -1)

    def kv_a_rows(w: torch.Tensor) -> torch.Tensor:
        w = w.clone()
        if perm is not None:
            w[cfg.kv_lora_rank :] = w[cfg.kv_lora_rank :][perm]
        return w

    with torch.no_grad():
        for p in hf.parameters():  # random norm weights and biases too, so that every copy matters
            p.normal_(0.0, 0.3)
        if q_lora_rank:
            ours.wq_a.weight.copy_(hf.q_a_proj.weight)
            ours.q_norm.weight.copy_(hf.q_a_layernorm.weight)
            ours.wq_b.weight.copy_(q_rows(hf.q_b_proj.weight))
            if bias:
                ours.wq_a.bias.copy_(hf.q_a_proj.bias)
        else:
            ours.wq.weight.copy_(q_rows(hf.q_proj.weight))
        ours.wkv_a.weight.copy_(kv_a_rows(hf.kv_a_proj_with_mqa.weight))
        ours.kv_norm.weight.copy_(hf.kv_a_layernorm.weight)
        ours.wkv_b.weight.copy_(hf.kv_b_proj.weight)
        ours.wo.weight.copy_(hf.o_proj.weight)
        if bias:
            ours.wkv_a.bias.copy_(kv_a_rows(hf.kv_a_proj_with_mqa.bias[:, None])[:, 0])
            ours.wo.bias.copy_(hf.o_proj.bias)
    n_ours = sum(p.numel() for p in ours.parameters())
    assert n_ours == sum(p.numel() for p in hf.parameters())  # every HF parameter has a home
    rotary = DeepseekV3RotaryEmbedding(hf_cfg)
    assert rotary.attention_scaling == 1.0  # no yarn mscale on cos/sin either
    return hf, ours, rotary


def _deepseek_call(hf, rotary, x, start, impl, cache=None):
    t = x.shape[1]
    cos, sin = rotary(x, torch.arange(start, start + t)[None])
    mask = _hf_mask_or_none(impl, t, start + t)
    return hf(x, position_embeddings=(cos, sin), attention_mask=mask, past_key_values=cache)[0]


MLA_CASES = [
    # (q_lora_rank, rope_interleave, impl, bias)
    (0, False, "eager", False),
    (12, False, "eager", True),
    (0, True, "eager", True),
    (12, True, "sdpa", False),
    (12, True, "eager", False),
]


@pytest.mark.parametrize("mode", ["naive", "absorbed"])
@pytest.mark.parametrize(("q_lora_rank", "rope_interleave", "impl", "bias"), MLA_CASES)
def test_mla_equals_hf_deepseek_v3_attention(q_lora_rank, rope_interleave, impl, bias, mode):
    hf, ours, rotary = _mla_pair(q_lora_rank, rope_interleave, mode, impl, bias, backend="auto")
    x = torch.randn(2, sum(STEPS), 32)
    with torch.no_grad():
        assert _err(ours(x), _deepseek_call(hf, rotary, x, 0, impl)) <= TOL
        hf_cache, cache, start = DynamicCache(), ours.new_cache(batch_size=2, max_seq_len=16), 0
        for t in STEPS:
            chunk = x[:, start : start + t]
            expected = _deepseek_call(hf, rotary, chunk, start, impl, hf_cache)
            assert _err(ours(chunk, cache=cache), expected) <= TOL, f"chunk at {start}"
            start += t
            assert len(cache) == start == hf_cache.get_seq_length()


@pytest.mark.parametrize("backend", ["reference", "sdpa", "grouped"])
def test_mla_every_backend_equals_hf(backend):
    x = torch.randn(2, 5, 32)
    for mode in ("naive", "absorbed"):
        hf, ours, rotary = _mla_pair(12, True, mode, "eager", False, backend=backend)
        with torch.no_grad():
            assert _err(ours(x), _deepseek_call(hf, rotary, x, 0, "eager")) <= TOL


def test_mla_without_the_rope_permutation_differs_from_hf():
    """The permutation is needed: with rope_interleave=True, copying rope rows as they are gives other outputs."""
    assert DeepseekV3Config().rope_interleave is True  # HF's default: DeepSeek checkpoints are interleaved
    hf, ours, rotary = _mla_pair(0, True, "naive", "eager", False, backend="auto")
    x = torch.randn(1, 5, 32)
    with torch.no_grad():
        ours.wq.weight.copy_(hf.q_proj.weight)  # undo the permutation of the rope rows
        ours.wkv_a.weight.copy_(hf.kv_a_proj_with_mqa.weight)
        assert _err(ours(x), _deepseek_call(hf, rotary, x, 0, "eager")) > 1e-3
