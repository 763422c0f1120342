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

import contextlib
import gc
import hashlib
import math
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .. import atomic, data, resources
from ..cost.memory import training_step_bytes
from ..hf.causal_lm import family_of, load_causal_lm, save_causal_lm
from ..hf.io import copy_other_files, weights_id
from ..hf_config import from_hf_config
from . import checkpoint, distributed
from .evaluate import evaluate, tokenising
from .options import SAME_ON_RESUME, UptrainOptions


def learning_rate(step: int, *, lr: float, steps: int, warmup: int, min_lr: float) -> float:
    """Linear warmup to ``lr`` over ``warmup`` steps (step ``warmup - 1`` is at ``lr``), then cosine decay from ``lr``
    (step ``warmup``) to ``lr * min_lr`` at the last step. With ``warmup >= steps - 1`` no decay step remains: the
    run ends at ``lr``."""
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
    inputs: dict  # what the run reads (``_inputs_id``), saved with each checkpoint for --resume to compare
    # each parameter's dtype in SRC, which DST keeps (the model trains in float32)
    dtypes: dict[str, torch.dtype]


def _inputs(opts: UptrainOptions) -> tuple[Path | None, ...]:
    """Every path the run reads: never written, emptied or deleted (``attnlab.atomic``)."""
    return (opts.src, opts.data, opts.eval_data, opts.teacher)


def _run_name(opts: UptrainOptions) -> str:
    """How messages name the run directory (they add its path)."""
    return "--run-dir" if opts.run_dir is not None else "the run directory"


def _check_paths(opts: UptrainOptions) -> None:
    """The write rule for DST and the run directory, checked on every rank before anything is loaded."""
    for path, flag in ((opts.src, "SRC"), (opts.teacher, "--teacher")):
        if path is not None and not path.is_dir():
            if path.exists():  # "not found" sent users looking for a path that was there
                raise ValueError(
                    f"{flag} {path} is a file, not a checkpoint directory (config.json + safetensors)"
                )
            raise FileNotFoundError(f"{flag} checkpoint directory not found: {atomic.named(path)}")
    if opts.teacher is not None and not (opts.teacher / "config.json").is_file():
        raise ValueError(f"--teacher {opts.teacher} is not a checkpoint directory (no config.json)")
    try:
        atomic.check_destination(opts.dst, _inputs(opts), overwrite=opts.overwrite, what="DST")
    except FileExistsError as err:
        run = opts.run_path
        if not opts.overwrite and atomic.marker_kind(run) == "run" and (opts.dst / "uptrain.json").is_file():
            # a run killed between writing DST and deleting its run directory: checkpoints of ~3x the model
            raise FileExistsError(
                f"{err}; {_run_name(opts)} {run} is left over from the run that wrote it (kept for files added to "
                "it, or stopped before it was deleted): delete it yourself once DST is what you want"
            ) from None
        raise
    # DST gets SRC's other files after training: a broken link among them is refused now
    copy_other_files(opts.src, None)
    atomic.check_claim(opts.run_path, "run", sources=_inputs(opts), what=_run_name(opts))
    run, dst = opts.run_path.resolve(), opts.dst.resolve()
    if run == dst or dst in run.parents or run in dst.parents:
        raise ValueError(f"{_run_name(opts)} {opts.run_path} and DST {opts.dst} must lie outside each other")


def _check_sizes(opts: UptrainOptions, env: distributed.Env) -> None:
    """What the model's config.json alone decides (no weights loaded, no collective issued, on every rank):
    tensor-parallel sizes, the sequence length, and whether a training step fits in memory."""
    cfg = from_hf_config(opts.src)
    if opts.tp > 1:
        from ..parallel import check_shardable

        check_shardable(cfg, opts.tp, flag="--tp")
    if opts.seq_len > cfg.max_seq_len:
        raise ValueError(
            f"--seq-len {opts.seq_len} exceeds the model's max_position_embeddings {cfg.max_seq_len}"
        )
    teacher = from_hf_config(opts.teacher) if opts.teacher is not None else None
    if teacher is not None and opts.seq_len > teacher.max_seq_len:  # it would score positions it never had
        raise ValueError(
            f"--seq-len {opts.seq_len} exceeds --teacher {opts.teacher}'s max_position_embeddings "
            f"{teacher.max_seq_len}"
        )
    if env.device.type == "cpu":
        resources.check_fits(
            training_step_bytes(cfg, opts.batch_size, opts.seq_len, teacher=teacher),
            f"--batch-size {opts.batch_size} x --seq-len {opts.seq_len}",
            "lower --batch-size (--grad-accum N keeps the global batch: N micro-steps per optimizer step)",
        )


