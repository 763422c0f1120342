"""MLA against GQA at the same KV cache, on the GQA study's small pretrained MHA model, through attnlab's own path.

The source is the GQA study's pretrained model (``benchmarks/gqa_study.py``: a Llama checkpoint, 8 heads of 16,
its own byte-level BPE tokenizer, trained on Shakespeare with whole works held out). For each cache size of GQA
with G = 4, 2 and 1 KV heads (``2 G head_dim`` values per token and layer):

1. GQA: ``attnlab convert --kv-heads G`` with ``mean`` and ``fit`` (``hf.convert_checkpoint``).
2. MLA: ``attnlab convert --to mla`` (``hf.convert_checkpoint_to_mla``) with ``kv_lora_rank + rope_dim`` equal to
   that cache. ``rope_dim`` is chosen among 4, 8 and 16 by the loss on *training* text (no held-out text).
3. Every converted checkpoint is scored (``attnlab eval``'s function) and uptrained with ``attnlab uptrain``'s
   function for alpha x P steps, alpha = 0.02 and 0.05 (P = the source's pretraining steps), with the GQA study's
   recipe: distillation from the MHA model, the same data order, learning rate and seed for every conversion.
4. Before training: which rotary planes keep RoPE ("norm" = RoPE-aware, "first" = stride 1, "uniform" = the
   largest stride: the slowest planes DeepSeek's layout can reach), and for every MLA conversion the distance
   of the native DeepSeek export (with its latent norm) from attnlab's MLA model (without it).
5. The exact case: the GQA-1 ``fit`` checkpoint (one KV head) converted to MLA at full rank with every plane kept.
6. Decode tokens/s with a filled cache: the source, the GQA checkpoints and the MLA ones (absorbed attention).

Independent conversions run in a pool of single-threaded worker processes; finished jobs are cached in
benchmarks/.cache/mla_study/, so an interrupted study continues where it stopped.

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
import hashlib
import json
import os
import platform
import random
import shutil
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from multiprocessing import get_context
from pathlib import Path

import torch

from attnlab.atomic import write_atomic
from attnlab.bench.generate import decode_step_times
from attnlab.convert import convert_model_to_mla, fold_latent_norms, logit_distance
from attnlab.convert.mla import full_rank, max_stride
from attnlab.convert.mla_model import choose_stride
from attnlab.data import load_stream, split_held_out, text_files
from attnlab.hf import convert_checkpoint, convert_checkpoint_to_mla, load_causal_lm, load_llama
from attnlab.hf.checkpoint import calibration_batches
from attnlab.train import UptrainOptions, evaluate, evaluate_checkpoint, uptrain
from attnlab.train.evaluate import eval_windows

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the report and locations.py, beside this script
from locations import corpus, output, own_path
from mla_study_report import JSON, ROPE_DIMS, plot, section, targets, write_page

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / ".cache" / "mla_study"
GQA_STUDY = ROOT / "benchmarks" / ".cache" / "gqa_study"  # its caches: full/ and quick/
KV_HEADS = (4, 2, 1)
ALPHAS = (0.02, 0.05)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The GQA study's uptraining ("kd": distillation from the MHA model) and its evaluation and decode sizes."""

    seq_len: int = 128
    batch: int = 16
    lr: float = 2e-3
    warmup: float = 0.1  # fraction of the uptraining steps
    min_lr: float = 0.1
    distill_weight: float = 1.0
    temperature: float = 1.0
    seed: int = 1
    eval_windows: int = 512  # held-out windows scored, spread evenly over the held-out works
    select_windows: int = 64  # training-text windows that choose rope_dim
    distance_windows: int = 16  # held-out windows for the logit distances
    decode_batch: int = 32
    decode_context: int = 448
    decode_steps: int = 32
    decode_repeats: int = 3
    workers: int = 2
    pretrain_steps: int | None = None  # P; None: the source's (its uptrain.json)


