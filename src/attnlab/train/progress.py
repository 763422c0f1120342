"""What a run shows and records: progress on stderr (loss, tokens/s, ETA; periodic lines when stderr is not a
terminal) and one JSON line per step.

Only rank 0 writes; every rank keeps the same running numbers, so the summary is the same
everywhere. On resume the log is cut back to the checkpoint's step: steps done after the last checkpoint by the
killed run are done again and logged once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..atomic import json_text
from ..console import Progress
from .distributed import Env


def read_log(path: Path) -> list[tuple[str, dict]]:
    """The lines of a run's ``log.jsonl`` and their records. A killed run may have cut its last line short: that
    line is dropped (its step is redone on resume); a damaged line before it is an error naming the file."""
    lines = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    out = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a step record")
        except ValueError as err:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}, line {i + 1}: not a step record of attnlab uptrain ({err})") from None
        out.append((line, record))
    return out


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
            kept = [ln for ln, record in read_log(path) if record["step"] <= first_step]
            if kept:
                self.first_loss = json.loads(kept[0])["loss"]
        if self.enabled:
            path.write_text("".join(ln + "\n" for ln in kept))
        self._progress: Progress | None = None

    def __enter__(self) -> StepLog:
        self._progress = Progress(
            "uptrain", self.total, fields=("loss", "tok/s"), enabled=self.show
        ).__enter__()
        self._progress.update(self.first_step)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def step(self, record: dict, *, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds
        if self.first_loss is None:
            self.first_loss = record["loss"]
        self.last_loss = record["loss"]
        record = record | {"tokens_per_s": tokens / seconds if seconds > 0 else None}
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json_text(record, indent=None))
        if self._progress is not None:
            self._progress.update(
                record["step"],
                loss=f"{record['loss']:.4f}",
                **{"tok/s": f"{tokens / max(seconds, 1e-9):,.0f}"},
            )

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None
