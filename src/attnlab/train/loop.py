"""The uptraining loop: continue training a (converted) causal-LM checkpoint on text, on one process or many.

Read ``uptrain`` top to bottom: prepare (check everything before writing anything), then one loop over optimizer
steps, each accumulating ``grad_accum`` micro-steps (gradients are reduced over ranks only on the last one),
clipping, an AdamW step at the learning rate of ``learning_rate(step)``, a log line, and from time to time an
evaluation and a checkpoint. At the end DST is written atomically, a checkpoint like SRC.

Batches: optimizer step ``s`` consumes the samples ``s*G ... (s+1)*G - 1`` of the training order
(``attnlab.data.sample_windows``), G = batch_size x replicas x grad_accum; micro-step ``m`` of data-parallel replica
``r`` takes the ``batch_size`` samples starting at ``s*G + (m*replicas + r)*batch_size``. One process with batch 2B
and two replicas with batch B therefore see the same samples at every step (a DistributedSampler-style shard of
each batch). A replica is one rank, or with ``--tp N`` a group of N ranks that split the heads and read one batch.

Objective: next-token cross-entropy; with a teacher, ``(1 - w) * CE + w * T^2 * KL(teacher || student)`` on
logits softened by the temperature T (Hinton et al. 2015, arXiv 1503.02531).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import data
from ..hf.causal_lm import family_of, load_causal_lm, save_causal_lm
from . import checkpoint, distributed
from .evaluate import evaluate
from .options import SAME_ON_RESUME, UptrainOptions


def learning_rate(step: int, *, lr: float, steps: int, warmup: int, min_lr: float) -> float:
    """Linear warmup to ``lr`` over ``warmup`` steps, then cosine decay to ``lr * min_lr`` at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    floor = lr * min_lr
    return floor + 0.5 * (lr - floor) * (1.0 + math.cos(math.pi * min(1.0, progress)))


def select_trainable(model: nn.Module, which: str) -> list[str]:
    """Freeze all but the parameters ``--train`` names ("attention": the attention blocks); their names."""
    names = []
    for name, p in model.named_parameters():
        p.requires_grad_(which == "all" or ".attention." in f".{name}")
        if p.requires_grad:
            names.append(name)
    return names