# --quick: the whole path on tiny sizes in a few minutes, on the GQA study's --quick model (pretrained for 100
# steps), for development (its output stays in the cache).
QUICK = Recipe(
    batch=4, eval_windows=32, select_windows=8, distance_windows=8, decode_batch=4, decode_context=64,
    decode_steps=4, decode_repeats=1, pretrain_steps=100,
)  # fmt: skip


# ----------------------------------------------------------------------------------------------------- setup


def source_model(src: Path | None, quick: bool, data: Path) -> Path:
    """``--src``, else the GQA study's pretrained MHA model (its ``--quick`` one for ``quick``): from its cache,
    or pretrained by gqa_study.py on ``data`` (the text of this run, so that the held-out works are the same)."""
    if src is not None:
        return src
    model = GQA_STUDY / ("quick" if quick else "full") / "pretrain-mha"
    try:
        import gqa_study
    except ImportError:
        if (model / "config.json").is_file():
            return model
        raise SystemExit(
            f"mla_study.py: no pretrained model at {model} and no benchmarks/gqa_study.py to make one; pass "
            "--src DIR (a Llama checkpoint with its tokenizer.json)"
        ) from None
    scale = gqa_study.QUICK if quick else gqa_study.FULL
    split = gqa_study.open_cache(scale, model.parent, data)  # empties a cache made from other text
    if not (model / "config.json").is_file():
        gqa_study.run_pretrain(model.name, scale.n_heads, split, scale, model.parent)
    return model


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prepare(src: Path, cache: Path, data: Path) -> dict:
    """A private copy of the source, the GQA study's split of the works of ``data`` (whole works held out) and
    its calibration lines (256 lines of >= 7 words from the training works)."""
    copy = cache / "source"
    if not (copy / "model.safetensors").is_file() or sha256(copy / "model.safetensors") != sha256(
        src / "model.safetensors"
    ):
        shutil.rmtree(cache, ignore_errors=True)  # another source: nothing cached applies
        cache.mkdir(parents=True)
        shutil.copytree(src, cache / ".source.tmp")
        (cache / ".source.tmp").rename(copy)
    train, valid = split_held_out(text_files(data), 0.1)
    for name, files in (("train", train), ("valid", valid)):
        folder = cache / name
        if not folder.is_dir():
            tmp = cache / f".{name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            for f in files:
                (tmp / f.name).symlink_to(f)
            tmp.rename(folder)
    lines = sorted({ln.strip() for f in train for ln in f.read_text().splitlines() if len(ln.split()) >= 7})
    random.Random(0).shuffle(lines)
    calib = cache / "calib.txt"
    write_atomic(calib, "\n".join(lines[:256]) + "\n", ours=own_path(calib))
    pretrained = json.loads((copy / "uptrain.json").read_text()) if (copy / "uptrain.json").is_file() else {}
    return {
        "src": copy,
        "train": cache / "train",
        "valid": cache / "valid",
        "calib": calib,
        "pretrain_steps": pretrained.get("steps"),
        "train_works": [f.stem for f in train],
        "valid_works": [f.stem for f in valid],
    }


# ------------------------------------------------------------------------------ jobs (in worker processes)


def _worker_init() -> None:
    torch.set_num_threads(1)


def _held_out(ctx: dict, recipe: Recipe):
    return load_stream(ctx["src"], ctx["valid"], recipe.seq_len)


def _distance_batches(ctx: dict, recipe: Recipe) -> list[torch.Tensor]:
    stream = _held_out(ctx, recipe)
    x, _, _ = stream.windows(eval_windows(stream, recipe.seq_len, recipe.distance_windows), recipe.seq_len)
    return list(x.split(8))


