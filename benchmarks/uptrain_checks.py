"""Measured properties of ``attnlab uptrain`` on this machine: data parallelism follows the one-process loss
curve, and a run killed with SIGKILL resumes to the same weights bit for bit.

A small random Llama (transformers) with a byte-level BPE tokenizer is uptrained on three Shakespeare plays (the
first 40,000 characters of Hamlet, Macbeth and Othello from the corpus attnlab ships, the same bytes as in the
full corpus):

- one process with batch 4, ``torchrun --nproc-per-node 2`` with batch 2 (DDP), and the same with ``--fsdp``:
  the largest difference of the per-step losses and of the final weights;
- a run killed with SIGKILL after a checkpoint and resumed with ``--resume``: whether its weights equal the
  uninterrupted run's byte for byte, and whether every step is logged exactly once.

    python benchmarks/uptrain_checks.py      # writes benchmarks/results/uptrain_checks.json (~1-2 min)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

from attnlab.atomic import write_atomic
from attnlab.data import shakespeare, train_byte_bpe

sys.path.insert(0, str(Path(__file__).resolve().parent))  # locations.py, beside this script
from locations import own_path

ROOT = Path(__file__).resolve().parents[1]
ENV = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
STEPS = 40


def command(*args, ranks: int = 1) -> list[str]:
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    return [*launcher, "-m", "attnlab", *map(str, args)]


def build(root: Path) -> tuple[Path, Path]:
    corpus = root / "corpus"
    corpus.mkdir()
    for name in ("hamlet", "macbeth", "othello"):
        (corpus / f"{name}.txt").write_text((shakespeare() / f"{name}.txt").read_text()[:40000])
    tok = train_byte_bpe([p.read_text() for p in sorted(corpus.glob("*.txt"))], 512)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=128, eos_token_id=0, bos_token_id=0,
    )  # fmt: skip
    src = root / "src"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(src)
    tok.save(str(src / "tokenizer.json"))
    return src, corpus


def log_of(dst: Path) -> list[dict]:
    return [json.loads(line) for line in (dst / "uptrain_log.jsonl").read_text().splitlines()]


def compare(a: Path, b: Path) -> dict:
    la, lb = [r["loss"] for r in log_of(a)], [r["loss"] for r in log_of(b)]
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return {
        "steps": len(la),
        "max_abs_loss_difference": max(abs(x - y) for x, y in zip(la, lb, strict=True)),
        "max_rel_loss_difference": max(abs(x - y) / abs(y) for x, y in zip(la, lb, strict=True)),
        "max_abs_weight_difference": max((wa[k] - wb[k]).abs().max().item() for k in wa),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " ")
    )  # the first paragraph
    parser.add_argument(
        "--json",
        type=Path,
        default=ROOT / "benchmarks" / "results" / "uptrain_checks.json",
        help="the result file",
    )
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src, corpus = build(root)
        common = ["--data", corpus, "--steps", STEPS, "--seq-len", 64, "--lr", 3e-3, "--warmup", 4]
        runs = {
            "one": (["--batch-size", 4, "--save-every", 0], 1),
            "ddp": (["--batch-size", 2, "--save-every", 0], 2),
            "fsdp": (["--batch-size", 2, "--save-every", 0, "--fsdp"], 2),
        }
        for name, (extra, ranks) in runs.items():
            subprocess.run(command("uptrain", src, root / name, *common, *extra, ranks=ranks), env=ENV, check=True,
                           capture_output=True)  # fmt: skip
        result = {
            "model": "Llama, 2 layers, d_model 64, 8 query heads, 2 KV heads, vocab 512 (random init)",
            "steps": STEPS,
            "global_batch": 4,
            "ddp_vs_one_process": compare(root / "ddp", root / "one"),
            "fsdp_vs_one_process": compare(root / "fsdp", root / "one"),
        }

        args = [*common, "--batch-size", 4, "--save-every", 5]
        run = root / "killed.run"
        proc = subprocess.Popen(
            command("uptrain", src, root / "killed", *args), env=ENV, stderr=subprocess.DEVNULL
        )
        while not (run / "log.jsonl").is_file() or len((run / "log.jsonl").read_text().splitlines()) < 13:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        killed_at = len((run / "log.jsonl").read_text().splitlines())
        code = proc.wait()
        resumed = subprocess.run(command("uptrain", src, root / "killed", *args, "--resume", "--json"), env=ENV,
                                 check=True, capture_output=True, text=True)  # fmt: skip
        steps = [r["step"] for r in log_of(root / "killed")]
        result["sigkill_resume"] = {
            "exit_code_of_killed_run": code,
            "steps_logged_when_killed": killed_at,
            "resumed_from_step": json.loads(resumed.stdout)["resumed_from_step"],
            "weights_equal_bit_for_bit": (root / "killed" / "model.safetensors").read_bytes()
            == (root / "one" / "model.safetensors").read_bytes(),
            "every_step_logged_once": steps == list(range(1, STEPS + 1)),
            "losses_equal": [r["loss"] for r in log_of(root / "killed")]
            == [r["loss"] for r in log_of(root / "one")],
        }
    result["seconds"] = time.perf_counter() - started
    result["load_average"] = os.getloadavg()[0]
    write_atomic(args.json, json.dumps(result, indent=2) + "\n", ours=own_path(args.json))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
