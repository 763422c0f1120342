"""Analytic FLOPs against torch's FlopCounterMode (reference backend) and count_flops (sdpa backend)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from attnlab import AttentionConfig, GroupedQueryAttention, MLAConfig, ModelConfig, MultiHeadLatentAttention
from attnlab.bench import count_flops
from attnlab.cost import attention_flops, model_flops
from attnlab.model import Transformer
from conftest import seeded

N_RANDOM = (
    25  # random configs per variant family (175 in all), each: prefill fwd, fwd+bwd, decode; 2 backends
)


@pytest.fixture(autouse=True)
def _one_thread():
    # Counting runs thousands of tiny ops; with two threads on a shared 2-core machine each one can wait
    # hundreds of microseconds for the other thread. One thread is faster and does not change any count.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_gqa(rng: random.Random, kind: str) -> AttentionConfig:
    n_heads = rng.choice([4, 6, 8])
    groups = [g for g in range(2, n_heads) if n_heads % g == 0]  # strictly between MQA and MHA
    n_kv = {"mha": n_heads, "mqa": 1, "gqa": rng.choice(groups)}[kind]
    head_dim = rng.choice([4, 8, 12, 16])
    bias = rng.random() < 0.5
    return AttentionConfig(
        d_model=rng.choice([16, 24, 32]), n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, bias=bias,
        out_bias=rng.choice([None, not bias]),
    )  # fmt: skip


def random_mla(rng: random.Random, mode: str, q_lora: bool) -> MLAConfig:
    return MLAConfig(
        d_model=rng.choice([16, 24, 32]),
        n_heads=rng.choice([1, 2, 3, 4]),
        kv_lora_rank=rng.choice([4, 8, 12]),
        qk_nope_head_dim=rng.choice([0, 4, 8]),
        qk_rope_head_dim=rng.choice([2, 4, 6]),
        v_head_dim=rng.choice([4, 6, 8]),
        q_lora_rank=rng.choice([4, 10]) if q_lora else 0,
        bias=rng.random() < 0.5,
        mode=mode,
    )


FAMILIES = ["mha", "gqa", "mqa", "mla-naive", "mla-absorbed", "mla-naive-qlora", "mla-absorbed-qlora"]


def configs(family: str) -> list[AttentionConfig | MLAConfig]:
    rng = random.Random(seeded(f"flops-{family}"))
    if family.startswith("mla"):
        return [random_mla(rng, family.split("-")[1], family.endswith("qlora")) for _ in range(N_RANDOM)]
    return [random_gqa(rng, family) for _ in range(N_RANDOM)]


def build(cfg):
    module = GroupedQueryAttention(cfg) if isinstance(cfg, AttentionConfig) else MultiHeadLatentAttention(cfg)
    return module.double()  # float64: no dtype casts that a counter could see differently


class Counter:
    """One interface over FlopCounterMode (for "reference") and count_flops (for "sdpa")."""

    def __init__(self, backend: str) -> None:
        self.mode = FlopCounterMode(display=False) if backend == "reference" else count_flops()

    def __enter__(self) -> Counter:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)

    @property
    def total(self) -> int:
        return self.mode.get_total_flops() if isinstance(self.mode, FlopCounterMode) else self.mode.total


@pytest.mark.parametrize("family", FAMILIES)
def test_flops_equal_counters_prefill_forward_backward_and_decode(family):
    rng = random.Random(seeded(f"sizes-{family}"))
    checked = 0
    for cfg in configs(family):
        b, t, prior = rng.randint(1, 3), rng.randint(1, 6), rng.randint(1, 5)
        for backend in ("reference", "sdpa"):
            module = build(cfg.replace(backend=backend))
            x = torch.randn(b, t, cfg.d_model, dtype=torch.float64, requires_grad=True)
            with Counter(backend) as fwd:
                module(x)
            assert fwd.total == attention_flops(cfg, b, t, t).total, (backend, cfg)
            with Counter(backend) as both:
                module(x).square().sum().backward()
            assert both.total == attention_flops(cfg, b, t, t, backward=True).total, (backend, cfg)

            # decode with a cache: `prior` tokens cached, then one step, then a chunk of t tokens
            cache = module.new_cache(b, prior + 1 + t)
            x_prior, x_step, x_chunk = (
                torch.randn(b, n, cfg.d_model, dtype=torch.float64) for n in (prior, 1, t)
            )
            with torch.no_grad():
                module(x_prior, cache=cache)
                with Counter(backend) as step:
                    module(x_step, cache=cache)
                with Counter(backend) as chunk:
                    module(x_chunk, cache=cache)
            assert step.total == attention_flops(cfg, b, 1, prior + 1).total, (backend, cfg)
            assert chunk.total == attention_flops(cfg, b, t, prior + 1 + t).total, (backend, cfg)
            checked += 1
    assert checked == 2 * N_RANDOM


@pytest.mark.parametrize("mode", ["naive", "absorbed"])
def test_mla_parts_equal_the_counts_of_the_modules_that_do_them(mode):
    # Each part of the analytic count is checked against FlopCounterMode's count for the submodule that does
    # that work in one decode step over 100 cached tokens (not against its own formula).
    cfg = MLAConfig(d_model=64, n_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                    v_head_dim=16, backend="reference", mode=mode)  # fmt: skip
    module = build(cfg)
    cache = module.new_cache(1, 101)
    with torch.no_grad():
        module(torch.randn(1, 100, 64, dtype=torch.float64), cache=cache)
        with FlopCounterMode(display=False) as fc:
            module(torch.randn(1, 1, 64, dtype=torch.float64), cache=cache)
    counted = {name.rsplit(".", 1)[-1]: sum(ops.values()) for name, ops in fc.get_flop_counts().items()}
    f = attention_flops(cfg, 1, 1, 101)
    assert f.q_proj == counted["wq"] and f.latent_proj == counted["wkv_a"] and f.out_proj == counted["wo"]
    assert f.k_proj + f.v_proj == counted.get(
        "wkv_b", 0
    )  # naive decompresses every cached latent; absorbed: 0
    inside = counted["MultiHeadLatentAttention"] - sum(
        counted[n] for n in ("wq", "wkv_a", "wo", "wkv_b") if n in counted
    )
    assert f.absorb + f.scores + f.values == inside  # the attention math and the absorbed einsums
    assert f.total == counted["MultiHeadLatentAttention"]


def test_causal_count_equals_a_kernel_that_skips_masked_pairs():
    # The oracle: a causal attention written row by row, each query multiplying only the keys it may see,
    # counted by FlopCounterMode; the causal=True count must equal it, the default must equal the full square.
    cfg = AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2)
    for t_q, t_k in [(5, 5), (3, 9), (1, 7), (8, 8)]:
        q, k, v = torch.randn(2, 4, t_q, 8), torch.randn(2, 4, t_k, 8), torch.randn(2, 4, t_k, 8)
        with FlopCounterMode(display=False) as skipping:
            for i in range(t_q):
                seen = t_k - t_q + i + 1  # bottom-right alignment: query i sits at position t_k - t_q + i
                torch.softmax(q[:, :, i : i + 1] @ k[:, :, :seen].transpose(-2, -1), -1) @ v[:, :, :seen]
        with FlopCounterMode(display=False) as full:
            torch.softmax(q @ k.transpose(-2, -1), -1) @ v
        causal, plain = attention_flops(cfg, 2, t_q, t_k, causal=True), attention_flops(cfg, 2, t_q, t_k)
        assert causal.scores + causal.values == skipping.get_total_flops()
        assert plain.scores + plain.values == full.get_total_flops()
        assert causal.q_proj == plain.q_proj
    for causal in (True, False):  # without the mask too: it was counted (the keys include the new tokens)
        with pytest.raises(ValueError, match="q_len <= kv_len"):
            attention_flops(cfg, 1, 5, 3, causal=causal)
    with pytest.raises(ValueError, match="batch"):
        attention_flops(cfg, 0, 5, 5)
    with pytest.raises(TypeError, match="cfg must be an AttentionConfig or MLAConfig, got str"):
        attention_flops("x", 1, 1, 1)  # once an AttributeError on cfg.n_heads


@pytest.mark.parametrize("held, new", [(0, 5), (2, 3), (5, 3), (9, 4), (6, 1)])
def test_a_sliding_window_step_counts_as_the_keys_its_cache_hands_it(held, new):
    """A step of several tokens past the window was counted over every token so far (kv_len); the module computes
    it over the window of earlier keys its cache holds and the new ones."""
    cfg = AttentionConfig(d_model=16, n_heads=4, n_kv_heads=2, window=3)
    module = GroupedQueryAttention(cfg).eval()
    with torch.no_grad():
        cache = module.new_cache(3, 32)
        if held:
            module(torch.randn(3, held, 16), cache=cache)
        with count_flops() as fc:
            module(torch.randn(3, new, 16), cache=cache)
    assert fc.total == attention_flops(cfg, 3, new, held + new).total


def test_plain_flop_counter_misses_cpu_sdpa_and_count_flops_does_not():
    q = torch.randn(2, 8, 16, 32, requires_grad=True)
    k = torch.randn(2, 2, 16, 32, requires_grad=True)
    v = torch.randn(2, 2, 16, 32, requires_grad=True)
    expected = 2 * 2 * 8 * 16 * 16 * (32 + 32)  # per query head: scores and weighted values
    with FlopCounterMode(display=False) as plain:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    assert plain.get_total_flops() == 0  # why count_flops exists
    with count_flops() as fc:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert fc.total == expected
    assert fc.by_op == {"_scaled_dot_product_flash_attention_for_cpu": expected}
    with count_flops() as fc:
        out.sum().backward()
    assert fc.total == 2 * expected  # dQ, dK, dV, dP: twice the forward products


def small_model(attention, **kw) -> ModelConfig:
    return ModelConfig(vocab_size=97, n_layers=2, attention=attention, ffn_dim=40, **kw)


@pytest.mark.parametrize(
    "attention",
    [
        AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, backend="reference"),
        MLAConfig(d_model=32, n_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                  q_lora_rank=12, backend="reference", mode="naive"),
        MLAConfig(d_model=32, n_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                  backend="reference"),
    ],
    ids=["gqa", "mla-naive", "mla-absorbed"],
)  # fmt: skip
def test_model_flops_equal_flop_counter_on_transformer(attention):
    cfg = small_model(attention, tie_embeddings=isinstance(attention, MLAConfig))
    model = Transformer(cfg).double()
    tokens = torch.randint(0, cfg.vocab_size, (2, 7))
    with FlopCounterMode(display=False) as fc:
        model(tokens)
    assert fc.get_total_flops() == model_flops(cfg, 2, 7).total
    with FlopCounterMode(display=False) as fc:
        model(tokens).sum().backward()
    assert fc.get_total_flops() == model_flops(cfg, 2, 7, backward=True).total
    caches = model.new_caches(2, 12, dtype=torch.float64)
    with torch.no_grad():
        model(tokens, caches=caches)
        with FlopCounterMode(display=False) as fc:
            model(tokens[:, :1], caches=caches)
    assert fc.get_total_flops() == model_flops(cfg, 2, 1, 8).total


def test_moe_flops_use_active_experts():
    # An MoE token runs its active and shared experts: the same MLP work as a dense layer whose width is theirs
    # together. The router is a d_model -> n_experts linear layer, counted here by FlopCounterMode.
    attn = AttentionConfig(d_model=64, n_heads=4)
    dense = ModelConfig(vocab_size=100, n_layers=4, attention=attn, ffn_dim=256)
    moe = dense.replace(
        n_experts=16, n_shared_experts=1, n_active_experts=2, moe_ffn_dim=64, n_dense_layers=0
    )
    as_dense = dense.replace(ffn_dim=(2 + 1) * 64)
    a, b = model_flops(as_dense, 1, 10), model_flops(moe, 1, 10)
    assert a.attention == b.attention and a.lm_head == b.lm_head and a.mlp == b.mlp
    with FlopCounterMode(display=False) as fc:
        torch.nn.Linear(64, 16, bias=False)(torch.randn(10, 64))
    assert b.router == moe.n_layers * fc.get_total_flops()
    one_dense = model_flops(moe.replace(n_dense_layers=1), 1, 10)
    assert one_dense.mlp - b.mlp == model_flops(dense, 1, 10).mlp // 4 - a.mlp // 4  # a dense first layer


def test_windowed_pairs_equal_a_count_of_the_mask_and_take_no_time_at_any_length():
    """The causal sliding-window pair count against the mask itself (each query at position kv_len - q_len + i sees
    the keys within `window` of it), and at 2^40 tokens (compare's largest --seq-len) it answers at once: it was a
    loop over the queries, seconds at 10^7 and no answer at 2^40."""
    import time

    from attnlab.cost.flops import attended_pairs

    for q_len in range(1, 12):
        for kv_len in range(q_len, 20):
            for window in range(1, 24):
                pos = torch.arange(kv_len - q_len, kv_len)[:, None]
                key = torch.arange(kv_len)[None, :]
                mask = (key <= pos) & (key > pos - window)
                assert attended_pairs(q_len, kv_len, True, window) == int(mask.sum())
    start = time.perf_counter()
    assert attended_pairs(10**7, 10**7, True, 512) == 512 * 511 // 2 + (10**7 - 511) * 512
    assert time.perf_counter() - start < 0.1
    assert attended_pairs(2**40, 2**40, True, 512) == 512 * 511 // 2 + (2**40 - 511) * 512