def job_planes(g: int, rope_dim: int, stride: int, ctx: dict, recipe: Recipe) -> dict:
    """One MLA conversion in memory (no training, no latent norm: the choice of planes alone): its held-out
    loss and, for choosing rope_dim, its loss on training text."""
    started = time.perf_counter()
    source = load_llama(ctx["src"]).float()
    head_dim = source.cfg.attention.head_dim
    batches = calibration_batches(ctx["src"], ctx["calib"])
    rank = 2 * g * head_dim - rope_dim
    mla = convert_model_to_mla(source, rank, rope_dim, calib=batches, planes=stride)
    train = load_stream(ctx["src"], ctx["train"], recipe.seq_len)
    return {
        "kv_heads": g,
        "kv_lora_rank": rank,
        "rope_dim": rope_dim,
        "stride": stride,
        "loss": evaluate(mla, _held_out(ctx, recipe), recipe.seq_len, max_windows=recipe.eval_windows),
        "train_loss": evaluate(mla, train, recipe.seq_len, max_windows=recipe.select_windows)["loss"],
        "seconds": time.perf_counter() - started,
    }


def job_convert_and_uptrain(kind: str, g: int, rope_dim: int | None, ctx: dict, recipe: Recipe) -> dict:
    """``attnlab convert`` (GQA "mean" / "fit", or ``--to mla``), ``attnlab eval``, then ``attnlab uptrain`` for
    each alpha (from the converted checkpoint each time)."""
    started = time.perf_counter()
    src, cache = ctx["src"], Path(ctx["cache"])
    name = f"mla-kv{g}" if kind == "mla" else f"gqa-kv{g}-{kind}"
    converted = cache / "converted" / name
    native = None
    if kind == "mla":
        source = load_llama(src).float()
        rank = 2 * g * source.cfg.attention.head_dim - rope_dim
        summary = convert_checkpoint_to_mla(
            src, converted, rank, rope_dim, calib=ctx["calib"], overwrite=True
        )
        # What the latent norm costs on held-out text: the written checkpoint against the same conversion
        # without it (cheap to redo; the latent norm's fit is what takes the time).
        batches = calibration_batches(src, ctx["calib"])
        mla = convert_model_to_mla(source, rank, rope_dim, calib=batches, planes=summary["rope_stride"])
        stream = _held_out(ctx, recipe)
        native = {
            "distance": logit_distance(
                mla, load_causal_lm(converted).float(), _distance_batches(ctx, recipe)
            ),
            "loss_without_norm": evaluate(mla, stream, recipe.seq_len, max_windows=recipe.eval_windows)[
                "loss"
            ],
        }
    else:
        calib = ctx["calib"] if kind == "fit" else None
        summary = convert_checkpoint(src, converted, g, kind, calib=calib, overwrite=True)
    score = evaluate_checkpoint(
        converted, ctx["valid"], seq_len=recipe.seq_len, max_windows=recipe.eval_windows
    )
    rows = [{"alpha": 0.0, "steps": 0, "eval": score}]
    for alpha in ALPHAS:
        steps = max(1, round(alpha * ctx["pretrain_steps"]))
        dst = cache / "uptrain" / f"{name}-a{alpha}"
        opts = UptrainOptions(
            src=converted, dst=dst, data=ctx["train"], eval_data=ctx["valid"], steps=steps, batch_size=recipe.batch,
            seq_len=recipe.seq_len, lr=recipe.lr, warmup=max(1, round(recipe.warmup * steps)), min_lr=recipe.min_lr,
            seed=recipe.seed, save_every=0, eval_windows=recipe.eval_windows, teacher=src,
            distill_weight=recipe.distill_weight, temperature=recipe.temperature, overwrite=True,
        )  # fmt: skip
        result = uptrain(opts, progress=False)
        rows.append(
            {"alpha": alpha, "steps": steps, "eval": result["eval"], "tokens_per_s": result["tokens_per_s"]}
        )
        shutil.rmtree(dst)  # only its score is kept
    return {
        "kind": "mla" if kind == "mla" else "gqa",
        "method": kind,
        "kv_heads": g,
        "rope_dim": rope_dim,
        "conversion": summary,
        "native": native,
        "rows": rows,
        "seconds": time.perf_counter() - started,
    }


# ------------------------------------------------------------------------------------ in the main process


