"""Where the benchmark scripts read their text and write their results: one rule for all of them.

- **Full runs** (a script's default grid and sizes) are the ones whose results the repository keeps: they write
  ``benchmarks/results/`` and ``docs/``, and the studies among them read the whole corpus beside the checkout,
  ``../shared/data/shakespeare`` (42 works: the published numbers were made on them). Without it they stop with
  one line saying where to put it (exit 2) rather than publish numbers made on other text.
- **Quick or partial runs** (``--quick``, or fewer shapes, variants, layers, lines ... than the defaults) write the
  same files at the same relative paths under ``benchmarks/.cache/quick/`` (git-ignored), never over the
  committed ones, and read the corpus the package ships (``attnlab.data.shakespeare()``: 36 of the plays), so
  they run in a plain clone. How many times a run repeats a timing, or on how many threads, does not make it
  partial.

A path given on a script's command line (``--json``, ``--doc``, ``--png``) is used as given.

Writing follows attnlab's write rule (``attnlab.atomic``): the results and cache directories of the checkout
(``OWN``) are attnlab's, so the scripts replace their files there; a path elsewhere (a ``--json`` of yours) is
replaced only when it holds attnlab's mark (a JSON written by ``write_json``, a plot, a generated page).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FULL_CORPUS = ROOT.parent / "shared" / "data" / "shakespeare"
QUICK = ROOT / "benchmarks" / ".cache" / "quick"


OWN = (
    ROOT / "benchmarks" / "results",
    ROOT / "benchmarks" / ".cache",
    ROOT / "docs",
    ROOT / "src" / "attnlab" / "assets",
)


def own_path(path: Path) -> bool:
    """Whether ``path`` lies in a directory of the checkout whose files the scripts write (``OWN``)."""
    resolved = Path(path).resolve()
    return any(resolved.is_relative_to(d) for d in OWN)


def output(committed: Path, full: bool) -> Path:
    """``committed`` (a path inside the checkout) for a full run, else its place under ``QUICK``."""
    return committed if full else QUICK / committed.relative_to(ROOT)


def at_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> bool:
    """Whether the options ``names`` (their ``dest``) all have their default values: the run is a full one."""
    return all(getattr(args, name) == parser.get_default(name) for name in names)


def corpus(full: bool, script: str) -> Path:
    """The directory of ``.txt`` works a run reads: the whole corpus for a full run, else the shipped one."""
    if not full:
        from attnlab.data import shakespeare

        return shakespeare()
    if not FULL_CORPUS.is_dir():
        print(
            f"{script}: a full run reads the 42 works of {FULL_CORPUS} (its published numbers were made on them); "
            "put the corpus there, or make a quick or smaller run, which reads the 36 plays attnlab ships",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return FULL_CORPUS


def positive(text: str) -> int:
    """An argparse type: an integer >= 1 (0 repeats, threads or new tokens gave a traceback, some after minutes)."""
    if not (text.strip().isascii() and text.strip().isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def positive_list(text: str) -> list[int]:
    """An argparse type: a comma list of integers >= 1."""
    try:
        return [positive(item) for item in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers >= 1, got {text!r}") from None
