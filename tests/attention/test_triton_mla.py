"""MLA's absorbed decode as a Triton kernel (``attention/triton_mla.py``), run on the CPU by Triton's interpreter
(``TRITON_INTERPRET=1``): contiguous and paged latent rows (shuffled blocks, rows of different lengths, an empty
row, a window), float32 and bfloat16, against a float64 softmax written out here; the MLA module through the backend
table with the kernel named, against the module's existing path; and how the table marks latent rows.

The interpreter must be on before triton is first imported (torch._dynamo imports it), so the kernel runs in one
subprocess per session (``_measure``, a few seconds) and each test checks its part of what that measured. No GPU
here: these check what the kernel computes, not how fast (benchmarks/gpu_check.py times it on a GPU).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnlab import MLAConfig, MultiHeadLatentAttention
from attnlab.attention import backends, kernels
from attnlab.attention.kernels import attend, call_of
from attnlab.cache import PagedView

pytestmark = pytest.mark.usefixtures("one_thread")
R, P = 32, 8  # kv_lora_rank, qk_rope_head_dim
SCALE = 0.2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MLA = MLAConfig(d_model=48, n_heads=4, kv_lora_rank=R, qk_nope_head_dim=16, qk_rope_head_dim=P, v_head_dim=12)


def _oracle(q: torch.Tensor, rows: list[torch.Tensor], magnitude: bool = False) -> torch.Tensor:
    """Softmax attention in float64, one batch row at a time: q (B, H, 1, R + P), rows[i] (S_i, R + P), values the
    first R columns (``magnitude``: their absolute values); a row with no tokens gives zeros."""
    out = []
    for qi, kv in zip(q.double(), rows, strict=True):
        if kv.shape[0] == 0:
            out.append(torch.zeros(qi.shape[0], 1, R, dtype=torch.float64))
            continue
        p = torch.softmax(qi @ kv.double().T * SCALE, dim=-1)  # (H, 1, S)
        v = kv[:, :R].double()
        out.append(p @ (v.abs() if magnitude else v))
    return torch.stack(out)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a.double() - b.double()).abs().max().item()


def _shuffled_view(rows: list[torch.Tensor], block: int, g: torch.Generator) -> PagedView:
    """A pool holding ``rows`` in blocks of ``block`` tokens at random places, in runs of 1 to 3 consecutive blocks;
    random values everywhere else."""
    n_slots = sum(
        -(-len(r) // block) for r in rows
    )  # room for 3 blocks per slot, at least one per block of a row
    pool = torch.randn(1, n_slots * 3 * block, rows[0].shape[-1], generator=g).to(rows[0].dtype)
    free = torch.randperm(n_slots, generator=g).tolist()
    runs = []
    for row in rows:
        row_runs, at = [], 0
        while at < len(row):
            n = min(len(row) - at, block * int(torch.randint(1, 4, (), generator=g)))
            start = free.pop() * 3 * block
            pool[0, start : start + n] = row[at : at + n]
            row_runs.append((start, n))
            at += n
        runs.append(tuple(row_runs))
    return PagedView(pool, tuple(runs), tuple(len(r) for r in rows))


def _case(
    y: torch.Tensor, q: torch.Tensor, rows: list[torch.Tensor], existing: torch.Tensor | None = None
) -> dict:
    """How far ``y`` is from the float64 softmax, against the bound that rounding allows (``_close``)."""
    want = _oracle(q, rows)
    # bfloat16's unit roundoff u = 2^-8 on each weight p_i before its product with v_i, and on the output
    u = torch.finfo(y.dtype).eps / 2
    bound = u * (_oracle(q, rows, magnitude=True) + want.abs()) + 1e-6
    return {
        "dtype": str(y.dtype).removeprefix("torch."),
        "finite": bool(torch.isfinite(y).all()),
        "err": _err(y, want),
        "over_bound": ((y.double() - want).abs() / bound).max().item(),
        "existing": None if existing is None else _err(existing, want),
    }


def _kernel_cases(tm) -> dict:
    out = {}
    for name, dtype in DTYPES.items():
        g = torch.Generator().manual_seed(0)
        for n_heads in (4, 40):  # one group of heads; two groups of 32, the second part-empty
            b, s = 2, 75  # three chunks of 32 tokens, the last partial
            q = torch.randn(b, n_heads, 1, R + P, generator=g).to(dtype)
            buffer = torch.randn(b, 90, R + P, generator=g).to(
                dtype
            )  # a LatentCache's buffer, 75 tokens live
            k = buffer[:, :s][:, None]
            y = tm.decode(q, k, R, scale=SCALE, chunk=32)
            existing = attend(
                q, k, k[..., :R], scale=SCALE
            )  # the CPU path: the fused MLA decode, else grouped
            out[f"contiguous-{name}-{n_heads}"] = _case(y, q, list(buffer[:, :s]), existing)
        rows = [torch.randn(n, R + P, generator=g).to(dtype) for n in (70, 0, 9, 41)]  # an empty row: zeros
        view = _shuffled_view(rows, 8, g)
        q = torch.randn(len(rows), 6, 1, R + P, generator=g).to(dtype)
        y = tm.decode(q, view, R, scale=SCALE, chunk=32)
        existing = attend(q, view, PagedView(view.pool[..., :R], view.runs, view.lengths), scale=SCALE)
        out[f"paged-{name}"] = _case(y, q, rows, existing)
        y = tm.decode(q, view, R, scale=SCALE, window=20, chunk=32)  # every row: its last 20 tokens
        out[f"window-{name}"] = _case(y, q, [r[-20:] for r in rows])
        y = tm.decode(q, view, R, scale=SCALE)  # the default chunking (one chunk per row here)
        out[f"one-chunk-{name}"] = _case(y, q, rows)
        # A static cache's buffers: rows of 75, 0 and 40 tokens live in 96 slots, NaN past each row's length (never
        # read: a read would reach the output), the lengths on the device as a tensor
        buffer = torch.randn(3, 96, R + P, generator=g).to(dtype)
        lengths = torch.tensor([75, 0, 40])
        for row, n in enumerate(lengths.tolist()):
            buffer[row, n:] = float("nan")
        q = torch.randn(3, 6, 1, R + P, generator=g).to(dtype)
        y = tm.decode(q, buffer[:, None], R, scale=SCALE, chunk=32, lengths=lengths)
        out[f"lengths-{name}"] = _case(y, q, [buffer[i, :n] for i, n in enumerate(lengths.tolist())])
        y = tm.decode(q, buffer[:, None], R, scale=SCALE, window=20, chunk=32, lengths=lengths)
        out[f"lengths-window-{name}"] = _case(
            y, q, [buffer[i, max(0, n - 20) : n] for i, n in enumerate(lengths.tolist())]
        )
    return out


def _module_cases() -> dict:
    """The MLA module's decode steps with the kernel named (``backend="triton_mla"``) against the same weights on
    the existing path ("auto": the fused C++ decode on a CPU), over a contiguous and a scattered paged cache; and
    which backend the table picked for each attend call."""
    chosen = []
    real = kernels.choose
    kernels.choose = lambda call, backend="auto": (
        chosen.append(real(call, backend).backend.name) or real(call, backend)
    )
    out = {}
    for name, dtype in DTYPES.items():
        torch.manual_seed(0)
        mla = MultiHeadLatentAttention(MLA).eval()
        with torch.no_grad():
            for p in mla.parameters():
                p.normal_(0.0, 0.3)
        mla = mla.to(dtype)
        x = torch.randn(3, 12, MLA.d_model).to(dtype)
        for kind in ("contiguous", "paged", "static"):
            got = {}
            for backend in ("auto", "triton_mla"):
                mla.cfg = mla.cfg.replace(backend=backend)
                chosen.clear()
                if kind == "paged":
                    cache = mla.new_paged_cache(20, 4, 3)
                    cache.placement = "scattered"
                    for row, n in enumerate((9, 3, 6)):  # rows of different lengths, prefilled one by one
                        cache.select([row])
                        mla(x[row : row + 1, :n], cache=cache)
                    cache.select([0, 1, 2])
                elif (
                    kind == "static"
                ):  # fixed buffers of 16 slots, rows of 9, 3 and 6 tokens: read to each length
                    cache = mla.new_cache(3, 16, static=True)
                    for row, n in enumerate((9, 3, 6)):
                        mla(x[row : row + 1, :n], cache=cache.row(row))
                else:
                    cache = mla.new_cache(3, 16)
                    mla(x[:, :9], cache=cache)
                with torch.no_grad():
                    steps = [mla(x[:, 9 + i : 10 + i], cache=cache) for i in range(3)]
                got[backend] = (torch.cat(steps, dim=1), chosen[-3:])
            y, ran = got["triton_mla"]
            out[f"module-{kind}-{name}"] = {
                "err": _err(y, got["auto"][0]),
                "scale": got["auto"][0].abs().max().item(),
                "ran": ran,
                "auto_ran": got["auto"][1],
            }
    kernels.choose = real
    return out


def _edge_cases(tm) -> dict:
    """An empty batch; lengths outside the buffers (refused by every other backend, read unchecked by the kernel);
    and the module's decode under torch.inference_mode, as generate runs it, whose views record no base."""
    out = {}
    q, k = torch.randn(0, 4, 1, R + P), torch.randn(0, 1, 5, R + P)
    out["empty"] = list(tm.decode(q, k, R, scale=SCALE).shape)
    q, k = torch.randn(2, 4, 1, R + P), torch.randn(2, 1, 10, R + P)
    for bad in ([3, 12], [-3, 3]):
        try:
            attend(q, k, k[..., :R], scale=SCALE, lengths=torch.tensor(bad), backend="triton_mla")
            out[f"lengths {bad}"] = "taken"
        except ValueError as err:
            out[f"lengths {bad}"] = str(err)
    chosen = []
    real = kernels.choose
    kernels.choose = lambda call, backend="auto": (
        chosen.append(real(call, backend).backend.name) or real(call, backend)
    )
    torch.manual_seed(0)
    mla = MultiHeadLatentAttention(MLA.replace(backend="triton_mla")).eval()
    x = torch.randn(2, 10, MLA.d_model)
    with torch.inference_mode():
        cache = mla.new_cache(2, 16)
        mla(x[:, :9], cache=cache)
        chosen.clear()
        mla(x[:, 9:], cache=cache)
    kernels.choose = real
    out["inference_mode_ran"] = chosen
    return out


