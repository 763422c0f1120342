"""The fused decode step of a decoder block (``attnlab.model.Block`` through ``fused.BlockStep``).

Oracles: the same model run module by module (the fused step switched off), over generated shapes, float32 within
1e-5 and bfloat16 within bfloat16 rounding, logits and cache contents alike; and transformers' LlamaForCausalLM
with the same weights, step by step. Then the cases that must not take the fused step (hooks, training, gradient,
a mask, MLA, another backend, a paged cache), that a replaced weight is followed, that a failed step changes
nothing, and that a model that ran fused steps still pickles.
"""

from __future__ import annotations

import copy
import os
import pickle

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab import AttentionConfig, MLAConfig, ModelConfig
from attnlab import model as model_module
from attnlab.attention import fused
from attnlab.hf.causal_lm import load_causal_lm
from attnlab.model import Transformer

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
pytestmark = pytest.mark.skipif(os.environ.get("ATTNLAB_FUSED") == "0", reason="ATTNLAB_FUSED=0")


class Spy:
    """Counts the fused block steps taken (``BlockStep.__call__``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        run = fused.BlockStep.__call__

        def counted(step, *args):
            self.calls += 1
            return run(step, *args)

        monkeypatch.setattr(fused.BlockStep, "__call__", counted)


def _model(attn, *, ffn_dim=64, bias=False, dtype=torch.float32, n_layers=2, seed=0) -> Transformer:
    cfg = ModelConfig(
        vocab_size=101, n_layers=n_layers, attention=attn, ffn_dim=ffn_dim, max_seq_len=64, mlp_bias=bias
    )
    model = Transformer(cfg).eval()
    model.init_weights(std=0.2, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norm gains and biases away from their init: the test sees them used
                p.normal_(mean=1.0 if "norm" in name else 0.0, std=0.2)
    return model.to(dtype)


def _decode(model, tokens, prompt_len, position_ids=None, caches=None):
    """Logits of the decode steps after a prefill of ``prompt_len`` tokens, and the caches."""
    with torch.no_grad():
        caches = caches or model.new_caches(tokens.shape[0], 64)
        model(tokens[:, :prompt_len], caches=caches)
        steps = []
        for i in range(prompt_len, tokens.shape[1]):
            pos = None if position_ids is None else position_ids[:, i : i + 1]
            steps.append(model(tokens[:, i : i + 1], caches=caches, position_ids=pos))
    return torch.cat(steps, dim=1), caches


def _module_by_module(monkeypatch, fn):
    with monkeypatch.context() as m:
        m.setattr(model_module._FusedPlan, "of", staticmethod(lambda *a: None))
        return fn()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@SETTINGS
@given(data=st.data())
def test_fused_steps_equal_the_module_by_module_steps(dtype, data):
    n_kv, group = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    head_dim = data.draw(st.sampled_from([2, 8, 12, 16, 64]))
    attn = AttentionConfig(
        d_model=data.draw(st.integers(4, 80)),
        n_heads=n_kv * group,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        bias=data.draw(st.booleans()),
        rope=data.draw(st.booleans()),
    )
    model = _model(attn, ffn_dim=data.draw(st.integers(1, 130)), bias=attn.bias, dtype=dtype)
    batch, prompt = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 30))
    tokens = torch.randint(0, 101, (batch, prompt + data.draw(st.integers(1, 3))))
    with pytest.MonkeyPatch.context() as monkeypatch:  # a fixture would not be reset between examples
        spy = Spy(monkeypatch)
        got, caches = _decode(model, tokens, prompt)
        # every one-token call of both layers was fused: the decode steps (and a one-token prompt)
        assert spy.calls == 2 * (tokens.shape[1] - prompt + (prompt == 1))
        want, ref_caches = _module_by_module(monkeypatch, lambda: _decode(model, tokens, prompt))

    def close(a: torch.Tensor, b: torch.Tensor) -> None:
        # float32: the fused step sums in another order, so its error scales with the tensor's size, not each
        # element's: 1e-5 of the largest (a logit range of 5 showed 1.6e-5 on a near-zero logit). bf16: its rounding.
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, b.abs().max().item()))
        else:
            torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)

    close(got, want)
    for c, r in zip(caches, ref_caches, strict=True):
        assert len(c) == len(r) == tokens.shape[1]
        close(c.k[:, :, : len(c)], r.k[:, :, : len(r)])
        close(c.v[:, :, : len(c)], r.v[:, :, : len(r)])


def test_rows_at_their_own_positions_equal_the_module_by_module_steps(monkeypatch):
    """position_ids (B, 1) per row (a left-padded batch continuing): each row's own RoPE angles."""
    model = _model(AttentionConfig(d_model=48, n_heads=6, n_kv_heads=2))
    tokens = torch.randint(0, 101, (3, 12))
    position_ids = torch.arange(12).repeat(3, 1) + torch.tensor([[0], [5], [17]])
    spy = Spy(monkeypatch)
    got, _ = _decode(model, tokens, 8, position_ids)
    assert spy.calls == 2 * 4
    want, _ = _module_by_module(monkeypatch, lambda: _decode(model, tokens, 8, position_ids))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_steps_equal_transformers_llama_step_by_step(tmp_path, monkeypatch):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(mean=1.0 if "norm" in name else 0.0, std=0.1 if "norm" in name else 0.3)
    hf.save_pretrained(tmp_path / "llama")
    ours = load_causal_lm(tmp_path / "llama")
    tokens = torch.randint(0, 101, (1, 14))
    spy = Spy(monkeypatch)
    got, _ = _decode(ours, tokens, 9)
    assert spy.calls == 2 * 5
    with torch.no_grad():
        cache = transformers.DynamicCache()
        hf(tokens[:, :9], past_key_values=cache, use_cache=True)
        want = torch.cat(
            [hf(tokens[:, i : i + 1], past_key_values=cache).logits for i in range(9, 14)], dim=1
        )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _one_step(model, tokens=None):
    tokens = torch.randint(0, 101, (2, 5)) if tokens is None else tokens
    return _decode(model, tokens, tokens.shape[1] - 1)[0]


