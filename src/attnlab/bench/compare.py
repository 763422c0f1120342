"""``attnlab compare``: the cost model's comparison as a rich table, a one-line verdict, JSON, a plot, and one layer
of each variant timed on this machine (``--measure``).

The figures come from ``attnlab.cost`` (pure functions of the configs); printing, plotting and timing live here.
The CLI function in ``attnlab.cli`` only forwards its options to ``run_compare``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from ..atomic import check_figure_path, check_inputs, json_text, save_figure
from ..config import ModelConfig, check_int
from ..console import Grid, print_grid
from ..cost import (
    Comparison,
    compare,
    compute_peak,
    dtype_name,
    kv_cache_bytes,
    load_model,
    preset_names,
    variants,
)
from ..cost.hardware import HARDWARE_NAMES, get_hardware
from ..cost.memory import DTYPE_BITS
from ..cost.parallel import check_tp, rank_config
from ..cost.sweep import format_bytes, format_seconds
from .layer import LayerTiming, check_fits, measure_variants
from .machine import MEASURED_DTYPES, measure_local


def _si(n: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}"


def compare_table(c: Comparison) -> Grid:
    tp = c.tp > 1
    title = (
        f"{c.model}: batch {c.batch} x {c.seq_len} tokens, {c.dtype}, {c.hardware}"
        + (f", tp {c.tp} (per rank: weights {format_bytes(c.weight_bytes)} of {format_bytes(c.memory_bytes)})" if tp else
           f" (weights {format_bytes(c.weight_bytes)} of {format_bytes(c.memory_bytes)})")
    )  # fmt: skip
    header = "variant|KV heads|attn params|KV bytes/token|KV cache|prefill FLOPs|decode step|bound|max batch"
    if tp:
        header = (
            "variant|KV heads|per rank|KV bytes/token|per rank|KV cache/rank|prefill FLOPs/rank|decode step|bound|"
            "max batch"
        )
    caption = (
        "* native. attn params: all layers. prefill FLOPs: whole model, causal. decode step: roofline of one "
        "token per sequence at this context. MLA KV heads: one latent, (x) = equivalent GQA groups."
    )
    if tp:
        caption = (
            f"* native. One of {c.tp} ranks: per rank 'n xr' = n KV heads cached on each rank, each on r ranks "
            f"(MLA: the whole latent on every rank). decode step: roofline of one rank plus its all-reduces at "
            f"{_si(c.link_bandwidth or 0, 'B/s')} per direction."
            + (f" Not splittable over tp={c.tp}: {', '.join(c.skipped)}." if c.skipped else "")
        )
    if c.sliding_layers:  # what the KV cache column counts, which KV bytes/token x tokens would not give
        held = min(c.window or 0, c.seq_len)
        caption += (
            f" Sliding window: {c.sliding_layers} of {c.n_layers} layers attend to the last {c.window} tokens and "
            f"cache {held:,} of the {c.seq_len:,} (KV cache counts that; KV bytes/token is every layer's; MLA: no "
            "window, as DeepSeek-V3)."
        )
    grid = Grid(title, header.split("|"), right=tuple(range(1, header.count("|") + 1)), caption=caption)
    for r in c.rows:
        heads = str(r.n_kv_heads) if r.variant != "mla" else f"latent ({r.equivalent_gqa_groups:g})"
        cells = [r.label + (" *" if r.native else ""), heads]
        if tp:
            cells += [f"{r.kv_heads_per_rank} x{r.kv_replicas}", f"{r.kv_cache_bytes_per_token:,}",
                      f"{r.kv_cache_bytes_per_token_per_rank:,}", format_bytes(r.kv_cache_bytes_per_rank)]  # fmt: skip
        else:
            cells += [
                _si(r.attention_params, "").strip(),
                f"{r.kv_cache_bytes_per_token:,}",
                format_bytes(r.kv_cache_bytes),
            ]
        cells += [
            _si(r.prefill_flops, "FLOP"),
            format_seconds(r.decode_step_seconds),
            r.decode_bound,
            str(r.max_batch),
        ]
        grid.add_row(*cells)
    return grid


def measure_table(timings: list[LayerTiming], hw_source: str) -> Grid:
    grid = Grid(
        f"one attention layer, one decode step, on this machine ({hw_source})",
        ["variant", "layer timed", "tokens", "FLOPs", "bytes", "predicted (local)", "measured",
         "measured / predicted"],
        right=(2, 3, 4, 5, 6, 7),
    )  # fmt: skip
    for t in timings:
        grid.add_row(t.label, t.layer, f"{t.tokens:,}", _si(t.flops, ""), format_bytes(t.bytes),
                     format_seconds(t.predicted_seconds), format_seconds(t.measured_seconds), f"{t.ratio:.2f}")  # fmt: skip
    return grid


# Sizes past these are typing errors, not models (and overflow a float in the roofline).
MAX_SIZE = 2**40


def run_compare(
    *,
    model: str,
    seq_len: int,
    batch: int,
    dtype: str,
    hardware: str,
    tp: int = 1,
    devices: int | None = None,
    plot: Path | None = None,
    as_json: bool = False,
    measure: bool = False,
) -> None:
    """Everything ``attnlab compare`` does; errors are ValueError/TypeError/FileNotFoundError.

    ``--devices`` is ``--tp`` under the name it had when it split everything evenly over the devices; it now means
    the same honest per-rank model (data-parallel replicas would not change any per-device figure here).
    """
    if devices is not None:
        if tp != 1 and tp != devices:
            raise ValueError(
                f"--devices {devices} and --tp {tp} disagree: --devices is another name for --tp"
            )
        tp = devices
    tp_name = "--tp" if devices is None else "--devices"  # in the errors: the option the user gave
    for name, value in (("--seq-len", seq_len), ("--batch", batch), (tp_name, tp)):
        check_int(name, value)
        if value > MAX_SIZE:
            raise ValueError(f"{name} must be <= 2**40 = {MAX_SIZE:,}, got {value}")
    if hardware not in HARDWARE_NAMES:
        raise ValueError(f"--hardware {hardware!r} is not known; known: {', '.join(HARDWARE_NAMES)}")
    try:
        dtype_name(dtype)
    except (ValueError, TypeError):
        raise ValueError(f"--dtype {dtype!r} is not known; use one of {', '.join(DTYPE_BITS)}") from None
    if tp > 1 and (hardware == "local" or measure):
        raise ValueError(
            f"{tp_name} models GPUs and their interconnect; --hardware local and --measure are one process on this "
            "machine"
        )
    # a checkpoint (or config.json) is an input: never written
    read = [Path(model)] if Path(model).exists() else []
    if plot is not None:
        check_inputs(check_figure_path(plot).absolute(), read, str(plot), "--plot")
    model_cfg = load_model(model)
    # the native variant must split (compare checks it too, without flags)
    check_tp(model_cfg, tp, flag=tp_name)
    # a dtype the device has no rate for, refused before any measuring (this machine: MEASURED_DTYPES)
    if measure and dtype_name(dtype) not in MEASURED_DTYPES:
        raise ValueError(f"--measure runs in {', '.join(MEASURED_DTYPES)}; got --dtype {dtype!r}")
    if hardware == "local" and dtype_name(dtype) == "fp64":
        raise ValueError(
            "--hardware local has no float64 peak FLOP/s (this machine is measured in "
            f"{', '.join(MEASURED_DTYPES)}); choose h100, h200 or a100-80gb, or another --dtype"
        )
    if hardware != "local" and not measure:
        compute_peak(get_hardware(hardware), dtype)
    out = Console(highlight=False)  # (its number highlighter bolded digits inside prose, splitting tokens)
    err = Console(stderr=True)
    local = None  # this machine, measured once per run: the compare table and the timings share it
    if measure:
        check_fits(variants(model_cfg), batch, seq_len, dtype_name(dtype))
    if hardware == "local" or measure:
        if err.is_terminal and not as_json:  # a person waiting; scripts get stderr for errors only
            err.print("measuring this machine ...")
        local = measure_local(fresh=measure)
    comparison = compare(
        model_cfg,
        batch=batch,
        seq_len=seq_len,
        dtype=dtype,
        hardware=local if hardware == "local" else get_hardware(hardware),
        tp=tp,
    )
    # after every check: a refused run gets one line
    for note in _notes(model, model_cfg, seq_len, dtype, tp, tp_name):
        err.print(f"note: {note}", highlight=False, soft_wrap=True)
    if plot is not None:
        plot_comparison(comparison, model_cfg, plot, sources=read)
    timings: list[LayerTiming] = []
    hw_source = ""
    if measure:
        chosen = variants(model_cfg)
        with Progress(
            TextColumn("timing one layer: {task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(), console=err, transient=True, disable=not err.is_terminal,  # a pipe got a blank line
        ) as bar:  # fmt: skip
            task = bar.add_task("measuring this machine", total=len(chosen))

            def step(label: str) -> None:
                bar.update(task, description=label, completed=[v.label for v in chosen].index(label))

            hw, timings = measure_variants(
                chosen, batch=batch, seq_len=seq_len, dtype=comparison.dtype, progress=step, hw=local
            )
            bar.update(task, completed=len(chosen))
        peak = compute_peak(hw, comparison.dtype)  # the rate the prediction used (the cost model's one rule)
        hw_source = f"bandwidth {_si(hw.bandwidth, 'B/s')}, {comparison.dtype} compute {_si(peak, 'FLOP/s')}"
    if as_json:
        doc = {**comparison.to_json(), "verdict": comparison.verdict()}
        if plot is not None:
            doc["plot"] = str(plot)
        if measure:
            doc["measured"] = [
                {"variant": t.label, "layer": t.layer, "tokens": t.tokens, "flops": t.flops, "bytes": t.bytes,
                 "predicted_seconds": t.predicted_seconds, "measured_seconds": t.measured_seconds, "ratio": t.ratio}
                for t in timings
            ]  # fmt: skip
            doc["local_hardware"] = hw_source
        # the rates local figures were read against, as numbers (they move from run to run)
        if local is not None:
            measured = hw if measure else local
            doc["local_rates"] = {
                "bandwidth_bytes_per_s": measured.bandwidth,
                "peak_flops_per_s": dict(measured.peak_flops),
                "measured": measured.source,
            }
        print(json_text(doc, indent=1), end="")
        return
    print_grid(compare_table(comparison), out)
    out.print(comparison.verdict())
    if plot is not None:
        out.print(f"plot written to {plot}")
    if measure:
        print_grid(measure_table(timings, hw_source), out)


def plot_comparison(
    comparison: Comparison, model_cfg: ModelConfig, path: str | Path, *, sources: Iterable[Path] = ()
) -> Path:
    """Two panels: KV cache vs context length per variant; decode latency vs KV heads (the shape of Fig. 6 of
    the GQA paper, Ainslie et al., arXiv 2305.13245). Written atomically as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = check_figure_path(path)
    fig, (ax_kv, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=100)
    contexts = [2**k for k in range(9, 18)]
    for v in variants(model_cfg):
        if v.label in comparison.skipped:
            continue
        local = rank_config(v.model, comparison.tp)  # what one rank caches
        sizes = [kv_cache_bytes(local, comparison.batch, s, comparison.dtype) / 2**30 for s in contexts]
        ax_kv.plot(
            contexts,
            sizes,
            marker="o",
            ms=3,
            lw=2.5 if v.native else 1.2,
            label=v.label + (" (native)" if v.native else ""),
        )
    free = (comparison.memory_bytes - comparison.weight_bytes) / 2**30
    if free > 0:
        ax_kv.axhline(free, color="gray", ls="--", lw=1, label=f"{comparison.hardware} memory after weights")
    ax_kv.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="KV cache (GiB)")
    per_rank = f", per rank of tp={comparison.tp}" if comparison.tp > 1 else ""
    ax_kv.set_title(f"KV cache, batch {comparison.batch}, {comparison.dtype}{per_rank}")
    ax_kv.legend(fontsize=7)
    gqa = [r for r in comparison.rows if r.variant != "mla"]
    ax_lat.plot(
        [r.n_kv_heads for r in gqa],
        [r.decode_step_seconds * 1e3 for r in gqa],
        marker="o",
        label="MHA / GQA / MQA",
    )
    for r in comparison.rows:
        if r.native:
            ax_lat.plot([r.equivalent_gqa_groups], [r.decode_step_seconds * 1e3], "k*", ms=12, label="native")
    mla = [r for r in comparison.rows if r.variant == "mla"]
    ax_lat.plot([r.equivalent_gqa_groups for r in mla], [r.decode_step_seconds * 1e3 for r in mla], "s", color="C3",
                label="MLA (at its equivalent GQA groups)")  # fmt: skip
    ax_lat.set(xscale="log", xlabel="KV heads", ylabel="decode step (ms)")
    ax_lat.set_xscale("log", base=2)
    on = comparison.hardware + (f" x{comparison.tp} (tensor parallel)" if comparison.tp > 1 else "")
    ax_lat.set_title(f"decode at {comparison.seq_len} tokens on {on}")
    ax_lat.legend(fontsize=8)
    fig.suptitle(f"{comparison.model}: attention variants")
    fig.tight_layout()
    return save_figure(fig, path, sources=sources)


