"""``attend``: every backend against a float64 oracle, masks of every allowed shape, bottom-right causal
alignment, fully masked rows, gradients, bfloat16, and input validation.

The oracle repeats KV head ``j`` for query heads ``j * n_rep ... (j + 1) * n_rep - 1`` (consecutive heads share,
as Hugging Face's ``repeat_kv``), builds the full (B, n_heads, T_q, T_k) mask by broadcasting, and softmaxes in
float64; a row with nothing to attend is zero by definition.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from attnlab.attention.kernels import attend

pytestmark = pytest.mark.usefixtures("one_thread")
BACKENDS = ("reference", "sdpa", "grouped", "auto")


def oracle(q, k, v, attn_mask=None, is_causal=False, scale=None):
    b, h, t_q, d = q.shape
    n_kv, t_k = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    heads = torch.arange(h) // (h // n_kv)  # query head -> its KV head
    k, v = k.double()[:, heads], v.double()[:, heads]
    scores = q.double() @ k.transpose(-2, -1) * scale
    allowed = torch.ones(b, h, t_q, t_k, dtype=torch.bool)
    if attn_mask is not None:
        allowed = allowed & attn_mask
    if is_causal:  # query i sits at position T_k - T_q + i
        i = torch.arange(t_q)[:, None] + (t_k - t_q)
        allowed = allowed & (torch.arange(t_k)[None, :] <= i)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    return probs @ v


def _err(a, b) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a.double() - b.double()).abs().max().item()


def _qkv(b=2, h=4, n_kv=2, t_q=3, t_k=5, d=8, d_v=None, dtype=torch.float32, grad=False):
    q = torch.randn(b, h, t_q, d, dtype=dtype, requires_grad=grad)
    k = torch.randn(b, n_kv, t_k, d, dtype=dtype, requires_grad=grad)
    v = torch.randn(b, n_kv, t_k, d_v or d, dtype=dtype, requires_grad=grad)
    return q, k, v


B, H, T_K = 2, 4, 5
# Mask shapes with "q" standing for T_q: 1-D, 2-D, 3-D, and 4-D with a head axis of 1 or n_heads.
MASK_SHAPES = [
    (T_K,),
    ("q", T_K),
    (1, T_K),
    ("q", 1),
    (1, "q", T_K),
    (H, "q", T_K),
    (B, 1, "q", T_K),
    (B, H, "q", T_K),
    (1, H, "q", T_K),
    (1, 1, "q", T_K),
    (B, 1, 1, T_K),
]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("template", MASK_SHAPES, ids=str)
@pytest.mark.parametrize("t_q", [3, 1])  # 1: the decode shape, which some backends route to their own kernel
def test_mask_broadcasts_like_sdpa(t_q, template, backend, is_causal):
    q, k, v = _qkv(B, H, 2, t_q, T_K)
    shape = tuple(t_q if s == "q" else s for s in template)
    mask = torch.rand(shape) > 0.3
    got = attend(q, k, v, attn_mask=mask, is_causal=is_causal, backend=backend)
    assert got.shape == (B, H, t_q, 8)
    assert not got.isnan().any()
    assert _err(got, oracle(q, k, v, mask, is_causal)) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("t_q", "t_k"), [(1, 1), (1, 6), (3, 7), (6, 6)])
def test_causal_aligns_bottom_right(backend, t_q, t_k):
    q, k, v = _qkv(2, 6, 3, t_q, t_k)
    got = attend(q, k, v, is_causal=True, backend=backend)
    assert _err(got, oracle(q, k, v, is_causal=True)) <= 1e-5
    # The last T_q queries of a causal self-attention over T_k tokens are exactly these rows.
    q_full = torch.cat((torch.randn(2, 6, t_k - t_q, 8), q), dim=2)
    full = attend(q_full, k, v, is_causal=True, backend=backend)
    assert _err(got, full[:, :, t_k - t_q :]) <= 1e-5
    # Query i must not see key T_k - T_q + i + 1 or later: changing the future leaves it unchanged.
    if t_q > 1:
        v2 = v.clone()
        v2[:, :, t_k - t_q + 1 :] += 10.0
        again = attend(q, k, v2, is_causal=True, backend=backend)
        assert torch.equal(again[:, :, 0], got[:, :, 0])
        assert not torch.allclose(again[:, :, -1], got[:, :, -1])


def test_causal_rejects_more_queries_than_keys():
    q, k, v = _qkv(t_q=4, t_k=3)
    with pytest.raises(ValueError, match=r"T_q=4, T_k=3"):
        attend(q, k, v, is_causal=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_are_zero_with_finite_gradients(backend):
    q, k, v = _qkv(2, 4, 2, 4, 4, grad=True)
    mask = torch.ones(2, 4, 4, 4, dtype=torch.bool)
    mask[0, 1, 2] = False  # one row of one head of one sequence
    mask[1, :, 0] = False  # a row in every head
    for is_causal in (False, True):
        out = attend(q, k, v, attn_mask=mask, is_causal=is_causal, backend=backend)
        assert not out.isnan().any()
        assert torch.equal(out[0, 1, 2], torch.zeros(8))
        assert torch.equal(out[1, :, 0], torch.zeros(4, 8))
        assert _err(out, oracle(q, k, v, mask, is_causal)) <= 1e-5
        out.square().sum().backward()
        for t in (q, k, v):
            assert torch.isfinite(t.grad).all()
        assert torch.equal(q.grad[0, 1, 2], torch.zeros(8))  # a dead row has no gradient to give
        q.grad = k.grad = v.grad = None
    # Everything masked (a padded sequence): zeros everywhere.
    out = attend(q, k, v, attn_mask=torch.zeros(4, dtype=torch.bool), backend=backend)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("fill", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("t_q", [4, 1])
@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_out_slots_may_hold_inf_and_nan(backend, t_q, fill):
    # Issue 8: a fully masked row was NaN in "reference" and "grouped" when a masked-out value was inf, and every
    # backend let inf/NaN in padded slots reach the live rows. The oracle is the same attention on clean inputs.
    q, k, v = _qkv(2, 4, 2, t_q, 6)
    mask = torch.ones(2, 4, t_q, 6, dtype=torch.bool)
    mask[..., 4:] = False  # padding: keys 4 and 5 are attended by no query
    mask[0, 1, 0] = False  # a fully masked row
    mask[1, :, -1, :2] = False
    expected = oracle(q, k, v, mask)
    for dirty in ("k", "v", "kv"):
        k2, v2 = k.clone(), v.clone()
        if "k" in dirty:
            k2[..., 4:, :] = fill
        if "v" in dirty:
            v2[..., 4:, :] = fill
        out = attend(q, k2, v2, attn_mask=mask, backend=backend)
        assert torch.equal(out[0, 1, 0], torch.zeros(8)), dirty
        assert _err(out, expected) <= 1e-5, dirty


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_inputs(backend):
    for b, t_q, t_k in ((0, 3, 3), (2, 0, 3), (2, 3, 0), (2, 0, 0)):
        q, k, v = _qkv(b, 4, 2, t_q, t_k)
        for mask in (None, torch.ones(b, 1, t_q, t_k, dtype=torch.bool)):
            out = attend(q, k, v, attn_mask=mask, backend=backend)
            assert out.shape == (b, 4, t_q, 8) and torch.equal(
                out, torch.zeros_like(out)
            )  # nothing to attend
            if t_q <= t_k:
                assert attend(q, k, v, attn_mask=mask, is_causal=True, backend=backend).shape == out.shape


@pytest.mark.parametrize("t_q", [5, 1])
@pytest.mark.parametrize("n_kv", [1, 2, 4])
def test_backends_agree_forward_and_backward(n_kv, t_q):
    """Gradients of q, k and v agree across backends, with a padding mask combined with the causal rule
    (T_q = 1 is the decode shape, which backends may route to a different kernel)."""
    q0, k0, v0 = _qkv(2, 4, n_kv, t_q, 7, d=16, d_v=12)
    mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    mask[1, ..., :2] = False
    grad_out = torch.randn(2, 4, t_q, 12)
    results = {}
    for backend in BACKENDS:
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out = attend(q, k, v, attn_mask=mask, is_causal=True, backend=backend)
        out.backward(grad_out)
        results[backend] = (out, q.grad, k.grad, v.grad)
    q, k, v = (t.clone().double().requires_grad_() for t in (q0, k0, v0))
    out = oracle(q, k, v, mask, True)
    out.backward(grad_out.double())
    expected = (out, q.grad, k.grad, v.grad)
    for backend, got in results.items():
        for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
            assert _err(g, e) <= 2e-5, f"{backend} {name}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("dtype", "t_k", "tol"), [(torch.float32, 4500, 1e-5), (torch.bfloat16, 2500, 2e-2)])
def test_long_context_decode_with_masks(backend, dtype, t_k, tol):
    """Decode against a few thousand cached tokens (long enough for kernels that cut the context into
    chunks), with a mask that kills whole stretches of keys, some rows entirely, and a head-dependent pattern."""
    q, k, v = _qkv(2, 4, 1, 1, t_k, d=32)  # MQA: B * n_kv_heads = 2 (KV head, sequence) pairs
    mask = torch.rand(2, 4, 1, t_k) > 0.5
    mask[0, :, :, : t_k // 2] = False  # the first half of the context is dead for sequence 0
    mask[1, 3] = False  # head 3 of sequence 1 attends to nothing
    mask[1, 1, :, 100:] = False  # head 1 of sequence 1 sees only its first 100 keys
    expected = oracle(q, k, v, mask)
    got = attend(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask, is_causal=True, backend=backend)
    assert got.dtype == dtype
    assert torch.equal(got[1, 3].float(), torch.zeros(1, 32))
    assert _err(got, expected) <= tol
    no_mask = attend(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True, backend=backend)
    assert _err(no_mask, oracle(q, k, v)) <= tol


def test_scale_is_used_and_defaults_to_head_dim():
    q, k, v = _qkv(d=16)
    for backend in BACKENDS:
        assert _err(attend(q, k, v, backend=backend), oracle(q, k, v, scale=0.25)) <= 1e-5
        assert _err(attend(q, k, v, scale=0.1, backend=backend), oracle(q, k, v, scale=0.1)) <= 1e-5
        assert _err(attend(q, k, v, scale=0.1, backend=backend), oracle(q, k, v)) > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_agrees_with_float64(backend):
    """bfloat16 in, bfloat16 out; error vs float64 within 2e-2 (bf16 has an 8-bit mantissa, |out| <~ 2)."""
    q, k, v = _qkv(2, 8, 2, 6, 9, d=64)
    mask = torch.rand(2, 1, 6, 9) > 0.2
    expected = oracle(q, k, v, mask, True)
    got = attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=mask, is_causal=True, backend=backend)
    assert got.dtype == torch.bfloat16
    assert _err(got, expected) <= 2e-2
    # Rounding the inputs to bfloat16 is most of it: the kernel itself adds at most a few output roundings.
    exact_on_rounded = oracle(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, True)
    assert _err(got, exact_on_rounded) <= 1.6e-2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("t_q", [1, 5])  # a decode step (grouped's split-K kernel) and a prefill
@pytest.mark.parametrize(
    "q_value, k_value, scale",
    [
        (
            40.0,
            40.0,
            None,
        ),  # 64 dims of 40: the product 102400 passes float16's 65504, the scaled score 12800 not
        (1000.0, 1e-3, 100.0),  # a scale above 1: the scaled queries pass it, the scores (~6400) do not
        (1.0, 300.0, None),  # large scores keep few bits in float16: 0.05 off where SDPA is within 6e-4
    ],
)
def test_float16_scores_are_computed_in_float32(backend, t_q, q_value, k_value, scale):
    """The grouped kernels multiplied q and k in float16 (NaN past its range, and few bits of a large score), and
    auto sends a CPU float16 decode there; scaling the queries first overflowed them for a scale above 1."""
    g = torch.Generator().manual_seed(0)
    q = q_value * (1 + 0.1 * torch.rand(1, 4, t_q, 64, generator=g))
    k = k_value * torch.randn(1, 2, 7, 64, generator=g).sign()
    v = torch.randn(1, 2, 7, 64, generator=g)
    q, k, v = q.half(), k.half(), v.half()
    got = attend(q, k, v, scale=scale, backend=backend)
    assert got.dtype == torch.float16 and bool(torch.isfinite(got).all())
    assert _err(got, oracle(q, k, v, scale=scale)) <= 2e-3


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    b=st.integers(1, 3),
    n_kv=st.integers(1, 3),
    group=st.integers(1, 4),
    t_q=st.integers(1, 9),
    extra_k=st.integers(0, 6),
    d=st.sampled_from([8, 40, 80, 96, 128, 192]),
    is_causal=st.booleans(),
    mask_kind=st.sampled_from(["none", "2d", "3d", "4d-1", "4d-h"]),
    seed=st.integers(0, 2**16),
)
def test_property_backends_equal_oracle(b, n_kv, group, t_q, extra_k, d, is_causal, mask_kind, seed):
    torch.manual_seed(seed)
    h, t_k = n_kv * group, t_q + extra_k
    q, k, v = _qkv(b, h, n_kv, t_q, t_k, d=d)
    shapes = {
        "none": None,
        "2d": (t_q, t_k),
        "3d": (h, t_q, t_k),
        "4d-1": (b, 1, t_q, t_k),
        "4d-h": (b, h, t_q, t_k),
    }
    mask = None if shapes[mask_kind] is None else torch.rand(shapes[mask_kind]) > 0.25
    expected = oracle(q, k, v, mask, is_causal)
    for backend in BACKENDS:
        got = attend(q, k, v, attn_mask=mask, is_causal=is_causal, backend=backend)
        assert _err(got, expected) <= 2e-5, backend


@pytest.mark.parametrize("backend", ["grouped", "auto"])
def test_decode_does_not_repeat_kv_in_memory(backend):
    """One query per head against a long cache: the bytes allocated stay below one copy of K and V.

    Repeating K/V for each query head (the textbook way, and "reference") allocates n_rep copies: 16 here.
    """
    q = torch.randn(1, 16, 1, 64)
    k, v = torch.randn(1, 1, 4096, 64), torch.randn(1, 1, 4096, 64)
    expected = oracle(q, k, v)

    def allocated(backend_name: str) -> tuple[int, torch.Tensor]:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = attend(q, k, v, is_causal=True, backend=backend_name)
        return sum(max(e.self_cpu_memory_usage, 0) for e in prof.events()), out

    repeated, _ = allocated("reference")  # the profiler does see a repetition when there is one
    assert repeated > 15 * (k.nbytes + v.nbytes)
    used, out = allocated(backend)
    assert used < k.nbytes + v.nbytes
    assert _err(out, expected) <= 1e-5


# ------------------------------------------------------------------------------------------ bad input


def test_bad_backend_is_named():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"backend must be one of.*'flash'"):
        attend(q, k, v, backend="flash")


@pytest.mark.parametrize(
    "shape", [(2, 4, 3, 4), (3, 1, 3, 5), (4, 5), (2, 2, 3, 5), (1, 2, 4, 3, 5)], ids=str
)
def test_mask_of_wrong_shape_is_rejected(shape):
    q, k, v = _qkv(2, 4, 2, 3, 5)
    with pytest.raises(
        ValueError, match=re.escape(f"attn_mask of shape {tuple(shape)!r} does not broadcast")
    ):
        attend(q, k, v, attn_mask=torch.ones(shape, dtype=torch.bool))


def test_mask_must_be_bool():
    q, k, v = _qkv(2, 4, 2, 3, 5)
    with pytest.raises(TypeError, match=r"attn_mask must be a bool tensor.*torch.float32"):
        attend(q, k, v, attn_mask=torch.zeros(3, 5))
    with pytest.raises(TypeError, match=r"attn_mask must be a bool tensor .*got list"):
        attend(q, k, v, attn_mask=[[True] * 5] * 3)


def test_shape_and_dtype_errors_name_the_values():
    q, k, v = _qkv(2, 6, 4, 3, 5)
    with pytest.raises(ValueError, match=r"query heads \(6\) must be a multiple of KV heads \(4\)"):
        attend(q, k, v)
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"share a dtype.*torch.bfloat16"):
        attend(q, k.bfloat16(), v)
    with pytest.raises(ValueError, match=r"q must have 4 dims.*\(4, 3, 8\)"):
        attend(q[0], k, v)
    with pytest.raises(ValueError, match=r"batch sizes differ"):
        attend(q, k[:1], v[:1])
    with pytest.raises(ValueError, match=r"head dims differ: 8 vs 6"):
        attend(q, k[..., :6], v)
    with pytest.raises(ValueError, match=r"disagree on heads or length"):
        attend(q, k, v[:, :, :4])


@pytest.mark.parametrize("backend", ["auto", "reference", "sdpa", "grouped", "fused"])
def test_bad_options_zero_sizes_and_mixed_devices_are_refused_by_name(backend):
    """A window of 0 attended to every key in a decode step and to none in a prefill, a soft-cap of 0 gave uniform
    weights, integer operands gave zeros, a zero-head q killed the process in the C++ kernel (SIGFPE), and K on
    another device than q reached the kernel's fake implementation (uninitialised memory)."""
    for t_q in (1, 3):
        q, k, v = _qkv(t_q=t_q)
        for kwargs, field in [
            (dict(window=0), "window"),
            (dict(window=-2), "window"),
            (dict(window=2.0), "window"),
            (dict(softcap=0.0), "softcap"),
            (dict(softcap=-1.0), "softcap"),
            (dict(softcap=float("nan")), "softcap"),
            (dict(dropout_p=-0.1), "dropout_p"),
            (dict(dropout_p=1.0), "dropout_p"),
        ]:
            with pytest.raises(ValueError, match=field):
                attend(q, k, v, backend=backend, **kwargs)
        with pytest.raises(TypeError, match="is_causal must be True or False, got None"):
            attend(q, k, v, is_causal=None, backend=backend)
        with pytest.raises(TypeError, match=r"floating point, got torch\.int64"):
            attend(q.long(), k.long(), v.long(), backend=backend)
        with pytest.raises(ValueError, match="one device, got cpu, meta, cpu"):
            attend(q, k.to("meta"), v, backend=backend)
        for zero in (q[:, :0], q[..., :0]):
            with pytest.raises(ValueError, match="at least one head and one dim"):
                attend(zero, k[:, :0] if zero.shape[1] == 0 else k[..., :0], v, backend=backend)


