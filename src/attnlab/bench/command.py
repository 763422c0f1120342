"""``attnlab bench decode``: parse the command's options, run the grid, print or save the results."""

from __future__ import annotations

import sys
from pathlib import Path

from ..atomic import check_figure_path, json_text
from .decode import DecodeGrid, run_decode
from .report import plot as write_plot
from .report import print_tables


def str_list(name: str, text: str) -> tuple[str, ...]:
    """ "fp32, bf16" -> ("fp32", "bf16"); an empty list or item ("8,,1") is refused, naming the option."""
    parts = tuple(part.strip() for part in text.split(","))
    if not all(parts):
        raise ValueError(f"--{name} must be a comma list without empty items, got {text!r}")
    return parts


def int_list(name: str, text: str) -> tuple[int, ...]:
    """ "32,8,1" -> (32, 8, 1), with an error naming the option."""
    try:
        values = tuple(int(part) for part in str_list(name, text))
    except ValueError:
        raise ValueError(f"--{name} must be a comma list of integers, got {text!r}") from None
    if min(values) < 1:
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
        dtypes=str_list("dtype", dtype),
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
        if plot is not None:  # as compare says it (with --json the path is in the result)
            print(f"plot written to {result['plot']}")
    return result
