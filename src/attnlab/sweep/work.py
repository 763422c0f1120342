"""The sweep's jobs, each a function ``(args, deps, out) -> dict`` that ``attnlab.jobs.run_jobs`` calls in a worker:
the functions behind ``attnlab convert``, ``attnlab uptrain``, ``attnlab eval`` and a timed decode, on paths.

Uptraining runs in the worker by default; with ``$ATTNLAB_SWEEP_LAUNCH`` set to a launcher command line (e.g.
``torchrun --standalone --nproc-per-node 2``) it runs as ``LAUNCH -m attnlab uptrain ... --json`` in a subprocess,
so that DDP (or ``--fsdp`` / ``--tp`` given in ``$ATTNLAB_SWEEP_UPTRAIN_FLAGS``) trains every uptraining job.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from ..convert.model import DATA_AWARE
from ..cost.memory import kv_cache_bytes

LAUNCH = "ATTNLAB_SWEEP_LAUNCH"
UPTRAIN_FLAGS = "ATTNLAB_SWEEP_UPTRAIN_FLAGS"


def convert(args: dict, deps: dict, out: Path | None) -> dict:
    """``attnlab convert SRC OUT --kv-heads G --method M`` or ``--to mla --kv-lora-rank R --rope-dim D``; the
    result holds the converted checkpoint's config.json (what the costs are computed from)."""
    from ..hf import convert_checkpoint, convert_checkpoint_to_mla

    calib = args["calib"] if args["method"] in (*DATA_AWARE, "calib") else None
    device = args.get("device", "cpu")  # (``plan.device_args``: absent on the CPU)
    if args["kind"] == "mla":
        summary = convert_checkpoint_to_mla(
            args["src"],
            out,
            args["kv_lora_rank"],
            args["rope_dim"],
            calib=calib,
            overwrite=True,
            device=device,
        )
    else:
        summary = convert_checkpoint(
            args["src"], out, args["n_kv_heads"], args["method"], calib=calib, overwrite=True, device=device
        )
    return {"config": json.loads((out / "config.json").read_text()), "summary": summary}


def uptrain(args: dict, deps: dict, out: Path | None) -> dict:
    """``attnlab uptrain SRC OUT --steps N [--teacher T] ...``, SRC being the output of the job it depends on (a
    conversion), else ``args["src"]`` (a study's pretraining from a random init); the result is its summary, whose
    ``eval`` is ``attnlab eval``'s on the held-out text. Options missing from ``args`` keep uptrain's defaults."""
    from ..train import UptrainOptions
    from ..train import uptrain as run

    (src,) = [d["out"] for d in deps.values()] or [args["src"]]
    fields = {k: args[k] for k in ("steps", "batch_size", "seq_len", "lr", "seed", "eval_windows")}
    fields |= {
        k: args[k] for k in ("warmup", "min_lr", "distill_weight", "temperature") if args.get(k) is not None
    }
    launcher = os.environ.get(LAUNCH, "").strip()
    device = args.get("device", "cpu")
    if launcher and device.startswith("cuda"):
        device = "cuda"  # under torchrun each rank takes cuda:LOCAL_RANK
    opts = UptrainOptions(
        src=Path(src), dst=out, data=Path(args["data"]), eval_data=Path(args["eval_data"]),
        teacher=Path(args["teacher"]) if args["teacher"] else None, save_every=args["save_every"], resume=True,
        overwrite=True, device=device, **fields,
    )  # fmt: skip
    if not launcher:
        return run(opts, progress=False)
    command = [*shlex.split(launcher), "-m", "attnlab", "uptrain", str(opts.src), str(opts.dst)]
    for name, value in opts.to_json().items():
        if name in ("src", "dst") or value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        command += [flag] if value is True else [flag, str(value)]
    command += [*shlex.split(os.environ.get(UPTRAIN_FLAGS, "")), "--json"]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()] or [f"exit code {proc.returncode}"]
        # attnlab's own line where a rank wrote one (under torchrun the last line is its "====" failure banner)
        ours = [ln for ln in lines if ln.startswith("attnlab: ")]
        raise RuntimeError(f"{launcher} ... uptrain failed: {(ours or lines)[-1]}")
    return json.loads(proc.stdout)


def evaluate(args: dict, deps: dict, out: Path | None) -> dict:
    """``attnlab eval CKPT --data HELDOUT --seq-len T --max-windows N``."""
    from ..train import evaluate_checkpoint

    ckpt = args["ckpt"] if args["ckpt"] is not None else next(iter(deps.values()))["out"]
    return evaluate_checkpoint(
        ckpt, args["eval_data"], seq_len=args["seq_len"], max_windows=args["eval_windows"],
        device=args.get("device", "cpu"),
    )  # fmt: skip


@torch.no_grad()
def speed(args: dict, deps: dict, out: Path | None) -> dict:
    """Decode tokens/s on this machine with a filled cache of ``context`` tokens (at most the model's positions,
    less the steps timed), the fastest of ``repeats`` (other work only ever slows a repeat down); and the caches'
    bytes, measured and from the cost model.

    One checkpoint (``args["ckpt"]``, else the one job it depends on) gives its figures. ``args["ckpts"]`` (label ->
    a checkpoint, or the name of the job that writes it) times several in turn in one process, one decode run of
    each per repeat (round robin), so that their ratios come from the same moments of a shared machine; the
    result holds each one's figures under ``"models"``."""
    before = torch.get_num_threads()
    torch.set_num_threads(args["threads"])  # the count its key and its row say, whoever runs it
    try:
        return _speed(args, deps)
    finally:
        torch.set_num_threads(before)


def _speed(args: dict, deps: dict) -> dict:
    from ..bench.generate import decode_step_times
    from ..hf import load_causal_lm

    if "ckpts" in args:
        paths = {label: deps[c]["out"] if c in deps else c for label, c in args["ckpts"].items()}
    else:
        paths = {"": args["ckpt"] if args["ckpt"] is not None else next(iter(deps.values()))["out"]}
    where = torch.device(args.get("device", "cpu"))
    models = {label: load_causal_lm(p).float().eval().to(where) for label, p in paths.items()}
    steps, batch = args["steps"], args["batch"]
    context = min([args["context"], *(m.cfg.max_seq_len - steps for m in models.values())])
    if context < 1:
        least = min(m.cfg.max_seq_len for m in models.values())
        raise ValueError(f"the model holds {least} positions: too few to time {steps} steps")
    gen = torch.Generator().manual_seed(0)
    vocab = min(m.cfg.vocab_size for m in models.values())
    prompt = torch.randint(0, vocab, (batch, context), generator=gen).to(where)
    times, nbytes = decode_step_times(models, prompt, steps, args["repeats"])
    rows = {}
    for label, model in models.items():
        predicted = kv_cache_bytes(model.cfg, batch, context + steps, "fp32")
        if (
            predicted != nbytes[label]
        ):  # the cost model is tested to equal every cache; a mismatch is a bug to see
            raise RuntimeError(f"KV cache bytes of {label or paths[label]}: cost model {predicted}, caches hold "
                               f"{nbytes[label]}")  # fmt: skip
        rows[label] = {
            "tokens_per_s": batch * steps / min(times[label]),
            "seconds": times[label],
            "context": context,
            "batch": batch,
            "steps": steps,
            "threads": torch.get_num_threads(),
            "cache_nbytes": nbytes[label],
            "cost_model_nbytes": predicted,
            "python": sys.version.split()[0],
        }
    return {"models": rows, "repeats": args["repeats"]} if "ckpts" in args else rows[""]