def _measure() -> dict:
    """Everything the kernel computed (run in a subprocess with the interpreter on: see the module docstring)."""
    from attnlab.attention import triton_mla

    assert triton_mla.INTERPRET and backends.BACKENDS["triton_mla"].devices == {"cuda", "cpu"}
    torch.set_num_threads(1)
    with torch.no_grad():
        return {**_kernel_cases(triton_mla), **_module_cases(), "edges": _edge_cases(triton_mla)}


@pytest.fixture(scope="module")
def measured() -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip(
            "triton is not installed (pip install 'attnlab[gpu]'): the Triton MLA kernel is not checked"
        )
    here = Path(__file__).resolve()
    src = here.parents[2] / "src"
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(src), str(here.parent), str(here.parents[1]), env.get("PYTHONPATH", "")]
    )
    code = f"import json, {here.stem} as t; print('RESULT', json.dumps(t._measure()))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def _close(case: dict, dtype: str) -> None:
    """float32: the float64 result to float32 rounding. bfloat16: within what rounding allows, entry by entry: the
    kernel sums in float32 but rounds each weight p_i to bfloat16 before its product with the values (as the GPU's
    tensor-core product takes it, and as FlashAttention does), so |y - y64| <= u (sum_i p_i |v_i| + |y64|), u = 2^-8.
    (The CPU's fused decode keeps the weights in float32: its error is reported beside, not bounded against.)"""
    assert case["dtype"] == dtype and case["finite"], case
    if dtype == "float32":
        assert case["err"] < 2e-6, case
    else:
        assert case["over_bound"] <= 1.0, case


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("n_heads", [4, 40])
def test_contiguous_latent_rows_give_the_float64_softmax(measured, dtype, n_heads):
    _close(measured[f"contiguous-{dtype}-{n_heads}"], dtype)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("case", ["paged", "window", "one-chunk"])
