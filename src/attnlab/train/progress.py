"""What a run shows and records: a progress bar on stderr (loss, tokens/s, ETA) and one JSON line per step.

Only rank 0 writes; every rank keeps the same running numbers, so the summary is the same
everywhere. On resume the log is cut back to the checkpoint's step: steps done after the last checkpoint by the
killed run are done again and logged once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .distributed import Env


class StepLog:
    def __init__(self, path: Path, *, first_step: int, total: int, show: bool, env: Env) -> None:
        self.path, self.first_step, self.total = path, first_step, total
        self.enabled = env.is_main  # writes the log
        self.show = show and env.is_main  # draws the progress bar
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.tokens = 0
        self.seconds = 0.0
        kept: list[str] = []
        if self.enabled and first_step > 0 and path.is_file():
            kept = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= first_step]
            if kept:
                self.first_loss = json.loads(kept[0])["loss"]
        if self.enabled:
            path.write_text("".join(ln + "\n" for ln in kept))
        self._progress: Progress | None = None

    def __enter__(self) -> StepLog:
        if self.show:
            self._progress = Progress(
                TextColumn("uptrain"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[rate]} tok/s"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self._progress.start()
            self._task = self._progress.add_task(
                "uptrain", total=self.total, completed=self.first_step, loss="-", rate="-"
            )
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()

    def step(self, record: dict, *, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds
        if self.first_loss is None:
            self.first_loss = record["loss"]
        self.last_loss = record["loss"]
        record = record | {"tokens_per_s": tokens / seconds if seconds > 0 else None}
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self._progress is not None:
            self._progress.update(
                self._task,
                advance=1,
                loss=f"{record['loss']:.4f}",
                rate=f"{tokens / max(seconds, 1e-9):,.0f}",
            )

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None
