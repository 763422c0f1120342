"""The sweep's results: its rows with every figure (quality from ``attnlab eval``'s function, KV bytes and the
roofline from the cost model, tokens/s measured here), the Pareto marks, the terminal table, the markdown report
and the plots. Every number shown is read from the results dict, which is what ``--json`` prints and ``--out``
saves.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..config import AttentionConfig
from ..console import Grid, print_grid
from ..cost.memory import kv_cache_bytes
from ..cost.roofline import roofline
from ..hf.causal_lm import model_config

# Pareto: lower loss, fewer KV bytes per token, more tokens/s
OBJECTIVES = (("loss", -1), ("kv_bytes_per_token", -1), ("tokens_per_s", 1))


def pareto(rows: list[dict]) -> list[bool]:
    """For each row, whether it is Pareto-optimal: it has every objective and no other such row is at least as good
    in all of them and better in one (``OBJECTIVES``: quality, bytes, speed)."""

    def figures(row: dict) -> tuple[float, ...] | None:
        values = [row.get(name) for name, _ in OBJECTIVES]
        if any(v is None or (isinstance(v, float) and math.isnan(v)) for v in values):
            return None
        return tuple(sign * v for v, (_, sign) in zip(values, OBJECTIVES, strict=True))  # larger is better

    scored = [figures(r) for r in rows]
    marks = []
    for mine in scored:
        if mine is None:
            marks.append(False)
            continue
        dominated = any(
            other is not None and all(o >= m for o, m in zip(other, mine, strict=True)) and other != mine
            for other in scored
        )
        marks.append(not dominated)
    return marks


def costs(
    hf: dict, context: int, batch: int, hardware: tuple[str, ...], n_kv_heads: int | None = None
) -> dict:
    """KV bytes (bf16) per token and per request (``context`` tokens), and the roofline's decode step of ``batch``
    such requests on each ``hardware`` (``local``: this machine, measured once per boot), for the checkpoint whose
    config.json is ``hf``, with ``n_kv_heads`` KV heads where given (a GQA model written in the MHA layout, whose
    config.json counts the repeated heads: GPT-NeoX's; attnlab loads and caches it with its own)."""
    from ..bench.machine import get_hardware

    cfg = model_config("config.json", hf)
    if n_kv_heads is not None and isinstance(cfg.attention, AttentionConfig):
        cfg = cfg.replace(attention=cfg.attention.replace(n_kv_heads=n_kv_heads))
    per_batch = kv_cache_bytes(cfg, batch, context, "bf16")
    return {
        "kv_bytes_per_token": per_batch / (batch * context),
        "kv_bytes_per_request": per_batch / batch,
        "predicted_decode_s": {
            hw: roofline(cfg, get_hardware(hw), batch=batch, seq_len=context).decode.seconds
            for hw in hardware
        },
    }


def build_rows(plan_rows: list[dict], outcomes: dict, src_hf: dict, opts) -> list[dict]:
    """The rows of the results: each planned row with its jobs' figures, or the one-line reason it has none."""
    rows = []
    for planned in plan_rows:
        row = {k: planned.get(k) for k in ("variant", "kind", "method", "steps", "n_kv_heads", "kv_lora_rank",
                                            "rope_dim")}  # fmt: skip
        errors = []
        hf = src_hf
        if planned["convert"] is not None:
            conv = outcomes[planned["convert"]]
            hf = conv.result["config"] if conv.result else None
            if conv.error:
                errors.append(conv.error)
        n_kv = planned.get("n_kv_heads") if planned.get("kv_lora_rank") is None else None
        row |= costs(hf, opts.context, opts.batch, opts.hardware, n_kv) if hf is not None else {}
        q = outcomes[planned["eval"]]
        if q.result is not None:
            scores = q.result.get("eval") or q.result  # an uptraining's summary holds its final eval
            row |= {k: scores[k] for k in ("loss", "perplexity", "bits_per_byte")}
        elif q.error and q.error not in errors and not q.error.startswith("needs "):
            errors.append(q.error)
        t = outcomes[planned["speed"]]
        if t.result is not None:
            timed = t.result["models"][planned["speed_of"]] if planned.get("speed_of") else t.result
            row |= {"tokens_per_s": timed["tokens_per_s"], "measured_context": timed["context"],
                    "cache_nbytes": timed["cache_nbytes"]}  # fmt: skip
        elif t.error and not t.error.startswith("needs "):
            errors.append(f"speed: {t.error}")
        elif t.error and planned.get("speed_of") and not errors:  # the shared timing failed with another row
            errors.append(
                f"tok/s: the shared timing (--timing together) {t.error}; --timing each times every row"
            )
        job = planned["checkpoint_job"]
        out = outcomes[job].out if job is not None else Path(opts.src).resolve()  # absolute, as the others
        row["checkpoint"] = str(out) if out is not None and out.is_dir() else None
        row["error"] = "; ".join(errors) or None
        rows.append(row)
    for row, mark in zip(rows, pareto(rows), strict=True):
        row["pareto"] = mark
    return rows


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.4g} B"


COLUMNS = ["", "variant", "method", "steps", "loss", "ppl", "bits/byte", "KV B/token", "KV/request", "tok/s"]


def table_rows(results: dict) -> list[list[str]]:
    hw, notes = results["options"]["hardware"], _notes(results)
    out = []
    for r in results["rows"]:
        cells = ["*" if r["pareto"] else "", r["variant"], r["method"], str(r["steps"]),
                 _num(r.get("loss"), ".4f"), _num(r.get("perplexity"), ".2f"), _num(r.get("bits_per_byte"), ".3f"),
                 _num(r.get("kv_bytes_per_token"), ".4g"), _bytes(r.get("kv_bytes_per_request")),
                 _num(r.get("tokens_per_s"), ".0f")]  # fmt: skip
        pred = r.get("predicted_decode_s") or {}
        cells += [_num(pred[h] * 1e3 if h in pred else None, ".3g") for h in hw]
        if notes:
            cells.append(r["error"] or "")
        out.append(cells)
    return out


