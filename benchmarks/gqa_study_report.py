"""docs/results.md and its plots, generated from the JSON that benchmarks/gqa_study.py writes.

Every number on the page is computed here from the JSON; sentences that state a finding compute it too.
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import matplotlib

from attnlab.atomic import save_figure, write_atomic

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parent))  # locations.py, beside this script
from locations import own_path

MARKERS = {"mean": "o", "first": "s", "random": "^", "fit": "D", "none": "x"}


CE = "mean, no teacher"


def label(cell: dict) -> str:
    """Cells are named by method; the paper's recipe (next-token loss only) is the extra row ``CE``."""
    return (
        cell["method"]
        if cell["recipe"] == "kd" or cell["method"] == "none"
        else f"{cell['method']}, no teacher"
    )


class Study:
    """Lookups over the JSON: loss by (KV heads, method, alpha), controls, decode speed."""

    def __init__(self, result: dict) -> None:
        self.r = result
        self.scale = result["scale"]
        self.n_heads = self.scale["n_heads"]
        self.alphas = result["alphas"]
        self.loss = {
            (c["kv_heads"], label(c), row["alpha"]): row["eval"]["loss"]
            for c in result["cells"]
            for row in c["rows"]
        }
        self.steps = {row["alpha"]: row["steps"] for c in result["cells"] for row in c["rows"]}
        self.mha = result["pretrain"]["pretrain-mha"]["eval"]["loss"]
        self.scratch = {p["kv_heads"]: p["eval"]["loss"] for p in result["pretrain"].values()}
        self.decode = {int(g): v for g, v in result["decode"].items()}

    def rel(self, a: float, b: float) -> float:
        """Relative gap of loss ``a`` over loss ``b``, in percent."""
        return 100.0 * (a / b - 1.0)

    def alpha_needed(self, g: int, method: str, target: float) -> float | None:
        """Smallest alpha at which ``method``'s loss reaches ``target``, interpolating linearly between the
        measured alphas; None if it never does within the grid."""
        points = [(a, self.loss[g, method, a]) for a in self.alphas]
        if points[0][1] <= target:
            return 0.0
        for (a0, l0), (a1, l1) in itertools.pairwise(points):
            if l1 <= target:
                return a0 + (a1 - a0) * (l0 - target) / (l0 - l1)
        return None


