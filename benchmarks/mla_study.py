"""MLA against GQA at the same KV cache, on the GQA study's small pretrained MHA model: a configuration of
``attnlab sweep``, plus the measurements a sweep has no business with.

The source is the GQA study's pretrained model (``benchmarks/gqa_study.py``: a Llama checkpoint, 8 heads of 16,
its own byte-level BPE tokenizer, trained on Shakespeare with whole works held out). For each cache size of GQA
with G = 4, 2 and 1 KV heads (``2 G head_dim`` values per token and layer):

1. Before training, which rotary planes keep RoPE ("norm" = RoPE-aware, "first" = stride 1, "uniform" = the
   largest stride: the slowest planes DeepSeek's layout can reach): MLA conversions in memory, scored on held-out
   text; ``rope_dim`` is chosen among 4, 8 and 16 by the loss on *training* text (no held-out text).
2. The sweep: ``attnlab sweep SRC --variants gqa:4,2,1/mean,fit mla:R+D,.../fit --uptrain-steps 0,20,50 --timing
   together`` with ``R + D`` equal to each GQA cache and the chosen ``D``: every conversion scored and uptrained for
   alpha x P steps, alpha = 0.02 and 0.05 (P = the source's pretraining steps), with the GQA study's recipe
   (distillation from the MHA model, the same data order, learning rate and seed for every conversion), and the
   decode tokens/s of the source and every shape timed in turn in one job (MLA absorbed).
3. For every MLA conversion, the distance of the native DeepSeek export (with its latent norm) from attnlab's MLA
   model (without it); the exact case: the GQA-1 ``fit`` checkpoint (one KV head) converted to MLA at full rank
   with every plane kept.

The jobs run through ``attnlab.jobs.run_jobs`` in the GQA study's job cache (benchmarks/.cache/studies/), so the
GQA rows the two studies share (same jobs, same inputs) are computed once, and an interrupted study continues
where it stopped.

The full study reads the whole corpus beside the checkout, ``../shared/data/shakespeare`` (42 works, as the GQA
study's model was trained on), and stops (exit 2) without it. ``--quick`` runs the whole path on the GQA study's
``--quick`` model (pretrained here if it is not cached) and the 36 plays attnlab ships, so it runs in a plain
clone; it writes only under benchmarks/.cache/.

    python benchmarks/mla_study.py                      # the study (~30 min on 2 cores): JSON, PNG, docs page
    python benchmarks/mla_study.py --src DIR            # another Llama checkpoint with a tokenizer.json
    python benchmarks/mla_study.py --replot             # docs/conversion.md and the PNG from the JSON
    python benchmarks/mla_study.py --quick              # tiny sizes, minutes; output kept in the cache
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from attnlab.atomic import claim_dir, write_atomic
from attnlab.convert import convert_model_to_mla, fold_latent_norms, logit_distance
from attnlab.convert.mla import full_rank, max_stride
from attnlab.convert.mla_model import choose_stride
from attnlab.data import load_stream, text_files
from attnlab.hf import load_causal_lm, load_llama
from attnlab.hf.causal_lm import model_config as checkpoint_config
from attnlab.hf.checkpoint import calibration_batches
from attnlab.hf.io import read_config
from attnlab.jobs import Job, Outcome, run_jobs
from attnlab.sweep import SweepOptions, plan
from attnlab.sweep.report import build_rows
from attnlab.train import evaluate
from attnlab.train.evaluate import eval_windows

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the GQA study, the report and locations.py
import gqa_study
from locations import corpus, output, own_path
from mla_study_report import JSON, ROPE_DIMS, plot, section, targets, write_page

ROOT = Path(__file__).resolve().parents[1]
KV_HEADS = (4, 2, 1)
ALPHAS = (0.02, 0.05)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The GQA study's uptraining ("kd": distillation from the MHA model) and its evaluation and decode sizes."""

    seq_len: int = 128
    batch: int = 16
    lr: float = 2e-3
    warmup: float = 0.1  # fraction of the uptraining steps
    min_lr: float = 0.1  # attnlab uptrain's default, which the sweep keeps
    distill_weight: float = 1.0
    temperature: float = 1.0
    seed: int = 1
    eval_windows: int = 512  # held-out windows scored, spread evenly over the held-out works
    select_windows: int = 64  # training-text windows that choose rope_dim
    distance_windows: int = 16  # held-out windows for the logit distances
    decode_batch: int = 32
    decode_context: int = 448
    decode_steps: int = 32
    decode_repeats: int = 9
    decode_estimate: str = (
        "the fastest"  # of the repeats (the sweep's timing; an older study took the median)
    )
    workers: int = 2
    pretrain_steps: int | None = None  # P; None: the source's (its uptrain.json)


