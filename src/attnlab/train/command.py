"""``attnlab uptrain`` and ``attnlab eval``: run the library function, print a table (rank 0) or JSON."""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..atomic import json_text
from .evaluate import evaluate_checkpoint
from .loop import uptrain
from .options import UptrainOptions


def _is_main() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _table(title: str, rows: dict) -> Table:
    """Paths in the title and the values are text, not markup (``ck[v2]`` printed ``ck``; ``[/b]`` raised)."""
    table = Table(title=Text(title))
    table.add_column("field")
    table.add_column("value", justify="right")
    for key, value in rows.items():
        table.add_row(Text(key), Text(_fmt(value)))
    return table


def run_uptrain(opts: UptrainOptions, *, as_json: bool) -> dict:
    summary = uptrain(opts, progress=True)
    if not _is_main():
        return summary
    if as_json:
        print(json_text(summary), end="")
        return summary
    shown = {k: v for k, v in summary.items() if k not in ("options", "eval", "eval_before")}
    for name in ("eval_before", "eval"):
        if summary[name] is not None:
            shown |= {
                f"{name}.{k}": v
                for k, v in summary[name].items()
                if k in ("loss", "perplexity", "bits_per_byte")
            }
    Console(highlight=False).print(_table(f"attnlab uptrain: {opts.src} -> {opts.dst}", shown))
    return summary


def run_eval(
    ckpt, data, *, seq_len: int | None, batch_size: int, max_windows: int, as_json: bool, device: str = "auto"
) -> dict:
    result = evaluate_checkpoint(
        ckpt, data, seq_len=seq_len, batch_size=batch_size, max_windows=max_windows, show_progress=True,
        device=device,
    )  # fmt: skip
    if as_json:
        print(json_text(result), end="")
    else:
        Console().print(_table(f"attnlab eval: {ckpt}", result))
    return result
