"""Atomic file writes: the data goes to a temporary file beside the destination, then one rename.

A reader sees the old file or the new one, never half of one; a failed write leaves no temporary behind.
(Whole checkpoint directories have their own: ``attnlab.hf.io.atomic_dir``.)
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def _temp_beside(path: Path, suffix: str) -> Iterator[str]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results and caches are meant to be read
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write ``data`` (text is UTF-8 encoded) to ``path`` atomically; returns the path."""
    path = Path(path)
    with _temp_beside(path, ".tmp") as tmp:
        Path(tmp).write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def save_figure(fig: Any, path: str | os.PathLike, **savefig: Any) -> Path:
    """Save a matplotlib figure as PNG at ``path`` atomically and close it; returns the path."""
    import matplotlib.pyplot as plt

    path = Path(path)
    try:
        with _temp_beside(path, ".tmp.png") as tmp:
            fig.savefig(tmp, format="png", **savefig)
    finally:
        plt.close(fig)
    return path
