"""The measuring half of the "measure" job: this machine (``measure_local``), FLOPs counted on real modules
(``count_flops``), timed decode steps against baselines and the roofline, timed layers next to the cost model's
prediction, and the tables, plots and generated pages that show them. The figures they are compared with come
from ``attnlab.cost``."""

from .counter import count_flops
from .decode import DecodeGrid, run_decode
from .machine import get_hardware, measure_local
from .timing import interleaved

__all__ = ["DecodeGrid", "count_flops", "get_hardware", "interleaved", "measure_local", "run_decode"]
