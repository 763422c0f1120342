"""``attnlab convert``: check the options of the chosen target, convert with a progress bar (stderr), print the
summary as a table or JSON.

``--to gqa`` (the default): ``--kv-heads G [--method M] [--calib FILE]`` -> ``hf.checkpoint.convert_checkpoint``.
``--to mla``: ``--kv-lora-rank R [--rope-dim D] [--planes P] [--calib FILE]`` ->
``hf.mla_checkpoint.convert_checkpoint_to_mla``. An option of the other target is refused, not ignored.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from ..atomic import check_destination, json_text, lock, reading
from ..convert.mla_model import PLANES

TARGETS = ("gqa", "mla")
_OPTIONS = {"gqa": ("--kv-heads", "--method"), "mla": ("--kv-lora-rank", "--rope-dim", "--planes")}


def check_options(to: str, given: dict[str, object]) -> None:
    """``given``: option name -> value (None when not given). Refuses an unknown target, a missing required
    option and any option of the other target, naming it."""
    if to not in TARGETS:
        raise ValueError(f"--to must be one of {', '.join(TARGETS)}; got {to!r}")
    other = TARGETS[1 - TARGETS.index(to)]
    for name in _OPTIONS[other]:
        if given.get(name) is not None:
            raise ValueError(
                f"{name} belongs to --to {other}; --to {to} takes {', '.join(_OPTIONS[to])} (and --calib)"
            )
    required = {"gqa": "--kv-heads", "mla": "--kv-lora-rank"}[to]
    if given.get(required) is None:
        raise ValueError(f"--to {to} needs {required}")


def parse_planes(planes: str | None) -> str | int | None:
    """``--planes``: a criterion name or an integer stride."""
    if planes is None or planes in PLANES:
        return planes
    # ASCII digits only: str.isdigit took "３" as 3 (and "²", which int() then refused naming no option)
    if re.fullmatch(r"[0-9]+", planes.strip()):
        return int(planes)
    raise ValueError(
        f"--planes must be one of {', '.join(PLANES)} or a positive integer stride; got {planes!r}"
    )


def _cell(value: object) -> str:
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {_cell(v)}" for k, v in value.items())
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def run_convert(
    src: str | Path,
    dst: str | Path,
    *,
    to: str = "gqa",
    kv_heads: int | None = None,
    method: str | None = None,
    kv_lora_rank: int | None = None,
    rope_dim: int | None = None,
    planes: str | None = None,
    calib: str | Path | None = None,
    overwrite: bool = False,
    as_json: bool = False,
    device: str = "auto",
) -> dict:
    """``attnlab convert``: convert, then print the summary as a table (or JSON); returns the summary."""
    from ..console import Grid, Progress, print_grid

    check_options(
        to,
        {"--kv-heads": kv_heads, "--method": method, "--kv-lora-rank": kv_lora_rank, "--rope-dim": rope_dim,
         "--planes": planes},
    )  # fmt: skip
    stride = parse_planes(planes)
    # SRC and what the options ask of it before DST, so that one run names the mistakes in the order a user fixes
    # them (a missing SRC, a refused method or rank were reported as "destination exists"): the converters' own
    # input checks, which read no more than config.json
    if to == "gqa":
        from .checkpoint import check_inputs

        check_inputs(Path(src), kv_heads, method or "mean", calib, device)
    else:
        from .mla_checkpoint import check_inputs as check_mla_inputs

        check_mla_inputs(Path(src), kv_lora_rank, rope_dim, stride, calib, device)
    # One writer of dst for the whole run, not only while it writes (a second convert into dst once ran beside
    # this one, and with --overwrite the later finisher replaced the other's result); checked first, since the lock
    # file is written beside dst.
    check_destination(dst, (src, calib), overwrite=overwrite)
    # SRC is read again at the end (its other files are copied): no attnlab writer may replace it meanwhile
    with lock(dst), reading(src, "SRC"), Progress("loading", transient=True) as bar:
        if to == "gqa":
            from .checkpoint import convert_checkpoint

            method = method or "mean"
            bar.update(description=f"converting layers ({method})")
            summary = convert_checkpoint(
                src, dst, kv_heads, method, calib=calib, overwrite=overwrite, device=device,
                progress=lambda done, total: bar.update(done, total=total),
            )  # fmt: skip
            title = f"attnlab convert: {summary['model_type']} -> {kv_heads} KV heads ({method})"
        else:
            from .mla_checkpoint import UNITS, convert_checkpoint_to_mla

            summary = convert_checkpoint_to_mla(
                src, dst, kv_lora_rank, rope_dim, calib=calib, planes=stride, overwrite=overwrite, device=device,
                progress=lambda stage, done, total: bar.update(done, total=total, description=f"{stage} ({UNITS[stage]})"),
            )  # fmt: skip
            title = (
                f"attnlab convert: {summary['model_type']} -> MLA (DeepSeek-V3), kv_lora_rank "
                f"{kv_lora_rank}, rope_dim {summary['qk_rope_head_dim']}"
            )
    if summary["files_left_out"]:
        print(
            "attnlab: left out of the destination (the source model's weights, which the converted ones "
            f"replace, and its uptraining records): {', '.join(summary['files_left_out'])}",
            file=sys.stderr,
        )
    if as_json:
        print(json_text(summary), end="")
        return summary
    grid = Grid(title, ["field", "value"])
    for key, value in summary.items():
        grid.add_row(key, _cell(value))
    print_grid(grid)
    return summary