def _streams(
    opts: UptrainOptions, vocab_size: int, show: bool = False
) -> tuple[data.TokenStream, data.TokenStream | None]:
    """The training and held-out streams; ``show``: the tokenising as progress on stderr (``tokenising``)."""
    files = data.text_files(opts.data, "--data")
    if opts.eval_data is not None:
        train_files, eval_files = files, data.text_files(opts.eval_data, "--eval-data")
    else:
        train_files, eval_files = data.split_held_out(files, opts.held_out)
    with tokenising(show) as tell:
        train = data.checked_stream(
            data.tokenize_files(opts.src, train_files, vocab_size, progress=tell),
            opts.seq_len,
            f"--data {opts.data}",
        )
        held = None
        if eval_files:
            flag = "--eval-data" if opts.eval_data is not None else "--data"
            names = ", ".join(str(f) for f in eval_files[:3]) + (", ..." if len(eval_files) > 3 else "")
            what = (
                f"--eval-data {opts.eval_data}"
                if opts.eval_data is not None
                else f"the held-out text ({names})"
            )
            held = data.checked_stream(
                data.tokenize_files(opts.src, eval_files, vocab_size, flag, progress=tell), opts.seq_len, what
            )
    return train, held


def _check_teacher(teacher: nn.Module, student: nn.Module, opts: UptrainOptions) -> None:
    if teacher.cfg.vocab_size != student.cfg.vocab_size:
        raise ValueError(
            f"--teacher {opts.teacher} has vocab_size {teacher.cfg.vocab_size} but SRC has "
            f"{student.cfg.vocab_size}: distillation needs the same vocabulary"
        )
    if (opts.teacher / "tokenizer.json").is_file():
        theirs = data.load_tokenizer(opts.teacher, teacher.cfg.vocab_size).get_vocab()
        if theirs != data.load_tokenizer(opts.src, student.cfg.vocab_size).get_vocab():
            raise ValueError(f"--teacher {opts.teacher} has another tokenizer vocabulary than SRC {opts.src}")


# Options naming inputs: --resume compares what they are (``_inputs_id``), not how their paths are spelled.
PATH_OPTIONS = ("src", "data", "eval_data", "teacher")


def _inputs_id(opts: UptrainOptions) -> dict:
    """What the run reads: SRC and the teacher by their resolved paths, the text of --data and --eval-data by its
    files' names and bytes (``data.fingerprint``); a checkpoint carries it, and --resume refuses other inputs."""
    text = [data.fingerprint(data.text_files(root, flag)) if root is not None else None
            for root, flag in ((opts.data, "--data"), (opts.eval_data, "--eval-data"))]  # fmt: skip
    teacher = str(opts.teacher.resolve()) if opts.teacher is not None else None
    # each checkpoint's config.json and weight files: another model written to the same path (a convert
    # --overwrite) is another input, of the same shape too
    configs = [_config_id(path) if path is not None else None for path in (opts.src, opts.teacher)]
    weights = [weights_id(path) if path is not None else None for path in (opts.src, opts.teacher)]
    return {
        "src": str(opts.src.resolve()),
        "teacher": teacher,
        "text": text,
        "configs": configs,
        "weights": weights,
    }


def _config_id(checkpoint: Path) -> str:
    return hashlib.sha256((checkpoint / "config.json").read_bytes()).hexdigest()[:16]