# --quick: the whole path on tiny sizes in a few minutes, on the GQA study's --quick model (pretrained for 100
# steps), for development (its output stays in the cache).
QUICK = Recipe(
    batch=4, eval_windows=32, select_windows=8, distance_windows=8, decode_batch=4, decode_context=64,
    decode_steps=4, decode_repeats=1, pretrain_steps=100,
)  # fmt: skip


def mqa_or_gqa(g: int) -> str:
    return gqa_study.variant(g)


# ----------------------------------------------------------------------------------------------------- setup


def source_model(src: Path | None, quick: bool, data: Path) -> tuple[dict, Path]:
    """The study's data (the GQA study's split of ``data`` and calibration lines, in its job cache) and the source:
    ``--src``, else the GQA study's pretrained MHA model (its ``--quick`` one for ``quick``), pretrained here when
    it is not cached."""
    cache = gqa_study.CACHE / ("quick" if quick else "full")
    if src is None:
        return gqa_study.pretrained(gqa_study.QUICK if quick else gqa_study.FULL, cache, data)
    root = claim_dir(cache / "jobs", "cache", what="job cache")
    split = plan.prepare_data(data, None, root)
    valid = [f.stem for f in text_files(split["heldout"])]
    return split | {"root": root, "train_works": [f.stem for f in text_files(split["train"])],
                    "valid_works": valid}, src  # fmt: skip


# ------------------------------------------------------------------------------ jobs (in worker processes)


def _held_out(args: dict):
    return load_stream(Path(args["src"]), Path(args["heldout"]), args["seq_len"])


def _distance_batches(args: dict) -> list[torch.Tensor]:
    stream = _held_out(args)
    x, _, _ = stream.windows(eval_windows(stream, args["seq_len"], args["distance_windows"]), args["seq_len"])
    return list(x.split(8))


def job_planes(args: dict, deps: dict, out: Path | None) -> dict:
    """One MLA conversion in memory (no training, no latent norm: the choice of planes alone): its held-out
    loss and, for choosing rope_dim, its loss on training text."""
    started = time.perf_counter()
    source = load_llama(Path(args["src"])).float()
    g, rope_dim, stride = args["kv_heads"], args["rope_dim"], args["stride"]
    batches = calibration_batches(Path(args["src"]), Path(args["calib"]))
    rank = 2 * g * source.cfg.attention.head_dim - rope_dim
    mla = convert_model_to_mla(source, rank, rope_dim, calib=batches, planes=stride)
    train = load_stream(Path(args["src"]), Path(args["train"]), args["seq_len"])
    return {
        "kv_heads": g,
        "kv_lora_rank": rank,
        "rope_dim": rope_dim,
        "stride": stride,
        "loss": evaluate(mla, _held_out(args), args["seq_len"], max_windows=args["eval_windows"]),
        "train_loss": evaluate(mla, train, args["seq_len"], max_windows=args["select_windows"])["loss"],
        "seconds": time.perf_counter() - started,
    }


def job_native(args: dict, deps: dict, out: Path | None) -> dict:
    """What the latent norm costs on held-out text: the sweep's converted checkpoint (the native DeepSeek export)
    against the same conversion without it (cheap to redo; the latent norm's fit is what takes the time)."""
    (converted,) = deps.values()
    source = load_llama(Path(args["src"])).float()
    batches = calibration_batches(Path(args["src"]), Path(args["calib"]))
    planes = converted["summary"]["rope_stride"]
    mla = convert_model_to_mla(source, args["kv_lora_rank"], args["rope_dim"], calib=batches, planes=planes)
    native = load_causal_lm(converted["out"]).float()
    loss = evaluate(mla, _held_out(args), args["seq_len"], max_windows=args["eval_windows"])["loss"]
    return {"distance": logit_distance(mla, native, _distance_batches(args)), "loss_without_norm": loss}


