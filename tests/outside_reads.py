"""Files the test session reads beside the checkout, caught by an audit hook (``sys.addaudithook``).

The suite must pass in a plain clone, so nothing it reads may lie next to the checkout (where a developer's
machine keeps the full data corpus, or another checkout). ``install()`` adds a hook that sees this process's
``open``, ``os.listdir`` and ``os.scandir`` calls and records each path under the checkout's parent directory
that is neither inside the checkout nor in a place Python itself uses: the interpreter's prefixes, the
``sys.path`` entries, the temporary directory, ``$XDG_CACHE_HOME``, and hidden directories beside the checkout
(``~/.cache`` and ``~/.config`` when the checkout lies in the home directory, a ``.venv``). tests/conftest.py
fails the session if any was recorded. Nothing is watched beside a checkout at the filesystem's root or inside
one of those places (a clone in the temporary directory).

The hook runs on every audited event, so it stays cheap: a set lookup for other events, and for the watched
ones a few string operations (paths are made absolute, not resolved: a link beside the checkout is not
followed). Subprocesses are not watched.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WATCHED = frozenset({"open", "os.listdir", "os.scandir"})
READS: dict[str, str] = {}  # path -> the test that read it first
_installed = [False]


def _prefix(path: str | os.PathLike) -> str:
    return os.path.join(os.path.abspath(path), "")  # "/a/b/": "/a/bc" does not start with it


PARENT = _prefix(ROOT.parent)
_PLACES = [ROOT, sys.prefix, sys.base_prefix, sys.exec_prefix, tempfile.gettempdir(), *sys.path,
           os.environ.get("XDG_CACHE_HOME", "")]  # fmt: skip
ALLOWED = tuple({_prefix(p) for p in _PLACES if p and os.path.isabs(p)})
# Nothing to watch beside a checkout at the filesystem's root, or inside one of those places (cloned into /tmp).
WATCHING = not PARENT.startswith(ALLOWED) and _prefix(ROOT.anchor) != PARENT


def outside(path: str) -> bool:
    """Whether reading the absolute ``path`` reads beside the checkout (never, where nothing is watched)."""
    path = os.path.join(path, "")  # a directory named without its last separator is still itself
    if not WATCHING or not path.startswith(PARENT) or path.startswith(ALLOWED):
        return False
    return not path[len(PARENT) :].startswith(".")  # hidden: ~/.cache, ~/.config, a venv's .venv


def _hook(event: str, args: tuple) -> None:
    if event not in WATCHED or not args:
        return
    path = args[0]
    if path is None or isinstance(path, int):  # a file descriptor: its open was seen when it was made
        return
    try:
        path = os.path.abspath(os.fsdecode(path))
    except (TypeError, ValueError):
        return
    if outside(path):
        READS.setdefault(path, os.environ.get("PYTEST_CURRENT_TEST", "outside a test"))


def install() -> None:
    """Add the hook, once: an audit hook stays for the life of the process."""
    if WATCHING and not _installed[0]:
        _installed[0] = True
        sys.addaudithook(_hook)
