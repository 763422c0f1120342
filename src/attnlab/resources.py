"""What this machine can hold and compute on: its memory, the one check that refuses a size before it is allocated,
and the device a command runs on (``resolve_device``: what ``--device`` names; ``announce_device``: the line saying so).

Commands size their work from the cost model (``attnlab.cost``: weights, caches, activations) and ask
``check_fits`` before allocating, so a batch that cannot fit is one clear error instead of minutes of swapping or
an allocator failure deep inside a forward pass.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import re
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


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


# The device a command computes on. One resolver for every command (``--device``), so that "auto", the names it
# takes and the refusals read the same everywhere. torch is imported inside: ``attnlab --help`` never imports it.
DEVICES = "auto, cpu, cuda or cuda:N"
_DEVICE = re.compile(r"(cpu|cuda)(?::(\d+))?")


def _no_cuda_reason() -> str:
    import torch

    if torch.version.cuda is None:
        return f"this PyTorch ({torch.__version__}) is built without CUDA"
    return "no CUDA GPU is visible to this process (torch.cuda.is_available() is False)"


def resolve_device(value: object = "auto", flag: str = "--device") -> torch.device:
    """The ``torch.device`` that ``--device`` names: "auto" (CUDA when ``torch.cuda.is_available()``, else the CPU),
    "cpu", "cuda" (its first GPU, ``cuda:0``) or "cuda:N". A device this process cannot use is refused
    (ValueError naming the value and why) before any work; "auto" asks only ``is_available`` and touches no GPU."""
    import torch

    if not isinstance(value, str):
        raise TypeError(f"{flag} must be a string ({DEVICES}), got {value!r}")
    text = value.strip().lower()
    if text == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    found = _DEVICE.fullmatch(text)
    if found is None or (found.group(1) == "cpu" and found.group(2) is not None):
        raise ValueError(f"{flag} must be {DEVICES}; got {value!r}")
    if found.group(1) == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"{flag} {value}: {_no_cuda_reason()}; use --device cpu (or auto)")
    index = int(found.group(2) or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(
            f"{flag} {value}: this process sees {count} CUDA GPU{'s' if count != 1 else ''} "
            f"(cuda:0{f' .. cuda:{count - 1}' if count > 1 else ''})"
        )
    return torch.device("cuda", index)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, name = line.partition(":")
            if key.strip() == "model name":
                return name.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def describe_device(device: torch.device) -> str:
    """What the device line says: "cuda:0 (NVIDIA H100 80GB HBM3)" or "cpu (AMD EPYC 9R14, 2 threads)"."""
    import torch

    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        return f"cpu ({_cpu_name()}, {torch.get_num_threads()} threads)"
    return str(device)


def announce_device(device: torch.device, note: str = "") -> None:
    """The one stderr line of a command that computes: which device it runs on (``note``: how, e.g. its ranks)."""
    print(f"device: {describe_device(device)}{f', {note}' if note else ''}", file=sys.stderr)


def die_with_launcher() -> None:
    """Under torchrun on Linux, end this rank when torchrun ends: it starts its ranks in a session of their own, so
    a SIGKILL of torchrun (``timeout -s KILL``, ``kill -9`` of its process group) left them training on, writing DST
    after the run was stopped, or waiting up to 30 minutes in the rendezvous. The parent-death signal is SIGKILL: a
    rank waiting in the rendezvous never returns to Python to run a SIGTERM handler (what a killed rank leaves, its
    temporaries, the next run removes).

    Only for a rank whose parent is torchrun itself: a process that merely inherited torchrun's variables (a rank's
    own ``attnlab eval`` subprocess, started from a thread that may end first), another launcher's rank (one built on
    torch's elastic API, which may be a container's init) and a shell's background job run as they did. A rank whose
    torchrun died before this call (while it imported torch) is not caught."""
    if sys.platform != "linux" or "TORCHELASTIC_RUN_ID" not in os.environ or "RANK" not in os.environ:
        return
    if not _is_torchrun(os.getppid()):
        return
    with contextlib.suppress(OSError, AttributeError):  # (no libc prctl: the rank lives as it did)
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


def _is_torchrun(pid: int) -> bool:
    """Whether process ``pid`` runs torchrun (its program, or the script its interpreter runs, or ``-m
    torch.distributed.run``: not a word of its arguments); False where it cannot tell."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    if any(w.rsplit(b"/", 1)[-1] == b"torchrun" for w in words[:2]):
        return True
    return words[1:2] == [b"-m"] and words[2:3] in ([b"torch.distributed.run"], [b"torch.distributed.launch"])
