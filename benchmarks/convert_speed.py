"""How long ``attnlab convert --method fit`` takes on a model of SmolLM-135M's shape, before and after the
one-pass calibration (issue 13).

Random weights (the time does not depend on them) in a Llama checkpoint of SmolLM-135M's shape: 30 layers,
d_model 576, 9 query heads, 3 KV heads of head_dim 64, SwiGLU width 1536, vocabulary 49152, tied embeddings,
bfloat16 on disk; a byte-level BPE tokenizer trained on the Shakespeare corpus. Two calibration files, both read
the CLI's way (``calibration_batches``: at most 256 lines, 128 tokens each):

    lines  Hamlet as it stands (what ``--calib hamlet.txt`` reads): the first 256 non-empty lines, short ones;
    long   256 passages of Hamlet, each at least 128 tokens long: the most calibration the CLI reads.

Timed in one run, one after the other:

    forward  one plain forward pass of the float32 model over the calibration batches (output head included);
    solves   the per-layer ``mha_to_gqa(..., "fit")`` calls alone, on each layer's input rows; of which
             ``moments`` is the second moment of the rows (float64), the rest the fit itself;
    after    ``convert_checkpoint(SRC, DST, 1, "fit", calib=FILE)`` end to end (load, tokenise, convert, write);
    before   the same call with the code of commit ``--before`` (the model rerun once per layer to collect that
             layer's inputs), in a subprocess; by default on the "lines" calibration only (on "long" it would be
             about 30 forward passes of several minutes each on this machine).

Target (issue 13): after <= 2 x (forward + solves).

    python benchmarks/convert_speed.py            # writes benchmarks/results/convert_speed.json and docs/convert_speed.md
    python benchmarks/convert_speed.py --replot   # only rewrites docs/convert_speed.md from the JSON

The full run trains its tokenizer on the whole corpus beside the checkout (../shared/data/shakespeare) and stops
(exit 2) without it. A run with other sizes (``--n-layers 2``, one calibration, ...) reads the plays attnlab ships
and writes under benchmarks/.cache/quick/ instead (see locations.py).
"""

from __future__ import annotations

import argparse
import io as stdio
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from attnlab import AttentionConfig, ModelConfig
from attnlab.atomic import write_atomic
from attnlab.convert import mha_to_gqa
from attnlab.convert.gqa import second_moment
from attnlab.convert.model import calibrate
from attnlab.cost import get_preset
from attnlab.hf import convert_checkpoint, load_llama, save_llama
from attnlab.hf.checkpoint import calibration_batches
from attnlab.model import Transformer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # locations.py, beside this script
from locations import at_defaults, corpus, output, own_path

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "2d78f8b"  # main before the one-pass calibration: convert_model reran the model for every layer
SMOLLM = get_preset("smollm-135m")
SHAPE = {
    "n_layers": SMOLLM.n_layers,
    "d_model": SMOLLM.attention.d_model,
    "n_heads": SMOLLM.attention.n_heads,
    "n_kv_heads": SMOLLM.attention.n_kv_heads,
    "head_dim": SMOLLM.attention.head_dim,
    "ffn_dim": SMOLLM.ffn_dim,
    "vocab_size": SMOLLM.vocab_size,
    "tie_embeddings": SMOLLM.tie_embeddings,
}


def build_checkpoint(dst: Path, shape: dict, vocab: int, data: Path) -> Path:
    attn = AttentionConfig(
        d_model=shape["d_model"],
        n_heads=shape["n_heads"],
        n_kv_heads=shape["n_kv_heads"],
        head_dim=shape["head_dim"],
    )
    cfg = ModelConfig(
        shape["vocab_size"], shape["n_layers"], attn, shape["ffn_dim"], max_seq_len=2048, tie_embeddings=True
    )
    model = Transformer(cfg)
    model.init_weights(seed=0)
    save_llama(model.to(torch.bfloat16), dst)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train([str(p) for p in sorted(data.glob("*.txt"))], trainer)
    tok.save(str(dst / "tokenizer.json"))
    return dst


def calibration_files(tok: Tokenizer, dst: Path, data: Path) -> dict[str, Path]:
    lines = [ln.strip() for ln in (data / "hamlet.txt").read_text().splitlines() if ln.strip()]
    passages, current = [], []
    for line in lines:
        current.append(line)
        if len(tok.encode(" ".join(current)).ids) >= 128:
            passages.append(" ".join(current))
            current = []
        if len(passages) == 256:
            break
    files = {"lines": dst / "lines.txt", "long": dst / "long.txt"}
    files["lines"].write_text("\n".join(lines) + "\n")
    files["long"].write_text("\n".join(passages) + "\n")
    return files


