"""The fused few-row linear kernel (``fused.linear``, ``attention.linear``) against ``F.linear`` in float64.

Oracle: ``torch.nn.functional.linear`` on the same operands in float64. float32 results within 1e-5 relative to
the size of the terms (|x| |w| summed); bfloat16 within one bfloat16 rounding of the output plus the float32
sum. Shapes are generated: widths that are and are not multiples of the kernel's 8 lanes and 4-row groups,
several weights side by side, biases or none, 1 to 8 input rows, two threads (the rows split between them).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from attnlab import AttentionConfig, GroupedQueryAttention, ModelConfig
from attnlab.attention import fused
from attnlab.attention.linear import Linear, project
from attnlab.model import Transformer

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
needs_kernel = pytest.mark.skipif(os.environ.get("ATTNLAB_FUSED") == "0", reason="ATTNLAB_FUSED=0")


def _bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Allowed error of ``F.linear(x, w, b)``: float32 summation error over the terms, plus (bfloat16) the
    output's rounding, half a unit in the last place: 2^-8 of the value."""
    b64 = None if b is None else b.double()
    terms = F.linear(x.double().abs(), w.double().abs(), None if b is None else b64.abs())
    bound = 1e-5 * (terms + 1)
    if x.dtype == torch.float32:
        return bound
    return bound + 2**-8 * F.linear(x.double(), w.double(), b64).abs()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@SETTINGS
@given(data=st.data())
def test_linear_equals_f_linear_over_generated_shapes(dtype, data):
    rows, k = data.draw(st.integers(1, fused.LINEAR_MAX_ROWS)), data.draw(st.integers(1, 300))
    widths = data.draw(st.lists(st.integers(1, 700), min_size=1, max_size=3))
    with_bias = data.draw(st.lists(st.booleans(), min_size=len(widths), max_size=len(widths)))
    threads = data.draw(st.sampled_from([1, 2]))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    x = torch.randn(rows, k, generator=gen).to(dtype)
    ws = [torch.randn(n, k, generator=gen).to(dtype) for n in widths]
    bs = [
        torch.randn(n, generator=gen).to(dtype) if b else None for n, b in zip(widths, with_bias, strict=True)
    ]
    assert fused.linear_supports(x, *ws, *bs)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = fused.linear(x, ws, bs)
    finally:
        torch.set_num_threads(before)
    assert got.shape == (rows, sum(widths)) and got.dtype == dtype
    want = torch.cat(
        [
            F.linear(x.double(), w.double(), None if b is None else b.double())
            for w, b in zip(ws, bs, strict=True)
        ],
        dim=-1,
    )
    bound = torch.cat([_bound(x, w, b) for w, b in zip(ws, bs, strict=True)], dim=-1)
    assert ((got.double() - want).abs() <= bound).all(), (got.double() - want).abs().max()


@needs_kernel
def test_a_row_gives_the_same_bits_alone_or_in_a_batch():
    """Batched decoding gives every row the tokens it gets alone: the kernel's sum per row ignores the others."""
    torch.manual_seed(0)
    w, x = torch.randn(300, 200), torch.randn(6, 200)
    alone = torch.cat([fused.linear(x[i : i + 1], [w]) for i in range(6)])
    assert torch.equal(fused.linear(x, [w]), alone)


def test_linear_module_takes_the_kernel_only_for_few_rows_without_gradient(monkeypatch):
    """``Linear`` is ``nn.Linear`` to a state dict and for training; a spy counts the kernel's calls."""
    calls = []
    real = fused.linear
    monkeypatch.setattr(fused, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    lin = Linear(64, 48)
    plain = nn.Linear(64, 48)
    plain.load_state_dict(lin.state_dict())
    few, many = torch.randn(1, 3, 64), torch.randn(3, 4, 64)  # 3 rows; 12 rows > LINEAR_MAX_ROWS
    with torch.no_grad():
        torch.testing.assert_close(lin(few), plain(few), rtol=1e-5, atol=1e-5)
        assert len(calls) == (0 if os.environ.get("ATTNLAB_FUSED") == "0" else 1)
        torch.testing.assert_close(lin(many), plain(many), rtol=0, atol=0)
    n = len(calls)
    out = lin(few)  # gradient on: nn.Linear's path, and the gradient flows
    out.sum().backward()
    assert len(calls) == n and lin.weight.grad is not None


def test_project_equals_the_layers_one_by_one_and_keeps_their_hooks():
    torch.manual_seed(0)
    layers = [Linear(40, 24), Linear(40, 8, bias=False), nn.Linear(40, 16)]
    x = torch.randn(2, 1, 40)
    with torch.no_grad():
        together = project(x, *layers)
        for got, layer in zip(together, layers, strict=True):
            torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        seen = []
        layers[1].register_forward_hook(lambda _m, _a, out: seen.append(out.shape))
        project(x, *layers)
    assert seen == [(2, 1, 8)]  # a hooked layer makes project call every layer as a module


def test_decode_steps_through_the_kernel_equal_nn_linear_decode_steps():
    """A model's cached decode steps give the logits of the same model whose linears are plain ``nn.Linear``."""
    torch.manual_seed(0)
    attn = AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2)
    cfg = ModelConfig(vocab_size=97, n_layers=2, ffn_dim=96, attention=attn, max_seq_len=32)
    model = Transformer(cfg).eval()
    model.init_weights(seed=0)
    plain = Transformer(cfg).eval()
    for module in list(plain.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, Linear):
                setattr(
                    module,
                    child_name,
                    nn.Linear(child.in_features, child.out_features, child.bias is not None),
                )
    plain.load_state_dict(model.state_dict())
    assert not any(type(m) is Linear for m in plain.modules())
    tokens = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        outs = []
        for m in (model, plain):
            caches = m.new_caches(2, 32)
            m(tokens[:, :6], caches=caches)
            outs.append(torch.cat([m(tokens[:, i : i + 1], caches=caches) for i in range(6, 9)], dim=1))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_gqa_module_projections_are_linear_layers():
    gqa = GroupedQueryAttention(AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2))
    assert all(
        type(getattr(gqa, n)) is Linear and isinstance(getattr(gqa, n), nn.Linear)
        for n in ("wq", "wk", "wv", "wo")
    )
