"""Presenting decode-benchmark results: rich tables, the latency-vs-n_kv_heads plot, docs/performance.md.

Everything here reads the JSON-ready dict that ``run_decode`` returns, so the page can be regenerated from a
saved result file without rerunning anything.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

from ..atomic import save_figure

COLUMNS = {
    "attention": ("fused", "grouped", "sdpa", "reference", "fused_4x_buffer"),
    "layer": ("ours", "hf_llama_sdpa"),
    "mla": ("absorbed", "naive", "hf_deepseek_v3"),
    "paged": ("paged", "contiguous", "paged_scattered"),
}
TITLES = {
    "attention": "Attention alone, one decode step (ms)",
    "layer": "Whole attention layer, one decode step (ms)",
    "mla": "MLA layer, one decode step (ms)",
    "paged": "Paged vs contiguous cache, attention alone (ms)",
    "e2e": "End to end: decode tokens/s of a 4-layer model",
}


def table_rows(result: dict[str, Any], kind: str) -> tuple[list[str], list[list[str]]]:
    """Header and string cells of the ``kind`` rows, for both the terminal and the markdown page."""
    rows = [r for r in result["rows"] if r["kind"] == kind]
    if kind == "e2e":
        header = [
            "dtype",
            "variant",
            "context",
            "KV bytes/token",
            "tok/s batch 1",
            "tok/s batch 4",
            "batch-4 cache",
        ]
        cells = [
            [
                r["dtype"],
                r["variant"],
                str(r["context"]),
                str(r["kv_bytes_per_token"]),
                f"{r['tokens_per_s_batch1']:.1f}",
                f"{r['tokens_per_s_batch4']:.1f}",
                r["batch4_cache"],
            ]
            for r in rows
        ]
        return header, cells
    # the contenders these rows timed (a grid of fewer attention_baselines times fewer), in the columns' order
    names = tuple(n for n in COLUMNS[kind] if any(n in r["ms"] for r in rows))
    header = ["dtype", "B", "context", "kv heads", *names, "roofline", "of roofline", "GB/s", "speedups"]
    cells = []
    for r in rows:
        speed = ", ".join(f"{k} {v:.2f}x" for k, v in r["speedup"].items())
        cells.append(
            [
                r["dtype"],
                str(r["batch"]),
                str(r["context"]),
                str(r["n_kv_heads"]) if kind != "mla" else "latent",
                *(f"{r['ms'][n]:.3f}" if n in r["ms"] else "-" for n in names),
                f"{r['roofline_ms']:.3f}",
                f"{r['roofline_fraction']:.2f}",
                f"{r['achieved_gbps']:.1f}",
                speed,
            ]
        )
    return header, cells


def print_tables(result: dict[str, Any]) -> None:
    from rich.console import Console

    from ..console import Grid, print_grid

    console = Console(highlight=False)
    hw = result["machine"]["hardware"]
    console.print(f"decode path: {result['machine'].get('decode_path', 'unknown')}")
    console.print(
        f"machine: {hw['name']}: read bandwidth {hw['bandwidth'] / 1e9:.1f} GB/s, matmul peak "
        + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in hw["peak_flops"].items())
    )
    for kind in TITLES:
        header, cells = table_rows(result, kind)
        if cells:
            print_grid(Grid(TITLES[kind], header, cells, right=tuple(range(1, len(header)))), console)


def plot(result: dict[str, Any], path: str | os.PathLike, *, ours: bool = False) -> Path:
    """Latency vs n_kv_heads per dtype (the shape of the GQA paper's Fig. 6), with the roofline drawn in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["kind"] == "attention"]
    if not rows:
        raise ValueError("the result has no attention rows to plot")
    dtypes = sorted({r["dtype"] for r in rows})
    shapes = sorted({(r["batch"], r["context"]) for r in rows})
    fig, axes = plt.subplots(
        len(dtypes), len(shapes), figsize=(4.5 * len(shapes), 3.8 * len(dtypes)), squeeze=False
    )
    for (i, dtype), (j, (b, context)) in itertools.product(enumerate(dtypes), enumerate(shapes)):
        ax = axes[i][j]
        sel = sorted(
            (r for r in rows if (r["dtype"], r["batch"], r["context"]) == (dtype, b, context)),
            key=lambda r: r["n_kv_heads"],
        )
        if not sel:
            ax.set_visible(False)
            continue
        x = [r["n_kv_heads"] for r in sel]
        for name, style in (("reference", "s:"), ("sdpa", "^--"), ("grouped", "v-."), ("fused", "o-")):
            if all(name in r["ms"] for r in sel):  # what the grid timed (attention_baselines)
                ax.plot(x, [r["ms"][name] for r in sel], style, label=name)
        ax.plot(x, [r["roofline_ms"] for r in sel], "k-", lw=2, alpha=0.5, label="roofline")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="n_kv_heads (of 32 query heads)",
            ylabel="ms per decode step",
            title=f"{dtype}, batch {b}, context {context}",
        )
        ax.set_xticks(x, [str(n) for n in x])
        ax.set_xticks([], minor=True)  # the log axis's own minor labels (2x10^0, 3x10^0) beside these
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path, ours=ours, dpi=110)


