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
    if args["kind"] == "mla":
        summary = convert_checkpoint_to_mla(
            args["src"], out, args["kv_lora_rank"], args["rope_dim"], calib=calib, overwrite=True
        )
    else:
        summary = convert_checkpoint(
            args["src"], out, args["n_kv_heads"], args["method"], calib=calib, overwrite=True
        )
    return {"config": json.loads((out / "config.json").read_text()), "summary": summary}


def uptrain(args: dict, deps: dict, out: Path | None) -> dict:
    """``attnlab uptrain CONVERTED OUT --steps N [--teacher SRC] ...``; the result is its summary, whose ``eval``
    is ``attnlab eval``'s on the held-out text."""
    from ..train import UptrainOptions
    from ..train import uptrain as run

    (converted,) = (d["out"] for d in deps.values())
    fields = {k: args[k] for k in ("steps", "batch_size", "seq_len", "lr", "seed", "eval_windows")}
    opts = UptrainOptions(
        src=Path(converted), dst=out, data=Path(args["data"]), eval_data=Path(args["eval_data"]),
        teacher=Path(args["teacher"]) if args["teacher"] else None, save_every=args["save_every"], resume=True,
        overwrite=True, **fields,
    )  # fmt: skip
    launcher = os.environ.get(LAUNCH, "").strip()
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
        raise RuntimeError(f"{launcher} ... uptrain failed: {lines[-1]}")
    return json.loads(proc.stdout)


def evaluate(args: dict, deps: dict, out: Path | None) -> dict:
    """``attnlab eval CKPT --data HELDOUT --seq-len T --max-windows N``."""
    from ..train import evaluate_checkpoint

    ckpt = args["ckpt"] if args["ckpt"] is not None else next(iter(deps.values()))["out"]
    return evaluate_checkpoint(
        ckpt, args["eval_data"], seq_len=args["seq_len"], max_windows=args["eval_windows"]
    )


@torch.no_grad()
def speed(args: dict, deps: dict, out: Path | None) -> dict:
    """Decode tokens/s on this machine with a filled cache of ``context`` tokens (at most the model's positions,
    less the steps timed), the fastest of ``repeats`` (other work only ever slows a repeat down); and the caches'
    bytes, measured and from the cost model."""
    from ..bench.generate import decode_step_times
    from ..hf import load_causal_lm

    ckpt = args["ckpt"] if args["ckpt"] is not None else next(iter(deps.values()))["out"]
    model = load_causal_lm(ckpt).float().eval()
    steps, batch = args["steps"], args["batch"]
    context = min(args["context"], model.cfg.max_seq_len - steps)
    if context < 1:
        raise ValueError(f"the model holds {model.cfg.max_seq_len} positions: too few to time {steps} steps")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.cfg.vocab_size, (batch, context), generator=gen)
    times, nbytes = decode_step_times({0: model}, prompt, steps, args["repeats"])
    predicted = kv_cache_bytes(model.cfg, batch, context + steps, "fp32")
    if predicted != nbytes[0]:  # the cost model is tested to equal every cache; a mismatch is a bug to see
        raise RuntimeError(f"KV cache bytes: cost model {predicted}, caches hold {nbytes[0]}")
    return {
        "tokens_per_s": batch * steps / min(times[0]),
        "seconds": times[0],
        "context": context,
        "batch": batch,
        "steps": steps,
        "threads": torch.get_num_threads(),
        "cache_nbytes": nbytes[0],
        "cost_model_nbytes": predicted,
        "python": sys.version.split()[0],
    }