@torch.no_grad()
def job_exact(args: dict, deps: dict, out: Path | None) -> dict:
    """The one-KV-head GQA ``fit`` checkpoint as MLA at full rank with every plane kept: attnlab's MLA model
    computes it exactly; the native export differs by its latent norm only."""
    (converted,) = deps.values()
    gqa_dir = Path(converted["out"])
    gqa = load_llama(gqa_dir).float()
    attn = gqa.cfg.attention
    batches = calibration_batches(gqa_dir, Path(args["calib"]))
    rank = full_rank(attn, attn.head_dim)
    mla = convert_model_to_mla(gqa, rank, attn.head_dim, calib=batches)
    native, _ = fold_latent_norms(mla, batches)
    held_out = _distance_batches(args)
    stream = _held_out(args)
    scored = {
        name: evaluate(m, stream, args["seq_len"], max_windows=args["eval_windows"])["loss"]
        for name, m in (("gqa", gqa), ("mla", mla), ("native", native))
    }
    return {
        "kv_lora_rank": rank,
        "rope_dim": attn.head_dim,
        "kv_values_per_layer": rank + attn.head_dim,
        "gqa_vs_mla": logit_distance(gqa, mla, held_out),
        "mla_vs_native": logit_distance(mla, native, held_out),
        "loss": scored,
    }


# ------------------------------------------------------------------------------------ in the main process


def sweep_options(recipe: Recipe, src: Path, data_dir: Path, mla: list[tuple[int, int]], steps: list[int]):
    """``attnlab sweep SRC --variants gqa:4,2,1/mean,fit mla:R+D,.../fit --uptrain-steps 0,... --timing together``
    with the GQA study's recipe."""
    return SweepOptions(
        src=src, data=data_dir,
        variants=(f"gqa:{','.join(map(str, KV_HEADS))}/mean,fit", f"mla:{','.join(f'{r}+{d}' for r, d in mla)}/fit"),
        methods=("mean", "fit"), uptrain_steps=(0, *steps), teacher="src", context=recipe.decode_context,
        batch=recipe.decode_batch, jobs=recipe.workers, seq_len=recipe.seq_len, batch_size=recipe.batch, lr=recipe.lr,
        eval_windows=recipe.eval_windows, seed=recipe.seed, warmup=recipe.warmup, distill_weight=recipe.distill_weight,
        temperature=recipe.temperature, timing="together", timing_steps=recipe.decode_steps,
        timing_repeats=recipe.decode_repeats,
        timing_threads=recipe.workers,  # run_jobs gives a lone timing all the workers' threads
    )  # fmt: skip


def runs(
    outcomes: dict[str, Outcome],
    planned: list[dict],
    ranks: dict[int, tuple[int, int]],
    alpha: dict[int, float],
) -> list[dict]:
    """The study's rows from the sweep's: per conversion, its summary and its score at each alpha (``alpha``: by
    uptraining steps)."""

    def result(name: str) -> dict:
        if outcomes[name].result is None:
            raise SystemExit(f"mla_study.py: job {name} failed: {outcomes[name].error}")
        return outcomes[name].result

    out = []
    for kind, g, method in [*(("gqa", g, m) for g in KV_HEADS for m in ("mean", "fit")),
                            *(("mla", g, "calib") for g in KV_HEADS)]:  # fmt: skip
        name = f"mla-{ranks[g][0]}" if kind == "mla" else mqa_or_gqa(g)
        mine = [r for r in planned if (r["variant"], r["method"]) == (name, method)]
        rows, seconds = [], 0.0
        for r in mine:
            done = result(r["eval"])
            seconds += outcomes[r["eval"]].seconds
            row = {"alpha": alpha[r["steps"]], "steps": r["steps"], "eval": done.get("eval") or done}
            rows.append(row | ({"tokens_per_s": done["tokens_per_s"]} if r["steps"] else {}))
        conv = result(mine[0]["convert"])
        out.append({
            "kind": kind, "method": "mla" if kind == "mla" else method, "kv_heads": g,
            "rope_dim": ranks[g][1] if kind == "mla" else None, "conversion": conv["summary"],
            "native": result(f"native/{name}") if kind == "mla" else None, "rows": rows,
            "seconds": seconds + outcomes[mine[0]["convert"]].seconds,
        })  # fmt: skip
    return out