def plots(s: Study, docs: Path) -> list[Path]:
    methods = s.r["methods"]
    heads = s.r["kv_heads"]
    paths = []

    fig, axes = plt.subplots(1, len(heads), figsize=(4.2 * len(heads), 3.8), sharey=True)
    for ax, g in zip(axes, heads, strict=True):
        for m in methods:
            ax.plot(s.alphas, [s.loss[g, m, a] for a in s.alphas], marker=MARKERS[m], label=m)
        ax.plot(s.alphas, [s.loss[g, CE, a] for a in s.alphas], "C0--", marker="o", mfc="none", label=CE)
        ax.plot(
            s.alphas,
            [s.loss[s.n_heads, "none", a] for a in s.alphas],
            "k:",
            marker="x",
            label="MHA trained on",
        )
        half = next(r["rows"][0] for r in s.r["fit_half"] if r["kv_heads"] == g)
        ax.plot(
            [half["steps"] / s.scale["pretrain_steps"]],
            [half["eval"]["loss"]],
            "D",
            color="C3",
            mfc="none",
            label="fit, half of mean's alpha = 0.05 steps",
        )
        ax.axhline(s.scratch[g], color="grey", ls="--", label="same shape from scratch")
        ax.set_title(f"{g} KV heads ({s.n_heads // g} query heads each)")
        ax.set_xlabel("alpha (uptraining steps / pretraining steps)")
        ax.grid(alpha=0.3)
    lows = [s.loss[g, m, a] for g in heads for m in [*methods, CE] for a in s.alphas if a > 0]
    axes[0].set_ylim(min(min(lows), s.mha) - 0.05, max(lows) + 0.3)
    axes[0].set_ylabel("validation loss (nats / token)")
    axes[-1].legend(fontsize=8)
    fig.suptitle("Uptraining after conversion: validation loss vs alpha (alpha = 0: converted, not trained)")
    fig.tight_layout()
    paths.append(
        save_figure(fig, docs / "gqa_study_alpha.png", dpi=110, ours=own_path(docs / "gqa_study_alpha.png"))
    )

    fig, ax = plt.subplots(figsize=(6, 4))
    all_heads = [s.n_heads, *heads]
    for a in s.alphas:
        ys = [s.loss[s.n_heads, "none", a]] + [s.loss[g, "mean", a] for g in heads]
        ax.plot(all_heads, ys, marker="o", label=f"mean, alpha = {a:g}")
    fit = [s.loss[s.n_heads, "none", 0.05]] + [s.loss[g, "fit", 0.05] for g in heads]
    ax.plot(all_heads, fit, "C3-.", marker="D", label="fit, alpha = 0.05")
    ax.plot(all_heads, [s.scratch[g] for g in all_heads], "k--", marker="s", label="from scratch, P steps")
    ax.set_xscale("log", base=2)
    ax.set_xticks(all_heads, [str(g) for g in all_heads])
    ax.invert_xaxis()
    ax.set_xlabel("KV heads (8 = MHA, 1 = MQA)")
    ax.set_ylabel("validation loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Validation loss vs KV heads")
    fig.tight_layout()
    paths.append(
        save_figure(
            fig, docs / "gqa_study_kv_heads.png", dpi=110, ours=own_path(docs / "gqa_study_kv_heads.png")
        )
    )

    fig, ax = plt.subplots(figsize=(6, 4))
    alpha = 0.05
    xs = [s.decode[g]["tokens_per_s"] for g in all_heads]
    for method, style in (("mean", "o-"), ("fit", "D-.")):
        ys = [s.mha] + [s.loss[g, method, alpha] for g in heads]  # MHA: the pretrained model itself
        ax.plot(xs, ys, style, label=f"{method}, alpha = {alpha:g} (MHA: as pretrained)")
        for g, x, y in zip(all_heads, xs, ys, strict=True):
            name = "MHA" if g == s.n_heads else ("MQA" if g == 1 else f"GQA-{g}")
            if method == "mean" or g != s.n_heads:
                ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 5))
    ax.legend(fontsize=8)
    ax.set_xlabel("decode tokens/s (filled KV cache, one thread)")
    ax.set_ylabel("validation loss")
    ax.grid(alpha=0.3)
    ax.set_title("Quality vs decode speed (the small-scale Figure 3)")
    fig.tight_layout()
    paths.append(
        save_figure(fig, docs / "gqa_study_speed.png", dpi=110, ours=own_path(docs / "gqa_study_speed.png"))
    )
    return paths


def fmt(x: float) -> str:
    return f"{x:.4f}"


def ordering(s: Study) -> str:
    """The paper's ordering of the conversion methods, at alpha = 0 and after alpha = 0.05, and why it differs."""
    heads = s.r["kv_heads"]

    def holds(a: float) -> list[int]:
        return [g for g in heads if s.loss[g, "mean", a] < s.loss[g, "first", a] < s.loss[g, "random", a]]

    def losses(a: float) -> str:
        return "; ".join(
            f"{g} KV {' / '.join(fmt(s.loss[g, m, a]) for m in ('mean', 'first', 'random'))}" for g in heads
        )

    at0, at5 = holds(0.0), holds(0.05)
    text = (
        f"- **Ordering mean > first > random at alpha = 0: "
        f"{'reproduced' if len(at0) == len(heads) else f'holds at {len(at0)} of {len(heads)} KV-head counts'}"
        f"{' (' + ', '.join(map(str, at0)) + ' KV)' if 0 < len(at0) < len(heads) else ''}.** Loss mean / first / "
        f"random at alpha = 0: {losses(0.0)}. After alpha = 0.05 (where the paper compares them, its Figure 5: "
        f"T5-Large to MQA uptrained with alpha = 0.05) it holds at {len(at5)} of {len(heads)}: {losses(0.05)}."
    )
    first_wins = [g for g in heads if s.loss[g, "first", 0.0] < s.loss[g, "mean", 0.0]]
    align = s.r["kv_head_alignment"]
    if first_wins:
        kept = ", ".join(
            f"{align[str(g)]['k_norm_kept']:.2f} / {align[str(g)]['v_norm_kept']:.2f} for groups of "
            f"{align[str(g)]['group_size']} (unrelated heads: {align[str(g)]['unrelated_heads']:.2f})"
            for g in heads
        )
        text += (
            f" Why first beats mean before uptraining ({', '.join(map(str, first_wins))} KV): this model's heads "
            f"learned unrelated projections. The mean of a group's key / value projections keeps {kept} of the "
            "heads' average norm (1 would be identical heads, 1 / sqrt(group size) unrelated heads of equal norm). "
            "A mean-pooled head is therefore a shrunken blend that points away from every query head's own key and "
            "value (attention logits and values scaled down), while first keeps one head of each group exact. "
            "Uptraining repairs the blend; how alike the heads of the paper's T5 models were is not reported."
        )
    return text


