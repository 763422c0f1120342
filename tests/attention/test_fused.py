"""The fused C++ decode kernel against the reference backend, over generated shapes; its fallback.

Oracle: ``attend(..., backend="reference")`` (repeat-KV, explicit float32 softmax) on the same tensors. float32
within 1e-5; bfloat16 within bfloat16's tolerance (the kernel computes in float32 and rounds the output once, as
the reference does). The kernel is built once per session (a few seconds; then reused from the build cache).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab import AttentionConfig, MLAConfig, ModelConfig, MultiHeadLatentAttention, PagedKVCache
from attnlab.attention import fused
from attnlab.attention.backends import Call, choose
from attnlab.attention.kernels import attend
from attnlab.model import Transformer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_extension_is_built_and_auto_takes_it_for_cpu_decode():
    """CI has g++ and ninja: a fallback there would hide a broken build behind passing equivalence tests."""
    if os.environ.get("ATTNLAB_FUSED") == "0":
        pytest.skip("ATTNLAB_FUSED=0 turns the kernel off")
    assert fused.available(), fused.status()
    assert fused.status().startswith("fused C++ kernel")
    for paged in (False, True):
        assert choose(Call("cpu", torch.float32, "decode", paged=paged)).backend.name == "fused"


def _inputs(draw, dtype: torch.dtype):
    """q (B, H, 1, Dk) and the live views k, v of a preallocated cache; MLA-like (v the first Dv columns of k's
    rows, one KV head) in a quarter of the draws."""
    b, n_kv = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    group = draw(st.one_of(st.integers(1, 9), st.sampled_from([16, 32])))  # 16 k: scored queries-in-lanes
    s, dk = draw(st.integers(0, 700)), draw(st.integers(1, 80))
    latent = draw(st.integers(0, 3)) == 0
    dv = draw(st.integers(1, dk)) if latent else dk
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    spare = draw(st.integers(0, 9))  # unused cache slots after the live prefix: the view is strided
    scale = draw(st.floats(0.25, 2.0)) * dk**-0.5  # around the usual 1/sqrt(head_dim)
    heads = 1 if latent else n_kv
    q = torch.randn(b, heads * group, 1, dk, generator=gen).to(dtype)
    buf_k = torch.randn(b, heads, s + spare, dk, generator=gen).to(dtype)
    buf_v = torch.randn(b, heads, s + spare, dk, generator=gen).to(dtype)
    k = buf_k[:, :, :s]
    v = k[..., :dv] if latent else buf_v[:, :, :s]
    return q, k, v, scale


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(data=st.data())
def test_contiguous_decode_equals_the_reference(dtype, data):
    q, k, v, scale = _inputs(data.draw, DTYPES[dtype])
    out = attend(q, k, v, scale=scale, backend="fused")
    if k.shape[2] == 0:  # nothing to attend to: zeros (the rule for a fully masked row)
        assert torch.equal(out, torch.zeros_like(out))
        return
    torch.testing.assert_close(out, attend(q, k, v, scale=scale, backend="reference"), **TOL[DTYPES[dtype]])
    for row in range(q.shape[0]):  # a row's result does not depend on the rows beside it
        sl = slice(row, row + 1)
        assert torch.equal(out[sl], fused.decode(q[sl], k[sl], v[sl], scale=scale))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [None, 128, 256, 32])
@pytest.mark.parametrize(
    "dims",
    [(64, 64, 2, 3), (64, 64, 2, 4), (128, 128, 1, 16), (64, 64, 1, 16), (128, 128, 1, 32), (576, 512, 1, 8),
     (576, 512, 1, 32)],
    ids=["gqa-3", "gqa-4", "gqa-16", "gqa-16-64", "mqa-32", "mla", "mla-32"],
)  # fmt: skip
def test_blocks_read_in_place_equal_the_reference(dims, block, dtype):
    """Rows of a width the kernel needs no padding for (a multiple of 16) are read where they lie rather than
    staged, float32 and bfloat16 (widened in registers) alike: contiguous caches and pages of any size (a block
    of 128 rows spans 4 pages of 32), with partial blocks at chunk ends staged as before; groups of 4 take their
    own score tile, groups of 16 and 32 (float32) the queries-in-lanes tiles (rows 64 or 128 wide and evenly spaced
    addressed from one pointer, tiles across a page boundary through a pointer per row). Every row equals the
    reference."""
    if not fused.available():
        pytest.skip(fused.status())
    dk, dv, heads, group = dims
    latent = dv != dk
    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(0)
    lengths = [1000, 300, 129]
    keys = [torch.randn(1, heads, n, dk, generator=gen).to(dt) for n in lengths]
    vals = [r[..., :dv] if latent else torch.randn(r.shape, generator=gen).to(dt) for r in keys]
    q = torch.randn(len(lengths), heads * group, 1, dk, generator=gen).to(dt)
    if block is None:
        # a strided live view, as a KVCache returns
        spare = torch.randn(1, heads, 1010, dk, generator=gen).to(dt)
        spare[:, :, :1000] = keys[0]
        keys[0] = spare[:, :, :1000]
        vals[0] = keys[0][..., :dv] if latent else vals[0]
        outs = [fused.decode(q[i : i + 1], keys[i], vals[i], scale=0.1) for i in range(len(lengths))]
    else:
        cache = PagedKVCache(
            sum(-(-n // block) for n in lengths), block, heads, dk, batch_size=len(lengths),
            values_in_keys=latent, value_dim=dv if latent else None, dtype=dt,
        )  # fmt: skip
        for i in range(len(lengths)):
            cache.select([i]).update(keys[i], None if latent else vals[i])
        out = attend(q, *cache.select([0, 1, 2]).views(), scale=0.1, backend="fused")
        outs = [out[i : i + 1] for i in range(len(lengths))]
    for i, got in enumerate(outs):
        ref = attend(q[i : i + 1], keys[i], vals[i], scale=0.1, backend="reference")
        torch.testing.assert_close(got, ref, **TOL[dt])
        k, v = keys[i].contiguous(), vals[i].contiguous()  # staged-or-not must not change a bit
        assert torch.equal(got, fused.decode(q[i : i + 1], k, v, scale=0.1))


def _paged(draw, dtype: torch.dtype):
    """A paged cache whose rows have drawn lengths, filled in two pieces each, in a pool whose free blocks are
    handed out in a drawn (scattering) order; with the same rows as contiguous tensors."""
    b, n_kv = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    group = draw(st.one_of(st.integers(1, 5), st.just(16)))
    dk, block = draw(st.integers(2, 48)), draw(st.sampled_from([1, 3, 16, 64]))
    lengths = draw(st.lists(st.integers(0, 300), min_size=b, max_size=b))
    latent = draw(st.booleans())
    dv = draw(st.integers(1, dk)) if latent else dk
    n_blocks = max(1, sum(-(-n // block) for n in lengths) + draw(st.integers(0, 6)))
    heads = 1 if latent else n_kv
    cache = PagedKVCache(
        n_blocks, block, heads, dk, batch_size=b, dtype=dtype, values_in_keys=latent,
        value_dim=dv if latent else None,
    )  # fmt: skip
    order = draw(st.permutations(range(n_blocks)))

    def take(table: list[int], wanted: int) -> int:  # the drawn order, not the allocator's runs
        chosen = next(x for x in order if x in cache._free)
        cache._free.remove(chosen)
        return chosen

    cache._take = take
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    keys = [torch.randn(1, heads, n, dk, generator=gen).to(dtype) for n in lengths]
    vals = [torch.randn(1, heads, n, dk, generator=gen).to(dtype) for n in lengths]
    cuts = [draw(st.integers(0, n)) for n in lengths]
    for row, cut in enumerate(cuts):  # the second piece is written after the other rows grew
        cache.select([row]).update(keys[row][:, :, :cut], None if latent else vals[row][:, :, :cut])
    for row, cut in enumerate(cuts):
        cache.select([row]).update(keys[row][:, :, cut:], None if latent else vals[row][:, :, cut:])
    values = [r[..., :dv] for r in keys] if latent else vals
    q = torch.randn(b, heads * group, 1, dk, generator=gen).to(dtype)
    return q, cache.select(list(range(b))), keys, values


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(data=st.data())
def test_paged_decode_attends_every_row_at_once_and_equals_the_reference(dtype, data):
    q, cache, keys, values = _paged(data.draw, DTYPES[dtype])
    out = attend(q, *cache.views(), scale=0.3, backend="fused")
    for row in range(q.shape[0]):
        alone = fused.decode(q[row : row + 1], keys[row], values[row], scale=0.3)
        # Same bits as the row alone from a contiguous cache: the kernel never depends on placement or batch.
        assert torch.equal(out[row : row + 1], alone)
        if keys[row].shape[2]:
            ref = attend(q[row : row + 1], keys[row], values[row], scale=0.3, backend="reference")
            torch.testing.assert_close(out[row : row + 1], ref, **TOL[DTYPES[dtype]])
        else:
            assert not out[row].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_absorbed_mla_decode_through_the_kernel_equals_the_reference_backend(dtype):
    """MLA's absorbed decode is MQA over the latent rows, values being their first kv_lora_rank columns: the
    kernel (auto) against the reference backend on the same module weights, and (float32) the naive form."""
    dt = DTYPES[dtype]
    cfg = MLAConfig(
        d_model=96, n_heads=6, kv_lora_rank=40, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12
    )
    mlas = {name: MultiHeadLatentAttention(cfg.replace(backend=backend)) for name, backend in
            (("fused", "fused"), ("reference", "reference"), ("naive", "reference"))}  # fmt: skip
    mlas["fused"].init_weights(std=0.3)
    for name, mla in mlas.items():
        mla.load_state_dict(mlas["fused"].state_dict())
        mla.mode = "naive" if name == "naive" else "absorbed"
        mlas[name] = mla.to(dt).eval()
    x = torch.randn(2, 30, 96).to(dt)
    outs = {}
    with torch.inference_mode():
        for name, mla in mlas.items():
            cache = mla.new_cache(2, 40)
            mla(x[:, :29], cache=cache)
            outs[name] = mla(x[:, 29:], cache=cache)
    torch.testing.assert_close(outs["fused"], outs["reference"], **TOL[dt])
    if dt == torch.float32:
        torch.testing.assert_close(outs["fused"], outs["naive"], **TOL[dt])


@pytest.mark.parametrize("tiles", [True, False], ids=["pairs", "float32-tiles"])
@pytest.mark.parametrize("page", [None, 1, 16, 48, 256])
@pytest.mark.parametrize(
    "dims",
    [(128, 128, 2, 8), (64, 64, 1, 8), (128, 128, 1, 32), (64, 64, 1, 20), (32, 16, 3, 9), (576, 512, 1, 16)],
    ids=["gqa-8", "gqa-8-64", "mqa-32", "gqa-20", "small", "mla"],
)
def test_bfloat16_on_the_pair_path_and_off_it_equals_the_reference(dims, page, tiles):
    """Where the CPU has AMX tiles or AVX512-BF16 dot products, bfloat16 steps with groups of 8 or more queries (keys
    a multiple of 32 wide) run on the pair path: scores of exact bfloat16 products summed in float32, weights
    rounded to bfloat16. Both that path and the float32 tiles (``use_amx(False)``) equal the reference within
    bfloat16's tolerance, for groups of 8 (on the dot products: two pairs of a key per lane pair, rows 128 and 64
    wide), padded groups (9, 20), MLA's latent rows, rows of lengths that end mid-tile and
    mid-block, contiguous caches and pages of 1 to 256 tokens (pages under 16 tokens are staged tile by tile, or
    read in steps of 4 and single rows on the dot products); and every row's result is the same bits alone or in a
    batch, from pages or a contiguous cache."""
    if tiles and not (fused.amx() or fused.bf16_dots()):
        pytest.skip(f"no AMX tiles or AVX512-BF16 here ({fused.status()})")
    dk, dv, heads, group = dims
    latent, dt = dv != dk, torch.bfloat16
    gen = torch.Generator().manual_seed(dk + group)
    lengths = [700, 129, 33, 1]
    keys = [torch.randn(1, heads, n, dk, generator=gen).to(dt) for n in lengths]
    vals = [r[..., :dv] if latent else torch.randn(r.shape, generator=gen).to(dt) for r in keys]
    q = torch.randn(len(lengths), heads * group, 1, dk, generator=gen).to(dt)
    with fused.use_amx(tiles):
        assert (fused.amx() or fused.bf16_dots()) is tiles
        if page is None:
            outs = [fused.decode(q[i : i + 1], keys[i], vals[i], scale=0.1) for i in range(len(lengths))]
        else:
            cache = PagedKVCache(
                sum(-(-n // page) for n in lengths), page, heads, dk, batch_size=len(lengths),
                values_in_keys=latent, value_dim=dv if latent else None, dtype=dt,
            )  # fmt: skip
            for i in range(len(lengths)):
                cache.select([i]).update(keys[i], None if latent else vals[i])
            out = attend(q, *cache.select(list(range(len(lengths)))).views(), scale=0.1, backend="fused")
            outs = [out[i : i + 1] for i in range(len(lengths))]
        for i, got in enumerate(outs):
            ref = attend(q[i : i + 1], keys[i], vals[i], scale=0.1, backend="reference")
            torch.testing.assert_close(got, ref, **TOL[dt])
            alone = fused.decode(q[i : i + 1], keys[i].contiguous(), vals[i].contiguous(), scale=0.1)
            assert torch.equal(got, alone)


def test_the_pair_path_is_reported_and_can_be_turned_off():
    """``amx()`` (or ``bf16_dots()``) follows ``use_amx`` and is restored after it; the two paths give different bits
    (the pair path rounds the weights to bfloat16) but the same result within bfloat16's tolerance; float32 never
    takes the pair path. Which of the two pair engines runs follows the CPU's flags."""
    if not (fused.amx() or fused.bf16_dots()):
        pytest.skip(f"no AMX tiles or AVX512-BF16 here ({fused.status()})")
    pairs = fused.amx if fused.amx() else fused.bf16_dots
    assert ("AMX" if fused.amx() else "AVX512-BF16") in fused.status()
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 16, 1, 64, generator=gen)
    k, v = torch.randn(1, 1, 300, 64, generator=gen), torch.randn(1, 1, 300, 64, generator=gen)
    on = fused.decode(q.bfloat16(), k.bfloat16(), v.bfloat16(), scale=0.125)
    with fused.use_amx(False):
        assert not pairs()
        off = fused.decode(q.bfloat16(), k.bfloat16(), v.bfloat16(), scale=0.125)
        f32_off = fused.decode(q, k, v, scale=0.125)
    assert pairs()
    assert not torch.equal(on, off)
    torch.testing.assert_close(on, off, **TOL[torch.bfloat16])
    assert torch.equal(fused.decode(q, k, v, scale=0.125), f32_off)