def run(data: dict, src: Path, recipe: Recipe, corpus_dir: Path) -> dict:
    started = time.perf_counter()
    torch.set_num_threads(1)  # the workers' threads: one each
    loads = [os.getloadavg()[0]]
    root = data["root"]
    pretrained = json.loads((src / "uptrain.json").read_text()) if (src / "uptrain.json").is_file() else {}
    p = recipe.pretrain_steps or pretrained.get("steps")
    if not p:
        raise SystemExit(f"mla_study.py: {src} has no uptrain.json: its pretraining steps P are unknown")
    source = load_llama(src).float()
    attn = source.cfg.attention
    head_dim = attn.head_dim
    rope_dims = [r for r in ROPE_DIMS if r <= head_dim]  # all of them but on the --quick model (head_dim 8)
    batches = calibration_batches(src, data["calib"])
    # The stride does not depend on the latent's size: one choice per rope_dim and criterion for every cache.
    strides = {
        (r, c): choose_stride(source, r, c, calib=batches)
        for r in rope_dims
        for c in ("norm", "first", "uniform")
    }
    common = {"src": str(src.resolve()), "src_id": plan.checkpoint_id(src), "calib": str(data["calib"]),
              "heldout": str(data["heldout"]), "seq_len": recipe.seq_len, "eval_windows": recipe.eval_windows,
              "data_id": data["fingerprint"]}  # fmt: skip
    plane_jobs = []
    for g in KV_HEADS:
        for r in rope_dims:
            chosen = {strides[r, "norm"]} | ({1, max_stride(head_dim, r)} if r < head_dim else set())
            for st in sorted(chosen):
                if 1 <= 2 * g * head_dim - r <= full_rank(attn, r):
                    args = common | {"kv_heads": g, "rope_dim": r, "stride": st, "train": str(data["train"]),
                                     "select_windows": recipe.select_windows}  # fmt: skip
                    plane_jobs.append(Job(f"planes/kv{g}/r{r}/s{st}", job_planes, args))
    found = run_jobs(
        plane_jobs, root, workers=recipe.workers, threads=recipe.workers, title="mla study: planes"
    )
    planes = {n: o.result for n, o in found.items()}
    if any(v is None for v in planes.values()):
        raise SystemExit(f"mla_study.py: {'; '.join(o.error for o in found.values() if o.error)}")

    def rope_choice(g: int) -> int:
        """The rope_dim whose RoPE-aware conversion has the lowest loss on training text."""
        names = [f"planes/kv{g}/r{r}/s{strides[r, 'norm']}" for r in rope_dims]
        return min((planes[n] for n in names if n in planes), key=lambda row: row["train_loss"])["rope_dim"]

    ranks = {g: (2 * g * head_dim - rope_choice(g), rope_choice(g)) for g in KV_HEADS}
    alpha = {0: 0.0} | {max(1, round(a * p)): a for a in ALPHAS}
    opts = sweep_options(recipe, src, corpus_dir, [ranks[g] for g in KV_HEADS], list(alpha)[1:])
    cfg = checkpoint_config(src, read_config(src))
    jobs, planned = plan.plan_jobs(opts, cfg, plan.variants(cfg, opts.variants, False), data)
    extra = {"distance_windows": recipe.distance_windows}
    for g in KV_HEADS:
        r, d = ranks[g]
        args = common | extra | {"kv_lora_rank": r, "rope_dim": d}
        jobs.append(Job(f"native/mla-{r}", job_native, args, deps=(f"convert/mla-{r}/calib",)))
    exact = {k: common[k] for k in ("calib", "heldout", "seq_len", "eval_windows", "data_id")} | extra
    jobs.append(Job("exact", job_exact, exact | {"src": common["src"]}, deps=("convert/mqa/fit",)))
    jobs.sort(key=lambda j: j.alone)  # the timing last: it runs alone, once everything else is done
    outcomes = run_jobs(jobs, root, workers=recipe.workers, threads=recipe.workers, title="mla study (jobs)")
    loads.append(os.getloadavg()[0])
    timed = outcomes["speed"].result["models"]
    names = {"source": "mha"} | {mqa_or_gqa(g): f"gqa-kv{g}" for g in KV_HEADS}
    names |= {f"mla-{ranks[g][0]}": f"mla-kv{g}" for g in KV_HEADS}
    per_token = recipe.decode_batch * (recipe.decode_context + recipe.decode_steps)
    decode = {
        names[label]: {"tokens_per_s": t["tokens_per_s"], "kv_bytes_per_token": t["cache_nbytes"] / per_token}
        for label, t in timed.items()
    }  # KV bytes measured: the caches' bytes over the tokens they hold
    source_eval = outcomes["eval/source"].result
    every = found | outcomes
    return {
        "study": "MLA vs GQA conversion at the same KV cache, before and after uptraining",
        "source": {
            "from": str(src),
            "checkpoint_id": common["src_id"],
            "model": {
                "layers": source.cfg.n_layers,
                "d_model": attn.d_model,
                "n_heads": attn.n_heads,
                "n_kv_heads": attn.n_kv_heads,
                "head_dim": head_dim,
                "vocab_size": source.cfg.vocab_size,
            },
            "pretrain_steps": p,
            "eval": source_eval,
        },
        "recipe": dataclasses.asdict(recipe),
        "alphas": list(ALPHAS),
        "kv_heads": list(KV_HEADS),
        "train_works": data["train_works"],
        "valid_works": data["valid_works"],
        "strides": [{"rope_dim": r, "planes": c, "stride": st} for (r, c), st in strides.items()],
        "planes": [planes[j.name] for j in plane_jobs],
        "runs": runs(outcomes, planned, ranks, alpha),
        "exact": outcomes["exact"].result,
        "decode": decode,
        "sweep": {
            "options": {
                k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(opts).items()
            },
            "rows": build_rows(planned, outcomes, read_config(src), opts),
        },
        "computed": sorted(n for n, o in every.items() if not o.cached),
        "cached": sorted(n for n, o in every.items() if o.cached),
        "seconds": time.perf_counter() - started,
        "load_average": {"samples": loads, "mean": sum(loads) / len(loads), "max": max(loads)},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
    }