def fit_in_half(s: Study) -> str:
    """fit's losses with at most half of mean's alpha = 0.05 steps (converted only, the alphas of the grid within
    that budget, and a run of exactly half the steps) against mean's alpha = 0.05 loss."""
    a, heads = 0.05, s.r["kv_heads"]
    half = {r["kv_heads"]: r["rows"][0] for r in s.r["fit_half"]}
    budget = s.steps[a] // 2

    def runs(g: int) -> list[tuple[int, float]]:
        grid = [(s.steps[b], s.loss[g, "fit", b]) for b in s.alphas if s.steps[b] <= budget]
        return sorted(dict([*grid, (half[g]["steps"], half[g]["eval"]["loss"])]).items())  # by steps, once

    reached = [g for g in heads if min(loss for _, loss in runs(g)) <= s.loss[g, "mean", a]]
    where = (
        "reached at every KV-head count"
        if len(reached) == len(heads)
        else f"reached at {len(reached)} of {len(heads)} KV-head counts ({', '.join(map(str, reached)) or 'none'})"
    )
    text = "; ".join(
        f"{g} KV: mean {fmt(s.loss[g, 'mean', a])} after {s.steps[a]} steps; fit "
        + ", ".join(f"{fmt(loss)} after {n}" for n, loss in runs(g))
        for g in heads
    )
    needs = []
    for g in heads:
        need = s.alpha_needed(g, "fit", s.loss[g, "mean", a])
        needs.append(f"{g} KV " + ("beyond the grid" if need is None else f"{100 * need / a:.0f} %"))
    return (
        f"- **fit reaches mean's alpha = 0.05 loss with at most half the steps ({budget}): {where}.** {text}. "
        "The steps fit needs, read off the alpha grid by linear interpolation (an overestimate where the loss "
        f"curve is convex), as a share of mean's: {'; '.join(needs)}."
    )