def matmul_gflops() -> float:
    """This run's float32 matmul rate at a calibration-sized product (to read the times against)."""
    a, w = torch.randn(2048, 576), torch.randn(1536, 576)
    for _ in range(3):
        a @ w.T
    start, n = time.perf_counter(), 20
    for _ in range(n):
        a @ w.T
    return 2 * 2048 * 576 * 1536 * n / (time.perf_counter() - start) / 1e9


@torch.no_grad()
def time_forward(model: Transformer, batches: list) -> tuple[float, float]:
    """(seconds of the forward pass, seconds of its output head alone: final norm and vocabulary logits)."""
    model(batches[0][0][:1, :8])  # warm-up
    start = time.perf_counter()
    for ids, _ in batches:
        model(ids)
    forward = time.perf_counter() - start
    hidden = [torch.randn(*ids.shape, model.cfg.d_model) for ids, _ in batches]
    start = time.perf_counter()
    for h in hidden:
        model.output(model.norm(h)).float()
    return forward, time.perf_counter() - start


@torch.no_grad()
def time_solves(model: Transformer, batches: list, n_kv_heads: int) -> tuple[float, float]:
    """(seconds in ``mha_to_gqa(..., "fit")`` over all layers, seconds of it in the second moments)."""
    solves = moments = 0.0
    for i, inputs in enumerate(calibrate(model, batches)):
        rows = torch.cat(list(inputs.rows()))
        start = time.perf_counter()
        second_moment(rows, model.cfg.attention.bias)
        moments += time.perf_counter() - start
        start = time.perf_counter()
        mha_to_gqa(model.layers[i].attention, n_kv_heads, "fit", calib=rows)
        solves += time.perf_counter() - start
    return solves, moments


def time_after(src: Path, dst: Path, calib: Path, n_kv_heads: int) -> tuple[float, list[float]]:
    marks = []
    start = time.perf_counter()
    convert_checkpoint(
        src,
        dst,
        n_kv_heads,
        "fit",
        calib=calib,
        overwrite=True,
        progress=lambda *_: marks.append(time.perf_counter()),
    )
    total = time.perf_counter() - start
    return total, [b - a for a, b in itertools.pairwise(marks)]


