"""``attnlab bench decode``: parse the command's options, run the grid, print or save the results."""

from __future__ import annotations

import sys
from pathlib import Path

from ..atomic import check_figure_path, json_text
from .decode import DecodeGrid, run_decode
from .report import plot as write_plot
from .report import print_tables


def int_list(name: str, text: str) -> tuple[int, ...]:
    """ "32,8,1" -> (32, 8, 1), with an error naming the option."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--{name} must be a comma list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{name} must list integers >= 1, got {text!r}")
    return values


def run_bench_decode(
    *,
    kv_heads: str,
    batch: str,
    context: str,
    dtype: str,
    repeats: int,
    layer: bool,
    mla: bool,
    paged: bool,
    e2e: bool,
    plot: Path | None,
    as_json: bool,
    cached_hardware: bool = False,
) -> dict:
    if plot is not None:
        check_figure_path(plot)  # before minutes of timing, not after
    grid = DecodeGrid(
        kv_heads=int_list("kv-heads", kv_heads),
        batches=int_list("batch", batch),
        contexts=int_list("context", context),
        dtypes=tuple(d.strip() for d in dtype.split(",") if d.strip()),
        repeats=repeats,
        layer=layer,
        mla=mla,
        paged=paged,
        e2e=e2e,
        e2e_context=min(int_list("context", context)),
        fresh_hardware=not cached_hardware,
    )
    progress = (
        None if as_json else (lambda row: print(f"  done: {row['kind']} {row['dtype']}", file=sys.stderr))
    )
    result = run_decode(grid, progress=progress)
    if plot is not None:
        result["plot"] = str(write_plot(result, plot))
    if as_json:
        print(json_text(result, indent=1), end="")
    else:
        print_tables(result)
    return result