def _notes(results: dict) -> bool:
    """Whether the table has a note column: where some row could not be done (its reason goes there)."""
    return any(r["error"] for r in results["rows"])


def header(results: dict) -> list[str]:
    hw = results["options"]["hardware"]
    return [*COLUMNS, *(f"ms/step {h}" for h in hw), *(["note"] if _notes(results) else [])]


_NOT_MEASURED = "not measured (no timing job succeeded)"  # (it said "at None tokens")


def _measured(results: dict) -> str:
    """Where tok/s were measured, for the table's title."""
    n = results["measured_context"]
    return _NOT_MEASURED if n is None else f"measured here at {n} tokens"


def title(results: dict) -> str:
    o = results["options"]
    return (
        f"attnlab sweep: {o['src']} (* = Pareto-optimal in loss, KV bytes and tokens/s; KV in bf16, a request of "
        f"{o['context']} tokens, batch {o['batch']}; tok/s {_measured(results)})"
    )


def print_table(results: dict) -> None:
    grid = Grid(title(results), header(results))
    for cells in table_rows(results):
        grid.add_row(*cells)
    print_grid(grid)


def _held_out(data: str) -> str:
    """How ``plan._texts`` held text out of ``--data`` without --eval-data."""
    from ..data import text_files

    try:
        one = len(text_files(Path(data))) == 1
    except (OSError, ValueError):  # moved since: the rule for a directory
        one = False
    return f"the last tenth of the lines of {data}" if one else f"whole files of {data}"


def markdown(results: dict, plots: list[str]) -> str:
    o = results["options"]
    lines = [
        "<!-- generated by attnlab sweep from sweep.json: edit that, not this -->",
        f"# Sweep of {o['src']}",
        "",
        f"Held-out text: {o['eval_data'] or _held_out(o['data'])}; uptraining distils from "
        f"{o['teacher']}. Loss in nats per token; KV bytes in bf16, per request of "
        f"{o['context']} tokens (batch {o['batch']}); tok/s: "
        + (
            f"decode with a filled cache of {results['measured_context']} tokens on this machine "
            f"({results['machine']['threads']} threads)"
            if results["measured_context"] is not None
            else _NOT_MEASURED
        )
        + "; ms/step: the roofline's decode step. "
        "`*`: Pareto-optimal (no other row is at least as good in loss, KV bytes and tok/s).",
        "",
        "| " + " | ".join(header(results)) + " |",
        "|" + "---|" * len(header(results)),
    ]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in cells) + " |" for cells in table_rows(results)]
    lines += ["", f"{results['jobs']['run']} jobs run, {results['jobs']['cached']} from the cache, "
              f"{results['jobs']['failed']} failed ({results['jobs']['skipped']} skipped after a failure); {results['seconds']:.0f} s (load average "
              f"{results['machine']['load_average']:.2f})."]  # fmt: skip
    lines += ["", *(f"![{p}]({p})" for p in plots)]
    return "\n".join(lines) + "\n"


# the plots of an --out directory: file name -> (the rows' x value, its axis label)
PLOTS = {
    "quality_vs_kv_bytes.png": ("kv_bytes_per_token", "KV bytes per token (bf16)"),
    "quality_vs_steps.png": ("steps", "uptraining steps"),
    "quality_vs_speed.png": ("tokens_per_s", "decode tokens/s (measured here)"),
}
# every file a sweep writes in --out, beside its job cache
OUT_FILES = ("report.md", "sweep.json", *PLOTS)


def plot(results: dict, out: Path) -> list[str]:
    """Quality against KV bytes per token, uptraining steps and measured tokens/s; the PNG names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..atomic import save_figure

    rows = [r for r in results["rows"] if r.get("loss") is not None]
    names = []
    for name, (x_key, xlabel) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        series: dict[str, list[dict]] = {}
        for r in rows:
            if r.get(x_key) is not None:
                series.setdefault(f"{r['variant']} {r['method']}".replace(" -", ""), []).append(r)
        last = max((r["steps"] for r in rows), default=0)
        palette = plt.get_cmap("tab10" if len(series) <= 10 else "tab20")
        for k, (label, pts) in enumerate(series.items()):
            pts = sorted(pts, key=lambda r: (r["steps"], r[x_key]))
            # one colour per variant and method, a line through its step counts; hollow until the most steps
            (line,) = ax.plot([p[x_key] for p in pts], [p["loss"] for p in pts], "-", lw=1, alpha=0.6,
                             color=palette(k % palette.N))  # fmt: skip
            for i, p in enumerate(pts):
                hollow = p["steps"] < last and p["variant"] != "source"
                ax.plot(p[x_key], p["loss"], "o", color=line.get_color(), label=label if i == len(pts) - 1 else None,
                        markerfacecolor="white" if hollow else line.get_color())  # fmt: skip
                if p["pareto"]:
                    ax.plot(
                        p[x_key], p["loss"], "o", markersize=14, markerfacecolor="none", markeredgecolor="k"
                    )
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out loss (nats/token)")
        steps = "" if last == 0 else f"hollow: fewer than {last} uptraining steps, filled: {last}; "
        ax.set_title(f"{Path(results['options']['src']).name}: {steps}ringed: Pareto-optimal", fontsize=9)
        if series:  # no row with a loss: an empty plot without a legend
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        save_figure(fig, out / name, dpi=110, bbox_inches="tight")
        names.append(name)
    return names