def _same_inputs(saved: dict | None, now: dict) -> None:
    """A resumed run reads what the interrupted one read (checkpoints from before ``_inputs_id`` carry none)."""
    if saved is None:
        return
    for i, (key, flag) in enumerate((("src", "SRC"), ("teacher", "--teacher"))):
        if saved[key] != now[key]:
            raise ValueError(f"--resume: {flag} was {saved[key]} in the interrupted run, now {now[key]}")
        # checkpoints from before the config hash (the weights' id) hold none
        for part, what in (
            ("configs", "its config.json changed"),
            ("weights", "its weight files were written"),
        ):
            if part in saved and saved[part][i] != now[part][i]:
                raise ValueError(
                    f"--resume: {flag} {now[key]} is not the checkpoint the interrupted run started from ({what} "
                    "since): start over with --overwrite"
                )
    if saved["text"] != now["text"]:
        raise ValueError(
            "--resume: the text of --data / --eval-data is not what the interrupted run read (a file was added, "
            "removed, renamed or changed)"
        )


def _claim(
    opts: UptrainOptions, env: distributed.Env, held: contextlib.ExitStack, inputs: dict
) -> Path | None:
    """On rank 0: take DST's and the run directory's one-writer locks for the whole run, then decide whether the
    run directory is continued (the checkpoint returned), started over (None) or refused."""

    def decide() -> str | None:
        held.enter_context(atomic.lock(opts.dst, "DST"))
        # SRC is read again after training (config, shard map and side files go into DST): no attnlab writer
        # may replace it meanwhile, and the run's work is not lost at its final write
        held.enter_context(atomic.reading(opts.src, "SRC"))
        held.enter_context(atomic.lock(opts.run_path, _run_name(opts)))
        _check_paths(opts)  # again, under the locks
        found = checkpoint.checkpoints(opts.run_path)
        if found and opts.resume:
            saved = checkpoint.verify(found[-1])
            _same_inputs(saved.get("inputs"), inputs)
            for name in SAME_ON_RESUME:
                if name in PATH_OPTIONS and saved.get("inputs") is not None:
                    continue  # compared by what they are, above
                was, now = saved["options"].get(name), opts.to_json()[name]
                if was != now:
                    flag = "--" + name.replace("_", "-")
                    raise ValueError(f"--resume: {flag} was {was!r} in the interrupted run, now {now!r}")
            if saved["global_batch"] != opts.batch_size * env.dp_size * opts.grad_accum:
                raise ValueError(
                    f"--resume: the global batch (batch size x data-parallel replicas x grad accum) was "
                    f"{saved['global_batch']}, now {opts.batch_size * env.dp_size * opts.grad_accum}"
                )
            return str(found[-1])
        if found and not opts.overwrite:
            raise ValueError(
                f"{opts.run_path} holds checkpoints of an interrupted run (newest {found[-1].name}): pass --resume to "
                f"continue it, or {checkpoint.start_over(opts.run_path)}"
            )
        # started over: the run directory is emptied, which a file a user added there stops now, before loading
        atomic.check_claim(opts.run_path, "run", sources=_inputs(opts), fresh=True, what=_run_name(opts))
        return None

    value = distributed.on_main(decide, env)
    return Path(value) if value else None


