"""A small MHA checkpoint built offline in about 20 s on 2 idle cores, to try ``attnlab sweep`` on (the README's newcomer path).

From the Shakespeare plays attnlab ships (``attnlab.data.shakespeare()``): a byte-level BPE tokenizer (512 tokens)
trained on them, and an 8-head Llama (d_model 64, 2 layers, 256 positions) pretrained from a random init with
``attnlab.train.uptrain`` (the function behind ``attnlab uptrain``). Writes, atomically, a directory DST with

    DST/model/   the Llama checkpoint (config.json, model.safetensors, tokenizer.json + tokenizer_config.json),
                 ready for every command (and for llama.cpp's GGUF converter: benchmarks/llamacpp_roundtrip.py)
    DST/text/    the plays (links into the shipped corpus), for --data

    python benchmarks/tiny_model.py tiny                 # ~20 s on 2 idle cores
    python benchmarks/tiny_model.py tiny --steps 2000    # better trained, a few minutes
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

from attnlab.atomic import atomic_dir
from attnlab.config import AttentionConfig, ModelConfig
from attnlab.data import save_tokenizer, shakespeare, split_held_out, text_files, train_byte_bpe
from attnlab.hf import save_llama
from attnlab.model import Transformer
from attnlab.train import UptrainOptions, uptrain


def build(dst: Path, steps: int, overwrite: bool) -> dict:
    works = text_files(shakespeare())
    train, _ = split_held_out(works, 0.1)  # the sweep holds out the same whole plays
    with atomic_dir(dst, overwrite, kind="run", what="DST") as tmp:
        (tmp / "text").mkdir()
        for f in works:
            (tmp / "text" / f.name).symlink_to(f)
        tok = train_byte_bpe([f.read_text() for f in train], 512)
        cfg = ModelConfig(512, 2, AttentionConfig(d_model=64, n_heads=8), 176, max_seq_len=256)
        model = Transformer(cfg)
        model.init_weights(seed=0)
        save_llama(
            model, tmp / "init", base_config={"bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "float32"}
        )
        save_tokenizer(tok, tmp / "init")
        opts = UptrainOptions(
            src=tmp / "init", dst=tmp / "model", data=tmp / "text", steps=steps, batch_size=8, seq_len=128, lr=3e-3,
            warmup=max(1, steps // 20), save_every=0, eval_windows=64, seed=0,
        )  # fmt: skip
        summary = uptrain(opts, progress=True)
        shutil.rmtree(tmp / "init")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dst", type=Path, help="directory to write (model/ and text/)")
    parser.add_argument("--steps", type=int, default=400, help="pretraining steps (default 400)")
    parser.add_argument("--overwrite", action="store_true", help="replace a DST this script wrote")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    try:
        summary = build(args.dst, args.steps, args.overwrite)
    except (ValueError, OSError) as err:
        print(f"tiny_model.py: error: {err}", file=sys.stderr)
        sys.exit(2)
    loss = summary["eval"]["loss"] if summary.get("eval") else float("nan")
    print(
        f"{args.dst / 'model'}: {args.steps} steps in {summary.get('seconds', 0):.0f} s, held-out loss {loss:.3f}"
    )


if __name__ == "__main__":
    main()