@pytest.mark.parametrize("t_q", [1, 3])
def test_values_wider_than_the_keys_run_on_a_backend_that_takes_them(t_q):
    """A decode step with D_v > D_k went to the fused kernel, which needs D_v <= D_k, and raised; the backend
    table now says so and hands it on."""
    q, k, v = _qkv(t_q=t_q, d_v=16)  # keys of 8 dims
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
    for backend in ("auto", "fused", "grouped"):
        torch.testing.assert_close(attend(q, k, v, backend=backend).double(), want, rtol=1e-5, atol=1e-5)


def test_float64_keeps_its_precision_and_passes_gradcheck():
    """Decode steps, RoPE and RMSNorm computed a float64 call in float32 (6e-8 from SDPA; gradcheck failed on
    ``attend``, on a GQA module with RoPE and on MLA in both modes)."""
    from attnlab import AttentionConfig, GroupedQueryAttention, MLAConfig, MultiHeadLatentAttention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True)
               for s in ((1, 2, 1, 4), (1, 1, 3, 4), (1, 1, 3, 4)))  # fmt: skip
    want = F.scaled_dot_product_attention(q, k.expand(1, 2, 3, 4), v.expand(1, 2, 3, 4))
    for backend in ("auto", "reference", "grouped"):
        torch.testing.assert_close(attend(q, k, v, backend=backend), want, rtol=1e-13, atol=1e-13)
        assert torch.autograd.gradcheck(lambda q, k, v, b=backend: attend(q, k, v, backend=b), (q, k, v))
    torch.manual_seed(0)
    modules = [GroupedQueryAttention(AttentionConfig(d_model=8, n_heads=2, n_kv_heads=1))] + [
        MultiHeadLatentAttention(MLAConfig(d_model=16, n_heads=2, kv_lora_rank=8, qk_nope_head_dim=4,
                                           qk_rope_head_dim=2, v_head_dim=4, mode=mode))
        for mode in ("naive", "absorbed")
    ]  # fmt: skip
    for module in modules:
        x = torch.randn(1, 3, module.cfg.d_model, dtype=torch.float64, generator=gen, requires_grad=True)
        assert torch.autograd.gradcheck(module.double(), (x,)), module.cfg


