"""Uptraining: continue training a (converted) causal-LM checkpoint, on one process or under torchrun with DDP or
FSDP2, with atomic checkpoints and exact resume; and the one evaluation function everything uses.

``uptrain(UptrainOptions(src, dst, data, ...))`` is ``attnlab uptrain``; ``evaluate(model, stream, seq_len)``
and ``evaluate_checkpoint(ckpt, data)`` are ``attnlab eval``. See docs/uptraining.md.
"""

from .evaluate import evaluate, evaluate_checkpoint
from .loop import build_optimizer, distill_loss, learning_rate, uptrain
from .options import UptrainOptions

__all__ = [
    "UptrainOptions",
    "build_optimizer",
    "distill_loss",
    "evaluate",
    "evaluate_checkpoint",
    "learning_rate",
    "uptrain",
]
