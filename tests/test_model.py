"""The decoder: cached generation equals uncached generation, full-forward logits equal prefill + decode logits,
sampling options, and bad input."""

from __future__ import annotations

import pytest
import torch

from attnlab import AttentionConfig, MLAConfig, ModelConfig
from attnlab.model import Transformer
from conftest import seeded

pytestmark = pytest.mark.usefixtures("one_thread")

ATTENTION = {
    "gqa": AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2),
    "mqa-sdpa": AttentionConfig(d_model=32, n_heads=4, n_kv_heads=1, backend="sdpa"),
    "mla-absorbed": MLAConfig(
        d_model=32,
        n_heads=4,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        q_lora_rank=12,
    ),
    "mla-naive": MLAConfig(
        d_model=32,
        n_heads=2,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=16,
        mode="naive",
    ),
}


def _model(name: str, **changes) -> Transformer:
    cfg = ModelConfig(
        vocab_size=97, n_layers=2, attention=ATTENTION[name], ffn_dim=64, max_seq_len=64, **changes
    )
    model = Transformer(cfg).eval()
    # A wide init so that logits have clear winners: greedy decoding then tests the cache, not float ties.
    model.init_weights(std=0.3, seed=seeded(0))
    return model


def _err(a, b) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_full_forward_logits_equal_prefill_plus_decode(name):
    model = _model(name)
    tokens = torch.randint(0, 97, (2, 10))
    with torch.no_grad():
        full = model(tokens)
        assert full.shape == (2, 10, 97) and full.dtype == torch.float32
        caches = model.new_caches(batch_size=2, max_seq_len=10)
        assert len(caches) == 2
        steps = [model(tokens[:, :6], caches=caches)]
        steps += [model(tokens[:, i : i + 1], caches=caches) for i in range(6, 10)]
    assert all(len(c) == 10 for c in caches)
    assert _err(torch.cat(steps, dim=1), full) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_inference_in_place_sums_equal_the_autograd_forward_bit_for_bit(name, dtype):
    # Without grad mode the block, its norms, RoPE and MLP update their own fresh buffers in place; with grad mode
    # (parameters frozen, so every kernel choice is the same) they allocate as autograd needs. Same values exactly.
    model = _model(name).to(dtype).requires_grad_(False)
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.enable_grad():
        caches = model.new_caches(batch_size=2, max_seq_len=12)
        grad_mode = [model(tokens[:, :7], caches=caches), model(tokens[:, 7:], caches=caches)]
    with torch.inference_mode():
        caches = model.new_caches(batch_size=2, max_seq_len=12)
        in_place = [model(tokens[:, :7], caches=caches), model(tokens[:, 7:], caches=caches)]
        assert not torch.equal(in_place[0], torch.zeros_like(in_place[0]))
    for a, b in zip(grad_mode, in_place, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_construction_works_on_the_meta_device(name):
    cfg = ModelConfig(vocab_size=97, n_layers=2, attention=ATTENTION[name], ffn_dim=64)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert all(p.is_meta for p in model.parameters())
    shapes = {n: p.shape for n, p in Transformer(cfg).named_parameters()}
    assert {n: p.shape for n, p in model.named_parameters()} == shapes


def test_tied_embeddings_share_one_tensor():
    model = _model("gqa", tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight


def test_bad_input():
    model = _model("gqa")
    prompt = torch.randint(0, 97, (1, 3))
    with pytest.raises(TypeError, match=r"tokens must be an integer tensor, got dtype torch.float32"):
        model(prompt.float())
    with pytest.raises(ValueError, match=r"caches has 1 entries for 2 layers"):
        model(prompt, caches=model.new_caches(1, 8)[:1])
    with pytest.raises(ValueError, match=r"max_seq_len must be >= 1, got 0"):  # once: the config's length
        model.new_caches(1, 0)
    with pytest.raises(TypeError, match=r"cfg must be a ModelConfig, got AttentionConfig"):
        Transformer(ATTENTION["gqa"])
    moe = ModelConfig(
        vocab_size=10,
        n_layers=1,
        attention=ATTENTION["gqa"],
        ffn_dim=8,
        n_experts=4,
        n_active_experts=2,
        moe_ffn_dim=8,
    )
    with pytest.raises(ValueError, match=r"ModelConfig.n_experts=4"):
        Transformer(moe)


def test_token_ids_outside_the_vocabulary_and_a_missing_cache_are_named():
    model = _model("gqa")
    for bad in (97, -2):  # an IndexError from the embedding before
        with pytest.raises(ValueError, match=rf"tokens hold id {bad}, outside the vocabulary \[0, 97\)"):
            model(torch.tensor([[1, bad, 3]]))
    caches = model.new_caches(1, 8)
    with pytest.raises(
        ValueError, match=r"caches\[1\] is None: give every layer a cache, or pass caches=None"
    ):
        model(torch.tensor([[1, 2]]), caches=[caches[0], None])  # layer 1 would see the new tokens alone
    assert len(caches[0]) == 0


@torch.no_grad()
def test_a_sliding_model_decodes_its_window_over_a_cache_of_every_token():
    """The fused block step attended to every held token when a sliding layer's cache was not its ring (7.6 off
    the full forward): it now runs only while every held token lies in the window."""
    from attnlab import KVCache

    window = 4
    cfg = ModelConfig(
        vocab_size=97,
        n_layers=2,
        ffn_dim=192,
        max_seq_len=64,
        attention=AttentionConfig(d_model=128, n_heads=8, n_kv_heads=2, window=window),
    )
    sliding = Transformer(cfg).eval()
    sliding.init_weights(std=0.15, seed=seeded(0))
    tokens = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(0))
    full = sliding(tokens)
    caches = [KVCache(2, cfg.attention.n_kv_heads, 32, cfg.attention.head_dim) for _ in sliding.layers]
    steps = [sliding(tokens[:, :3], caches=caches)] + [
        sliding(tokens[:, t : t + 1], caches=caches) for t in range(3, 20)
    ]
    assert _err(torch.cat(steps, 1), full) < 1e-4


def test_norm_gain_float32_rounds_as_a_gain_applied_before_the_cast():
    """Llama's RMSNorm casts the normalised x back, then scales it: ``w * n(x).to(dtype)``; OLMo 2's scales it in
    float32, then casts: ``(w * n(x)).to(dtype)``. Equal in float32, not in bfloat16; ``norm_gain_float32`` picks the
    second for every norm of the model, the q/k norms by their own ``AttentionConfig`` field."""
    from attnlab.attention.norm import RMSNorm, make_norm

    gen = torch.Generator().manual_seed(seeded(5))
    x = torch.randn(64, 48, generator=gen).bfloat16()
    w = (1 + 0.3 * torch.randn(48, generator=gen)).bfloat16()
    n = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    llama, olmo = RMSNorm(48).bfloat16(), RMSNorm(48, gain_float32=True).bfloat16()
    with torch.no_grad():
        for norm in (llama, olmo):
            norm.weight.copy_(w)
        assert torch.equal(llama(x), w * n.to(torch.bfloat16))
        assert torch.equal(olmo(x), (w * n).to(torch.bfloat16))
        assert not torch.equal(llama(x), olmo(x))  # the rounding differs somewhere in 64 x 48 values
        torch.testing.assert_close(llama.float()(x.float()), olmo.float()(x.float()), rtol=0, atol=0)
    attn = AttentionConfig(d_model=48, n_heads=6, n_kv_heads=2, qk_norm="full", norm_gain_float32=True)
    cfg = ModelConfig(vocab_size=97, n_layers=2, attention=attn, ffn_dim=64, norm_gain_float32=True)
    norms = [m for m in Transformer(cfg).modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * 4 + 1 and all(m.gain_float32 for m in norms)
    with pytest.raises(ValueError, match="a LayerNorm has no gain offset or float32 gain"):
        make_norm("layernorm", 48, 1e-5, gain_float32=True)
    with pytest.raises(TypeError, match=r"ModelConfig\.norm_gain_float32 must be True or False"):
        cfg.replace(norm_gain_float32=1)
