"""The corpus the package ships: ``attnlab.data.shakespeare()`` extracts it once, checked, atomically, safely."""

from __future__ import annotations

import hashlib
import io
import tarfile
import threading
from importlib import resources
from pathlib import Path

import pytest

from attnlab import data
from attnlab.atomic import MARKER, marker_kind
from attnlab.data import shakespeare, text_files

ASSETS = resources.files("attnlab") / "assets"


def sums() -> dict[str, str]:
    lines = (ASSETS / "shakespeare.sha256").read_text().splitlines()
    return {name: digest for digest, name in (line.split() for line in lines)}


def digests(folder: Path) -> dict[str, str]:
    """The works' digests; the folder must also carry attnlab's marker (an attnlab cache directory)."""
    assert marker_kind(folder) == "cache"
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.name != MARKER}


def test_the_package_ships_36_plays_in_at_most_1_5_mb():
    # DESIGN.md: the embedded corpus is at most 1.5 MB. The plays the tests slice text from are in it.
    assert len((ASSETS / "shakespeare.tar.xz").read_bytes()) <= 1_500_000
    assert len(sums()) == 36
    assert {"hamlet.txt", "macbeth.txt", "othello.txt"} <= sums().keys()


def test_the_extracted_works_are_the_listed_source_texts_byte_for_byte(tmp_path):
    # The list of sums is made from the source texts by benchmarks/make_corpus.py (--check compares them again).
    folder = shakespeare(tmp_path / "corpus")
    assert folder == tmp_path / "corpus"
    assert digests(folder) == sums()
    assert [p.name for p in text_files(folder)] == sorted(sums())
    assert (folder / "hamlet.txt").read_text(encoding="utf-8").count("Ophelia") > 10


def test_the_default_place_is_a_per_archive_directory_in_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    digest = hashlib.sha256((ASSETS / "shakespeare.tar.xz").read_bytes()).hexdigest()[:16]
    assert shakespeare() == tmp_path / "attnlab" / "corpus" / digest
    assert digests(shakespeare()) == sums()


def test_a_second_call_uses_the_first_extraction(tmp_path, monkeypatch):
    folder = shakespeare(tmp_path / "corpus")
    before = {p.name: p.stat().st_ino for p in [folder, *folder.iterdir()]}

    def extract_again(*args):
        raise AssertionError("extracted a second time")

    monkeypatch.setattr(data, "_extract", extract_again)
    assert shakespeare(tmp_path / "corpus") == folder
    assert {p.name: p.stat().st_ino for p in [folder, *folder.iterdir()]} == before


@pytest.mark.parametrize("damage", ["edited", "truncated", "missing", "extra"])
def test_a_damaged_or_partial_copy_in_the_cache_is_replaced(tmp_path, monkeypatch, damage):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = shakespeare()
    hamlet = folder / "hamlet.txt"
    if damage == "edited":
        hamlet.write_bytes(hamlet.read_bytes().replace(b"Ophelia", b"Opheliq", 1))
    elif damage == "truncated":
        hamlet.write_bytes(hamlet.read_bytes()[:1000])
    elif damage == "missing":
        hamlet.unlink()
    else:
        (folder / "notes.txt").write_text("not a play")
    assert digests(shakespeare()) == sums()


def test_a_damaged_copy_at_a_given_place_is_replaced_but_other_files_are_never_touched(tmp_path):
    extracted = shakespeare(tmp_path / "extracted")
    (extracted / "hamlet.txt").write_text(
        "To be"
    )  # a damaged copy attnlab extracted there (its marker): replaced
    assert digests(shakespeare(extracted)) == sums()

    for files in ({"hamlet.txt": "To be"}, {"hamlet.txt": "To be", "thesis.tex": "my own work"}):
        mine = (
            tmp_path / f"mine{len(files)}"
        )  # the user's directories (no marker): never replaced, whatever they hold
        mine.mkdir()
        for name, text in files.items():
            (mine / name).write_text(text)
        with pytest.raises(FileExistsError, match="attnlab replaces or deletes only what it wrote"):
            shakespeare(mine)
        assert {p.name: p.read_text() for p in mine.iterdir()} == files
    (tmp_path / "file").write_text("a file")
    with pytest.raises(FileExistsError):
        shakespeare(tmp_path / "file")
    assert (tmp_path / "file").read_text() == "a file"


def test_concurrent_first_calls_each_return_the_complete_corpus(tmp_path):
    start, results, errors = threading.Barrier(4), [], []

    def call():
        start.wait()
        try:
            results.append(shakespeare(tmp_path / "corpus"))
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == [tmp_path / "corpus"] * 4
    assert digests(tmp_path / "corpus") == sums()
    assert [p.name for p in tmp_path.iterdir()] == ["corpus"]  # no temporaries left beside it


def test_a_corpus_another_process_put_in_place_meanwhile_is_used(tmp_path, monkeypatch):
    # Another process extracts between this one's first look and its lock: this one then uses that copy.
    real_holds, real_extract, others = data._holds, data._extract, []

    def holds(folder, listed):
        if (
            not others
        ):  # the look before the lock; meanwhile another attnlab process extracts the corpus there
            others.append(folder)
            with data.atomic_dir(folder, kind="cache") as tmp:
                real_extract(*data._shipped(), tmp)
            return False
        return real_holds(folder, listed)

    monkeypatch.setattr(data, "_holds", holds)
    monkeypatch.setattr(data, "_extract", lambda *args: pytest.fail("extracted a second time"))
    assert digests(shakespeare(tmp_path / "corpus")) == sums()


def tar_xz(*members: tuple[str, bytes | None]) -> bytes:
    """An xz'd tar of regular files, or symbolic links to ../../etc/passwd where the data is None."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name, body in members:
            info = tarfile.TarInfo(name)
            if body is None:
                info.type, info.linkname = tarfile.SYMTYPE, "../../etc/passwd"
                tar.addfile(info)
            else:
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    return buf.getvalue()


@pytest.mark.parametrize(
    ("members", "error"),
    [
        ([("../escaped.txt", b"x")], "not one of its listed works"),
        ([("{tmp}/absolute.txt", b"x")], "not one of its listed works"),
        ([("a.txt", None)], "not one of its listed works"),  # a link named as a work
        ([("a.txt", b"changed")], "does not match its SHA-256"),
        ([("a.txt", b"text"), ("a.txt", b"text")], "twice"),
        ([], "lacks a.txt"),
    ],
)
def test_extraction_writes_only_the_listed_works_inside_its_directory(tmp_path, members, error):
    into = tmp_path / "into"
    into.mkdir()
    members = [(name.format(tmp=tmp_path), body) for name, body in members]
    with pytest.raises(ValueError, match=error):
        data._extract(tar_xz(*members), {"a.txt": hashlib.sha256(b"text").hexdigest()}, into)
    assert sorted(p.name for p in tmp_path.rglob("*")) in (["into"], ["a.txt", "into"])  # nothing outside