BEFORE_CODE = """
import json, sys, time
import attnlab
from attnlab.hf.checkpoint import convert_checkpoint
src, dst, calib, kv, where = sys.argv[1:]
assert attnlab.__file__.startswith(where), attnlab.__file__
start = time.perf_counter()
convert_checkpoint(src, dst, int(kv), "fit", calib=calib, overwrite=True)
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def time_before(ref: str, src: Path, dst: Path, calib: Path, n_kv_heads: int) -> float:
    """``convert_checkpoint`` end to end with the library as it was at commit ``ref`` (a subprocess)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src"], capture_output=True, check=True)
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=stdio.BytesIO(archive.stdout)) as tar:
            tar.extractall(tmp, filter="data")
        where = str(Path(tmp) / "src")
        out = subprocess.run(
            [sys.executable, "-c", BEFORE_CODE, str(src), str(dst), str(calib), str(n_kv_heads), where],
            env=dict(os.environ, PYTHONPATH=where),
            capture_output=True,
            text=True,
        )
        if out.returncode:
            raise RuntimeError(f"the code of {ref} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def run(args: argparse.Namespace) -> dict:
    shape = dict(SHAPE, n_layers=args.n_layers)
    result = {
        "command": "python benchmarks/convert_speed.py"
        + (f" --n-layers {args.n_layers}" if args.n_layers != SHAPE["n_layers"] else ""),
        "shape": shape,
        "target_kv_heads": args.kv_heads,
        "before_ref": args.before,
        "machine": {
            "platform": platform.platform(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "loadavg_start": os.getloadavg(),
            "matmul_gflops_start": matmul_gflops(),
        },
        "runs": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = build_checkpoint(tmp / "src", shape, args.tokenizer_vocab, args.corpus)
        files = calibration_files(Tokenizer.from_file(str(src / "tokenizer.json")), tmp, args.corpus)
        model = load_llama(src).float()
        for name in args.calibrations:
            batches = calibration_batches(src, files[name])
            row = {
                "calibration": name,
                "sequences": sum(len(ids) for ids, _ in batches),
                "tokens": sum(int(mask.sum()) for _, mask in batches),
                "padded_tokens": sum(ids.numel() for ids, _ in batches),
                "loadavg_before": os.getloadavg(),
            }
            print(f"[{name}] {row['sequences']} sequences, {row['tokens']} tokens", file=sys.stderr)
            row["forward_s"], row["head_s"] = time_forward(model, batches)
            print(f"[{name}] forward {row['forward_s']:.1f} s", file=sys.stderr)
            row["solves_s"], row["moments_s"] = time_solves(model, batches, args.kv_heads)
            print(f"[{name}] solves {row['solves_s']:.1f} s", file=sys.stderr)
            row["after_s"], row["after_layer_s"] = time_after(src, tmp / "dst", files[name], args.kv_heads)
            print(f"[{name}] after {row['after_s']:.1f} s", file=sys.stderr)
            row["before_s"] = None
            if name in args.before_on:
                row["before_s"] = time_before(args.before, src, tmp / "dst", files[name], args.kv_heads)
                print(f"[{name}] before {row['before_s']:.1f} s", file=sys.stderr)
            row["loadavg_after"] = os.getloadavg()
            result["runs"].append(row)
    result["machine"]["loadavg_end"] = os.getloadavg()
    return result


def _load(values: list[float]) -> str:
    return " / ".join(f"{v:.1f}" for v in values)


def markdown(result: dict, json_path: Path) -> str:
    shape, machine = result["shape"], result["machine"]
    lines = [
        f"# Conversion speed: `attnlab convert --method fit` on a {shape['n_layers']}-layer model",
        "",
        "_Generated by `benchmarks/convert_speed.py` from its JSON result; do not edit by hand._",
        "",
        f"Command: `{result['command']}`",
        "",
        f"A Llama checkpoint of SmolLM-135M's shape with random weights: {shape['n_layers']} layers, d_model "
        f"{shape['d_model']}, {shape['n_heads']} query heads, {shape['n_kv_heads']} KV heads of {shape['head_dim']}, "
        f"SwiGLU {shape['ffn_dim']}, vocabulary {shape['vocab_size']}, tied embeddings; converted to "
        f"{result['target_kv_heads']} KV head(s) with `--method fit`. Calibration is read the CLI's way (at most "
        "256 lines of at most 128 tokens): `lines` is Hamlet as it stands (short lines), `long` 256 passages of at "
        "least 128 tokens (the most the CLI reads).",
        "",
        "- **forward**: one plain forward pass of the float32 model over the calibration batches, of which **head**"
        " is the output head (final norm and vocabulary logits), which calibration does not need;",
        f'- **solves**: the {shape["n_layers"]} per-layer `mha_to_gqa(..., "fit")` calls alone, of which **moments** is the float64'
        " second moment of each layer's inputs;",
        '- **after**: `convert_checkpoint(..., method="fit")` end to end (load, tokenise, calibrate in one pass, '
        "solve, write);",
        f"- **before**: the same call with the code of commit `{result['before_ref']}`, which reran the whole model "
        "once per layer to collect that layer's inputs.",
        "",
        "| calibration | tokens (padded) | forward s (head) | solves s (moments) | after s "
        "| after / (forward + solves) | before s | before / after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["runs"]:
        ratio = r["after_s"] / (r["forward_s"] + r["solves_s"])
        before = f"{r['before_s']:.1f}" if r["before_s"] is not None else "not run"
        speedup = f"{r['before_s'] / r['after_s']:.1f}x" if r["before_s"] is not None else ""
        lines.append(
            f"| {r['calibration']} | {r['tokens']} ({r['padded_tokens']}) | {r['forward_s']:.1f} ({r['head_s']:.1f}) | "
            f"{r['solves_s']:.1f} ({r['moments_s']:.1f}) | {r['after_s']:.1f} | {ratio:.2f} | {before} | {speedup} |"
        )
    lines += ["", "Findings, computed from the table:", ""]
    worst = max(r["after_s"] / (r["forward_s"] + r["solves_s"]) for r in result["runs"])
    strict = max(r["after_s"] / (r["forward_s"] - r["head_s"] + r["solves_s"]) for r in result["runs"])
    lines.append(
        f"- Target `after <= 2 x (forward + solves)`: {'met' if worst <= 2 else '**not met**'} "
        f"(worst ratio {worst:.2f}; {strict:.2f} against a forward pass without the output head)."
    )
    for r in result["runs"]:
        if r["before_s"] is not None:
            lines.append(
                f"- On `{r['calibration']}` the per-layer recomputation took {r['before_s']:.0f} s, "
                f"{r['before_s'] / r['forward_s']:.1f} forward passes' worth; the one-pass conversion "
                f"{r['after_s']:.0f} s ({r['before_s'] / r['after_s']:.1f}x faster)."
            )
        per_layer = r["after_layer_s"]
        if len(per_layer) >= 4:
            k = len(per_layer) // 3
            first, last = statistics.median(per_layer[:k]), statistics.median(per_layer[-k:])
            lines.append(
                f"- On `{r['calibration']}` a layer of the one-pass conversion took a median {first:.2f} s among "
                f"layers 2-{k + 1} and {last:.2f} s among the last {k} (x{last / first:.2f}: "
                f"{'flat in depth' if last < 1.5 * first else 'growing with depth'}); single layers ranged "
                f"{min(per_layer):.1f}-{max(per_layer):.1f} s on the shared machine."
            )
    lines += [
        "",
        "| calibration | load average (1 min) before / after the row |",
        "|---|---:|",
        *(
            f"| {r['calibration']} | {r['loadavg_before'][0]:.1f} / {r['loadavg_after'][0]:.1f} |"
            for r in result["runs"]
        ),
        "",
    ]
    longest = max(result["runs"], key=lambda r: r["padded_tokens"])
    mb = longest["padded_tokens"] * shape["d_model"] * 4 / 1e6
    lines += [
        f"Memory: the one pass keeps the hidden states of every calibration batch, {longest['padded_tokens']} "
        f"padded tokens x {shape['d_model']} float32 values = {mb:.0f} MB on `{longest['calibration']}`.",
        "",
        "## Machine",
        "",
        f"{machine['platform']}, torch {machine['torch']}, {machine['threads']} threads on {machine['cpus']} CPUs, "
        f"float32 matmul {machine['matmul_gflops_start']:.0f} GFLOP/s at the start. The machine is shared: load "
        f"average (1 / 5 / 15 min) {_load(machine['loadavg_start'])} at the start, {_load(machine['loadavg_end'])} "
        "at the end; times are comparable within this run only.",
        "",
        f"Raw numbers: `{json_path.relative_to(ROOT) if json_path.is_relative_to(ROOT) else json_path}`.",
        "",
    ]
    return "\n".join(lines)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with ``--json`` and ``--doc`` filled in: the committed files for a full run (every option that
    sets what is converted and timed at its default), else their places under .cache/quick/."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " ")
    )  # the first paragraph
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument(
        "--n-layers", type=int, default=SHAPE["n_layers"], help="Fewer layers: a quick check."
    )
    parser.add_argument("--calibrations", default="lines,long", help="Comma list of lines, long.")
    parser.add_argument("--before-on", default="lines", help="Calibrations to time the old code on.")
    parser.add_argument("--before", default=BEFORE, help="Commit whose code is 'before'.")
    parser.add_argument("--tokenizer-vocab", type=int, default=8192)
    parser.add_argument("--json", type=Path, help="Default: benchmarks/results/convert_speed.json.")
    parser.add_argument("--doc", type=Path, help="Default: docs/convert_speed.md.")
    parser.add_argument("--replot", action="store_true", help="Only rewrite the doc from the JSON.")
    args = parser.parse_args(argv)
    args.full = at_defaults(
        parser, args, "kv_heads", "n_layers", "calibrations", "before_on", "before", "tokenizer_vocab"
    )
    args.json = args.json or output(ROOT / "benchmarks" / "results" / "convert_speed.json", args.full)
    args.doc = args.doc or output(ROOT / "docs" / "convert_speed.md", args.full)
    args.calibrations = [c for c in args.calibrations.split(",") if c]
    args.before_on = [c for c in args.before_on.split(",") if c]
    return args


def main() -> None:
    args = arguments()
    if args.replot:
        result = json.loads(args.json.read_text())
    else:
        args.corpus = corpus(args.full, "convert_speed.py")
        result = run(args)
        write_atomic(args.json, json.dumps(result, indent=2) + "\n", ours=own_path(args.json))
    write_atomic(args.doc, markdown(result, args.json), ours=own_path(args.doc))


if __name__ == "__main__":
    main()