def targets(s: Study) -> list[str]:
    out = []
    a = 0.05
    for g, bound, label in ((2, 2.0, "2 KV heads (4 query heads per KV head)"), (1, 5.0, "MQA (1 KV head)")):
        gaps = {m: s.rel(s.loss[g, m, a], s.mha) for m in s.r["methods"]}
        best = min(gaps, key=gaps.get)
        verdict = (
            "reached"
            if gaps["mean"] <= bound
            else ("reached with " + best if gaps[best] <= bound else "not reached")
        )
        out.append(
            f"- **{label} within {bound:g} % of MHA after alpha = {a:g}: {verdict}.** Gap to the pretrained MHA "
            f"model's loss {fmt(s.mha)}: mean {gaps['mean']:+.2f} %, "
            + ", ".join(f"{m} {v:+.2f} %" for m, v in gaps.items() if m != "mean")
            + f"; without the teacher (mean, next-token loss only) {s.rel(s.loss[g, CE, a], s.mha):+.2f} %"
            + f". The MHA model trained on for the same {s.steps[a]} steps reaches "
            f"{fmt(s.loss[s.n_heads, 'none', a])} ({s.rel(s.loss[s.n_heads, 'none', a], s.mha):+.2f} %)"
            + (
                ", so part of any gain over the pretrained loss is plain extra training, not recovery."
                if s.loss[s.n_heads, "none", a] < s.mha
                else ": extra training alone does not lower the MHA model's loss."
            )
        )
    out.append(ordering(s))
    out.append(fit_in_half(s))
    heads, methods = s.r["kv_heads"], s.r["methods"]
    gaps = {(g, m): s.rel(s.loss[g, m, a], s.scratch[g]) for g in heads for m in methods}
    within = [m for m in methods if all(gaps[g, m] <= 1.0 for g in heads)]
    verdict = (
        "reached with mean"
        if "mean" in within
        else (f"reached with {' and '.join(within)}, not with mean" if within else "not reached")
    )
    out.append(
        f"- **Converted + uptrained (alpha = 0.05) within 1 % of the same shape trained from scratch for all "
        f"{s.scale['pretrain_steps']} steps: {verdict}.** Gap to from scratch (negative = better), "
        + ", ".join(methods)
        + ": "
        + "; ".join(f"{g} KV " + " / ".join(f"{gaps[g, m]:+.2f} %" for m in methods) for g in heads)
        + f". Compute: {100 * a:.0f} % extra steps on top of the MHA pretraining, against 100 % for the control."
    )
    best4 = max((m for m in s.r["minilm"] if m["kv_heads"] == 4), key=lambda m: m["after"]["mean_cosine"])
    out.append(
        f"- **MiniLM after distillation, cosine >= 0.95 at 4 KV heads: "
        f"{'reached' if best4['after']['mean_cosine'] >= 0.95 else 'not reached'}** "
        f"({fmt(best4['after']['mean_cosine'])} after {best4['steps']} distillation steps from the "
        f"{best4['method']} conversion's {fmt(best4['before']['mean_cosine'])})."
    )
    out.append(study_time(s))
    return out


def study_time(s: Study) -> str:
    """Wall time of the invocations that computed the page's jobs, and what the cached pretraining adds."""
    runs, jobs, workers = s.r["runs"], s.r["job_seconds"], s.scale["workers"]
    computed = {name for r in runs for name in r["computed"]}
    minutes = sum(r["seconds"] for r in runs) / 60
    before = sorted(set(jobs) - computed)  # computed by runs before the history began (the pretraining)
    earlier = sum(jobs[n] for n in before) / 60
    verdict = (
        "reached"
        if minutes + earlier / workers <= 60
        else ("reached with the pretrained models cached" if minutes <= 60 else "not reached")
    )
    listed = "; ".join(
        f"{r['seconds'] / 60:.1f} min computing {len(r['computed'])} jobs at a 1-minute load average of "
        f"{r['load_mean']:.1f} (max {r['load_max']:.1f})"
        for r in runs
    )
    text = f"- **The whole study in at most 60 minutes: {verdict}** on this shared 2-core machine. {listed}"
    if before:
        text += (
            f"; cached from an earlier run: {', '.join(before)} ({earlier:.0f} worker-min, about "
            f"{earlier / workers:.0f} min on {workers} workers), so about {minutes + earlier / workers:.0f} min "
            "from an empty cache"
        )
    cpu = s.r.get("job_cpu_seconds", {})
    if set(cpu) == set(jobs):
        text += (
            f". The jobs used {sum(cpu.values()) / 60:.0f} CPU-min (pretraining "
            f"{sum(v for n, v in cpu.items() if n.startswith('pretrain')) / 60:.0f}): on {workers} idle cores "
            f"about {sum(cpu.values()) / 60 / workers:.0f} min"
        )
    return text + "."


def quality_figures(r: dict) -> dict[str, float]:
    """Every quality figure of a study JSON by a readable name (old and new JSONs share this layout)."""
    out = {"unigram loss": r["unigram"]["loss"]} if "unigram" in r else {}
    for name, p in r["pretrain"].items():
        out[f"{name} loss"] = p["eval"]["loss"]
    for c in r["cells"]:
        for row in c["rows"]:
            out[f"{c['kv_heads']} KV {label(c)}, alpha {row['alpha']:g}"] = row["eval"]["loss"]
    for c in r["fit_half"]:
        out[f"{c['kv_heads']} KV fit after {c['rows'][0]['steps']} steps"] = c["rows"][0]["eval"]["loss"]
    for m in r["minilm"]:
        for when in ("before", "after"):
            out[f"MiniLM {m['kv_heads']} KV cosine {when}"] = m[when]["mean_cosine"]
    return out