def build_optimizer(model: nn.Module, opts: UptrainOptions) -> torch.optim.AdamW:
    """AdamW on the trainable parameters; matrices decay, vectors (norms, biases) do not (as nanoGPT)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": opts.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=opts.lr, betas=(0.9, 0.95), eps=1e-8)


def distill_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * KL(teacher || student) per token, on logits (..., vocab) softened by the temperature T."""
    s = F.log_softmax(student.float().flatten(0, -2) / temperature, dim=-1)
    t = F.log_softmax(teacher.float().flatten(0, -2) / temperature, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2


@dataclass
class Prepared:
    """What the checks before training found and loaded (on every rank)."""

    model_type: str
    model: nn.Module
    teacher: nn.Module | None
    train: data.TokenStream
    eval: data.TokenStream | None
    resume_from: Path | None


def _check_paths(opts: UptrainOptions) -> None:
    src, dst = opts.src.resolve(), opts.dst.resolve()
    if not opts.src.is_dir():
        raise FileNotFoundError(f"SRC checkpoint directory not found: {opts.src}")
    if src == dst or src in dst.parents:
        raise ValueError(f"DST {opts.dst} must be outside SRC {opts.src} (uptraining never modifies SRC)")
    if opts.dst.exists() and not opts.overwrite:
        raise FileExistsError(f"DST exists: {opts.dst} (pass --overwrite to replace it)")
    run = opts.run_path.resolve()
    if run in (src, dst) or src in run.parents or dst in run.parents:
        raise ValueError(f"the run directory {opts.run_path} must be outside SRC and DST")
    if opts.teacher is not None and not opts.teacher.is_dir():
        raise FileNotFoundError(f"--teacher checkpoint directory not found: {opts.teacher}")


def _streams(opts: UptrainOptions) -> tuple[data.TokenStream, data.TokenStream | None]:
    files = data.text_files(opts.data, "--data")
    if opts.eval_data is not None:
        train_files, eval_files = files, data.text_files(opts.eval_data, "--eval-data")
    else:
        train_files, eval_files = data.split_held_out(files, opts.held_out)
    train = data.checked_stream(
        data.tokenize_files(opts.src, train_files), opts.seq_len, f"--data {opts.data}"
    )
    held = None
    if eval_files:
        what = f"--eval-data {opts.eval_data}" if opts.eval_data is not None else "the held-out files"
        held = data.checked_stream(data.tokenize_files(opts.src, eval_files), opts.seq_len, what)
    return train, held


def _check_teacher(teacher: nn.Module, student: nn.Module, opts: UptrainOptions) -> None:
    if teacher.cfg.vocab_size != student.cfg.vocab_size:
        raise ValueError(
            f"--teacher {opts.teacher} has vocab_size {teacher.cfg.vocab_size} but SRC has "
            f"{student.cfg.vocab_size}: distillation needs the same vocabulary"
        )
    if (opts.teacher / "tokenizer.json").is_file():
        theirs = data.load_tokenizer(opts.teacher).get_vocab()
        if theirs != data.load_tokenizer(opts.src).get_vocab():
            raise ValueError(f"--teacher {opts.teacher} has another tokenizer vocabulary than SRC {opts.src}")


def _resume_point(opts: UptrainOptions, env: distributed.Env) -> Path | None:
    """Decide, on rank 0, whether the run directory is continued, started over or refused."""

    def decide() -> tuple[str, Any]:
        run = opts.run_path
        found = checkpoint.checkpoints(run)
        if found and opts.resume:
            saved = checkpoint.read_state(found[-1])
            for name in SAME_ON_RESUME:
                was, now = saved["options"].get(name), opts.to_json()[name]
                if was != now:
                    flag = "--" + name.replace("_", "-")
                    return "error", f"--resume: {flag} was {was!r} in the interrupted run, now {now!r}"
            if saved["global_batch"] != opts.batch_size * env.dp_size * opts.grad_accum:
                return "error", (
                    f"--resume: the global batch (batch size x data-parallel replicas x grad accum) was "
                    f"{saved['global_batch']}, now {opts.batch_size * env.dp_size * opts.grad_accum}"
                )
            return "ok", str(found[-1])
        if found and not opts.overwrite:
            return "error", (
                f"{run} holds checkpoints of an interrupted run (newest {found[-1].name}): pass --resume to "
                "continue it or --overwrite to start over"
            )
        return "ok", None

    verdict, value = distributed.broadcast_object(decide() if env.is_main else None, env)
    if verdict == "error":
        raise ValueError(value)
    return Path(value) if value else None


def prepare(opts: UptrainOptions, env: distributed.Env) -> Prepared:
    """Every check that can fail, before anything is written; loads the model (float32) and the teacher."""
    _check_paths(opts)
    model_type = family_of(opts.src)
    model = load_causal_lm(opts.src).float()
    if opts.tp > 1:
        from ..parallel import check_tp

        check_tp(model.cfg, opts.tp)  # on every rank, before a collective touches the model
    if opts.seq_len > model.cfg.max_seq_len:
        raise ValueError(
            f"--seq-len {opts.seq_len} exceeds the model's max_position_embeddings {model.cfg.max_seq_len}"
        )
    teacher = None
    if opts.teacher is not None:
        teacher = load_causal_lm(opts.teacher).float().requires_grad_(False)
        _check_teacher(teacher, model, opts)
    train, held = _streams(opts)
    return Prepared(model_type, model, teacher, train, held, _resume_point(opts, env))


def _batch(
    stream: data.TokenStream, opts: UptrainOptions, env: distributed.Env, step: int, micro: int
) -> tuple[torch.Tensor, torch.Tensor]:
    global_batch = opts.batch_size * env.dp_size * opts.grad_accum
    first = step * global_batch + (micro * env.dp_size + env.dp_rank) * opts.batch_size
    windows = data.sample_windows(
        stream.n_windows(opts.seq_len), opts.seed, torch.arange(first, first + opts.batch_size)
    )
    x, y, _ = stream.windows(windows, opts.seq_len)
    return x.to(env.device), y.to(env.device)


def uptrain(opts: UptrainOptions, *, progress: bool = True) -> dict:
    """Run (or resume) an uptraining; returns the summary (also written to DST/uptrain.json)."""
    env = distributed.setup(opts.tp)
    try:
        return _uptrain(opts, env, progress)
    finally:
        distributed.teardown(env)


def _uptrain(opts: UptrainOptions, env: distributed.Env, progress: bool) -> dict:
    from .progress import StepLog

    started = time.perf_counter()
    torch.manual_seed(opts.seed)
    prep = prepare(opts, env)
    model, cfg = prep.model.to(env.device), prep.model.cfg
    teacher = None
    if prep.teacher is not None:
        teacher = distributed.shard_frozen(prep.teacher.to(env.device), env, fsdp=opts.fsdp)
    trainable = select_trainable(model, opts.train)
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    model = distributed.parallelize(model, env, fsdp=opts.fsdp)
    optimizer = build_optimizer(model, opts)

    run = opts.run_path
    step = resumed = 0
    if env.is_main:
        checkpoint.remove_partial(run)
        if prep.resume_from is None and run.exists():
            shutil.rmtree(run)  # a run that never saved a checkpoint (or --overwrite): start over
        run.mkdir(parents=True, exist_ok=True)
    distributed.barrier(env)
    if prep.resume_from is not None:
        step = resumed = checkpoint.load_checkpoint(prep.resume_from, model, optimizer, env)["step"]
    global_batch = opts.batch_size * env.dp_size * opts.grad_accum
    log = StepLog(run / "log.jsonl", first_step=step, total=opts.steps, show=progress, env=env)
    autocast = torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=opts.dtype == "bf16")
    scored = {"batch_size": opts.batch_size, "max_windows": opts.eval_windows, "env": env}

    def held_out() -> dict | None:
        return evaluate(model, prep.eval, opts.seq_len, **scored) if prep.eval is not None else None

    eval_before = held_out() if opts.eval_every and step == 0 else None
    model.train()
    with log:
        while step < opts.steps:
            tick = time.perf_counter()
            lr = learning_rate(
                step, lr=opts.lr, steps=opts.steps, warmup=opts.warmup_steps, min_lr=opts.min_lr
            )
            for group in optimizer.param_groups:
                group["lr"] = lr
            sums = torch.zeros(
                3, device=env.device
            )  # loss, cross-entropy, distillation (means per micro-step)
            for micro in range(opts.grad_accum):
                x, y = _batch(prep.train, opts, env, step, micro)
                with distributed.grad_sync(model, micro == opts.grad_accum - 1):
                    with autocast:
                        logits = model(x)
                    ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                    loss, kl = ce, torch.zeros((), device=env.device)
                    if teacher is not None:
                        with torch.no_grad(), autocast:
                            teacher_logits = teacher(x)
                        kl = distill_loss(logits, teacher_logits, opts.temperature)
                        loss = (1.0 - opts.distill_weight) * ce + opts.distill_weight * kl
                    (loss / opts.grad_accum).backward()
                sums += torch.stack((loss, ce, kl)).detach()
            grad_norm = distributed.clip_grad_norm_(
                [p for p in model.parameters() if p.requires_grad], opts.grad_clip or float("inf")
            )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            loss, ce, kl = (distributed.all_reduce_sum(sums, env) / (opts.grad_accum * env.dp_size)).tolist()
            record = {"step": step, "lr": lr, "loss": loss, "ce": ce, "grad_norm": float(grad_norm)}
            if teacher is not None:
                record["distill"] = kl
            if opts.eval_every and step % opts.eval_every == 0 and step < opts.steps:
                record["eval"] = held_out()
            log.step(record, tokens=global_batch * opts.seq_len, seconds=time.perf_counter() - tick)
            if opts.save_every and step % opts.save_every == 0 and step < opts.steps:
                meta = {"samples": step * global_batch, "global_batch": global_batch}
                meta |= {"world_size": env.world_size, "tp": env.tp, "options": opts.to_json()}
                checkpoint.save_checkpoint(run, step, model, optimizer, env, meta, opts.keep)

    final = held_out()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    summary = {
        "src": str(opts.src),
        "dst": str(opts.dst),
        "model_type": prep.model_type,
        "steps": opts.steps,
        "resumed_from_step": resumed if prep.resume_from is not None else None,
        "world_size": env.world_size,
        "tp": env.tp,
        "fsdp": distributed.uses_fsdp(env, opts.fsdp),
        "global_batch": global_batch,
        "tokens_per_step": global_batch * opts.seq_len,
        "train": opts.train,
        "parameters": n_params,
        "trainable_parameters": n_trainable,
        "trainable_tensors": len(trainable),
        "train_files": len(prep.train.files),
        "eval_files": len(prep.eval.files) if prep.eval is not None else 0,
        "train_loss_first": log.first_loss,
        "train_loss_last": log.last_loss,
        "eval_before": eval_before,
        "eval": final,
        "seconds": time.perf_counter() - started,
        "tokens_per_s": log.tokens_per_s,
        "options": opts.to_json(),
    }
    if env.is_main:
        save_causal_lm(
            state,
            cfg,
            opts.dst,
            like=opts.src,
            overwrite=opts.overwrite,
            extra_files={
                "uptrain_log.jsonl": (run / "log.jsonl").read_text(),
                "uptrain.json": json.dumps(summary, indent=2) + "\n",
            },
        )
        shutil.rmtree(run)
    distributed.barrier(env)
    return summary
