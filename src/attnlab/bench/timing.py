"""Timing contenders fairly on a shared, noisy machine.

Each repeat runs every contender once, in turn (A, B, C, A, B, C, ...), so that a burst of load from another
process hits all of them alike; the figure kept is the median over repeats. Ratios between contenders measured
this way are far steadier than absolute times.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved(
    contenders: dict[str, Callable[[], object]],
    *,
    repeats: int = 7,
    warmup: int = 1,
    reset: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Median seconds per call of each contender, timed round-robin; ``reset`` runs untimed after each call."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for i in range(warmup + repeats):
        for name, fn in contenders.items():
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if reset is not None:
                reset()
            if i >= warmup:
                samples[name].append(elapsed)
    return {name: statistics.median(times) for name, times in samples.items()}
