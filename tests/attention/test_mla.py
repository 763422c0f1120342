"""``MultiHeadLatentAttention``: absorbed == naive (forward and backward), cached decode == full forward for
every backend and mode, the cache holds only the latent and the rotary key, dropout, and bad input.
(Equality with Hugging Face's DeepseekV3Attention is in test_hf_oracles.py.)
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab import MLAConfig, MultiHeadLatentAttention
from attnlab.cache import LatentCache
from conftest import seeded

pytestmark = pytest.mark.usefixtures("one_thread")
BACKENDS = ("reference", "sdpa", "grouped", "auto")
MODES = ("naive", "absorbed", "auto")
CONFIGS = {
    "q_full": MLAConfig(
        d_model=32, n_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
    ),
    "q_lora": MLAConfig(
        d_model=32,
        n_heads=3,
        kv_lora_rank=12,
        qk_nope_head_dim=10,
        qk_rope_head_dim=6,
        v_head_dim=8,
        q_lora_rank=20,
        bias=True,
        rope_theta=500.0,
    ),
}


def _err(a, b) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a.double() - b.double()).abs().max().item()


def _build(cfg: MLAConfig, **changes) -> MultiHeadLatentAttention:
    torch.manual_seed(seeded(1))  # the same weights for every mode and backend of one config
    mla = MultiHeadLatentAttention(cfg.replace(**changes) if changes else cfg).eval()
    with torch.no_grad():
        for p in mla.parameters():
            p.normal_(0.0, 0.3)  # norm gains and biases too, so that each of them matters
    return mla


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_module_layout_follows_deepseek_names(name):
    cfg = CONFIGS[name]
    mla = _build(cfg)
    h = cfg.n_heads
    shapes = {n: tuple(p.shape) for n, p in mla.named_parameters()}
    expected = {
        "wkv_a.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.d_model),
        "kv_norm.weight": (cfg.kv_lora_rank,),
        "wkv_b.weight": (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        "wo.weight": (cfg.d_model, h * cfg.v_head_dim),
    }
    if cfg.q_lora_rank:
        expected |= {
            "wq_a.weight": (cfg.q_lora_rank, cfg.d_model),
            "q_norm.weight": (cfg.q_lora_rank,),
            "wq_b.weight": (h * cfg.qk_head_dim, cfg.q_lora_rank),
        }
    else:
        expected["wq.weight"] = (h * cfg.qk_head_dim, cfg.d_model)
    if cfg.bias:
        expected |= {"wq_a.bias": (cfg.q_lora_rank,), "wkv_a.bias": (expected["wkv_a.weight"][0],)}
        expected["wo.bias"] = (cfg.d_model,)
    assert shapes == expected


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_absorbed_equals_naive_forward_and_backward(name, backend):
    x0 = torch.randn(2, 7, 32)
    grad_out = torch.randn(2, 7, 32)
    mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    mask[0, ..., :3] = False  # padding in the first sequence
    results = {}
    for mode in MODES:
        mla = _build(CONFIGS[name], mode=mode, backend=backend)
        x = x0.clone().requires_grad_()
        y = mla(x, attn_mask=mask)
        y.backward(grad_out)
        results[mode] = (y, x.grad, {n: p.grad for n, p in mla.named_parameters()})
    (y_n, dx_n, g_n), (y_a, dx_a, g_a) = results["naive"], results["absorbed"]
    assert _err(y_a, y_n) <= 1e-5
    assert _err(dx_a, dx_n) <= 1e-5
    assert g_a.keys() == g_n.keys()
    for n in g_n:
        assert _err(g_a[n], g_n[n]) <= 5e-5, n


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_then_decode_equals_full_forward(name, mode, backend):
    mla = _build(CONFIGS[name], mode=mode, backend=backend)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        full = mla(x)
        cache = mla.new_cache(batch_size=2, max_seq_len=9)
        outs = [mla(x[:, :4], cache=cache)] + [mla(x[:, i : i + 1], cache=cache) for i in range(4, 9)]
        assert len(cache) == 9
        assert _err(torch.cat(outs, dim=1), full) <= 1e-5
        cache.reset()
        outs = [mla(x[:, a:b], cache=cache) for a, b in ((0, 2), (2, 5), (5, 6), (6, 9))]
        assert _err(torch.cat(outs, dim=1), full) <= 1e-5


def test_backends_agree_forward_and_backward():
    x0 = torch.randn(2, 5, 32)
    results = {}
    for backend in BACKENDS:
        mla = _build(CONFIGS["q_lora"], backend=backend)
        x = x0.clone().requires_grad_()
        y = mla(x)
        y.square().sum().backward()
        results[backend] = (y, x.grad, {n: p.grad for n, p in mla.named_parameters()})
    y_r, dx_r, g_r = results["reference"]
    for backend, (y, dx, g) in results.items():
        assert _err(y, y_r) <= 1e-5 and _err(dx, dx_r) <= 2e-5, backend
        for n in g_r:
            assert _err(g[n], g_r[n]) <= 1e-4, f"{backend} {n}"


def test_mode_can_switch_mid_sequence_on_one_cache():
    """Both modes read the same latent cache: prefill naive, decode absorbed, equals a full forward."""
    mla = _build(CONFIGS["q_full"], mode="naive")
    x = torch.randn(1, 6, 32)
    with torch.no_grad():
        full = mla(x)
        cache = mla.new_cache(batch_size=1, max_seq_len=6)
        first = mla(x[:, :4], cache=cache)
        mla.mode = "absorbed"
        rest = [mla(x[:, i : i + 1], cache=cache) for i in (4, 5)]
    assert _err(torch.cat([first, *rest], dim=1), full) <= 1e-5


def test_auto_mode_picks_by_flops_and_runs_what_it_picks(monkeypatch):
    """ "auto": naive once (kv_len - t_q) r (d_nope + d_v) < pairs (2 r - d_nope - d_v): absorbed pays per query
    what naive pays per key (moving into and out of the latent) and wider products per pair; so naive without a
    cache, absorbed for decode steps and paged caches, naive over a long cache from r dims / (2 r - dims) new
    tokens; results equal."""
    cfg = MLAConfig(
        d_model=576, n_heads=9, kv_lora_rank=320, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64
    )
    # no cache: naive at every length (absorbed was chosen up to 80 queries, and cost 0.8-8.6 % more FLOPs)
    assert {cfg.mode_for(t) for t in (1, 2, 80, 81, 512)} == {"naive"}
    long = 10**6  # over a long cache: from r dims / (2 r - dims) = 80 new tokens (it was 81)
    assert [cfg.mode_for(t, kv_len=long + t) for t in (1, 79, 80, 512)] == [
        "absorbed",
        "absorbed",
        "naive",
        "naive",
    ]
    assert cfg.mode_for(1, kv_len=2) == "absorbed"  # a decode step over one cached token
    assert cfg.mode_for(512, paged=True) == "absorbed"
    assert (
        cfg.replace(mode="naive").mode_for(1) == "naive" and cfg.mode_for(512, mode="absorbed") == "absorbed"
    )
    v3 = cfg.replace(kv_lora_rank=512, qk_nope_head_dim=128, v_head_dim=128)
    assert (v3.mode_for(170, kv_len=long + 170), v3.mode_for(171, kv_len=long + 171)) == ("absorbed", "naive")
    narrow = cfg.replace(kv_lora_rank=64)  # 2 r <= d_nope + d_v: absorbed never costs more
    assert narrow.mode_for(10**6) == "absorbed"
    small = CONFIGS["q_full"]  # r 16, d_nope 8, d_v 6: a step of 2 over 13 cached: 13 * 16 * 14 > 27 * 18
    assert (small.mode_for(2, kv_len=15), small.mode_for(13)) == ("absorbed", "naive")
    mla = _build(small)
    assert mla.mode == "auto"
    ran = []
    for name in ("_naive", "_absorbed"):
        real = getattr(MultiHeadLatentAttention, name)
        monkeypatch.setattr(
            MultiHeadLatentAttention, name, lambda self, *a, _n=name, _r=real: ran.append(_n) or _r(self, *a)
        )
    x = torch.randn(1, 15, 32)
    with torch.no_grad():
        full = mla(x)
        cache = mla.new_cache(batch_size=1, max_seq_len=15)
        steps = [mla(x[:, :13], cache=cache), mla(x[:, 13:14], cache=cache), mla(x[:, 14:], cache=cache)]
        want = mla(x, mode="absorbed")
    assert ran == ["_naive", "_naive", "_absorbed", "_absorbed", "_absorbed"]
    assert _err(torch.cat(steps, dim=1), full) <= 1e-5 and _err(full, want) <= 1e-5


def test_cache_holds_only_latent_and_rotary_key():
    cfg = CONFIGS["q_lora"]
    mla = _build(cfg)
    cache = mla.new_cache(batch_size=2, max_seq_len=10)
    assert isinstance(cache, LatentCache)
    assert cache.kv.shape == (2, 10, cfg.kv_lora_rank + cfg.qk_rope_head_dim) == (2, 10, cfg.cache_dim)
    assert cache.nbytes == 2 * 10 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    x = torch.randn(2, 3, 32)
    with torch.no_grad():
        mla(x, cache=cache)
        # The cached row is kv_norm(latent) followed by the rotary key; at position 0 RoPE is the identity.
        latent, k_rope = mla.wkv_a(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        assert _err(cache.kv[:, :3, : cfg.kv_lora_rank], mla.kv_norm(latent)) <= 1e-6
        assert _err(cache.kv[:, 0, cfg.kv_lora_rank :], k_rope[:, 0]) <= 1e-6
        assert _err(cache.kv[:, 1, cfg.kv_lora_rank :], k_rope[:, 1]) > 1e-4  # position 1 is rotated


def test_softmax_scale_uses_the_full_query_head_dim():
    cfg = CONFIGS["q_full"]
    assert cfg.softmax_scale == (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_matches_float32(mode, backend):
    mla = _build(CONFIGS["q_lora"])
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        expected = mla(x)
        mla16 = _build(CONFIGS["q_lora"], mode=mode, backend=backend).to(torch.bfloat16)
        mla16.load_state_dict(mla.state_dict())
        cache = mla16.new_cache(batch_size=2, max_seq_len=7)
        assert cache.kv.dtype == torch.bfloat16
        x16 = x.bfloat16()
        steps = [mla16(x16[:, :4], cache=cache)] + [mla16(x16[:, i : i + 1], cache=cache) for i in (4, 5, 6)]
    # Measured 0.4% of the largest output (one bfloat16 rounding per stage); 1.5% bounds it with room to spare.
    bound = 1.5e-2 * expected.abs().max().item()
    assert _err(torch.cat(steps, dim=1), expected) <= bound
    assert _err(mla16(x16), expected) <= bound


@pytest.mark.parametrize("mode", MODES)
def test_dropout_in_training_only(mode):
    mla = _build(CONFIGS["q_full"], dropout=0.5, mode=mode)
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        evaluated = mla(x)
        assert torch.equal(mla(x), evaluated)
        mla.train()
        first, second = mla(x), mla(x)
    assert _err(first, evaluated) > 1e-3 and _err(first, second) > 1e-3


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    b=st.integers(1, 2),
    n_heads=st.integers(1, 4),
    kv_lora_rank=st.sampled_from([4, 16, 40]),
    qk_nope_head_dim=st.sampled_from([0, 8, 32, 96]),
    qk_rope_head_dim=st.sampled_from([2, 8, 64]),
    v_head_dim=st.sampled_from([8, 40, 128]),
    q_lora_rank=st.sampled_from([0, 12]),
    prefill=st.integers(1, 5),
    steps=st.integers(1, 3),
    backend=st.sampled_from(BACKENDS),
    seed=st.integers(0, 2**16),
)
def test_property_naive_absorbed_and_cache_agree(
    b,
    n_heads,
    kv_lora_rank,
    qk_nope_head_dim,
    qk_rope_head_dim,
    v_head_dim,
    q_lora_rank,
    prefill,
    steps,
    backend,
    seed,
):
    cfg = MLAConfig(
        d_model=24,
        n_heads=n_heads,
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=v_head_dim,
        q_lora_rank=q_lora_rank,
        backend=backend,
    )
    torch.manual_seed(seed)
    naive = MultiHeadLatentAttention(cfg.replace(mode="naive")).eval()
    absorbed = MultiHeadLatentAttention(cfg.replace(mode="absorbed")).eval()
    absorbed.load_state_dict(naive.state_dict())
    x = torch.randn(b, prefill + steps, 24)
    with torch.no_grad():
        full = naive(x)
        assert _err(absorbed(x), full) <= 1e-5
        cache = absorbed.new_cache(batch_size=b, max_seq_len=prefill + steps)
        outs = [absorbed(x[:, :prefill], cache=cache)]
        outs += [absorbed(x[:, i : i + 1], cache=cache) for i in range(prefill, prefill + steps)]
        assert _err(torch.cat(outs, dim=1), full) <= 1e-5


# ------------------------------------------------------------------------------------------ bad input


def test_bad_input_names_field_and_value():
    mla = _build(CONFIGS["q_full"])
    with pytest.raises(ValueError, match=r"d_model=32\), got shape \(1, 4, 30\)"):
        mla(torch.randn(1, 4, 30))
    with pytest.raises(TypeError, match=r"x has dtype torch.float64 but the weights are torch.float32"):
        mla(torch.randn(1, 4, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"mode must be 'auto', 'naive' or 'absorbed', got 'fast'"):
        mla.mode = "fast"  # refused where it is set (the mode lives in mla.cfg, which is validated)
    with pytest.raises(ValueError, match=r"mode must be 'auto', 'naive' or 'absorbed', got 'fast'"):
        mla(torch.randn(1, 4, 32), mode="fast")
    with pytest.raises(TypeError, match=r"cfg must be an MLAConfig, got AttentionConfig"):
        from attnlab import AttentionConfig

        MultiHeadLatentAttention(AttentionConfig(d_model=32, n_heads=4))


def test_cache_misuse_leaves_the_cache_unchanged():
    mla = _build(CONFIGS["q_full"])
    cache = mla.new_cache(batch_size=2, max_seq_len=5)
    mla(torch.randn(2, 3, 32), cache=cache)
    before = cache.kv.clone()
    with pytest.raises(ValueError, match=r"overflow: 3 tokens held \+ 3 new > max_seq_len=5"):
        mla(torch.randn(2, 3, 32), cache=cache)
    with pytest.raises(ValueError, match=r"batch of 4 but the cache was made for batch_size=2"):
        mla(torch.randn(4, 1, 32), cache=cache)
    with pytest.raises(ValueError, match=r"attn_mask of shape \(1, 3\) does not broadcast.*\(2, 4, 1, 4\)"):
        mla(torch.randn(2, 1, 32), attn_mask=torch.ones(1, 3, dtype=torch.bool), cache=cache)
    assert len(cache) == 3 and torch.equal(cache.kv, before)
    bf16 = mla.new_cache(batch_size=2, max_seq_len=5, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"kv has dtype torch.float32, the cache holds torch.bfloat16"):
        mla(torch.randn(2, 1, 32), cache=bf16)
    assert len(bf16) == 0


@pytest.mark.parametrize("t,held", [(1, 0), (3, 0), (9, 0), (1, 7), (2, 7), (6, 7), (12, 30)])
def test_auto_mode_costs_no_more_flops_than_either_mode(t, held):
    # the oracle: torch's FLOP counter on the module, each mode forced, against "auto"
    from torch.utils.flop_counter import FlopCounterMode

    mla = _build(CONFIGS["q_full"])
    x = torch.randn(1, held + t, 32)

    def flops(mode):
        cache = mla.new_cache(batch_size=1, max_seq_len=held + t)
        with torch.no_grad():
            if held:
                mla(x[:, :held], cache=cache, mode="naive")
            with FlopCounterMode(display=False) as counter:
                mla(x[:, held:], cache=cache, mode=mode)
        return counter.get_total_flops()

    naive, absorbed, auto = flops("naive"), flops("absorbed"), flops("auto")
    assert auto == min(naive, absorbed) and naive != absorbed
