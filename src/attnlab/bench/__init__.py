"""Decode benchmarks: timing harness, roofline fractions, tables, plots and the generated performance page."""

from .decode import DecodeGrid, run_decode
from .timing import interleaved

__all__ = ["DecodeGrid", "interleaved", "run_decode"]
