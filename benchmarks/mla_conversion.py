"""Llama-family -> MLA conversion without training: the error of each choice, at the KV cache of GQA.

For a Llama-family checkpoint (``--src``) and held-out Shakespeare, this measures the next-token loss of

- the source, and its GQA conversions ("mean", "fit") to fewer KV heads G;
- MLA conversions at the same KV values per token and layer as GQA-G (``kv_lora_rank + rope_dim = 2 G head_dim``),
  for two rotary widths and every plane choice ("error", "norm", "first", "uniform"), with the ablations of
  RoRoPE (mean over KV heads instead) and of the mean rotation of the planes that lose RoPE; each without the
  latent norm (attnlab, ``kv_norm=False``) and as the native DeepSeek-V3 layout (latent norm folded in);
- the full-rank conversion with every plane kept (exact for one KV head): the logit distance of the MLA model
  to the source and of the native layout to the MLA model.

Calibration lines come from the even plays, evaluation from the odd ones. A checkpoint without a
``tokenizer.json`` is read as a byte-level model (vocabulary 256). ``--train-tiny DIR`` first trains such a
model (4 layers, d_model 128, 8 heads of 16) on the even plays, so the script runs with no checkpoint at hand.

    python benchmarks/mla_conversion.py --train-tiny /tmp/tiny --kv-heads 4 --steps 700
    python benchmarks/mla_conversion.py --src /tmp/tiny     # writes benchmarks/results/mla_conversion.json

With the default sizes the plays are the whole corpus beside the checkout (../shared/data/shakespeare; without
it the script stops, exit 2). With other sizes (``--steps``, ``--n-calib``, ``--n-eval``, ``--kv-heads``,
``--seed``) they are the plays attnlab ships, and the result goes under benchmarks/.cache/quick/ (locations.py).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from attnlab import AttentionConfig, ModelConfig
from attnlab.atomic import write_atomic
from attnlab.convert import (
    convert_model,
    convert_model_to_mla,
    fold_latent_norms,
    layer_errors,
    logit_distance,
)
from attnlab.convert.mla import full_rank
from attnlab.convert.mla_model import choose_stride
from attnlab.hf import load_llama, save_llama
from attnlab.model import Transformer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # locations.py, beside this script
from locations import at_defaults, corpus, output, own_path

ROOT = Path(__file__).resolve().parents[1]


def token_stream(src: Path | None, plays: list[Path]) -> torch.Tensor:
    text = "\n".join(p.read_text(encoding="utf-8") for p in plays)
    if src is not None and (src / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        return torch.tensor(Tokenizer.from_file(str(src / "tokenizer.json")).encode(text).ids)
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def windows(stream: torch.Tensor, n: int, batch: int, length: int, seed: int) -> list[torch.Tensor]:
    """``n`` batches of ``batch`` random windows of ``length + 1`` tokens (inputs plus next-token targets)."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - length - 1, (n, batch), generator=gen)
    return [torch.stack([stream[s : s + length + 1] for s in row.tolist()]) for row in starts]


