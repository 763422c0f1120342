"""The MLA study's page section and plot, computed from its JSON (``benchmarks/mla_study.py`` writes it).

docs/conversion.md is the MiniLM study's part (``convert_minilm.markdown``) followed by ``section(result)``; both
scripts write the whole page, each from the two JSON files, so either one can regenerate it.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import matplotlib

from attnlab.atomic import save_figure, write_atomic

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parent))  # locations.py, beside this script
from gqa_study_report import compare, head
from locations import own_path

ROOT = Path(__file__).resolve().parents[1]
JSON = ROOT / "benchmarks" / "results" / "mla_study.json"
MINILM_JSON = ROOT / "benchmarks" / "results" / "convert_minilm.json"
ROPE_DIMS = (4, 8, 16)  # candidates for the MLA rows; plane choices are compared at 4 and 8
METHODS = (("mean", "GQA, mean"), ("fit", "GQA, fit"), ("mla", "MLA (DeepSeek-V3)"))


def ppl(run: dict, alpha: float) -> float:
    return next(r["eval"]["perplexity"] for r in run["rows"] if r["alpha"] == alpha)


def _runs(result: dict) -> dict[tuple[int, str], dict]:
    return {(r["kv_heads"], r["method"]): r for r in result["runs"]}


def _planes_row(result: dict, g: int, rope_dim: int, planes: str) -> dict | None:
    stride = next(
        x["stride"] for x in result["strides"] if (x["rope_dim"], x["planes"]) == (rope_dim, planes)
    )
    key = (g, rope_dim, stride)
    return next((r for r in result["planes"] if (r["kv_heads"], r["rope_dim"], r["stride"]) == key), None)


def targets(result: dict) -> dict[str, list[int]]:
    """Per alpha (0: before uptraining), the KV-head counts whose cache MLA uses at a lower perplexity than the
    best GQA conversion (mean or fit) after the same uptraining."""
    runs = _runs(result)
    return {
        str(alpha): [
            g
            for g in result["kv_heads"]
            if ppl(runs[g, "mla"], alpha) < min(ppl(runs[g, m], alpha) for m in ("mean", "fit"))
        ]
        for alpha in (0.0, *result["alphas"])
    }


def plot(result: dict, path: Path) -> None:
    runs, hd = _runs(result), result["source"]["model"]["head_dim"]
    n = len(result["kv_heads"])
    fig, axes = plt.subplots(1, n, figsize=(4 * n, 3.6), sharey=True)
    for ax, g in zip(axes, result["kv_heads"], strict=True):
        for method, label in METHODS:
            rows = runs[g, method]["rows"]
            ax.plot(
                [r["steps"] for r in rows], [r["eval"]["perplexity"] for r in rows], marker="o", label=label
            )
        ax.axhline(result["source"]["eval"]["perplexity"], color="grey", ls="--", lw=1, label="MHA source")
        ax.set_title(f"{2 * g * hd} KV values / token / layer (= GQA-{g})", fontsize=10)
        ax.set_xlabel("uptraining steps")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out perplexity")
    axes[-1].legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120, ours=own_path(path))


def section(result: dict, png: str = "conversion_mla.png") -> str:
    """The "GQA -> MLA" section of docs/conversion.md; every figure in it is computed from ``result``."""
    src, recipe = result["source"], result["recipe"]
    model, hd = src["model"], src["model"]["head_dim"]
    runs, alphas = _runs(result), result["alphas"]
    steps = {a: next(r["steps"] for r in result["runs"][0]["rows"] if r["alpha"] == a) for a in alphas}
    load = result["load_average"]
    lines = [
        "## GQA -> MLA at the same KV cache",
        "",
        "`attnlab convert SRC DST --to mla --kv-lora-rank R --rope-dim D [--calib FILE]` writes a checkpoint of a family that",
        "`attnlab families` converts to MLA as a native, dense DeepSeek-V3 checkpoint (`AutoModelForCausalLM` loads it without remote",
        "code) whose KV cache holds `R + D` values per token and layer. RoRoPE concentrates each rotary frequency",
        "plane of all KV heads into one virtual head; the planes chosen by their contribution to the attention",
        "scores keep RoPE in the shared rotary key; everything else loses RoPE and is factored jointly with the",
        "values into the latent; DeepSeek's latent norm is fitted last. A query bias (Qwen2's, even all zeros) is refused:",
        "DeepSeek's `q_proj` has none. [mla_conversion.md](mla_conversion.md) says what is exact and what is",
        "approximated. `attnlab uptrain` and `attnlab eval` take the written checkpoint like any other.",
        "",
        f"Source: the GQA study's pretrained MHA model ({model['layers']} layers, d_model {model['d_model']}, "
        f"{model['n_heads']} heads of {hd}, vocabulary {model['vocab_size']}, pretrained for P = "
        f"{src['pretrain_steps']} steps); held-out perplexity {src['eval']['perplexity']:.2f} on "
        f"{src['eval']['windows']} windows of {recipe['seq_len']} tokens from {len(result['valid_works'])} "
        f"held-out works ({', '.join(result['valid_works'])}). Calibration: 256 lines of the training works. "
        "Uptraining, the same for every row: "
        + " and ".join(f"alpha = {a} ({steps[a]} steps)" for a in alphas)
        + f" of {recipe['batch']} x {recipe['seq_len']} tokens, distillation from the MHA model (weight "
        f"{recipe['distill_weight']}, temperature {recipe['temperature']}; the GQA study's recipe), peak learning "
        f"rate {recipe['lr']}. MLA's `rope_dim` is the one of {', '.join(map(str, ROPE_DIMS))} whose conversion "
        "has the lowest loss on training text; `kv_lora_rank` fills the rest of the cache.",
        "",
        f"Command: `python benchmarks/mla_study.py` ({result['seconds'] / 60:.0f} min on "
        f"{result['machine']['cpus']} cores shared with other jobs: load average {load['mean']:.1f} on average, "
        f"{load['max']:.1f} at most){shared(result)}. Raw numbers: `benchmarks/results/mla_study.json`.",
        "",
        "Held-out perplexity (the best at each cache size and alpha in bold). The last column is what DeepSeek's",
        "latent norm costs the native export before training: the KL divergence (nats per token) from the same",
        "conversion without it, and the perplexity without it.",
        "",
        "| KV values / token / layer | conversion | before uptraining | "
        + " | ".join(f"alpha = {a}" for a in alphas)
        + " | latent norm: KL / perplexity without |",
        "|---|---|---:|" + "---:|" * len(alphas) + "---:|",
    ]
    for g in result["kv_heads"]:
        best = [min(ppl(runs[g, m], a) for m, _ in METHODS) for a in (0.0, *alphas)]
        for method, label in METHODS:
            run = runs[g, method]
            cells = [ppl(run, a) for a in (0.0, *alphas)]
            shown = " | ".join(
                f"**{p:.2f}**" if p == b else f"{p:.2f}" for p, b in zip(cells, best, strict=True)
            )
            norm = ""
            if method == "mla":
                conv = run["conversion"]
                label = (
                    f"MLA, rank {conv['kv_lora_rank']} + rope {conv['qk_rope_head_dim']} "
                    f"(planes {', '.join(map(str, conv['rope_planes']))})"
                )
                norm = f"{run['native']['distance']['kl']:.4f} / {math.exp(run['native']['loss_without_norm']):.2f}"
            lines.append(f"| {2 * g * hd} (= GQA-{g}) | {label} | {shown} | {norm} |")
    lines += ["", f"![MLA vs GQA at the same KV cache]({png})", "", "Findings, computed from the JSON:", ""]
    lines += findings(result)
    lines += plane_lines(result)
    lines += decode_lines(result)
    lines += against_previous(result)
    return "\n".join(lines) + "\n"


def quality_figures(r: dict) -> dict[str, float]:
    """Every held-out perplexity of a study JSON by a readable name (old and new JSONs share this layout)."""
    out = {"MHA source": r["source"]["eval"]["perplexity"]}
    hd = r["source"]["model"]["head_dim"]
    for run in r["runs"]:
        for row in run["rows"]:
            out[f"{2 * run['kv_heads'] * hd} values {run['method']}, alpha {row['alpha']:g}"] = row["eval"][
                "perplexity"
            ]
    for row in r["planes"]:
        out[f"planes {row['kv_heads']} KV rope {row['rope_dim']} stride {row['stride']}"] = row["loss"][
            "perplexity"
        ]
    for name, loss in r["exact"]["loss"].items():
        out[f"exact case {name}"] = math.exp(loss)
    return out


def against_previous(result: dict) -> list[str]:
    """What moved against the JSON this run replaced (``previous``): the source, the perplexities, the verdicts,
    the decode ratios."""
    prev = result.get("previous")
    if not prev:
        return []
    old, new = quality_figures(prev), quality_figures(result)
    common, same, change, worst = compare(old, new, lambda x: f"{x:.2f}")
    text = f"- {head(prev)}: "
    if old["MHA source"] != new["MHA source"]:
        text += (
            f"the source itself changed (the GQA study's pretrained model, perplexity {old['MHA source']:.2f} "
            f"before and {new['MHA source']:.2f} now: pretrained again from other random weights, see "
            "[results.md](results.md)), so every figure moves with it. "
        )
    text += f"{len(same)} of the {len(common)} perplexities are the same to 2 decimals"
    if worst is None or change == 0:
        text += ", all of them bit for bit."
    else:
        text += (
            f"; the largest change is {change:.2g} ({worst}: {old[worst]:.2f} before, {new[worst]:.2f} now)."
        )
        converted = [abs(new[k] / old[k] - 1) for k in common if k.endswith("alpha 0")]
        if old["MHA source"] == new["MHA source"] and converted:
            text += (
                f" The conversions themselves differ by at most {max(converted):.1e} (relative perplexity before "
                "training): float rounding, which uptraining amplifies."
            )
    wins, won = targets(result | prev), targets(result)
    moved = [f"after alpha = {a}: {len(wins[a])} -> {len(won[a])}" for a in won if wins.get(a) != won[a]]
    text += " Cache sizes where MLA beats the best GQA conversion, " + (
        f"before -> now: {'; '.join(moved)}." if moved else "unchanged at every alpha."
    )
    ratios = [
        f"{g} KV {prev['decode'][f'mla-kv{g}']['tokens_per_s'] / prev['decode'][f'gqa-kv{g}']['tokens_per_s']:.2f}x -> "
        f"{result['decode'][f'mla-kv{g}']['tokens_per_s'] / result['decode'][f'gqa-kv{g}']['tokens_per_s']:.2f}x"
        for g in result["kv_heads"]
    ]
    text += (
        " MLA's decode tokens/s relative to GQA's at the same cache, previous run -> this one: "
        + ", ".join(ratios)
        + " (timings move with the load of the shared machine; the perplexities do not depend on it)."
    )
    return ["", text]


def shared(result: dict) -> str:
    """What the run took from the job cache it shares with the GQA study (none in an older JSON)."""
    if "cached" not in result:
        return ""
    n, total = len(result["cached"]), len(result["cached"]) + len(result["computed"])
    return (
        f"; {n} of its {total} jobs came from the job cache it shares with the GQA study (the GQA rows are that "
        "study's jobs, same inputs) or from an earlier run"
    )


def findings(result: dict) -> list[str]:
    runs, won, n = _runs(result), targets(result), len(result["kv_heads"])
    lines = []
    for alpha in (0.0, *result["alphas"]):
        wins = won[str(alpha)]
        gaps = ", ".join(
            f"{ppl(runs[g, 'mla'], alpha) - min(ppl(runs[g, m], alpha) for m in ('mean', 'fit')):+.2f}"
            for g in result["kv_heads"]
        )
        if alpha == 0.0:
            head = "Before uptraining, MLA's perplexity is below the best GQA conversion's"
            verdict = ""
        else:
            head = f"After alpha = {alpha}, MLA's perplexity is below the best GQA conversion's after the same uptraining"
            verdict = f" (target: at least 2 of {n}: **{'met' if len(wins) >= 2 else 'not met'}**)"
        lines.append(
            f"- {head} at {len(wins)} of {n} cache sizes{verdict}; MLA minus the best GQA, from the largest cache "
            f"to the smallest: {gaps}."
        )
    after = [(g, a) for a in result["alphas"] for g in won[str(a)]]
    if after:
        gaps = [min(ppl(runs[g, m], a) for m in ("mean", "fit")) - ppl(runs[g, "mla"], a) for g, a in after]
        lines.append(
            f"- Where MLA wins after uptraining, it wins by {min(gaps):.2f} to {max(gaps):.2f} perplexity: small "
            "margins, from one uptraining run per row (one seed, the same data order for every row)."
        )
    spread = {
        m: max(ppl(runs[g, m], 0.0) for g in result["kv_heads"])
        - min(ppl(runs[g, m], 0.0) for g in result["kv_heads"])
        for m in ("fit", "mla")
    }
    lines.append(
        f"- Before training, MLA's perplexity moves by {spread['mla']:.2f} across the three cache sizes, GQA fit's by "
        f"{spread['fit']:.2f}: what MLA loses is mostly RoPE (one virtual head per rotary plane keeps it), not latent "
        "width, so its advantage grows as the cache shrinks."
    )
    kls = [runs[g, "mla"]["native"]["distance"]["kl"] for g in result["kv_heads"]]
    lines.append(
        f"- DeepSeek's latent norm, which the Llama source does not have, moves the native export by {min(kls):.4f}"
        f" to {max(kls):.4f} nats/token (KL) from attnlab's MLA model on held-out text; uptraining then trains the"
        " native model itself."
    )
    exact = result["exact"]
    lines.append(
        f"- Exact case: the GQA-1 `fit` checkpoint (one KV head) as MLA at full rank, {exact['kv_lora_rank']} + "
        f"{exact['rope_dim']} = {exact['kv_values_per_layer']} values per token and layer (GQA-1's own cache), every "
        f"plane kept: attnlab's MLA logits are within {exact['gqa_vs_mla']['max_abs']:.1e} of the GQA model's on "
        f"held-out text (perplexity {math.exp(exact['loss']['gqa']):.3f} and {math.exp(exact['loss']['mla']):.3f}). "
        f"The native export differs by its latent norm only: KL {exact['mla_vs_native']['kl']:.1e} nats/token, "
        f"perplexity {math.exp(exact['loss']['native']):.3f}."
    )
    return lines


def plane_lines(result: dict) -> list[str]:
    """Which planes keep RoPE, before any training: a table and its verdict."""
    hd = result["source"]["model"]["head_dim"]
    lines = [
        "",
        "Which rotary planes keep RoPE, before any training (held-out perplexity of attnlab's MLA model, stride in",
        "brackets). `norm` is the RoPE-aware choice (MHA2MLA's criterion: each plane's measured contribution to",
        "the attention scores), `first` the fastest planes (stride 1), `uniform` the largest stride, whose planes",
        "reach the slowest frequency DeepSeek's layout can express: its rotary frequencies start at 1, so the",
        "lowest-frequency planes alone cannot be kept. The training-text loss chooses `rope_dim` for the rows above.",
        "",
        "| KV values / token / layer | rope_dim | norm | first | uniform | norm vs first | training-text loss (norm) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    margins = []
    for g in result["kv_heads"]:
        for r in sorted({x["rope_dim"] for x in result["strides"]}):  # ROPE_DIMS up to the model's head_dim
            rows = {p: _planes_row(result, g, r, p) for p in ("norm", "first", "uniform")}
            norm, first = rows["norm"], rows["first"]
            if norm is None:
                continue
            cell = {
                p: f"{row['loss']['perplexity']:.2f} ({row['stride']})" if row else ""
                for p, row in rows.items()
            }
            versus = ""
            if first is not None and first["stride"] != norm["stride"]:
                margins.append(1 - norm["loss"]["perplexity"] / first["loss"]["perplexity"])
                versus = f"{-100 * margins[-1]:+.1f} %"
            elif first is not None:
                versus = "same planes"
            lines.append(
                f"| {2 * g * hd} | {r} | {cell['norm']} | {cell['first']} | {cell['uniform']} | {versus} | "
                f"{norm['train_loss']:.3f} |"
            )
    lines.append("")
    if margins:
        beats = sum(m > 0 for m in margins)
        lines.append(
            f"- Where the RoPE-aware choice differs from the first planes ({len(margins)} conversions), it has the "
            f"lower perplexity in {beats}, by {100 * min(margins):.1f} % to {100 * max(margins):.1f} %. Where it "
            "picks stride 1 it is the same conversion as `first`."
        )
    return lines


def decode_lines(result: dict) -> list[str]:
    recipe, decode = result["recipe"], result["decode"]
    lines = [
        "",
        f"Decode with a filled cache (batch {recipe['decode_batch']}, context {recipe['decode_context']}, "
        f"{recipe['decode_steps']} steps, one thread, {recipe.get('decode_estimate', 'median')} of {recipe['decode_repeats']} runs taken in turn; MLA "
        "absorbed: the query moves into latent space and attention runs over the cached rows). KV bytes per token",
        "are measured from the caches (float32, all layers):",
        "",
        "| model | KV bytes / token | decode tokens/s |",
        "|---|---:|---:|",
    ]
    for name, row in decode.items():
        lines.append(f"| {name} | {row['kv_bytes_per_token']:.0f} | {row['tokens_per_s']:.0f} |")
    ratios = [
        decode[f"mla-kv{g}"]["tokens_per_s"] / decode[f"gqa-kv{g}"]["tokens_per_s"]
        for g in result["kv_heads"]
    ]
    same = all(
        decode[f"mla-kv{g}"]["kv_bytes_per_token"] == decode[f"gqa-kv{g}"]["kv_bytes_per_token"]
        for g in result["kv_heads"]
    )
    why = (
        ""
        if min(ratios) >= 1
        else " Absorbed decoding reads no more bytes than GQA but multiplies each head's query by a latent-wide "
        "matrix (kv_lora_rank + rope_dim values instead of head_dim), arithmetic that a model this small on a CPU "
        "does not hide behind the cache reads."
    )
    why += (
        " The cores were shared with other jobs while these were timed (load above), so read the figures as "
        "ratios from one run."
    )
    lines += [
        "",
        f"- MLA's caches hold {'exactly' if same else '**not**'} the bytes of GQA's at each size. Its decode runs at "
        f"{min(ratios):.2f}x to {max(ratios):.2f}x GQA's tokens/s.{why}",
    ]
    return lines


def write_page(result: dict, doc: Path, png: Path) -> None:
    """docs/conversion.md: the MiniLM study's part (from its JSON), then this section."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import convert_minilm

    minilm = convert_minilm.markdown(
        json.loads(MINILM_JSON.read_text()), ROOT / "docs" / "conversion_minilm.png", MINILM_JSON,
        "python benchmarks/convert_minilm.py",
    )  # fmt: skip
    write_atomic(doc, minilm + section(result, png.name), ours=own_path(doc))
