"""What this machine can hold: its memory, and the one check that refuses a size before it is allocated.

Commands size their work from the cost model (``attnlab.cost``: weights, caches, activations) and ask
``check_fits`` before allocating, so a batch that cannot fit is one clear error instead of minutes of swapping or
an allocator failure deep inside a forward pass.
"""

from __future__ import annotations

from pathlib import Path


def _meminfo(field: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024  # the file says kB and means KiB
    except (OSError, ValueError):
        pass
    return None


def memory_bytes() -> int:
    """Physical memory (``MemTotal``); 0 where unknown."""
    return _meminfo("MemTotal") or 0


def available_memory_bytes() -> int | None:
    """Memory the kernel could give this process now (``MemAvailable``), or None where unknown."""
    return _meminfo("MemAvailable")


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


def check_fits(need: int, what: str, advice: str, available: int | None = None) -> None:
    """Refuse (ValueError) work that needs at least ``need`` bytes when the machine has less available.

    ``what``: the sizes that ask for it, as flags ("--batch-size 64 x --seq-len 2048"); ``advice``: how to ask
    for less. Where the available memory is unknown, nothing is refused.
    """
    have = available_memory_bytes() if available is None else available
    if have is not None and need > have:
        raise ValueError(
            f"{what} needs at least {_gb(need)} of memory, and this machine has {_gb(have)} available: {advice}"
        )
