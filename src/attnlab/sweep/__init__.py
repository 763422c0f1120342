"""``attnlab sweep``: quality, KV bytes and speed of every attention variant of a checkpoint, in one command.

``run_sweep(SweepOptions(src, data, ...))`` converts the source to each variant with each method, uptrains each
conversion for each step count (distilling from the source), scores every checkpoint on held-out text, times decode
per variant on this machine and costs it with the cost model; the jobs run through ``attnlab.jobs`` (cached,
parallel). ``pareto(rows)`` marks the rows no other row beats in loss, KV bytes and tokens/s.
"""

from .command import run_sweep
from .plan import SweepOptions
from .report import pareto

__all__ = ["SweepOptions", "pareto", "run_sweep"]
