"""The C++ kernels as PyTorch operators: counted, compiled, profiled and checked like any op.

Oracles: ``attnlab.cost`` for the FLOPs (the analytic model), the same modules counted with gradients on (where
the PyTorch kernels run and torch's own formulas count them), eager mode for the compiled steps, and
``torch.library.opcheck`` for the schemas and fake implementations.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from attnlab import AttentionConfig, GroupedQueryAttention, MLAConfig, ModelConfig, MultiHeadLatentAttention
from attnlab.attention import fused
from attnlab.bench import count_flops
from attnlab.cost import attention_flops, model_flops
from attnlab.model import Transformer

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(
        os.environ.get("ATTNLAB_FUSED") == "0", reason="ATTNLAB_FUSED=0 turns the kernels off"
    ),
]
OPS = torch.ops.attnlab
# The layer: 5 tokens of d_model 160, 8 heads over 2 KV heads of 24 dims (19,200 FLOPs counted without
# gradients, 787,200 with, before the kernels were operators); MQA; MLA with and without query compression.
LAYERS = {
    "gqa": AttentionConfig(d_model=160, n_heads=8, n_kv_heads=2, head_dim=24),
    "mqa": AttentionConfig(d_model=160, n_heads=8, n_kv_heads=1, head_dim=24, bias=True),
    "mla": MLAConfig(d_model=160, n_heads=4, kv_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
    "mla-qlora": MLAConfig(
        d_model=160, n_heads=4, kv_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        q_lora_rank=40,
    ),
}  # fmt: skip
MODEL = ModelConfig(vocab_size=97, n_layers=2, attention=LAYERS["gqa"], ffn_dim=96, max_seq_len=32)


@pytest.fixture(autouse=True, scope="module")
def _built():
    if not fused.available():
        pytest.skip(fused.status())


def _module(cfg):
    torch.manual_seed(0)
    module = GroupedQueryAttention(cfg) if isinstance(cfg, AttentionConfig) else MultiHeadLatentAttention(cfg)
    module.init_weights(std=0.2)
    return module.eval()


def _flops(fn, grad: bool) -> tuple[int, dict[str, int]]:
    with torch.set_grad_enabled(grad), count_flops() as fc:
        fn()
    return fc.total, fc.by_op


@pytest.mark.parametrize("name", LAYERS)
def test_flops_are_the_same_with_and_without_gradients_and_equal_the_cost_model(name):
    """A 5-token prefill (its projections in the few-row linear operator without gradients, nn.Linear with) and a
    decode step over 6 cached tokens (the decode or MLA operator without gradients, the grouped kernel with)."""
    cfg = LAYERS[name]
    module = _module(cfg)
    x = torch.randn(1, 5, cfg.d_model)  # 5 rows: the few-row operator's (up to fused.LINEAR_MAX_ROWS)
    counts = {grad: _flops(lambda: module(x), grad) for grad in (False, True)}
    assert counts[False][0] == counts[True][0] == attention_flops(cfg, 1, 5, 5).total, counts
    assert "attnlab.linear" in counts[False][1] and "attnlab.linear" not in counts[True][1]

    step = torch.randn(2, 1, cfg.d_model)
    totals = {}
    for grad in (False, True):
        cache = module.new_cache(2, 8)
        with torch.no_grad():
            module(torch.randn(2, 5, cfg.d_model), cache=cache)
        totals[grad], by_op = _flops(lambda c=cache: module(step, cache=c), grad)
        kernel = "attnlab.mla_decode" if name.startswith("mla") else "attnlab.decode"
        assert (kernel in by_op) == (not grad), by_op
    assert totals[False] == totals[True] == attention_flops(cfg, 2, 1, 6).total, totals


@pytest.mark.parametrize("window", [None, 3])
def test_a_static_cache_step_counts_the_same_with_and_without_gradients(window):
    """With gradients the step runs a masked PyTorch kernel, which computed (and counted) every slot of the buffers:
    254,976 FLOPs without gradients, 270,336 with, for 6 tokens in 16 slots. It reads the slots the rows attend."""
    cfg = LAYERS["gqa"].replace(window=window)
    module = _module(cfg)
    step = torch.randn(2, 1, cfg.d_model)
    totals, outputs = {}, {}
    for grad in (False, True):
        cache = module.new_cache(2, 16, static=True)
        with torch.no_grad():
            module(torch.randn(2, 5, cfg.d_model, generator=torch.Generator().manual_seed(3)), cache=cache)
        with torch.set_grad_enabled(grad), count_flops() as fc:
            outputs[grad] = module(step, cache=cache)
        totals[grad] = fc.total
        assert ("attnlab.static_decode" in fc.by_op) == (not grad), fc.by_op
    assert totals[False] == totals[True] == attention_flops(cfg, 2, 1, 6).total, totals
    torch.testing.assert_close(outputs[True].detach(), outputs[False], rtol=1e-4, atol=1e-5)


def test_under_autocast_a_decode_step_computes_in_autocasts_dtype_at_any_row_count():
    """The few-row linear operator and the block step computed in the weights' dtype under autocast, where
    nn.Linear computes in autocast's: a float32 model's projections gave float32 for up to 8 rows, bfloat16 for more,
    and a decode step into a bfloat16 cache failed ("k has dtype torch.float32")."""
    from attnlab.attention.linear import Linear

    layer = Linear(32, 16)
    plain = torch.nn.Linear(32, 16)
    plain.load_state_dict(layer.state_dict())
    torch.manual_seed(0)
    model = Transformer(MODEL).eval()
    model.init_weights(seed=0)
    tokens = torch.randint(0, MODEL.vocab_size, (2, 7))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for rows in (1, 8, 20):
            x = torch.randn(rows, 32)
            assert layer(x).dtype == plain(x).dtype == torch.bfloat16, rows
            torch.testing.assert_close(layer(x), plain(x), rtol=0, atol=0)
        caches = model.new_caches(2, 16)  # autocast's dtype (the weights' failed every step)
        assert {c.dtype for c in caches} == {torch.bfloat16}
        prefill = model(tokens[:, :6], caches=caches)
        step = model(tokens[:, 6:], caches=caches)
        whole = model(tokens)
    torch.testing.assert_close(step[:, -1], whole[:, -1], rtol=0.05, atol=0.05)
    assert prefill.dtype == step.dtype
    assert model.new_caches(2, 16)[0].dtype == torch.float32  # outside autocast, the weights'
    # a bfloat16 model under float16 autocast: its norms' float32 output was refused as x's dtype
    half = Transformer(MODEL).eval().to(torch.bfloat16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert half(tokens[:, :6], caches=half.new_caches(2, 16)).isfinite().all()


@pytest.mark.parametrize("window", [None, 3])
def test_a_static_cache_step_counts_the_keys_each_row_reads(window):
    """The kernel reads each row of a static cache's buffers to its length (its window's last keys); the count was
    every slot of the buffers: 25x the keys read at 10 tokens of a 4096-slot cache."""
    cfg = LAYERS["gqa"].replace(window=window)
    module = _module(cfg)
    for slots in (16, 256):
        cache = module.new_cache(2, slots, static=True)
        with torch.no_grad():
            module(torch.randn(2, 5, cfg.d_model), cache=cache)
            total, by_op = _flops(lambda c=cache: module(torch.randn(2, 1, cfg.d_model), cache=c), False)
        assert "attnlab.static_decode" in by_op and total == attention_flops(cfg, 2, 1, 6).total, (
            slots,
            by_op,
        )


def test_a_model_decode_step_counts_as_the_cost_model_with_and_without_gradients():
    """Without gradients through the decode and linear operators, with them through PyTorch's kernels; torch's own
    FlopCounterMode, no extra formulas. (A counter hooks every module, so the blocks run module by module under it:
    ``block_step``'s own formula is checked below.)"""
    torch.manual_seed(0)
    model = Transformer(MODEL).eval()
    model.init_weights(seed=0)
    tokens = torch.randint(0, MODEL.vocab_size, (2, 7))
    totals = {}
    for grad in (False, True):
        caches = model.new_caches(2, 16)
        with torch.no_grad():
            model(tokens[:, :6], caches=caches)
        with torch.set_grad_enabled(grad), FlopCounterMode(display=False) as fc:
            model(tokens[:, 6:], caches=caches)
        totals[grad] = fc.get_total_flops()
        ops = {str(op) for op in fc.get_flop_counts()["Global"]}
        assert ("attnlab.decode" in ops) == (not grad), ops
    assert totals[False] == totals[True] == model_flops(MODEL, 2, 1, 7).total, totals


FIRST_USE = """
import torch
from attnlab import AttentionConfig, GroupedQueryAttention
from attnlab.attention import fused
from attnlab.bench import count_flops
from attnlab.cost import attention_flops

cfg = AttentionConfig(d_model=160, n_heads=8, n_kv_heads=2, head_dim=24)
module = GroupedQueryAttention(cfg).eval()
with torch.no_grad(), count_flops() as fc:  # its FlopCounterMode opened before the kernels are loaded
    module(torch.randn(1, 5, 160))
assert fused.status().startswith("fused C++ kernel"), fused.status()
print(fc.total, attention_flops(cfg, 1, 5, 5).total, "attnlab.linear" in fc.by_op)
"""


def test_a_flop_counter_opened_before_the_first_use_counts_the_operators():
    """The operators and their formulas are defined when attnlab is imported, not when the kernels load: a counter
    copies the formulas it knows when it is opened. A fresh process loads the kernels inside the counter."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(Path(fused.__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run([sys.executable, "-c", FIRST_USE], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    counted, expected, linear_op = proc.stdout.split()
    assert counted == expected and linear_op == "True"


OPERATOR_FIRST = """
import torch
import torch.nn.functional as F
import attnlab.attention.fused  # defines the operators; nothing built yet

q, k, v = torch.randn(2, 6, 1, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
try:
    out = torch.ops.attnlab.decode(q, k, v, 0.25)  # the first thing that runs a kernel
except RuntimeError as err:
    print("refused:", err)
else:
    want = F.scaled_dot_product_attention(q, k, v, scale=0.25, enable_gqa=True)
    print("max error", float((out - want).abs().max()), attnlab.attention.fused.status())
"""


@pytest.mark.parametrize("fused_on", ["1", "0"])
def test_an_operator_called_before_anything_built_the_kernels_builds_them_or_says_why(fused_on):
    """``torch.ops.attnlab.*`` called first in a fresh process (before any module, ``attend`` or ``ensure_built``)
    answered with the dispatcher's "Could not run 'attnlab::decode' with arguments from the 'CPU' backend"."""
    env = dict(
        os.environ,
        ATTNLAB_FUSED=fused_on,
        PYTHONPATH=os.pathsep.join([str(Path(fused.__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run([sys.executable, "-c", OPERATOR_FIRST], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    if fused_on == "1":
        error, status = proc.stdout.split()[2], proc.stdout.split(None, 3)[3]
        assert float(error) < 1e-5 and status.startswith("fused C++ kernel"), proc.stdout
    else:
        assert proc.stdout.startswith("refused: torch.ops.attnlab.decode: the C++ kernels are not available")
        assert "ATTNLAB_FUSED=0" in proc.stdout


def test_an_operator_on_another_device_is_refused_by_name():
    q, k, v = (t.to("meta") for t in _decode_operands())
    assert OPS.decode(q, k, v, 0.25).shape == (2, 6, 1, 16)  # meta: the fake implementation answers
    # a device without a kernel (CUDA, say) reaches the pre-build kernel, which names the device instead of
    # building the CPU kernels and dispatching back to itself; called directly here, where there is no GPU
    with pytest.raises(NotImplementedError, match="CPU tensors only, got meta"):
        fused._unbuilt("attnlab", "decode")(q, k, v, 0.25)


def _decode_operands(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 1, 16, generator=gen).to(dtype)
    k, v = (torch.randn(2, 2, 37, 16, generator=gen).to(dtype) for _ in range(2))
    return q, k, v


def _block_operands():
    gen = torch.Generator().manual_seed(1)
    d, hd, n_heads, n_kv, ffn = 32, 8, 4, 2, 48

    def r(*shape):
        return torch.randn(*shape, generator=gen) * 0.2

    weights = fused.BlockWeights(
        attn_norm=r(d) + 1, wq=r(n_heads * hd, d), wk=r(n_kv * hd, d), wv=r(n_kv * hd, d), bq=r(n_heads * hd),
        bk=None, bv=r(n_kv * hd), wo=r(d, n_heads * hd), bo=None, ffn_norm=r(d) + 1, w1=r(ffn, d), w3=r(ffn, d),
        w2=r(d, ffn), b1=None, b3=r(ffn), b2=None,
    )  # fmt: skip
    x = r(3, 1, d)
    cos, sin = torch.cos(r(3, 1, hd)), torch.sin(r(3, 1, hd))
    cache_k, cache_v = r(3, n_kv, 10, hd), r(3, n_kv, 10, hd)
    return (x, *weights, cos, sin, cache_k, cache_v, 4, 1e-5, hd**-0.5)


def _paged_operands():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 1, 16, generator=gen)
    k_pool, v_pool = (torch.randn(2, 24, 16, generator=gen) for _ in range(2))
    # row 0: slots 8..11 then 0..3 (8 tokens, from its 2nd); row 1: slots 16..19 (3 tokens)
    return (q, k_pool, v_pool, [8, 0, 16, 0], 4, [1, 0], [8, 3], 0.25)


def _operands():
    q, k, v = _decode_operands()
    rows = torch.randn(2, 1, 37, 24)
    x = torch.randn(3, 32)
    return {
        "decode": (q, k, v, 0.25),
        "decode bf16": (*(t.bfloat16() for t in (q, k, v)), 0.25),
        "decode strided": (q, k[:, :, :20], v[:, :, 3:23], 0.25),
        "mla_decode": (torch.randn(2, 4, 1, 24), rows, 16, 0.2),
        "paged_decode": _paged_operands(),
        "static_decode": (q, k, v, torch.tensor([5, 0]), 0, 0.25),
        "static_decode window": (q, k, v, torch.tensor([9, 4]), 3, 0.25),
        "linear": (x, [torch.randn(16, 32), torch.randn(8, 32)], [torch.randn(16), None]),
        "block_step": _block_operands(),
    }


@pytest.mark.parametrize("case", list(_operands()))
def test_the_operators_pass_opcheck(case):
    """Schema (what each op mutates: only block_step's caches), fake implementations against the real outputs,
    the autograd registration, and AOT dispatch with dynamic shapes."""
    args = _operands()[case]
    torch.library.opcheck(getattr(OPS, case.split()[0]).default, args)


def test_the_operators_equal_the_pytorch_kernels():
    """The ops called directly: the decode family against the reference backend, linear against F.linear, the
    paged op against the rows it reads gathered, block_step's cache write where it belongs."""
    from attnlab.attention.kernels import attend

    ops = _operands()
    q, k, v, scale = ops["decode strided"]
    ref = attend(q, k, v, scale=scale, backend="reference")
    torch.testing.assert_close(OPS.decode(q, k, v, scale), ref, rtol=1e-5, atol=1e-5)
    q, rows, dv, scale = ops["mla_decode"]
    ref = attend(q, rows, rows[..., :dv], scale=scale, backend="reference")
    torch.testing.assert_close(OPS.mla_decode(q, rows, dv, scale), ref, rtol=1e-5, atol=1e-5)
    q, k_pool, v_pool, table, block, first, lengths, scale = ops["paged_decode"]
    out = OPS.paged_decode(*ops["paged_decode"])
    for b in range(2):
        slots = [s + j for s in table[2 * b : 2 * b + 2] for j in range(block)][first[b] : lengths[b]]
        ref = attend(
            q[b : b + 1], k_pool[None, :, slots], v_pool[None, :, slots], scale=scale, backend="reference"
        )
        torch.testing.assert_close(out[b : b + 1], ref, rtol=1e-5, atol=1e-5)
    for case in ("static_decode", "static_decode window"):  # each row to its length, NaN past it never read
        q, k, v, lengths, window, scale = ops[case]
        k, v = k.clone(), v.clone()
        for b, n in enumerate(lengths.tolist()):
            k[b, :, n:], v[b, :, n:] = float("nan"), float("nan")
        out = OPS.static_decode(q, k, v, lengths, window, scale)
        for b, n in enumerate(lengths.tolist()):
            lo = max(0, n - window) if window else 0
            ref = attend(
                q[b : b + 1], k[b : b + 1, :, lo:n], v[b : b + 1, :, lo:n], scale=scale, backend="reference"
            )
            torch.testing.assert_close(
                out[b : b + 1], ref.nan_to_num() if n == 0 else ref, rtol=1e-5, atol=1e-5
            )
    x, ws, bs = ops["linear"]
    ref = torch.cat([torch.nn.functional.linear(x, w, b) for w, b in zip(ws, bs, strict=True)], -1)
    torch.testing.assert_close(OPS.linear(x, ws, bs), ref, rtol=1e-5, atol=1e-5)
    args = ops["block_step"]
    before = args[19].clone()
    out = OPS.block_step(*args)
    assert out.shape == args[0].shape and torch.isfinite(out).all()
    changed = (args[19] != before).any(dim=-1)  # (B, n_kv, slots): the new key went to position 4 only
    assert changed[:, :, 4].all() and changed.sum() == changed[:, :, 4].numel()


def test_bad_operands_are_refused_by_name():
    q, k, v = _decode_operands()
    with pytest.raises(ValueError, match="inconsistent shapes"):
        OPS.decode(q, k[:, :1], v, 0.25)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        OPS.decode(q.double(), k.double(), v.double(), 0.25)
    args = list(_block_operands())
    args[2] = args[2][:, :-1]  # wq one column short
    with pytest.raises(ValueError, match="wq"):
        OPS.block_step(*args)
    q, k, v = _decode_operands()
    with pytest.raises(ValueError, match="row 1 has length 99"):
        OPS.static_decode(q, k, v, torch.tensor([3, 99]), 0, 0.25)
    with pytest.raises(ValueError, match="int64 CPU tensor of shape"):
        OPS.static_decode(q, k, v, torch.tensor([3, 4], dtype=torch.int32), 0, 0.25)
    paged = list(_paged_operands())
    paged[3] = [8, 0, 22, 0]  # a slot whose block runs past the pool
    with pytest.raises(ValueError, match="outside the pool"):
        OPS.paged_decode(*paged)


def test_table_entries_near_the_integer_limit_are_refused_not_read_past_the_pool():
    # slot + used and width * block wrapped past 2^63: a slot of 2^63 - 1 read outside the pool and returned what it
    # found there
    paged = list(_paged_operands())
    for slot in (2**63 - 1, 2**63 - 5):
        paged[3] = [slot, 0, 16, 0]
        with pytest.raises(ValueError, match="outside the pool"):
            OPS.paged_decode(*paged)
    paged = list(_paged_operands())
    paged[4], paged[6] = 2**62, [2**63 - 1, 3]  # 2 pages of 2^62: the message said "of -9223372036854775808"
    with pytest.raises(ValueError, match=r"slot 8 \(4611686018427387904 tokens\) outside the pool of 24"):
        OPS.paged_decode(*paged)
    paged[3] = [8, 16]  # 1 page a row
    with pytest.raises(ValueError, match=r"row 0 attends to tokens 1 \.\. 9223372036854775807 of 1 pages of"):
        OPS.paged_decode(*paged)


@pytest.mark.parametrize(
    "case", ["decode", "mla_decode", "static_decode", "paged_decode", "linear", "block_step"]
)
def test_an_operator_called_to_record_gradients_is_refused_naming_the_operand(case):
    """The kernels have no backward: the call gave outputs with a grad_fn and gradients of None after backward (a
    warning only then). With gradients off, or on operands that need none, the call runs."""
    args = list(_operands()[case])
    position = 1 if case == "linear" else 0  # linear's weights (a list), else the first operand
    original = args[position]
    if case == "linear":
        args[1] = [original[0].requires_grad_(), original[1]]
    else:
        args[0] = original.clone().requires_grad_()
    name = (
        OPS.linear.default._schema.arguments[1].name
        if case == "linear"
        else "x"
        if case == "block_step"
        else "q"
    )
    with pytest.raises(ValueError, match=f"attnlab.{case}: {name} requires grad"):
        getattr(OPS, case)(*args)
    with torch.no_grad():
        assert not getattr(OPS, case)(*args).requires_grad


def test_the_block_step_marks_the_caches_it_writes_so_a_backward_that_saved_them_says_so():
    # under the Autograd-key kernel the caches' versions stayed 0: a backward through a product that had saved a
    # cache then ran on the overwritten values
    args = list(_block_operands())
    cache_k = args[-5]
    weight = torch.randn(cache_k.shape, requires_grad=True)
    saved = (weight * cache_k).sum()
    with torch.no_grad():
        OPS.block_step(*args)
    assert cache_k._version == 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()


def test_a_forward_mode_tangent_is_refused_not_dropped():
    """torch.func.jvp gave a tangent of zeros, forward_ad one of None: the kernels have no derivatives."""
    import torch.autograd.forward_ad as fwd

    q, k, v = _decode_operands()
    with pytest.raises(ValueError, match=r"attnlab\.decode: q carries a forward-mode tangent"):
        torch.func.jvp(lambda a: OPS.decode(a, k, v, 0.25), (q,), (torch.randn_like(q),))
    with fwd.dual_level(), pytest.raises(ValueError, match="k carries a forward-mode tangent"):
        OPS.decode(q, fwd.make_dual(k, torch.randn_like(k)), v, 0.25)
    with fwd.dual_level():  # a dual level with no tangent on the operands: it runs
        assert OPS.decode(q, k, v, 0.25).shape == (2, 6, 1, 16)
    batched = torch.vmap(lambda a: OPS.decode(a, k, v, 0.25))(q[None].expand(3, -1, -1, -1, -1).contiguous())
    torch.testing.assert_close(batched[1], OPS.decode(q, k, v, 0.25))


ZERO_CASES = {
    "decode no heads": "OPS.decode(torch.randn(1, 0, 1, 8), torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8), 0.3)",
    "decode no dims": "OPS.decode(torch.randn(1, 2, 1, 0), torch.randn(1, 1, 3, 0), torch.randn(1, 1, 3, 0), 0.3)",
    "mla no heads": "OPS.mla_decode(torch.randn(1, 0, 1, 8), torch.randn(1, 1, 3, 8), 4, 0.3)",
    "static no heads": "OPS.static_decode(torch.randn(1, 0, 1, 8), torch.randn(1, 1, 3, 8), "
    "torch.randn(1, 1, 3, 8), torch.tensor([2]), 0, 0.3)",
    "paged no heads": "OPS.paged_decode(torch.randn(1, 0, 1, 8), torch.randn(1, 4, 8), torch.randn(1, 4, 8), "
    "[0], 4, [0], [3], 0.3)",
    "paged no rows": "OPS.paged_decode(torch.randn(0, 2, 1, 8), torch.randn(1, 4, 8), torch.randn(1, 4, 8), "
    "[], 4, [], [], 0.3)",
    "linear no features": "OPS.linear(torch.randn(3, 0), [torch.randn(4, 0)], [torch.zeros(4)])",
}


def test_no_heads_dims_or_features_are_refused_by_name():
    # SIGFPE killed the process for the heads and dims (the kernels divide by both); linear left y uninitialised.
    # In a child process, so that a crash is a failed assertion here
    code = "import torch, attnlab.attention.fused as f; f.ensure_built(); OPS = torch.ops.attnlab\n"
    for case, call in ZERO_CASES.items():
        code += f"try:\n    {call}\n    print({case!r}, 'ran', sep='|')\n"
        code += f"except ValueError as e:\n    print({case!r}, f'ValueError {{e}}', sep='|')\n"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stdout[-2000:], run.stderr[-2000:])
    said = dict(line.split("|", 1) for line in run.stdout.strip().splitlines()[-len(ZERO_CASES) :])
    for case in ZERO_CASES:
        assert said[case].startswith("ValueError attnlab:"), (case, said[case])
        assert any(f"{x} >= 1" in said[case] for x in ("H", "B", "K")), (case, said[case])


def test_the_kernels_read_the_arguments_the_schemas_pass(monkeypatch):
    """csrc/ops.cpp reads each argument by a name; fused.py's schemas are the one definition of those names and
    their order. The loaded library agrees (checked at every load), and a disagreement refuses the library."""
    ops = fused._library()
    fused.check_signatures(ops)
    assert (
        fused._argument_names(
            "block_step(Tensor x, Tensor? bq, Tensor(a!) cache_k, int[] table, int pos) -> Tensor"
        )
        == "block_step(x, bq, cache_k, table, pos)"
    )
    schemas = fused._schemas()
    swapped = dict(schemas, decode="decode(Tensor q, Tensor v, Tensor k, float scale) -> Tensor")
    monkeypatch.setattr(fused, "_schemas", lambda: swapped)
    with pytest.raises(RuntimeError, match=r"the kernels read arguments .*decode\(q, k, v, scale\)"):
        fused.check_signatures(ops)


class _Graphs:
    """A torch.compile backend that keeps the call targets of each graph and runs it as it is."""

    def __init__(self) -> None:
        self.targets: set = set()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.targets |= {n.target for n in gm.graph.nodes if n.op == "call_function"}
        return gm.forward


def _compiled(fn, *args):
    torch._dynamo.reset()
    graphs = _Graphs()
    out = torch.compile(fn, fullgraph=True, backend=graphs)(*args)
    return out, graphs.targets


@pytest.mark.parametrize("kind", ["gqa", "mla", "paged"])
def test_a_compiled_decode_step_has_the_operators_in_its_graph_and_equals_eager(kind):
    cfg = LAYERS["mla" if kind == "mla" else "gqa"]
    module = _module(cfg)
    caches = []
    for _ in range(2):
        cache = module.new_paged_cache(8, 4, 2) if kind == "paged" else module.new_cache(2, 16)
        with torch.no_grad():
            module(torch.randn(2, 5, cfg.d_model, generator=torch.Generator().manual_seed(3)), cache=cache)
        caches.append(cache)
    x = torch.randn(2, 1, cfg.d_model)
    with torch.no_grad():
        eager = module(x, cache=caches[0])
        compiled, targets = _compiled(lambda x: module(x, cache=caches[1]), x)
    kernel = {"gqa": OPS.decode, "mla": OPS.decode, "paged": OPS.paged_decode}[
        kind
    ]  # (MLA: see fused.decode)
    assert kernel.default in targets and OPS.linear.default in targets, targets
    assert torch.equal(compiled, eager)


def test_tracing_never_builds_the_kernels(monkeypatch):
    """Compiling before the first eager call: tracing does not run a build (seconds, a lock, a subprocess) but takes
    the PyTorch kernels, without a graph break; the eager call after it builds (here: loads) the kernels."""
    for key, value in fused._state.items():  # restored after the test: the loaded kernels stay in use
        monkeypatch.setitem(fused._state, key, value)
    fused.reset()
    module = _module(LAYERS["gqa"])
    cache = module.new_cache(2, 16)
    x = torch.randn(2, 1, 160)
    with torch.no_grad():
        module(torch.randn(2, 5, 160), cache=cache)  # a prefill: SDPA, the kernels not asked for
        assert fused.status() == "not built yet"
        _, targets = _compiled(lambda x: module(x, cache=cache), x)
        assert fused.status() == "not built yet"
        assert not any(str(t).startswith("attnlab.") for t in targets), targets
        module(x, cache=cache)
    assert fused.status().startswith("fused C++ kernel")


def test_a_compiled_model_decode_step_equals_eager():
    """The whole model's step: its blocks run module by module under compile (the block plan reads data pointers),
    through the decode and linear operators, in one graph."""
    torch.manual_seed(0)
    model = Transformer(MODEL).eval()
    model.init_weights(seed=0)
    tokens = torch.randint(0, MODEL.vocab_size, (2, 7))
    caches = [model.new_caches(2, 16) for _ in range(2)]
    with torch.no_grad():
        for c in caches:
            model(tokens[:, :6], caches=c)
        eager = model(tokens[:, 6:], caches=caches[0])
        compiled, targets = _compiled(lambda t: model(t, caches=caches[1]), tokens[:, 6:])
    assert {OPS.decode.default, OPS.linear.default} <= targets, targets
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_the_block_step_compiles_with_its_cache_writes_and_equals_eager():
    """``block_step`` mutates the caches (its schema says so): through AOT autograd's functionalization the compiled
    call writes the same cache entries and returns the same output."""
    eager_args, compiled_args = _block_operands(), _block_operands()
    eager = OPS.block_step(*eager_args)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: OPS.block_step(*a), fullgraph=True, backend="aot_eager")(
        *compiled_args
    )
    assert torch.equal(compiled, eager)
    assert torch.equal(compiled_args[19], eager_args[19]) and torch.equal(compiled_args[20], eager_args[20])


def test_the_block_step_counts_as_the_cost_model_of_its_block():
    args = _block_operands()
    x, weights, pos = args[0], fused.BlockWeights(*args[1:17]), args[21]
    n_kv, head_dim = args[19].shape[1], args[19].shape[3]
    d, ffn = x.shape[-1], weights.w1.shape[0]
    attn = AttentionConfig(
        d_model=d, n_heads=weights.wq.shape[0] // head_dim, n_kv_heads=n_kv, head_dim=head_dim
    )
    with FlopCounterMode(display=False) as fc:
        OPS.block_step(*args)
    mlp = 3 * 2 * d * ffn * x.shape[0]  # gate, up and down projections of every row
    assert fc.get_total_flops() == attention_flops(attn, x.shape[0], 1, pos + 1).total + mlp


def test_the_profiler_lists_each_operator_by_name():
    ops = _operands()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for case in ("decode", "mla_decode", "paged_decode", "linear", "block_step"):
            getattr(OPS, case)(*ops[case])
    names = {event.key for event in prof.key_averages()}
    assert {
        f"attnlab::{op}" for op in ("decode", "mla_decode", "paged_decode", "linear", "block_step")
    } <= names


@pytest.mark.parametrize("held", [5, 9, 14])
def test_a_windowed_paged_decode_step_counts_the_same_with_and_without_gradients(held):
    # with gradients the paged kernel scored every key of a block partly inside the window (masked): 13,440
    # against the operator's and the cost model's 13,056
    cfg = AttentionConfig(d_model=48, n_heads=6, n_kv_heads=2, head_dim=8, window=4)
    torch.manual_seed(0)
    attn = GroupedQueryAttention(cfg).eval()
    counts, outputs = [], []
    for grad in (False, True):
        cache = attn.new_paged_cache(32, 4, 1)
        with torch.no_grad():
            attn(torch.randn(1, held, 48, generator=torch.Generator().manual_seed(1)), cache=cache)
        x = torch.randn(1, 1, 48, generator=torch.Generator().manual_seed(2))
        with torch.set_grad_enabled(grad), count_flops() as counter:
            outputs.append(attn(x, cache=cache).detach())
        counts.append(counter.total)
    assert counts[0] == counts[1] == attention_flops(cfg, 1, 1, held + 1).total
    assert torch.allclose(outputs[0], outputs[1], atol=1e-6)