@torch.no_grad()
def loss(model: torch.nn.Module, batches: list[torch.Tensor]) -> float:
    total = [F.cross_entropy(model(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten()).item() for b in batches]
    return sum(total) / len(total)


def train_tiny(dst: Path, kv_heads: int, steps: int, seed: int, data: Path) -> None:
    plays = sorted(data.glob("*.txt"))[0::2]
    stream = token_stream(None, plays)
    cfg = ModelConfig(
        vocab_size=256,
        n_layers=4,
        attention=AttentionConfig(d_model=128, n_heads=8, n_kv_heads=kv_heads, head_dim=16),
        ffn_dim=344,
        max_seq_len=256,
    )
    model = Transformer(cfg)
    model.init_weights(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    for step, batch in enumerate(windows(stream, steps, 16, 128, seed)):
        lr = 3e-3 * min(1.0, (step + 1) / 100) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        out = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        out.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            print(f"step {step}: loss {out.item():.3f}", flush=True)
    save_llama(model.eval(), dst, overwrite=True)


def mla_row(src, cache, rope_dim, planes, calib, evals, rorope=True, mean_phase=True) -> dict:
    t0 = time.perf_counter()
    stride = choose_stride(src, rope_dim, planes, calib=calib, rorope=rorope)
    mla = convert_model_to_mla(
        src, cache - rope_dim, rope_dim, calib=calib, planes=stride, rorope=rorope, mean_phase=mean_phase
    )
    native, _ = fold_latent_norms(mla, calib)
    errors = layer_errors(src, mla, evals)
    return {
        "kv_lora_rank": cache - rope_dim,
        "rope_dim": rope_dim,
        "planes": planes,
        "stride": stride,
        "rorope": rorope,
        "mean_phase": mean_phase,
        "loss_mla": loss(mla, evals),
        "loss_native": loss(native, evals),
        "output_error": sum(e["output_error"] for e in errors) / len(errors),
        "score_error": sum(e["score_error"] for e in errors) / len(errors),
        "seconds": time.perf_counter() - t0,
    }


def run(src_dir: Path, n_calib: int, n_eval: int, seed: int, data: Path) -> dict:
    plays = sorted(data.glob("*.txt"))
    calib_stream, eval_stream = token_stream(src_dir, plays[0::2]), token_stream(src_dir, plays[1::2])
    src = load_llama(src_dir).float()
    attn = src.cfg.attention
    hd, n_kv = attn.head_dim, attn.n_kv_heads
    calib = [b[:, :-1] for b in windows(calib_stream, n_calib, 4, 128, seed)]
    evals = windows(eval_stream, n_eval, 4, 128, seed + 1)
    result = {"source": {"loss": loss(src, evals), "n_kv_heads": n_kv, "head_dim": hd}, "rows": []}
    for g in [g for g in range(n_kv, 0, -1) if n_kv % g == 0 and g < n_kv] or [1]:
        cache = 2 * g * hd
        for method in ("mean", "fit"):
            if g < n_kv:
                gqa = convert_model(src, g, method, calib=calib)
                result["rows"].append(
                    {"kind": "gqa", "cache": cache, "method": method, "loss": loss(gqa, evals)}
                )
        for rope_dim in (hd // 2, hd // 4):
            if rope_dim < 2 or cache - rope_dim > full_rank(attn, rope_dim):
                continue
            variants = [(p, True, True) for p in ("error", "norm", "first", "uniform")]
            variants += (
                [("error", False, True), ("error", True, False)] if n_kv > 1 else [("error", True, False)]
            )
            for planes, rorope, phase in variants:
                row = mla_row(src, cache, rope_dim, planes, calib, evals, rorope, phase)
                result["rows"].append({"kind": "mla", "cache": cache, **row})
                print(json.dumps(result["rows"][-1]), flush=True)
    rank = full_rank(attn, hd)
    mla = convert_model_to_mla(src, rank, hd, calib=calib)
    native, stats = fold_latent_norms(mla, calib)
    result["full_rank"] = {
        "kv_lora_rank": rank,
        "rope_dim": hd,
        "exact": n_kv == 1,
        "source_vs_mla": logit_distance(src, mla, evals),
        "mla_vs_native": logit_distance(mla, native, evals),
        "latent_error": [s["latent_error"] for s in stats],
        "loss_mla": loss(mla, evals),
        "loss_native": loss(native, evals),
    }
    return result


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with ``--json`` filled in: the committed file when the sizes are the defaults, else its place
    under benchmarks/.cache/quick/ (locations.py)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, help="a Llama / Mistral / Qwen2 checkpoint directory")
    parser.add_argument("--train-tiny", type=Path, help="train a byte-level model into this directory first")
    parser.add_argument("--kv-heads", type=int, default=4, help="KV heads of the --train-tiny model")
    parser.add_argument("--steps", type=int, default=700, help="training steps of the --train-tiny model")
    parser.add_argument("--n-calib", type=int, default=8, help="calibration batches of 4 x 128 tokens")
    parser.add_argument("--n-eval", type=int, default=16, help="evaluation batches of 4 x 128 tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="Default: benchmarks/results/mla_conversion.json.")
    args = parser.parse_args(argv)
    if args.src is None and args.train_tiny is None:
        parser.error("give --src DIR (or --train-tiny DIR)")
    args.full = at_defaults(parser, args, "kv_heads", "steps", "n_calib", "n_eval", "seed")
    args.json = args.json or output(ROOT / "benchmarks" / "results" / "mla_conversion.json", args.full)
    return args


def main() -> None:
    args = arguments()
    data = corpus(args.full, "mla_conversion.py")
    torch.manual_seed(args.seed)
    if args.train_tiny:
        train_tiny(args.train_tiny, args.kv_heads, args.steps, args.seed, data)
        args.src = args.src or args.train_tiny
    result = run(args.src, args.n_calib, args.n_eval, args.seed, data)
    result["machine"] = {"python": platform.python_version(), "torch": torch.__version__}
    result["command"] = " ".join(["python", "benchmarks/mla_conversion.py", *sys.argv[1:]])
    write_atomic(args.json, json.dumps(result, indent=2) + "\n", ours=own_path(args.json))
    print(json.dumps(result["source"]), json.dumps(result["full_rank"], indent=2), sep="\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
