"""The decode benchmark harness: its baselines compute what ours computes, and its outputs are complete."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from attnlab.bench import DecodeGrid, decode, interleaved, run_decode
from attnlab.bench.report import performance_page, plot, print_tables, table_rows
from attnlab.cli import app
from attnlab.config import AttentionConfig, MLAConfig
from attnlab.cost import attention_flops

TINY_MLA = MLAConfig(
    d_model=64, n_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16
)


@pytest.fixture(scope="module")
def tiny_result():
    grid = DecodeGrid(
        kv_heads=(4, 2, 1), contexts=(33,), dtypes=("fp32",), n_heads=4, head_dim=16, repeats=2,
        block_size=8, mla_cfg=TINY_MLA,
    )  # fmt: skip
    return run_decode(grid)


def test_interleaved_times_every_contender_round_robin():
    calls = []
    times = interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=1)
    assert calls == ["a", "b"] * 4 and set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    with pytest.raises(ValueError, match="repeats"):
        interleaved({"a": lambda: None}, repeats=0)


def test_attention_rows_cycle_through_caches_that_fill_twice_the_last_level_cache():
    llc = decode._llc_bytes()
    # one cache larger than the LLC: still two, so that no call finds its KV left in cache by the last one
    assert decode.ring_size(2 * llc) == 2
    assert decode.ring_size(llc // 4) == 8
    assert decode.ring_size(1) == decode.RING_MAX


def test_every_contender_agrees_with_its_baseline(tiny_result):
    kinds = {r["kind"] for r in tiny_result["rows"]}
    assert kinds == {"attention", "layer", "mla", "paged"}
    for row in tiny_result["rows"]:
        # ours vs reference / HF LlamaAttention / naive MLA and HF DeepseekV3Attention / contiguous cache
        assert row["max_abs_err"] < 1e-4, row
        assert row["roofline_ms"] > 0 and row["roofline_fraction"] > 0
        assert all(v > 0 for v in row["ms"].values())
    layer = [r for r in tiny_result["rows"] if r["kind"] == "layer"]
    assert [r["n_kv_heads"] for r in layer] == [4, 2, 1]
    for r in layer:  # the step appends its token and attends over context + 1 (counted over context)
        cfg = AttentionConfig(
            d_model=r["n_heads"] * r["head_dim"], n_heads=r["n_heads"], n_kv_heads=r["n_kv_heads"]
        )
        assert r["flops"] == attention_flops(cfg, r["batch"], 1, r["context"] + 1).total
    mla = next(r for r in tiny_result["rows"] if r["kind"] == "mla")
    assert set(mla["ms"]) == {"absorbed", "naive", "hf_deepseek_v3"}
    # no K/V heads: its head_dim was a plausible-looking 0; the latent row's width instead
    assert mla["head_dim"] is None and mla["latent_dim"] == TINY_MLA.kv_lora_rank + TINY_MLA.qk_rope_head_dim
    hw = tiny_result["machine"]["hardware"]
    assert hw["bandwidth"] > 0 and hw["peak_flops"]["fp32"] > 0
    json.dumps(tiny_result)  # JSON-ready


def test_a_fresh_result_is_what_rescoring_its_saved_rows_gives(tiny_result):
    """``decode.py --from-json`` rescores saved rows (rounded milliseconds); a run's own rows must already be that
    fixed point, or the page it wrote would not regenerate from its JSON."""
    from attnlab.bench.decode import rescore
    from attnlab.cost import Hardware

    rows = json.loads(json.dumps(tiny_result["rows"]))
    rescore(rows, Hardware(**tiny_result["machine"]["hardware"]))
    assert rows == tiny_result["rows"]


def test_page_and_plot(tiny_result, tmp_path):
    png = plot(tiny_result, tmp_path / "decode.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = performance_page(tiny_result, plot_path="decode.png", command="cmd", notes="## Notes\nclosing")
    assert "| fp32 | 1 | 33 | 2 |" in page and "GB/s" in page and page.rstrip().endswith("closing")


def test_cli_bench_decode_json_and_errors():
    runner = CliRunner()
    res = runner.invoke(
        app,
        ["bench", "decode", "--kv-heads", "8", "--context", "40", "--repeats", "1", "--no-layer", "--no-mla",
         "--no-paged", "--json"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [r["kind"] for r in data["rows"]] == ["attention"] and data["rows"][0]["n_kv_heads"] == 8
    bad = runner.invoke(app, ["bench", "decode", "--kv-heads", "3", "--json"])
    assert bad.exit_code == 2 and "--kv-heads 3 does not divide the 32 query heads" in bad.output  # a flag
    for (
        args,
        message,
    ) in (  # an empty item was dropped, and an empty --dtype said "max() arg is an empty sequence"
        (["--dtype", ""], "--dtype '' is empty"),  # (the command line's own check, before the list's)
        (["--dtype", "fp32,"], "--dtype must be a comma list without empty items, got 'fp32,'"),
        (["--kv-heads", "8,,1"], "--kv-heads must be a comma list of integers, got '8,,1'"),
    ):
        bad = runner.invoke(app, ["bench", "decode", *args, "--json"])
        lines = bad.stderr.strip().splitlines()
        assert bad.exit_code == 2 and len(lines) == 1 and lines[0].startswith(f"attnlab: error: {message}"), (
            bad.output
        )


def test_roofline_of_a_bfloat16_step_takes_the_faster_compute_rate(tiny_result):
    """bfloat16 products may be widened and run at the float32 rate (the fused kernel does), so a bf16 step's
    roofline is the faster of the two peaks (the cost model's rule, ``cost.compute_peak``); rescore recomputes
    stored rows with that rule, from their bytes, FLOPs and the timed column of their kind."""
    from attnlab.bench.decode import OURS, rescore
    from attnlab.cost import Hardware, step_seconds

    hw = Hardware("toy", {"fp32": 100e9, "bf16": 1e9}, bandwidth=10e9, memory_bytes=2**30, source="test")
    assert step_seconds(hw, 1e9, 1e6, "bf16") == step_seconds(hw, 1e9, 1e6, "fp32") == 1e9 / 100e9
    assert step_seconds(hw, 1e6, 1e9, "bf16") == 1e9 / 10e9  # memory-bound either way
    fast_bf16 = Hardware(
        "toy", {"fp32": 1e9, "bf16": 100e9}, bandwidth=10e9, memory_bytes=2**30, source="test"
    )
    assert step_seconds(fast_bf16, 1e9, 1e6, "bf16") == 1e9 / 100e9
    rows = [dict(r, dtype="bf16") for r in tiny_result["rows"]]
    rescore(rows, hw)
    for row in rows:
        want = max(row["flops"] / 100e9, row["bytes"] / 10e9)
        assert row["roofline_ms"] == pytest.approx(want * 1e3, rel=1e-3)
        assert row["roofline_fraction"] == pytest.approx(want * 1e3 / row["ms"][OURS[row["kind"]]], rel=1e-3)


def test_a_stream_read_in_the_rounds_gives_each_row_its_own_bandwidth():
    """With "stream" among the baselines, each attention row times a streaming read of the ring's bytes and library
    matmuls in the same rounds as the kernel, and its roofline takes that bandwidth and those peaks (not the run's):
    what a shared machine gave while the row ran. They are no contenders of the row's times."""
    from attnlab.cost import Hardware, step_seconds

    grid = DecodeGrid(
        kv_heads=(2,), contexts=(64,), dtypes=("fp32",), n_heads=4, head_dim=16, repeats=2, layer=False,
        mla=False, paged=False, attention_baselines=("sdpa", "stream"),
    )  # fmt: skip
    result = run_decode(grid)
    (row,) = result["rows"]
    # in bytes per second (a GB/s figure would read ~30); a loaded 2-core machine measured 88 MB/s here once
    assert row["bandwidth"] > 1e6 and set(row["ms"]) == {"fused", "sdpa"}
    hw = Hardware(**result["machine"]["hardware"])
    assert set(row["peak_flops"]) == {"fp32", "bf16"} and min(row["peak_flops"].values()) > 1e8
    own = Hardware(
        **{
            **result["machine"]["hardware"],
            "bandwidth": row["bandwidth"],
            "peak_flops": {**hw.peak_flops, **row["peak_flops"]},
        }
    )
    assert row["roofline_ms"] == pytest.approx(
        step_seconds(own, row["flops"], row["bytes"], "fp32") * 1e3, rel=1e-3
    )
    if hw.bandwidth != row["bandwidth"]:
        assert row["roofline_ms"] != pytest.approx(step_seconds(hw, row["flops"], row["bytes"], "fp32") * 1e3)


def test_a_baseline_that_computes_something_else_stops_the_row(monkeypatch):
    # max_abs_err was only stored: HF's layer given a one-token cache timed as a baseline, 5.9 off, exit 0
    import warnings

    from attnlab.bench import baselines
    from attnlab.cost.hardware import Hardware

    hw = Hardware("toy", {"fp32": 100e9, "bf16": 100e9}, bandwidth=10e9, memory_bytes=2**30, source="test")
    grid = DecodeGrid(kv_heads=(2,), contexts=(33,), dtypes=("fp32",), n_heads=4, head_dim=16, repeats=1)
    with warnings.catch_warnings():
        # the cache went by past_key_values, which transformers 5 warns it will drop (and then pass to **kwargs)
        warnings.simplefilter("error", FutureWarning)
        row = decode.layer_row(grid, hw, "fp32", 1, 33, 2)
    assert row["max_abs_err"] < 1e-4
    real = baselines.llama_attention
    monkeypatch.setattr(baselines, "llama_attention", lambda attn, k, v: real(attn, k[:, :, :1], v[:, :, :1]))
    with pytest.raises(RuntimeError, match=r"layer row \(dtype fp32, .*differ by .* different computations"):
        decode.layer_row(grid, hw, "fp32", 1, 33, 2)


@pytest.mark.parametrize(
    ("dtype", "wrong"),
    [
        # outputs of ~0.02 at 4096 tokens: zeros were within bfloat16's absolute 0.1
        ("bf16", {"fused": "zeros"}),
        ("fp32", {"fused": "drop a key"}),  # 1e-3 absolute let one key of 16384 go
        ("fp32", {"grouped": "plus 7"}),  # a baseline's output was timed and never compared
        ("bf16", {"sdpa": "zeros"}),
    ],
)
def test_every_timed_output_is_held_to_the_reference_relative_to_its_size(monkeypatch, dtype, wrong):
    from attnlab.cost.hardware import Hardware

    hw = Hardware("toy", {"fp32": 100e9, "bf16": 100e9}, bandwidth=10e9, memory_bytes=2**30, source="test")
    grid = DecodeGrid(
        kv_heads=(2,), contexts=(4096,), dtypes=(dtype,), n_heads=4, head_dim=16, repeats=1,
        attention_baselines=("grouped", "sdpa", "reference"),
    )  # fmt: skip
    row = decode.attention_row(grid, hw, dtype, 1, 4096, 2)  # the real kernels agree
    assert row["max_abs_err"] < {"fp32": 1e-6, "bf16": 1e-3}[dtype]
    [(name, how)] = wrong.items()

    def spoil(out, k, v, q, scale):
        if how == "zeros":
            return torch.zeros_like(out)
        if how == "plus 7":
            return out + 7
        return real_attend(q, k[:, :, 1:], v[:, :, 1:], scale=scale, backend="reference")

    real_attend, real_sdpa = decode.attend, decode.F.scaled_dot_product_attention

    def attend(q, k, v, *, scale, backend):
        out = real_attend(q, k, v, scale=scale, backend=backend)
        return spoil(out, k, v, q, scale) if backend == name else out

    def sdpa(q, k, v, *, scale, enable_gqa):
        return spoil(real_sdpa(q, k, v, scale=scale, enable_gqa=enable_gqa), k, v, q, scale)

    monkeypatch.setattr(decode, "attend", attend)
    if name == "sdpa":
        monkeypatch.setattr(decode.F, "scaled_dot_product_attention", sdpa)
    with pytest.raises(
        RuntimeError, match=r"attention row .* of the reference's largest value .* different comp"
    ):
        decode.attention_row(grid, hw, dtype, 1, 4096, 2)


def test_a_grid_that_cannot_run_is_refused_before_any_row():
    # dtypes=() ran nothing; mla_cfg=None and kv_norm=False failed at the MLA rows, after the others had run
    with pytest.raises(ValueError, match="--dtype must list one or more"):
        DecodeGrid(dtypes=())
    with pytest.raises(TypeError, match="mla_cfg must be an MLAConfig, got None"):
        DecodeGrid(mla_cfg=None)
    with pytest.raises(ValueError, match="kv_norm=True"):
        DecodeGrid(mla_cfg=TINY_MLA.replace(kv_norm=False))
    assert DecodeGrid(mla=False, mla_cfg=TINY_MLA.replace(kv_norm=False)).mla is False
    # a bare value was iterated ("bf16" as the dtypes 'b', 'f', ...) or failed inside; a repeated one ran twice
    with pytest.raises(TypeError, match="--kv-heads must be a tuple or list, got 8"):
        DecodeGrid(kv_heads=8)
    with pytest.raises(TypeError, match="--dtype must be a tuple or list, got 'bf16'"):
        DecodeGrid(dtypes="bf16")
    with pytest.raises(ValueError, match="--kv-heads lists 8 more than once"):
        DecodeGrid(kv_heads=(8, 4, 8))
    result = CliRunner().invoke(app, ["bench", "decode", "--dtype", "fp32,fp32", "--context", "8", "--json"])
    assert result.exit_code == 2 and "--dtype lists fp32 more than once" in result.stderr


def test_a_grid_of_fewer_baselines_is_shown_and_plotted_with_what_it_timed(tmp_path, capsys):
    grid = DecodeGrid(kv_heads=(4, 1), contexts=(32,), n_heads=4, head_dim=16, repeats=1, layer=False,
                      mla=False, paged=False, attention_baselines=("sdpa",), fresh_hardware=False)  # fmt: skip
    result = run_decode(grid)
    header, cells = table_rows(result, "attention")
    assert header[4:6] == ["fused", "sdpa"] and "grouped" not in header and len(cells) == 2
    print_tables(result)  # KeyError 'grouped' after printing part of the output
    assert "sdpa" in capsys.readouterr().out
    assert plot(result, tmp_path / "p.png").is_file()  # KeyError 'reference'


def test_compare_measure_times_each_layer_over_a_ring_of_distinct_layers(monkeypatch):
    """A layer whose weights and cache fit in the last-level cache, timed again and again alone, read nothing from
    memory: `compare --measure` printed measured / predicted below 1 for small layers (0.91 for Llama 3.2 1B's
    GQA-2 at 512 tokens). Each step is now timed over as many distinct layers and caches as fill twice that cache."""
    from attnlab.bench import layer
    from attnlab.bench.decode import ring_size
    from attnlab.cost import get_hardware, get_preset, variants

    made = []
    real = layer._filled_layer
    monkeypatch.setattr(layer, "_filled_layer", lambda *a: made.append(real(*a)) or made[-1])
    chosen = variants(get_preset("gpt2"))[:1]
    _, timings = layer.measure_variants(
        chosen, seq_len=16, dtype="fp32", min_seconds=0.0, hw=get_hardware("h100")
    )
    cfg, tokens = layer.timed_layer(chosen[0], 16)
    one = layer._layer_bytes(cfg, 1, tokens, "fp32")
    assert timings[0].bytes == one and len(made) == ring_size(one) >= 2
    assert len({id(cache) for _, cache in made}) == len(made)  # distinct caches, each read in its turn
    assert all(
        len(cache) == tokens for _, cache in made
    )  # each took the timed step (cropped back before each)


def test_bench_decode_says_where_its_plot_went(tmp_path):
    # compare says "plot written to ..."; bench decode wrote its PNG without a word (with --json the path is a key)
    res = CliRunner().invoke(
        app,
        ["bench", "decode", "--kv-heads", "8", "--context", "40", "--repeats", "1", "--no-layer", "--no-mla",
         "--no-paged", "--plot", str(tmp_path / "d.png")],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert (
        res.stdout.rstrip().endswith(f"plot written to {tmp_path / 'd.png'}")
        and (tmp_path / "d.png").is_file()
    )