def prepare(
    opts: UptrainOptions, env: distributed.Env, held: contextlib.ExitStack, progress: bool = False
) -> Prepared:
    """Every check that can fail, before anything is written; loads the model (float32) and the teacher.

    Checks that need no collective come first, on every rank (a bad tensor-parallel size stops every rank before
    the first one); then rank 0 takes the locks and decides about the run directory (``_claim``)."""
    _check_paths(opts)
    model_type = family_of(opts.src)
    _check_sizes(opts, env)
    inputs = _inputs_id(opts)
    resume_from = _claim(opts, env, held, inputs)
    model = load_causal_lm(opts.src)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    model = model.float()
    teacher = None
    if opts.teacher is not None:
        teacher = load_causal_lm(opts.teacher).float().requires_grad_(False)
        _check_teacher(teacher, model, opts)
    train, held_out = _streams(opts, model.cfg.vocab_size, show=progress and env.is_main)
    return Prepared(model_type, model, teacher, train, held_out, resume_from, inputs, dtypes)


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
    if opts.tp > 1 and (opts.src / "config.json").is_file():
        # the model's heads before the ranks: "launch with --nproc-per-node 3" is no advice for a --tp 3 that
        # cannot split the heads either (_check_sizes checks it again, with the rest, after the setup)
        from ..parallel import check_shardable

        check_shardable(from_hf_config(opts.src), opts.tp, flag="--tp")
    env = distributed.setup(opts.tp, opts.device)
    try:
        # DST's and the run directory's locks (rank 0), for the whole run
        # warnings.catch_warnings: the filters the run sets (distributed.parallelize's) end with it
        with contextlib.ExitStack() as held, warnings.catch_warnings(), distributed.quiet_redistribution():
            return _uptrain(opts, env, progress, held)
    finally:
        # FSDP2's modules hold reference cycles to pending collective work; collected at interpreter exit, after the
        # process group is gone, gloo's worker threads abort the process ("terminate called without an active
        # exception", seen on one rank in ~1 of 5 loaded test runs). Collect them while the group still runs.
        gc.collect()
        distributed.teardown(env)


def announce(env: distributed.Env, opts: UptrainOptions) -> None:
    """The device line: where rank 0 trains, in which precision, and (torchrun) how the ranks split the work."""
    how = "bf16 autocast (fp32 weights)" if opts.dtype == "bf16" else "fp32"
    if env.distributed:
        each = "cuda:LOCAL_RANK" if env.device.type == "cuda" else "the CPU"
        how += f"; {env.world_size} ranks, each on {each}, {distributed.backend(env.device)}"
    resources.announce_device(env.device, how)


def _last_checkpoint(run: Path) -> str:
    found = checkpoint.checkpoints(run)
    if not found:
        return "no checkpoint was saved yet, so a rerun starts from the beginning"
    return f"the last complete checkpoint is {found[-1]}: rerun the same command with --resume to continue from it"


@contextlib.contextmanager
def _resumable(run: Path) -> Iterator[None]:
    """A failed write during training (a full disk, a quota) leaves the run directory's last complete checkpoint;
    the error says where it is and how to continue."""
    try:
        yield
    except OSError as err:
        if err.strerror is None:
            raise
        reason = err.strerror.removesuffix(" (nothing was written; any previous version is unchanged)")
        raise OSError(err.errno, f"{reason}; {_last_checkpoint(run)}", err.filename) from err


def _round_as_written(
    model: nn.Module, dtypes: dict[str, torch.dtype], env: distributed.Env, run: Path
) -> None:
    """Round the trained weights to the dtypes DST holds them in (SRC's: a bfloat16 checkpoint stays one), so that
    the final evaluation, which the summary and ``attnlab sweep`` report, is DST's and not the float32 training
    copy's. A weight that its dtype cannot hold (past float16's range) is refused before anything is written."""
    overflow = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            dtype = dtypes.get(name.removeprefix("module."))  # DDP's wrapper; FSDP2 and TP keep the names
            if dtype is None or dtype == p.dtype:
                continue
            p.copy_(p.to(dtype))
            local = p.to_local() if hasattr(p, "to_local") else p  # a DTensor's shard
            if not bool(torch.isfinite(local).all()):
                overflow.append(f"{name.removeprefix('module.')} ({str(dtype).removeprefix('torch.')})")
    if distributed.any_rank(bool(overflow), env):
        raise ValueError(
            f"the trained weights do not fit the checkpoint's dtype: {', '.join(overflow[:3]) or 'a shard'} "
            f"overflow; nothing was written to DST and {_last_checkpoint(run).split(':')[0]}: lower --lr, or "
            "train a float32 or bfloat16 copy of SRC"
        )


