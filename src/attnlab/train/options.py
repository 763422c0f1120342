"""What an uptraining run is told: one validated dataclass (the CLI flags are its field names with dashes)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import check_seed

TRAINABLE = ("all", "attention")
DTYPES = ("fp32", "bf16")

# Fields that decide the computation: a resumed run must be given the same values as the run it continues.
# (How the global batch is split over ranks and micro-steps may change; the global batch may not.)
SAME_ON_RESUME = (
    "src",
    "data",
    "eval_data",
    "held_out",
    "steps",
    "seq_len",
    "lr",
    "min_lr",
    "warmup",
    "weight_decay",
    "grad_clip",
    "seed",
    "teacher",
    "distill_weight",
    "temperature",
    "train",
    "dtype",
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class UptrainOptions:
    src: Path
    dst: Path
    data: Path
    eval_data: Path | None = None  # None: hold out whole files of ``data`` (``held_out`` of them)
    held_out: float = 0.1
    steps: int = 1000
    batch_size: int = 8  # sequences per rank per micro-step
    seq_len: int = 256
    lr: float = 3e-4  # peak, reached after ``warmup`` steps
    min_lr: float = 0.1  # the cosine ends at lr * min_lr
    warmup: int | None = None  # None: 5 % of the steps
    grad_accum: int = 1
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0: no clipping
    seed: int = 0
    save_every: int = 100  # 0: no intermediate checkpoints
    keep: int = 3  # checkpoints kept in the run directory
    eval_every: int = 0  # 0: evaluate only at the end
    eval_windows: int = 0  # 0: every held-out window
    resume: bool = False
    teacher: Path | None = None
    distill_weight: float = 0.5
    temperature: float = 2.0
    train: str = "all"
    dtype: str = "fp32"
    fsdp: bool = False
    device: str = "auto"  # resources.resolve_device; under torchrun a GPU per rank (cuda:LOCAL_RANK)
    tp: int = 1  # ranks that split each layer's heads (tensor parallelism); the rest is data parallelism
    overwrite: bool = False
    run_dir: Path | None = None  # None: DST.run beside DST

    def __post_init__(self) -> None:
        for name in ("src", "dst", "data", "eval_data", "teacher", "run_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                if not isinstance(value, str):
                    raise TypeError(f"{_flag(name)} must be a path, got {value!r}")
                object.__setattr__(self, name, Path(value))
        for name, minimum in (
            ("steps", 1),
            ("batch_size", 1),
            ("seq_len", 1),
            ("grad_accum", 1),
            ("keep", 1),
            ("save_every", 0),
            ("eval_every", 0),
            ("eval_windows", 0),
            ("tp", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{_flag(name)} must be an int, got {value!r}")
            if value < minimum:
                raise ValueError(f"{_flag(name)} must be >= {minimum}, got {value}")
        check_seed(self.seed)
        if self.warmup is not None:
            if isinstance(self.warmup, bool) or not isinstance(self.warmup, int):
                raise TypeError(f"--warmup must be an int, got {self.warmup!r}")
            if not 0 <= self.warmup <= self.steps:
                raise ValueError(f"--warmup must be in [0, --steps={self.steps}], got {self.warmup}")
        for name, low, high, closed in (
            ("lr", 0.0, None, False),
            ("min_lr", 0.0, 1.0, True),
            ("weight_decay", 0.0, None, True),
            ("grad_clip", 0.0, None, True),
            ("distill_weight", 0.0, 1.0, True),
            # beyond, the float32 KL of softmax(logits / T) loses its digits: T=1e4 gave a negative KL, 1e-40 NaN
            ("temperature", 0.01, 100.0, True),
            ("held_out", 0.0, 1.0, True),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{_flag(name)} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{_flag(name)} must be a finite number, got {value}")
            if value < low or (value == low and not closed) or (high is not None and value > high):
                bounds = f"{'[' if closed else '('}{low}, {high if high is not None else 'inf'}]"
                raise ValueError(f"{_flag(name)} must be in {bounds}, got {value}")
        if self.held_out >= 1.0:
            raise ValueError(f"--held-out must be < 1, got {self.held_out}")
        if self.lr / (1 - 0.9) > 3.4e38:  # AdamW's first step moves by lr / (1 - beta1), a float32 scalar
            raise ValueError(
                f"--lr must be below 3.4e37 (its AdamW step would overflow float32), got {self.lr}"
            )
        if self.train not in TRAINABLE:
            raise ValueError(f"--train must be one of {', '.join(TRAINABLE)}; got {self.train!r}")
        if not isinstance(self.device, str):
            raise TypeError(f"--device must be a string, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        for name in ("resume", "fsdp", "overwrite"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{_flag(name)} must be True or False, got {getattr(self, name)!r}")

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else self.steps // 20

    @property
    def run_path(self) -> Path:
        """Where checkpoints and the log live until DST is written (see ``attnlab.train.checkpoint``)."""
        return self.run_dir if self.run_dir is not None else self.dst.with_name(self.dst.name + ".run")

    def to_json(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(self).items()}

    def replace(self, **changes: Any) -> UptrainOptions:
        return dataclasses.replace(self, **changes)