def test_hooks_training_gradient_and_masks_run_module_by_module(monkeypatch):
    model = _model(AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2))
    spy = Spy(monkeypatch)
    _one_step(model)
    assert spy.calls == 2
    seen = []
    handle = model.layers[1].feed_forward.w2.register_forward_hook(lambda *a: seen.append(1))
    _one_step(model)
    assert (spy.calls, len(seen)) == (3, 2)  # layer 0 fused; layer 1 through its modules, so the hook ran
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *a: seen.append(2))
    _one_step(model)
    handle.remove()
    assert spy.calls == 3 and 2 in seen
    _one_step(model)
    assert spy.calls == 5  # hooks gone: fused again
    # gradient: with grad enabled and trainable weights the step records autograd through the modules
    caches = model.new_caches(1, 8)
    with torch.no_grad():
        model(torch.tensor([[1, 2]]), caches=caches)
    model(torch.tensor([[3]]), caches=caches).sum().backward()
    assert spy.calls == 5 and model.layers[0].attention.wq.weight.grad is not None
    # a mask (a left-padded batch) and training mode
    with torch.no_grad():
        caches = model.new_caches(1, 8)
        model(torch.tensor([[1, 2]]), caches=caches)
        model(torch.tensor([[3]]), caches=caches, attn_mask=torch.ones(1, 1, 1, 3, dtype=torch.bool))
        model.train()
        model(torch.tensor([[4]]), caches=caches)
        model.eval()
    assert spy.calls == 5


@pytest.mark.parametrize(
    "attn",
    [
        AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, backend="sdpa"),
        MLAConfig(
            d_model=32, n_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8
        ),
    ],
    ids=["sdpa-backend", "mla"],
)
def test_other_attention_runs_module_by_module(monkeypatch, attn):
    spy = Spy(monkeypatch)
    _one_step(_model(attn))
    assert spy.calls == 0


def test_paged_cache_runs_module_by_module(monkeypatch):
    model = _model(AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2))
    spy = Spy(monkeypatch)
    caches = [layer.attention.new_paged_cache(4, 8, 1) for layer in model.layers]
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), caches=caches)
        model(torch.tensor([[4]]), caches=caches)
    assert spy.calls == 0


def test_replaced_weights_are_followed(monkeypatch):
    model = _model(AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2))
    other = _model(AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2), seed=1)
    tokens = torch.randint(0, 101, (2, 6))
    spy = Spy(monkeypatch)
    _one_step(model, tokens)
    model.load_state_dict(other.state_dict())  # copied into the same tensors
    torch.testing.assert_close(_one_step(model, tokens), _one_step(other, tokens), rtol=1e-5, atol=1e-5)
    model.load_state_dict(
        _model(AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2), seed=2).state_dict(), assign=True
    )
    with torch.no_grad():
        model.layers[0].feed_forward.w2.weight = torch.nn.Parameter(
            other.layers[0].feed_forward.w2.weight.clone()
        )
    want = _module_by_module(monkeypatch, lambda: _one_step(model, tokens))
    calls = spy.calls
    torch.testing.assert_close(_one_step(model, tokens), want, rtol=1e-5, atol=1e-5)
    assert spy.calls == calls + 2
    model.to(torch.bfloat16)  # parameters' data swapped in place: the plan sees new addresses
    want = _module_by_module(monkeypatch, lambda: _one_step(model, tokens))
    torch.testing.assert_close(_one_step(model, tokens), want, rtol=0, atol=0)
    assert spy.calls == calls + 4