# Issue 4's grid: n_kv_heads 32..1 (6) x batch 1, 2, 4, 8 x context 512 .. 16384 (6 powers of 2) x 2 dtypes.
FULL_GRID_SHAPES = 6 * 4 * 6 * 2


def markdown_table(header: list[str], cells: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in cells]
    return "\n".join(lines)


def _grid_line(g: dict[str, Any]) -> str:
    return (
        f"- n_kv_heads {list(g['kv_heads'])}, batch {list(g['batches'])}, context {list(g['contexts'])}, "
        f"{'/'.join(g['dtypes'])}, {g['repeats']} round-robin repeats (median)"
        + ("; whole layer and MLA" if g["layer"] else "")
        + ("; paged for n_kv_heads <= 8" if g["paged"] else "")
        + (f"; end to end at {g['e2e_context']} tokens" if g["e2e"] else "")
    )


def performance_page(result: dict[str, Any], *, plot_path: str, command: str, notes: str) -> str:
    """docs/performance.md: machine, tables, plot, then ``notes`` (targets, limits) written by the caller."""
    m = result["machine"]
    hw = m["hardware"]
    parts = [
        "# Decode performance",
        "",
        "_Generated by `benchmarks/decode.py` from its JSON result; do not edit by hand._",
        "",
        f"Command: `{command}`",
        "",
        "## Machine",
        "",
        f"- {hw['name']} ({m['processor']}), torch {m['torch']}, {m['threads']} threads, "
        f"OMP_WAIT_POLICY={m.get('omp_wait_policy', 'unset')}"
        + (f", load average at the start {m['load_average']}" if "load_average" in m else ""),
        f"- CPU: {m.get('cpu', 'not recorded')}; the kernels' instructions: {m.get('isa') or 'not recorded'}",
        f"- decode kernel (`fused`): {m.get('decode_path', 'not recorded')}",
        f"- measured streaming read bandwidth: **{hw['bandwidth'] / 1e9:.1f} GB/s**; matmul peak: "
        + ", ".join(f"**{k} {hw['peak_flops'][k] / 1e9:.0f} GFLOP/s**" for k in ("fp32", "bf16"))
        + f" (source: {hw['source']})",
        "- roofline time of a step = max(bytes / bandwidth, FLOPs / peak), bytes and FLOPs from `attnlab.cost`;"
        ' "of roofline" = roofline time / measured time (1.0 = at the limit).',
        "",
        "## Grid",
        "",
        "n_heads 32, head_dim 128 (MLA: DeepSeek-V2-Lite attention). The issue's full grid (every n_kv_heads x"
        f" batch 1-8 x context 512-16384 x 2 dtypes, each against three baselines: {FULL_GRID_SHAPES} shapes) is"
        f" not run; this representative grid ({len(result['rows'])} rows)"
        + (f" took {result['seconds'] / 60:.1f} minutes in this run:" if "seconds" in result else ":"),
        "",
        *(_grid_line(g) for g in result.get("grids", [result.get("grid")]) if g),
        "",
    ]
    for kind, title in TITLES.items():
        header, cells = table_rows(result, kind)
        if cells:
            parts += [f"## {title}", "", markdown_table(header, cells), ""]
            if kind == "attention":
                parts += [f"![decode latency vs n_kv_heads]({plot_path})", ""]
    parts += [notes.strip(), ""]
    return "\n".join(parts)