WHAT = {
    False: "the study before it ran as a configuration of `attnlab sweep`, with job runners of its own",
    True: "an earlier run of this configuration",
}


def compare(
    old: dict[str, float], new: dict[str, float], shown
) -> tuple[list[str], list[str], float, str | None]:
    """The figures both runs have, those equal as ``shown`` prints them, and the largest change and its name."""
    common = [k for k in new if k in old]
    same = [k for k in common if shown(old[k]) == shown(new[k])]
    change, worst = max(((abs(new[k] - old[k]), k) for k in common), default=(0.0, None))
    return common, same, change, worst


def head(prev: dict) -> str:
    return f"Against the JSON this run replaced ({WHAT[bool(prev.get('as_sweep'))]}; same seeds, same data)"


def verdicts(s: Study) -> list[str]:
    """The bold verdict of each quality target (the study's time aside)."""
    return [line.split("**")[1] for line in targets(s)[:-1]]


def against_previous(s: Study) -> list[str]:
    """What moved against the JSON this run replaced (``previous``): whether the pretrained models start from the
    same weights, the quality figures, the verdicts, the decode ratios."""
    prev = s.r.get("previous")
    if not prev:
        return []
    old, new = quality_figures(prev), quality_figures(s.r)
    common, same, change, worst = compare(old, new, fmt)
    first = {
        "before": prev["pretrain"]["pretrain-mha"]["curve"][0][1],
        "now": s.r["pretrain"]["pretrain-mha"]["curve"][0][1],
    }
    text = f"{head(prev)}. "
    if first["before"] != first["now"]:
        text += (
            f"The pretrained models differ: the MHA model's first training step had loss {first['before']:.4f} "
            f"before and {first['now']:.4f} now, so it started from other random weights (same seed: attnlab's "
            "`init_weights` has since drawn the MLP's up and down projections in another order), and its held-out "
            f"loss is {fmt(old['pretrain-mha loss'])} before, {fmt(new['pretrain-mha loss'])} now. Every figure "
            "downstream moves with it, by as much as another draw of the initial weights moves it: "
        )
    text += f"{len(same)} of the {len(common)} quality figures (losses, MiniLM cosines) are the same to 4 decimals"
    if worst is None or change == 0:
        text += ", all of them bit for bit."
    else:
        text += f"; the largest change is {change:.2g} ({worst}: {fmt(old[worst])} before, {fmt(new[worst])} now)."
    before_v, now_v = verdicts(Study(s.r | prev)), verdicts(s)
    moved = [f'"{b}" is now "{n}"' for b, n in zip(before_v, now_v, strict=True) if b != n]
    text += f" Of the {len(now_v)} quality verdicts above, " + (
        f"{len(moved)} changed: {'; '.join(moved)}." if moved else "none changed."
    )
    ratios = []
    for g in s.r["kv_heads"]:
        before = prev["decode"][str(g)]["tokens_per_s"] / prev["decode"][str(s.n_heads)]["tokens_per_s"]
        ratios.append(
            f"{g} KV {before:.2f}x -> {s.decode[g]['tokens_per_s'] / s.decode[s.n_heads]['tokens_per_s']:.2f}x"
        )
    text += (
        " Decode tokens/s relative to MHA, previous run -> this one: "
        + ", ".join(ratios)
        + " (timings move with "
        "the load of the shared machine)."
    )
    keys = ["pretrain-mha loss"]
    for g in s.r["kv_heads"]:
        keys += [
            f"{g} KV mean, alpha 0",
            f"{g} KV mean, alpha 0.05",
            f"{g} KV fit, alpha 0.05",
            f"pretrain-kv{g} loss",
        ]
    keys += [f"MiniLM {g} KV cosine after" for g in (4, 2)]
    table = ["| figure | previous JSON | this run | change |", "|---|---:|---:|---:|"]
    table += [
        f"| {k} | {fmt(old[k])} | {fmt(new[k])} | {new[k] - old[k]:+.4f} |"
        for k in keys
        if k in old and k in new
    ]
    return ["## Against the previous run", "", text, "", *table, ""]