def test_a_new_configuration_or_norm_eps_is_followed(monkeypatch):
    """The plan kept the softmax scale and eps it was built with: a layer given a new cfg (as MLA's mode setter
    gives one, and users do) decoded with the old scale."""
    model = _model(AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2))
    tokens = torch.randint(0, 101, (2, 6))
    spy = Spy(monkeypatch)
    _one_step(model, tokens)
    for layer in model.layers:
        layer.attention.cfg = layer.attention.cfg.replace(scale=1.0)
    model.layers[1].ffn_norm.eps = 0.5
    want = _module_by_module(monkeypatch, lambda: _one_step(model, tokens))
    calls = spy.calls
    torch.testing.assert_close(_one_step(model, tokens), want, rtol=1e-5, atol=1e-5)
    assert spy.calls == calls + 1  # layer 1's norms now differ in eps: module by module; layer 0 fused


def test_a_failed_step_leaves_the_cache_as_it_was():
    model = _model(AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2))
    caches = model.new_caches(1, 4)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4]]), caches=caches)
        before = [c.k.clone() for c in caches]
        with pytest.raises(ValueError, match="overflow"):
            model(torch.tensor([[5]]), caches=caches)
        with pytest.raises(ValueError, match="batch of 2"):
            model(torch.tensor([[5], [6]]), caches=model.new_caches(1, 8)[:1] + caches[1:])
    assert [len(c) for c in caches] == [4, 4]
    assert all(torch.equal(c.k, b) for c, b in zip(caches, before, strict=True))


def test_a_model_that_ran_fused_steps_still_pickles_and_copies(monkeypatch):
    model = _model(AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2))
    tokens = torch.randint(0, 101, (2, 6))
    spy = Spy(monkeypatch)
    first = _one_step(model, tokens)
    for again in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        torch.testing.assert_close(_one_step(again, tokens), first, rtol=0, atol=0)
    assert spy.calls == 6


@pytest.mark.parametrize(
    "change",
    [
        {"norm_offset": 1.0},  # Gemma's (1 + w) RMSNorm
        {"norm_gain_float32": True},  # OLMo 2's gain before the cast (a bfloat16 step would round otherwise)
        {"norm_placement": "sandwich"},
        {"norm_placement": "post"},
        {"parallel_residual": True},
        {"mlp": "geglu"},
        {"norm": "layernorm"},
        {"attention": {"qk_norm": "head"}},
        {"attention": {"softcap": 30.0}},
        {"attention": {"rope_dim": 4}},  # of head_dim 8
        {"attention": {"rope_interleaved": True}},
        {"attention": {"head_dim": 5, "rope": False}},  # odd: the kernel's heads are pairs of dims
    ],
    ids=lambda c: next(iter(c.values())) if "attention" not in c else next(iter(c["attention"])),
)
def test_a_block_the_kernel_does_not_compute_never_takes_the_fused_step(monkeypatch, change):
    # Issue 30: the fast path was chosen by module types, so a Gemma-like block (RMSNorm with a 1 + w option) would
    # have run the Llama kernel. It is chosen from the configuration now.
    attn = AttentionConfig(d_model=48, n_heads=6, n_kv_heads=2, **change.get("attention", {}))
    fields = {k: v for k, v in change.items() if k != "attention"}
    cfg = ModelConfig(vocab_size=101, n_layers=2, attention=attn, ffn_dim=64, max_seq_len=64, **fields)
    model = Transformer(cfg).eval()
    model.init_weights(std=0.2, seed=0)
    assert not model_module.fused_block_config(cfg, attn)
    spy = Spy(monkeypatch)
    tokens = torch.randint(0, 101, (2, 9))
    got, _ = _decode(model, tokens, 5)
    assert spy.calls == 0
    want, _ = _module_by_module(monkeypatch, lambda: _decode(model, tokens, 5))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    llama = AttentionConfig(d_model=48, n_heads=6, n_kv_heads=2)
    assert model_module.fused_block_config(cfg.replace(**{k: ModelConfig.__dataclass_fields__[k].default
                                                          for k in fields}, attention=llama), llama)  # fmt: skip


FAST_FAMILIES = {"llama", "mistral", "qwen2"}  # Llama's block: the only one the kernel was proven on


def test_of_every_registered_family_only_llamas_block_takes_the_fused_step(monkeypatch):
    """Each family's example model as the registry reads it, decoded: Gemma's (1 + w) norms, GeGLU and soft-caps,
    q/k norms, post and sandwich norms, parallel residuals, partial or interleaved rotary, MLA, never take the
    fused step; Llama, Mistral and Qwen2 do, and both paths give the module-by-module logits."""
    from attnlab.bench.families import example_config, loads
    from attnlab.families import REGISTERED

    tokens = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    for fam in (f for f in REGISTERED if loads(f)):
        cfg = example_config(fam)
        model = Transformer(cfg).eval()
        model.init_weights(std=0.2, seed=0)
        with monkeypatch.context() as m:
            spy = Spy(m)
            got, _ = _decode(model, tokens, 4)
        fast = fam.name in FAST_FAMILIES
        assert (spy.calls > 0) == fast, (fam.name, spy.calls)
        assert all(model_module.fused_block_config(cfg, a) == fast for a in cfg.layer_attentions), fam.name
        want, _ = _module_by_module(monkeypatch, lambda model=model: _decode(model, tokens, 4))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))