def test_under_autocast_attend_takes_its_dtype_as_sdpa_does():
    # a q/k norm keeps a float32 gain under autocast: float32 q and k beside a bfloat16 v failed "q, k, v must share
    # a dtype", so uptrain --dtype bf16 of Qwen3, OLMo 2, Gemma 3 and every MLA checkpoint failed
    from attnlab import AttentionConfig, MLAConfig, ModelConfig
    from attnlab.model import Transformer

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 9, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g)
    v = torch.randn(2, 2, 9, 16, generator=g).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = attend(q, k, v, is_causal=True)
        theirs = F.scaled_dot_product_attention(q, k, v.float(), is_causal=True, enable_gqa=True)
    assert ours.dtype == theirs.dtype == torch.bfloat16 and torch.allclose(
        ours.float(), theirs.float(), atol=2e-2
    )
    for attn in (
        AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, qk_norm="head"),
        MLAConfig(
            d_model=32, n_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8
        ),
    ):
        model = Transformer(ModelConfig(64, 2, attn, ffn_dim=48, max_seq_len=16))
        model.init_weights(seed=0)
        x = torch.randint(0, 64, (2, 12), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        F.cross_entropy(
            logits.float().flatten(0, 1), x.flatten()
        ).backward()  # trains, as uptrain --dtype bf16
        assert torch.allclose(logits.float(), model(x).detach(), atol=0.1)