@torch.no_grad()
def exact_case(ctx: dict, recipe: Recipe) -> dict:
    """The one-KV-head GQA ``fit`` checkpoint as MLA at full rank with every plane kept: attnlab's MLA model
    computes it exactly; the native export differs by its latent norm only."""
    gqa_dir = Path(ctx["cache"]) / "converted" / "gqa-kv1-fit"
    gqa = load_llama(gqa_dir).float()
    attn = gqa.cfg.attention
    batches = calibration_batches(gqa_dir, ctx["calib"])
    rank = full_rank(attn, attn.head_dim)
    mla = convert_model_to_mla(gqa, rank, attn.head_dim, calib=batches)
    native, _ = fold_latent_norms(mla, batches)
    held_out = _distance_batches(ctx, recipe)
    stream = _held_out(ctx, recipe)
    scored = {
        name: evaluate(m, stream, recipe.seq_len, max_windows=recipe.eval_windows)["loss"]
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


@torch.no_grad()
def decode_speed(checkpoints: dict[str, Path], recipe: Recipe) -> dict[str, dict]:
    """Decode tokens/s with a filled cache (one thread, round robin over the models, median of the repeats);
    MLA in its absorbed mode (attention over the cached latent rows)."""
    torch.set_num_threads(1)
    models = {name: load_causal_lm(path).float().eval() for name, path in checkpoints.items()}
    for model in models.values():
        for layer in model.layers:
            if hasattr(layer.attention, "mode"):
                layer.attention.mode = "absorbed"
    vocab = next(iter(models.values())).cfg.vocab_size
    prompt = torch.randint(0, vocab, (recipe.decode_batch, recipe.decode_context))
    times, nbytes = decode_step_times(models, prompt, recipe.decode_steps, recipe.decode_repeats)
    per_token = recipe.decode_batch * (recipe.decode_context + recipe.decode_steps)
    return {
        name: {
            "tokens_per_s": recipe.decode_batch * recipe.decode_steps / sorted(ts)[len(ts) // 2],
            "kv_bytes_per_token": nbytes[name]
            / per_token,  # measured: the caches' bytes over the tokens they hold
        }
        for name, ts in times.items()
    }


def run(src: Path, recipe: Recipe, data: Path, cache: Path = CACHE) -> dict:
    started = time.perf_counter()
    loads = [os.getloadavg()[0]]
    ctx = prepare(src, cache, data) | {"cache": str(cache)}
    ctx["pretrain_steps"] = recipe.pretrain_steps or ctx["pretrain_steps"]
    if not ctx["pretrain_steps"]:
        raise SystemExit(f"mla_study.py: {src} has no uptrain.json: its pretraining steps P are unknown")
    source = load_llama(ctx["src"]).float()
    attn = source.cfg.attention
    head_dim = attn.head_dim
    rope_dims = [r for r in ROPE_DIMS if r <= head_dim]  # all of them but on the --quick model (head_dim 8)
    batches = calibration_batches(ctx["src"], ctx["calib"])
    # The stride does not depend on the latent's size: one choice per rope_dim and criterion for every cache.
    strides = {
        (r, p): choose_stride(source, r, p, calib=batches)
        for r in rope_dims
        for p in ("norm", "first", "uniform")
    }
    plane_jobs = {}
    for g in KV_HEADS:
        for r in rope_dims:
            chosen = {strides[r, "norm"]} | ({1, max_stride(head_dim, r)} if r < head_dim else set())
            for s in sorted(chosen):
                if 1 <= 2 * g * head_dim - r <= full_rank(attn, r):
                    plane_jobs[f"planes-kv{g}-r{r}-s{s}"] = (g, r, s)

    done_dir = cache / "done"
    done_dir.mkdir(exist_ok=True)
    key = dataclasses.asdict(recipe) | {"source": sha256(ctx["src"] / "model.safetensors")}
    results: dict[str, dict] = {}
    for path in done_dir.glob("*.json"):
        found = json.loads(path.read_text())
        if found.pop("key", None) == key:
            results[path.stem] = found

    def rope_choice(g: int) -> int | None:
        """The rope_dim whose RoPE-aware conversion has the lowest loss on training text (None: not all done)."""
        names = [f"planes-kv{g}-r{r}-s{strides[r, 'norm']}" for r in rope_dims]
        names = [n for n in names if n in plane_jobs]
        if not all(n in results for n in names):
            return None
        return min((results[n] for n in names), key=lambda row: row["train_loss"])["rope_dim"]

    pending: dict[Future, str] = {}
    with ProcessPoolExecutor(
        recipe.workers, mp_context=get_context("spawn"), initializer=_worker_init
    ) as pool:

        def submit(name: str, fn, *args) -> None:
            if name not in results and name not in pending.values():
                pending[pool.submit(fn, *args, ctx, recipe)] = name

        for g in KV_HEADS:  # the longest jobs first
            for method in ("mean", "fit"):
                submit(f"gqa-kv{g}-{method}", job_convert_and_uptrain, method, g, None)
        for name, (g, r, s) in plane_jobs.items():
            submit(name, job_planes, g, r, s)
        while True:
            for g in KV_HEADS:
                r = rope_choice(g)
                if r is not None:
                    submit(f"mla-kv{g}", job_convert_and_uptrain, "mla", g, r)
            if not pending:
                break
            finished, _ = wait(pending, timeout=30, return_when=FIRST_COMPLETED)
            loads.append(os.getloadavg()[0])
            for future in finished:
                name = pending.pop(future)
                results[name] = future.result()
                write_atomic(
                    done_dir / f"{name}.json",
                    json.dumps(results[name] | {"key": key}, indent=2),
                    ours=own_path(done_dir / f"{name}.json"),
                )
                print(f"[{time.perf_counter() - started:7.0f} s] done {name}", flush=True)

    stream = _held_out(ctx, recipe)
    exact = exact_case(ctx, recipe)
    converted = cache / "converted"
    decode = decode_speed(
        {"mha": ctx["src"]}
        | {f"gqa-kv{g}": converted / f"gqa-kv{g}-mean" for g in KV_HEADS}
        | {f"mla-kv{g}": converted / f"mla-kv{g}" for g in KV_HEADS},
        recipe,
    )
    loads.append(os.getloadavg()[0])
    return {
        "study": "MLA vs GQA conversion at the same KV cache, before and after uptraining",
        "source": {
            "from": str(src),
            "sha256": key["source"],
            "model": {
                "layers": source.cfg.n_layers,
                "d_model": attn.d_model,
                "n_heads": attn.n_heads,
                "n_kv_heads": attn.n_kv_heads,
                "head_dim": head_dim,
                "vocab_size": source.cfg.vocab_size,
            },
            "pretrain_steps": ctx["pretrain_steps"],
            "eval": evaluate(source, stream, recipe.seq_len, max_windows=recipe.eval_windows),
        },
        "recipe": dataclasses.asdict(recipe),
        "alphas": list(ALPHAS),
        "kv_heads": list(KV_HEADS),
        "train_works": ctx["train_works"],
        "valid_works": ctx["valid_works"],
        "strides": [{"rope_dim": r, "planes": p, "stride": s} for (r, p), s in strides.items()],
        "planes": [results[name] for name in plane_jobs],
        "runs": [results[f"gqa-kv{g}-{m}"] for g in KV_HEADS for m in ("mean", "fit")]
        + [results[f"mla-kv{g}"] for g in KV_HEADS],
        "exact": exact,
        "decode": decode,
        "seconds": time.perf_counter() - started,
        "load_average": {"samples": loads, "mean": sum(loads) / len(loads), "max": max(loads)},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
    }


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with the cache and the files filled in: ``--quick`` keeps its JSON, plot and page under
    benchmarks/.cache/ (locations.py), out of the repository."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    args.cache = CACHE / "quick" if args.quick else CACHE
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
        data = corpus(not args.quick, "mla_study.py")
        result = run(source_model(args.src, args.quick, data), recipe, data, args.cache)
        result["targets"] = targets(result)
        write_atomic(args.json, json.dumps(result, indent=2) + "\n", ours=own_path(args.json))
    plot(result, args.png)
    write_page(result, args.doc, args.png)
    print(section(result, args.png.name))
    print(f"wrote {args.json}, {args.png}, {args.doc}")


if __name__ == "__main__":
    main()
