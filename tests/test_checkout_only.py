"""The suite reads nothing beside the checkout, so it passes in a plain clone: no test names the data directory
that lies next to it on a developer's machine, and the audit hook of tests/outside_reads.py (which fails the
session, see tests/conftest.py) does record such a read."""

from __future__ import annotations

import os
import re
import secrets
import sys
from pathlib import Path

import pytest

import outside_reads
from outside_reads import READS, ROOT

# "shared", a path separator or a comma among quotes and spaces, then "data": the corpus beside the checkout.
BESIDE = re.compile(r"shared[\s\"']*[/\\,][\s\"']*data")


def test_no_test_file_names_the_data_beside_the_checkout():
    named = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "tests").rglob("*"))
        if path.is_file() and path.suffix in (".py", ".txt", ".json", ".md", ".toml")
        and BESIDE.search(path.read_text(errors="replace"))
    ]  # fmt: skip
    assert named == []


def test_the_pattern_finds_the_ways_a_path_is_written():
    word = "sha" + "red"  # spelled apart, so that this file does not name the path itself
    for text in (f"../{word}/data/x", f'"{word}" / "data"', f"'{word}', 'data'", f"{word}\\data"):
        assert BESIDE.search(text), text
    assert not BESIDE.search(f"a {word} data structure, n_{word}_experts")


def test_a_read_beside_the_checkout_is_recorded_and_reads_inside_are_not(tmp_path):
    beside = str(ROOT.parent / f"attnlab-probe-{secrets.token_hex(8)}.txt")  # never created
    if not outside_reads.WATCHING:
        pytest.skip("nothing beside this checkout is watched (it lies at the root, or in the temp dir, ...)")
    try:
        with pytest.raises(FileNotFoundError), open(beside):  # audited before the system call, found or not
            pass
        assert beside in READS
        assert READS[beside].startswith("tests/test_checkout_only.py::")
    finally:
        READS.pop(beside, None)  # this read was on purpose: it must not fail the session
    before = dict(READS)
    (tmp_path / "x.txt").write_text("x")
    (tmp_path / "x.txt").read_text()
    (ROOT / "pyproject.toml").read_text()
    os.listdir(ROOT)
    assert dict(READS) == before


def test_python_s_own_places_are_not_reads_beside_the_checkout(tmp_path):
    hidden = ROOT.parent / ".cache"  # hidden directories beside the checkout: caches, venvs
    for path in [ROOT / "tests" / "x.py", Path(sys.prefix) / "lib" / "x.py", tmp_path / "x", hidden]:
        assert not outside_reads.outside(str(path)), path
    assert outside_reads.outside(str(ROOT.parent / "other-checkout" / "x.py")) == outside_reads.WATCHING