def previous_figures(path: Path) -> dict | None:
    """The figures of the JSON this run replaces (same layout), so that the page can say what moved."""
    if not path.is_file():
        return None
    prev = json.loads(path.read_text())
    return {k: prev[k] for k in ("source", "runs", "planes", "exact", "decode", "seconds") if k in prev} | {
        "as_sweep": "sweep" in prev
    }


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with the cache and the files filled in: ``--quick`` keeps its JSON, plot and page under
    benchmarks/.cache/ (locations.py), out of the repository."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " ")
    )  # the first paragraph
    parser.add_argument(
        "--src", type=Path, help="a Llama checkpoint with tokenizer.json (default: the GQA study's)"
    )
    parser.add_argument(
        "--replot", action="store_true", help="only redraw the page and the PNG from the JSON"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, output kept in benchmarks/.cache")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--doc", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)
    full = not args.quick
    args.json = args.json or output(JSON, full)
    args.doc = args.doc or output(ROOT / "docs" / "conversion.md", full)
    args.png = args.png or output(ROOT / "docs" / "conversion_mla.png", full)
    return args


def main() -> None:
    args = arguments()
    if args.replot:
        result = json.loads(args.json.read_text())
    else:
        recipe = dataclasses.replace(QUICK if args.quick else Recipe(), workers=args.workers)
        text = corpus(not args.quick, "mla_study.py")
        data, src = source_model(args.src, args.quick, text)
        result = run(data, src, recipe, text)
        result["targets"] = targets(result)
        result["previous"] = previous_figures(args.json)
        write_atomic(args.json, json.dumps(result, indent=2) + "\n", ours=own_path(args.json))
    plot(result, args.png)
    write_page(result, args.doc, args.png)
    print(section(result, args.png.name))
    print(f"wrote {args.json}, {args.png}, {args.doc}")


if __name__ == "__main__":
    main()