def write_report(result: dict, json_path: Path, page: Path, docs: Path, root: Path) -> Path:
    s = Study(result)
    sc = s.scale
    pngs = plots(s, docs)
    pre = result["pretrain"]["pretrain-mha"]
    uni = result["unigram"]
    val = pre["eval"]
    tokens = sc["pretrain_steps"] * sc["batch"] * sc["seq_len"]
    head_dim = sc["d_model"] // sc["n_heads"]
    load = result["load_average"]
    rel_json = json_path.relative_to(root) if json_path.is_relative_to(root) else json_path
    command = "python benchmarks/gqa_study.py" + (" --quick" if result["quick"] else "")
    lines = [
        "# Results: converting MHA to GQA / MQA and uptraining, small scale on Shakespeare",
        "",
        f"<!-- generated by benchmarks/gqa_study.py from {rel_json}; edit the script, not this file -->",
        "",
        "The GQA paper (Ainslie et al. 2023, arXiv 2305.13245) converts an MHA checkpoint to fewer KV heads and",
        "uptrains it for a fraction alpha of the pretraining steps. This page repeats that study at small scale,",
        *(
            [
                "as a configuration of `attnlab sweep` (its jobs: the functions behind `attnlab convert` -> `attnlab",
                "uptrain` -> `attnlab eval`, and its decode timing) plus the controls a sweep does not run.",
            ]
            if "sweep" in result  # an older JSON: the study ran its own jobs
            else ["through the same functions as `attnlab convert` -> `attnlab uptrain` -> `attnlab eval`."]
        ),
        "",
        f"- Model: Llama architecture, {sc['n_layers']} layers, d_model {sc['d_model']}, {sc['n_heads']} query heads "
        f"of head_dim {head_dim}, SwiGLU width {sc['ffn_dim']}, {result['parameters']:,} parameters; byte-level BPE "
        f"tokenizer of {sc['vocab']} tokens trained on the training works only.",
        f"- Data: {len(result['train_works'])} works for training; validation = {len(result['valid_works'])} whole "
        f"held-out works ({', '.join(result['valid_works'])}), scored on windows of {sc['seq_len']} tokens: "
        f"{val['tokens']:,} tokens, {val['bytes']:,} bytes.",
        f"- Pretraining: P = {sc['pretrain_steps']} steps of {sc['batch']} x {sc['seq_len']} tokens "
        f"({tokens:,} tokens), AdamW, peak lr {sc['lr']:g}, warmup 5 %, cosine to 10 %. Uptraining: alpha x P "
        f"steps, same batch, peak lr {sc['uptrain_lr']:g} after {100 * sc['uptrain_warmup']:.0f} % warmup (Adam "
        "starts afresh), cosine to 10 %, distilling the pretrained MHA model (`--teacher`, KL on logits at "
        f"temperature {sc['temperature']:g}, weight {sc['distill_weight']:g}); the row `{CE}` uptrains with the "
        "next-token loss alone, as the paper does. Controls: the converted shapes "
        "trained from scratch for P steps with the pretraining recipe.",
        f"- Run: `{command}` on {result['machine']['cpus']} cores shared with other jobs, {sc['workers']} "
        f"single-threaded worker processes, torch {result['machine']['torch']}. Decode speeds come from the last "
        f"invocation (1-minute load average: mean {load['mean']:.1f}, max {load['max']:.1f}); the time the whole "
        "study took is the last target below.",
        "",
        "## The pretrained model learned",
        "",
        "| model | validation loss | perplexity | bits per byte |",
        "|---|---:|---:|---:|",
        f"| unigram (training token frequencies) | {fmt(uni['loss'])} | {math.exp(uni['loss']):.1f} | "
        f"{uni['bits_per_byte']:.3f} |",
        f"| MHA, pretrained {sc['pretrain_steps']} steps | {fmt(val['loss'])} | {val['perplexity']:.1f} | "
        f"{val['bits_per_byte']:.3f} |",
        "",
        f"The pretrained model's loss is {100 * (1 - val['loss'] / uni['loss']):.0f} % below the unigram model's "
        f"(pretraining ran at {pre['tokens_per_s']:,.0f} tokens/s on one thread).",
        "",
        "## Conversion + uptraining: validation loss",
        "",
        "alpha = 0 is the converted checkpoint without training; the alpha columns add alpha x P uptraining steps "
        f"({', '.join(f'{s.steps[a]}' for a in s.alphas if a > 0)} steps). `none` is the MHA model trained on for "
        "the same steps (next-token loss). Scores: mean loss (nats / token) on "
        f"{result['pretrain']['pretrain-mha']['eval']['windows']} windows spread evenly over the held-out works. "
        "Decode: tokens/s of one decode step with a filled cache "
        f"(batch {sc['decode_batch']}, context {sc['decode_context']}, one thread).",
        "",
        "| KV heads | method | "
        + " | ".join(f"alpha {a:g}" for a in s.alphas)
        + f" | from scratch ({sc['pretrain_steps']} steps) | KV cache / token | decode tokens/s |",
        "|---:|---|" + "---:|" * (len(s.alphas) + 3),
    ]
    for g in [s.n_heads, *result["kv_heads"]]:
        methods = ["none"] if g == s.n_heads else [*result["methods"], CE]
        d = s.decode[g]
        per_token = d["kv_cache_bytes"] // (sc["decode_batch"] * (sc["decode_context"] + sc["decode_steps"]))
        for i, m in enumerate(methods):
            cells = " | ".join(fmt(s.loss[g, m, a]) for a in s.alphas)
            extra = f"{fmt(s.scratch[g])} | {per_token:,} B | {d['tokens_per_s']:,.0f}" if i == 0 else " | |"
            lines.append(f"| {g} | {m} | {cells} | {extra} |")
    mha_speed = s.decode[s.n_heads]["tokens_per_s"]
    ratios = ", ".join(f"{g} KV {s.decode[g]['tokens_per_s'] / mha_speed:.2f}x" for g in result["kv_heads"])
    slower = [g for g in result["kv_heads"] if s.decode[g]["tokens_per_s"] < mha_speed]
    lines += [
        "",
        f"Decode speed relative to MHA (same run, round robin, best of {result['decode_repeats']}): {ratios}."
        + (
            f" With {', '.join(map(str, slower))} KV heads the step was not faster than MHA's in this run; "
            "other jobs shared the cores (the load average above), which makes single timings unreliable."
            if slower
            else ""
        ),
        "",
        f"![loss vs alpha]({pngs[0].name})",
        "",
        f"![loss vs KV heads]({pngs[1].name})",
        "",
        f"![loss vs decode speed]({pngs[2].name})",
        "",
        "## Targets",
        "",
        *targets(s),
        "",
        *against_previous(s),
        "## MiniLM: distillation after conversion",
        "",
        "all-MiniLM-L6-v2 (BERT, 12 heads) converted with `convert_model` and distilled towards the original",
        "encoder: loss = every layer's hidden-state MSE (averaged over layers) + (1 - cosine) of the sentence "
        f"embeddings, {result['minilm'][0]['steps']} steps of {result['minilm'][0]['batch']} lines from the training "
        f"works, AdamW lr {sc['minilm_lr']:g} (warmup + cosine), word embeddings frozen. "
        f"Scored on {sc['minilm_eval_lines']} lines of the held-out works: mean cosine to the original's embedding and "
        "top-1 neighbour agreement (as in docs/conversion.md).",
        "",
        "| KV heads | init | cosine before | cosine after | top-1 before | top-1 after |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for m in result["minilm"]:
        b, a = m["before"], m["after"]
        lines.append(
            f"| {m['kv_heads']} | {m['method']} | {fmt(b['mean_cosine'])} | {fmt(a['mean_cosine'])} | "
            f"{b['top1_agreement']:.3f} | {a['top1_agreement']:.3f} |"
        )
    lines += ["", f"Raw numbers: `{rel_json}`.", ""]
    return write_atomic(page, "\n".join(lines), ours=own_path(page))