def _notes(model: str, cfg, seq_len: int, dtype: str, tp: int = 1, tp_name: str = "--tp") -> list[str]:
    """What the table's figures assume that the checkpoint does not say, printed on stderr (never silently): weights
    of a quantized config.json counted at ``dtype``; a context beyond the model's positions; a tensor-parallel split
    of q/k norms, which ``apply_tp`` does not make."""
    from ..hf_config import quantization, read_raw

    notes = []
    method = None if model in preset_names() else quantization(read_raw(model)[0])
    if method is not None:
        notes.append(
            f"{model} is quantized ({method}); its weights are counted at --dtype {dtype}, not as stored"
        )
    if seq_len > cfg.max_seq_len:
        notes.append(f"--seq-len {seq_len} is beyond the model's {cfg.max_seq_len} positions "
                     "(max_position_embeddings); the figures are what such a context would cost")  # fmt: skip
    norms = {a.qk_norm for a in cfg.layer_attentions if getattr(a, "qk_norm", "none") != "none"}
    if tp > 1 and norms:
        extra = (
            "; a norm over all heads needs their statistics from every rank, collectives not counted here"
            if "full" in norms
            else ""
        )
        notes.append(
            f"{tp_name} {tp} prices q/k norms split with their heads, which attnlab.parallel.apply_tp does not do yet "
            f"(qk_norm={sorted(norms)[0]!r}){extra}"
        )
    return notes