def _check_finite_step(step: int, loss: float, grad_norm: float, lr: float, run: Path) -> None:
    """A non-finite loss or gradient would make every later weight NaN: stop before the optimizer uses it."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    raise ValueError(
        f"training diverged at step {step + 1} (loss {loss}, gradient norm {grad_norm}, learning rate {lr:.3g}); "
        f"nothing was written to DST and {_last_checkpoint(run).split(':')[0]}: lower --lr (or raise --warmup) "
        "and start over with --overwrite"
    )


def _uptrain(opts: UptrainOptions, env: distributed.Env, progress: bool, held: contextlib.ExitStack) -> dict:
    from .progress import StepLog

    started = time.perf_counter()
    torch.manual_seed(opts.seed)
    prep = prepare(opts, env, held, progress)
    if env.is_main:
        announce(env, opts)
        # a script that always passes --resume: say what it got (the sweep's jobs, which ask for no progress, do)
        if opts.resume and prep.resume_from is None and progress:
            print(f"--resume: {opts.run_path} holds no checkpoint; starting at step 0", file=sys.stderr)
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
        # Created with attnlab's marker, or (a run that never saved a checkpoint, or --overwrite) emptied.
        atomic.claim_dir(
            run, "run", sources=_inputs(opts), fresh=prep.resume_from is None, what=_run_name(opts)
        )
    distributed.barrier(env)
    saved: dict = {}
    if prep.resume_from is not None:
        saved = checkpoint.load_checkpoint(prep.resume_from, model, optimizer, env)
        step = resumed = saved["step"]
    global_batch = opts.batch_size * env.dp_size * opts.grad_accum
    log = StepLog(run / "log.jsonl", first_step=step, total=opts.steps, show=progress, env=env)
    autocast = torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=opts.dtype == "bf16")
    scored = {"batch_size": opts.batch_size, "max_windows": opts.eval_windows, "env": env}

    def held_out() -> dict | None:
        return evaluate(model, prep.eval, opts.seq_len, **scored) if prep.eval is not None else None

    # the evaluation before training, made by the run that started at step 0 (a resumed run reads it back)
    eval_before = held_out() if opts.eval_every and step == 0 else saved.get("eval_before")
    model.train()
    with log, _resumable(run):
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
            loss, ce, kl = (distributed.all_reduce_sum(sums, env) / (opts.grad_accum * env.dp_size)).tolist()
            _check_finite_step(step, loss, float(grad_norm), lr, run)  # the same values on every rank
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            record = {"step": step, "lr": lr, "loss": loss, "ce": ce, "grad_norm": float(grad_norm)}
            if teacher is not None:
                record["distill"] = kl
            seconds = time.perf_counter() - tick  # the step's training time: tokens/s leaves the eval out
            if opts.eval_every and step % opts.eval_every == 0 and step < opts.steps:
                record["eval"] = held_out()
            log.step(record, tokens=global_batch * opts.seq_len, seconds=seconds)
            if opts.save_every and step % opts.save_every == 0 and step < opts.steps:
                meta = {"samples": step * global_batch, "global_batch": global_batch}
                meta |= {
                    "world_size": env.world_size,
                    "tp": env.tp,
                    "options": opts.to_json(),
                    "inputs": prep.inputs,
                    "eval_before": eval_before,
                }
                checkpoint.save_checkpoint(run, step, model, optimizer, env, meta, opts.keep)

    _round_as_written(model, prep.dtypes, env, run)
    final = held_out()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    summary = {
        "src": str(opts.src),
        "dst": str(opts.dst),
        "model_type": prep.model_type,
        "steps": opts.steps,
        "resumed_from_step": resumed if prep.resume_from is not None else None,
        "device": str(env.device),  # rank 0's (under torchrun with GPUs each rank has its own)
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
        with _resumable(run):
            save_causal_lm(
                state,
                cfg,
                opts.dst,
                like=opts.src,
                overwrite=opts.overwrite,
                sources=(*_inputs(opts), run),
                extra_files={
                    "uptrain_log.jsonl": (run / "log.jsonl").read_text(),
                    "uptrain.json": atomic.json_text(summary),
                },
            )
        # DST is written; a checkpoint a user put files in is kept with the run directory, and said
        atomic.remove_or_keep(run, "run", _run_name(opts))
    distributed.barrier(env)
    return summary
