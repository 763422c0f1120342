"""Evaluation: the one function that scores a causal LM on text, used by ``attnlab eval``, by ``attnlab
uptrain`` during training, by the GQA study and by the tests (which check it against transformers' own loss).

Scored are the stream's consecutive windows (``attnlab.data.TokenStream.windows``): each window predicts
``seq_len`` tokens, every token after the first is predicted once (up to the last whole window), with up to
``seq_len - 1`` tokens of context.
Reported: mean next-token loss in nats, perplexity ``exp(loss)``, and bits per byte ``sum(loss) / ln 2 /
bytes``, where bytes are the UTF-8 bytes of the text the scored tokens spell (comparable across tokenizers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .. import resources
from ..config import check_int
from ..console import Progress
from ..cost.memory import activation_bytes
from ..data import TokenStream, load_stream
from .distributed import ONE_PROCESS, Env, all_reduce_sum


def eval_windows(stream: TokenStream, seq_len: int, max_windows: int = 0) -> torch.Tensor:
    """The windows scored: all of them, or ``max_windows`` spread evenly over the stream (every part of a
    multi-file corpus is represented, and the choice does not depend on anything but the sizes)."""
    n = stream.n_windows(seq_len)
    if n < 1:
        raise ValueError(f"the text has {len(stream)} tokens: fewer than one window of {seq_len} + 1")
    if max_windows and max_windows < n:
        return torch.linspace(0, n - 1, max_windows).round().long().unique()
    return torch.arange(n)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    stream: TokenStream,
    seq_len: int,
    *,
    batch_size: int = 8,
    max_windows: int = 0,
    env: Env = ONE_PROCESS,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Loss, perplexity and bits per byte of ``model`` (tokens (B, T) -> logits (B, T, vocab)) on ``stream``.

    Under torchrun each data-parallel replica scores a share of the windows and the sums are reduced; every rank runs
    the same number of forward passes (a sharded model needs all of them), padding its share with zero-weight windows.
    ``progress(done, total)``: called after each batch with this rank's windows scored.
    """
    check_int("seq_len", seq_len)
    check_int("batch_size", batch_size)
    check_int("max_windows", max_windows, minimum=0)
    index = eval_windows(stream, seq_len, max_windows)
    share = -(-len(index) // env.dp_size)
    mine = index[env.dp_rank :: env.dp_size]  # the ranks of a tp group score the same windows together
    weight = torch.cat((torch.ones(len(mine)), torch.zeros(share - len(mine))))
    mine = torch.cat((mine, index[: share - len(mine)]))
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)  # nats, tokens, bytes
    try:
        for start in range(0, share, batch_size):
            x, y, nbytes = stream.windows(mine[start : start + batch_size], seq_len)
            w = weight[start : start + batch_size, None].double()
            logits = model(x.to(env.device))
            nll = F.cross_entropy(logits.float().flatten(0, 1), y.to(env.device).flatten(), reduction="none")
            nll = nll.view_as(y).double().cpu()
            sums += torch.stack(((nll * w).sum(), (w * torch.ones_like(nll)).sum(), (nbytes * w).sum()))
            if progress is not None:
                progress(min(start + batch_size, share), share)
    finally:
        model.train(was_training)
    nats, tokens, nbytes_total = all_reduce_sum(sums.to(env.device), env).cpu().tolist()
    loss = nats / tokens
    return {
        "loss": loss,
        "perplexity": math.inf if loss > 709.0 else math.exp(loss),  # past float64's exp: a diverged model
        "bits_per_byte": nats / math.log(2) / nbytes_total if nbytes_total else float("nan"),
        "tokens": int(tokens),
        "bytes": int(nbytes_total),
        "windows": len(index),
        "seq_len": seq_len,
    }


@contextlib.contextmanager
def tokenising(show: bool) -> Iterator[Callable[[int, int], None]]:
    """A ``progress(characters done, characters in all)`` for ``tokenize_files``, shown on stderr in kB of text
    (~1 s a MB: a 40 MB corpus was ~55 s of silence before a command's first line)."""
    with Progress("tokenising (kB of text)", enabled=show, transient=True) as bar:
        yield lambda done, total: bar.update(done // 1000, total=total // 1000)


def evaluate_checkpoint(
    ckpt: str | Path,
    data: str | Path,
    *,
    seq_len: int | None = None,
    batch_size: int = 8,
    max_windows: int = 0,
    show_progress: bool = False,
    device: str = "auto",
) -> dict:
    """``attnlab eval``: load a causal-LM checkpoint, tokenise ``data`` with its tokenizer, ``evaluate`` on
    ``device`` (``resources.resolve_device``; said on stderr) (``show_progress``: windows scored, on stderr)."""
    from ..hf.causal_lm import family_of, load_causal_lm

    ckpt = Path(ckpt)
    env = dataclasses.replace(ONE_PROCESS, device=resources.resolve_device(device))
    model_type = family_of(ckpt)
    model = load_causal_lm(ckpt).float()
    max_len = model.cfg.max_seq_len
    seq_len = seq_len if seq_len is not None else min(max_len, 1024)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 1 <= seq_len <= max_len:
        raise ValueError(
            f"--seq-len must be in [1, {max_len}] (the model's max_position_embeddings), got {seq_len}"
        )
    check_int("--batch-size", batch_size)
    check_int("--max-windows", max_windows, minimum=0)
    with tokenising(show_progress) as tell:
        stream = load_stream(ckpt, data, seq_len, vocab_size=model.cfg.vocab_size, progress=tell)
    windows = len(eval_windows(stream, seq_len, max_windows))
    if (
        env.device.type == "cpu"
    ):  # the weights are loaded; a forward pass over one batch of windows comes on top
        resources.check_fits(
            activation_bytes(model.cfg, min(batch_size, windows), seq_len, training=False),
            f"--batch-size {batch_size} x --seq-len {seq_len}",
            "lower --batch-size",
        )
    model = model.to(env.device)
    resources.announce_device(env.device)
    with Progress("eval (windows)", windows, enabled=show_progress) as bar:
        result = evaluate(
            model, stream, seq_len, batch_size=batch_size, max_windows=max_windows, env=env,
            progress=lambda done, total: bar.update(done, total=total),
        )  # fmt: skip
    return {
        "checkpoint": str(ckpt),
        "model_type": model_type,
        "data": str(data),
        "files": len(stream.files),
        "device": str(env.device),
    } | result