def test_the_dot_product_path_runs_where_the_cpu_has_avx512_bf16_and_no_tiles():
    """The pair path's engine follows the CPU: AMX tiles where granted, else AVX512-BF16's dot products where the
    CPU has them (and the build targets AVX-512), else neither; never both."""
    if not fused.available():
        pytest.skip(fused.status())
    assert not (fused.amx() and fused.bf16_dots())
    flags = fused.cpu_flags()
    if fused.isa() == "avx512" and os.environ.get("ATTNLAB_AMX", "1") != "0":
        assert fused.bf16_dots() is ("avx512_bf16" in flags)
    if fused.isa() in ("avx2", "generic"):
        assert not fused.bf16_dots()


@pytest.fixture(scope="module")
def avx2_kernel():
    """The kernel as CPUs without AVX-512 (and so without AMX) build it: 8-lane vectors, bfloat16 on the float32
    tiles. This machine's build takes the 16-lane path; only this one runs the other."""
    if not fused.available():
        pytest.skip(fused.status())
    return fused.load_library(
        flags=fused._ISA_FLAGS["avx2"], namespace="attnlab_avx2"
    )  # beside the package's own


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "dims", [(128, 128, 1, 32), (128, 128, 8, 4), (64, 64, 2, 3), (576, 512, 1, 16), (40, 24, 1, 5)]
)
def test_the_kernel_built_without_avx512_equals_the_reference(avx2_kernel, monkeypatch, dims, dtype):
    """Every tile shape of the 8-lane build (queries in lanes for groups of 16 and 32, 4 x 2 tiles for groups of 4,
    triples, pairs and a single, staged rows of widths that are not a multiple of 16) against the reference,
    contiguous and paged (pages of 16 rows) alike."""
    dk, dv, heads, group = dims
    dt, latent = DTYPES[dtype], dv != dk
    assert fused._isa(avx2_kernel) == "avx2"  # 8 lanes, no AMX
    monkeypatch.setitem(fused._state, "ops", avx2_kernel)
    gen = torch.Generator().manual_seed(dk * group)
    lengths = [300, 77]
    keys = [torch.randn(1, heads, n, dk, generator=gen).to(dt) for n in lengths]
    vals = [r[..., :dv] if latent else torch.randn(r.shape, generator=gen).to(dt) for r in keys]
    q = torch.randn(len(lengths), heads * group, 1, dk, generator=gen).to(dt)
    cache = PagedKVCache(
        sum(-(-n // 16) for n in lengths), 16, heads, dk, batch_size=len(lengths), values_in_keys=latent,
        value_dim=dv if latent else None, dtype=dt,
    )  # fmt: skip
    for i in range(len(lengths)):
        cache.select([i]).update(keys[i], None if latent else vals[i])
    paged = attend(q, *cache.select([0, 1]).views(), scale=0.1, backend="fused")
    for i in range(len(lengths)):
        ref = attend(q[i : i + 1], keys[i], vals[i], scale=0.1, backend="reference")
        alone = fused.decode(q[i : i + 1], keys[i], vals[i], scale=0.1)
        torch.testing.assert_close(alone, ref, **TOL[dt])
        assert torch.equal(paged[i : i + 1], alone)


@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [4, 8, 16, 32])  # rows, eights (dot products), lanes or pairs, wide lanes
def test_a_nan_reaches_the_output_of_the_query_heads_it_touches_as_in_sdpa(
    build, dtype, group, request, monkeypatch
):
    """A NaN in a query makes that head's output NaN, one in a key or value row every head of its group's, and no
    other head's: what SDPA gives. Contexts of several chunks (merged by log-sum-exp) and of one short block. A query
    of NaN used to come out as zeros: every score NaN left its chunk's maximum at -inf, the mark of a chunk with
    nothing attended, which the merge skips (and on the pair path 2^x clamped NaN to 2^-126)."""
    if build == "avx2":  # (the fixture skips where the kernel cannot build)
        monkeypatch.setitem(fused._state, "ops", request.getfixturevalue("avx2_kernel"))
    elif not fused.available():
        pytest.skip(fused.status())
    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(group)
    for n in (700, 40):
        q = torch.randn(2, 2 * group, 1, 64, generator=gen).to(dt)
        k, v = (torch.randn(2, 2, n, 64, generator=gen).to(dt) for _ in range(2))
        for where in ("q", "k", "v"):
            qq, kk, vv = q.clone(), k.clone(), v.clone()
            {"q": qq[1, group + 1, 0], "k": kk[1, 1, n // 2], "v": vv[1, 1, n - 1]}[where][5] = float("nan")
            got = fused.decode(qq, kk, vv, scale=0.125)
            want = torch.nn.functional.scaled_dot_product_attention(
                qq.float(), kk.float(), vv.float(), scale=0.125, enable_gqa=True
            )
            nan = got.isnan().any(-1)
            assert torch.equal(nan, want.isnan().any(-1)), (n, where, nan.flatten().tolist())
            assert nan.sum() == (1 if where == "q" else group)
            torch.testing.assert_close(got[~nan].float(), want[~nan], **TOL[dt])


@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [4, 8, 16, 32])
def test_keys_scored_minus_inf_get_no_weight_as_in_sdpa(build, dtype, group, request, monkeypatch):
    """Keys whose scores are -inf (a -inf in a key column the query weighs positively) get weight 0: a whole block
    or chunk of them, the first 16 to 300 of a row, or all of its keys (then the output is zeros, as SDPA's). The
    first block of such keys made every head of the group NaN (its weights were 2^(-inf - -inf)), and so did the
    first chunk once the merge stopped skipping chunks by their maximum; on the pair path alpha was NaN too."""
    if build == "avx2":
        monkeypatch.setitem(fused._state, "ops", request.getfixturevalue("avx2_kernel"))
    elif not fused.available():
        pytest.skip(fused.status())
    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(group)
    for n, n_inf in ((700, 16), (700, 128), (700, 256), (700, 300), (40, 40)):
        q = torch.randn(2, 2 * group, 1, 64, generator=gen)
        q[..., 0] = q[..., 0].abs() + 0.1
        k, v = (torch.randn(2, 2, n, 64, generator=gen) for _ in range(2))
        k[:, :, :n_inf, 0] = float("-inf")
        got = fused.decode(q.to(dt), k.to(dt), v.to(dt), scale=0.125)
        want = torch.nn.functional.scaled_dot_product_attention(
            *(t.to(dt).double() for t in (q, k, v)), scale=0.125, enable_gqa=True
        )
        assert not got.isnan().any(), (n, n_inf)
        torch.testing.assert_close(got.double(), want, **TOL[dt])


def test_inputs_the_kernel_does_not_take_run_the_grouped_kernel():
    """A mask, a gradient or dropout: "fused" answers through the grouped kernel, so the result stays right."""
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    mask = torch.rand(2, 1, 1, 9) > 0.3
    want = attend(q, k, v, attn_mask=mask, backend="reference")
    torch.testing.assert_close(attend(q, k, v, attn_mask=mask, backend="fused"), want, rtol=1e-5, atol=1e-5)
    qg = q.clone().requires_grad_()
    attend(qg, k, v, backend="fused").sum().backward()
    assert qg.grad is not None and qg.grad.abs().sum() > 0


def test_status_says_the_kernel_is_off_before_its_first_use():
    """README: with ATTNLAB_FUSED=0 the PyTorch kernels run "and status() says why": also before any step asked
    for the kernel (it said "not built yet")."""
    code = "import attnlab.attention.fused as f; print(f.status()); print(f.available()); print(f.status())"
    env = {**os.environ, "ATTNLAB_FUSED": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    said = "disabled by ATTNLAB_FUSED=0: the PyTorch kernels run"
    assert out.stdout.splitlines() == [said, "False", said]


def test_the_fallback_is_used_and_reported_when_the_extension_cannot_build(monkeypatch, tmp_path, capsys):
    """No compiler (CXX pointing nowhere) and a fresh build directory: the build fails, one warning says so (and
    no build is announced: there is nothing to run), ``available()`` is False with the reason in ``status()``, and
    "fused" and "auto" give the reference's results through the PyTorch kernels."""
    for key, value in fused._state.items():  # restored after the test: the built kernel stays in use
        monkeypatch.setitem(fused._state, key, value)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    fused.reset()
    q, k, v = torch.randn(2, 6, 1, 16), torch.randn(2, 3, 40, 16), torch.randn(2, 3, 40, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = attend(q, k, v, backend="fused")
        auto = attend(q, k, v)
    built = [w for w in caught if "could not be built" in str(w.message)]
    # the caller's line, not attnlab's (backends.py was named)
    assert built != [] and built[0].filename == __file__
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert "building the decode kernel" not in capsys.readouterr().err
    assert fused.available() is False
    assert fused.status().startswith("build failed, the PyTorch kernels run")
    ref = attend(q, k, v, backend="reference")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(auto, ref, rtol=1e-5, atol=1e-5)
    # a model's decode steps (fused block steps when built) run module by module, with the same logits

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=50, n_layers=2, attention=AttentionConfig(32, 4, 2), ffn_dim=48, max_seq_len=16
    )
    model = Transformer(cfg).eval()
    tokens = torch.randint(0, 50, (1, 6))
    with torch.no_grad():
        caches = model.new_caches(1)
        model(tokens[:, :5], caches=caches)
        step = model(tokens[:, 5:], caches=caches)
        whole = model(tokens)[:, 5:]
    torch.testing.assert_close(step, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    not Path("/proc/cpuinfo").is_file(), reason="no /proc/cpuinfo to read the CPU's flags from"
)
def test_the_isa_is_the_cpus_and_named_in_the_status():
    if not fused.available():
        pytest.skip(fused.status())
    flags = fused.cpu_flags()
    want = {"avx512"} if "avx512f" in flags else {"avx2"} if "avx2" in flags else {"generic"}
    if "amx_tile" in flags and "avx512f" in flags:
        want.add("amx")  # when the OS grants the tiles
    assert fused.isa() in want
    assert ("AVX-512" if "avx512f" in flags else "AVX2") in fused.status()


def test_attnlab_isa_avx2_builds_the_avx2_kernels_and_a_misspelt_one_is_named(tmp_path):
    """In a child process (the operators of a process are one build's): the 8-lane kernels on any x86 CPU with
    AVX2, named in the status; an unknown value is a ValueError naming the variable, not a silent fallback."""
    if not fused.available():
        pytest.skip(fused.status())
    if "avx2" not in fused.cpu_flags():
        pytest.skip("this CPU has no AVX2")
    code = "from attnlab.attention import fused; print(fused.isa()); print(fused.status())"
    env = {**os.environ, "ATTNLAB_ISA": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    isa, status = out.stdout.splitlines()
    assert isa == "avx2" and "AVX2" in status and "AMX" not in status
    env["ATTNLAB_ISA"] = "avx9"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0
    assert "ValueError: ATTNLAB_ISA='avx9': expected one of native, avx2" in out.stderr


@pytest.mark.parametrize("name", ["ATTNLAB_FUSED", "ATTNLAB_AMX", "ATTNLAB_BACKENDS"])
def test_an_on_off_variable_takes_1_or_0_and_names_anything_else(name, monkeypatch):
    # "false", "off" or " 0" left the kernels and the bf16 path on without a word; ATTNLAB_BACKENDS=false logged
    from attnlab.config import env_switch

    built = fused.available()  # before the variable is set below
    for value, default, want in (
        ("", True, True),
        (" 0 ", True, False),
        ("1", False, True),
        (None, False, False),
    ):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        assert env_switch(name, default) is want
    for bad in ("false", "off", "no", "2"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name}='{bad}': expected 1 \\(on\\) or 0 \\(off\\)"):
            env_switch(name, True)
    code = "import torch; from attnlab import attend; q = torch.randn(1, 2, 1, 8); attend(q, q, q)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, name: "off"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if name == "ATTNLAB_AMX" and not built:
        return  # read only once the kernels are built
    assert out.returncode != 0 and f"ValueError: {name}='off': expected 1 (on) or 0 (off)" in out.stderr


def test_the_status_says_which_bfloat16_engine_runs_now():
    # inside use_amx(False) it still named the AMX tiles or the AVX512-BF16 dot products
    if not fused.available() or "bfloat16 on" not in fused.status():
        pytest.skip(f"no bfloat16 pair path here: {fused.status()}")
    with fused.use_amx(False):
        assert "bfloat16 on" not in fused.status() and not fused.bf16_dots() and not fused.amx()
    assert "bfloat16 on" in fused.status()