def test_paged_latent_rows_in_shuffled_blocks_give_the_float64_softmax(measured, dtype, case):
    _close(measured[f"{case}-{dtype}"], dtype)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("case", ["lengths", "lengths-window"])
def test_rows_of_fixed_buffers_read_to_each_rows_length_give_the_float64_softmax(measured, dtype, case):
    """A static cache's buffers with the rows' lengths on the device (an empty row among them): each row's own
    tokens, the NaN past them never read; with a window, the last 20 of each row's tokens."""
    _close(measured[f"{case}-{dtype}"], dtype)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("cache", ["contiguous", "paged", "static"])
def test_the_mla_module_through_the_kernel_equals_its_existing_path(measured, dtype, cache):
    case = measured[f"module-{cache}-{dtype}"]
    assert case["ran"] == ["triton_mla"] * 3  # every decode step took the kernel, through the table
    assert "triton_mla" not in case["auto_ran"]  # "auto" never picks it on a CPU
    tol = (
        1e-5 if dtype == "float32" else 2 * torch.finfo(torch.bfloat16).eps
    )  # two bfloat16 steps of the largest
    assert case["err"] <= tol * max(1.0, case["scale"]), case


def test_the_table_marks_mla_latent_rows_and_nothing_else():
    mla = MultiHeadLatentAttention(MLA).eval()
    q = torch.randn(2, 4, 1, R + P)
    with torch.no_grad():
        cache = mla.new_cache(2, 8)
        keys, values = cache.append(torch.randn(2, 1, 3, R + P))
        assert call_of(q, keys, values).latent
        paged = mla.new_paged_cache(8, 4, 2)
        keys, values = paged.append(torch.randn(2, 1, 3, R + P), None)
        assert call_of(q, keys, values).latent
    k = torch.randn(2, 1, 3, R + P)
    assert not call_of(q, k, k[..., :R].clone()).latent  # the same numbers in another tensor
    assert not call_of(q, k, k[..., P:]).latent  # the last columns, not the first
    k2 = torch.randn(2, 2, 3, R + P)
    assert not call_of(torch.randn(2, 4, 1, R + P), k2, k2[..., :R]).latent  # two KV heads: not MLA


def test_an_empty_batch_bad_lengths_and_inference_mode(measured):
    """Each failed before: a batch of 0 divided by zero in the grid's split; lengths past the buffer were read past
    it (inf) and negative ones gave zeros, where every other backend refuses them; and under inference_mode
    (generate's) the latent rows were not recognised, so the kernel never ran in generation."""
    edges = measured["edges"]
    assert edges["empty"] == [0, 4, 1, R]
    assert edges["lengths [3, 12]"] == "attend: lengths[1] is 12, outside 0 .. 10 (the buffer's slots)"
    assert edges["lengths [-3, 3]"] == "attend: lengths[0] is -3, outside 0 .. 10 (the buffer's slots)"
    assert edges["inference_mode_ran"] == ["triton_mla"]
