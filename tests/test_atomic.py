"""attnlab.atomic: whole files or nothing, sources never touched, leftovers of dead processes removed, umask modes."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from attnlab import atomic
from attnlab.atomic import (
    atomic_dir,
    check_destination,
    claim_dir,
    marker_kind,
    remove_stale,
    save_figure,
    write_atomic,
)


def tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode() + f.read_bytes())
    return h.hexdigest()


@pytest.fixture
def umask_027():
    before = os.umask(0o027)
    yield
    os.umask(before)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(proc.stdout)


def test_write_atomic_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "out.json"
    write_atomic(path, "old")
    write_atomic(path, b"new", ours=True)  # a path attnlab names itself (a cache)
    assert path.read_text() == "new"
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.json"]
    assert path.stat().st_mode & 0o777 == 0o666 & ~atomic._umask()


def test_modes_follow_the_umask(tmp_path, umask_027):
    # Issue 8: checkpoints came out 0700/0600 whatever the umask.
    path = write_atomic(tmp_path / "f.json", "x")
    assert path.stat().st_mode & 0o777 == 0o640
    with atomic_dir(tmp_path / "ckpt") as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.bin").write_bytes(b"a")
        fd = os.open(tmp / "private", os.O_WRONLY | os.O_CREAT, 0o600)  # as safetensors writes
        os.close(fd)
    assert (tmp_path / "ckpt").stat().st_mode & 0o777 == 0o750
    assert (tmp_path / "ckpt" / "sub").stat().st_mode & 0o777 == 0o750
    assert (tmp_path / "ckpt" / "sub" / "a.bin").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "ckpt" / "private").stat().st_mode & 0o777 == 0o640


def test_failed_figure_keeps_the_old_file(tmp_path):
    path = tmp_path / "plot.png"
    save_figure(plt.figure(figsize=(2, 1)), path, dpi=50)
    old = path.read_bytes()
    fig = plt.figure()
    with pytest.raises(TypeError):
        save_figure(fig, path, no_such_savefig_option=1)
    assert path.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]
    assert not plt.fignum_exists(fig.number)  # closed even on failure

    save_figure(plt.figure(figsize=(2, 1)), path, dpi=50)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    save_figure(plt.figure(figsize=(2, 1)), tmp_path / "new" / "dir" / "p.PNG", dpi=50)  # directories made
    with pytest.raises(ValueError, match=r"ending in \.png"):
        save_figure(plt.figure(), tmp_path / "p.jpg")


def make_source(root: Path) -> Path:
    src = root / "holder" / "src"
    src.mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(os.urandom(64))
    return src


@pytest.mark.parametrize("relation", ["equal", "dst contains src", "dst inside src", "symlink to src",
                                      "symlink to holder", "dot", "dot-dot"])  # fmt: skip
@pytest.mark.parametrize("overwrite", [False, True])
def test_destination_may_not_be_contain_or_lie_inside_the_source(tmp_path, monkeypatch, relation, overwrite):
    src = make_source(tmp_path)
    before = tree_hash(tmp_path)
    dst = {
        "equal": src,
        "dst contains src": src.parent,
        "dst inside src": src / "out",
        "symlink to src": tmp_path / "link",
        "symlink to holder": tmp_path / "link",
        "dot": Path("."),
        "dot-dot": Path(".."),
    }[relation]
    if relation.startswith("symlink"):
        (tmp_path / "link").symlink_to(src if relation == "symlink to src" else src.parent)
        before = tree_hash(tmp_path)
    monkeypatch.chdir(src / ".." if relation == "dot" else src)
    match = r"is the source|contains the source|lies inside the source"
    with pytest.raises(ValueError, match=match), atomic_dir(dst, overwrite, sources=[src]) as tmp:
        (tmp / "x").write_text("x")
    assert tree_hash(tmp_path) == before
    assert not [p for p in tmp_path.rglob(".*tmp-*")]


def test_overwrite_replaces_an_attnlab_output_but_never_home_root_or_cwd(tmp_path, monkeypatch):
    src = make_source(tmp_path)
    dst = tmp_path / "dst"
    with atomic_dir(dst, sources=[src]) as tmp:
        (tmp / "old.txt").write_text("old")
    assert atomic.marker_kind(dst) == "checkpoint"
    with pytest.raises(FileExistsError, match="destination exists"):
        check_destination(dst, [src])
    with atomic_dir(dst, True, sources=[src]) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in dst.iterdir()) == [atomic.MARKER, "new.txt"]
    monkeypatch.chdir(dst)
    for refused in (dst, tmp_path, Path.home(), Path("/")):
        with pytest.raises(
            (ValueError, FileExistsError), match=r"refusing to replace|filesystem root|marker"
        ):
            check_destination(refused, overwrite=True)
    assert (dst / "new.txt").exists()


@pytest.mark.parametrize("kind", ["user directory", "user file", "symlink to an output", "another kind"])
def test_overwrite_never_replaces_what_attnlab_did_not_write(tmp_path, kind):
    # Issue 29: --overwrite (and --run-dir) emptied or replaced directories of the user's.
    dst = tmp_path / "dst"
    if kind == "user directory":
        dst.mkdir()
        (dst / "thesis.tex").write_text("years of work")
    elif kind == "user file":
        dst.write_text("notes")
    elif kind == "symlink to an output":
        with atomic_dir(tmp_path / "real") as tmp:
            (tmp / "v").write_text("1")
        dst.symlink_to(tmp_path / "real")
    else:
        atomic.claim_dir(dst, "run")  # an attnlab run directory is not a checkpoint to replace
    before = tree_hash(tmp_path)
    with pytest.raises(FileExistsError, match="attnlab"), atomic_dir(dst, True) as tmp:
        (tmp / "x").write_text("x")
    with pytest.raises(FileExistsError, match="attnlab"):
        atomic.remove_owned(dst, "checkpoint")
    assert tree_hash(tmp_path) == before and not list(tmp_path.glob(".dst*"))


def test_claim_dir_creates_marks_empties_only_its_own(tmp_path, monkeypatch):
    run = atomic.claim_dir(tmp_path / "a" / "run", "run", what="--run-dir")
    assert atomic.marker_kind(run) == "run"
    with atomic_dir(run / "step-00000001") as tmp:
        (tmp / "model.safetensors").write_text("w")
    assert atomic.claim_dir(run, "run") == run and (run / "step-00000001").exists()  # kept unless fresh
    atomic.claim_dir(run, "run", fresh=True)
    assert [p.name for p in run.iterdir()] == [atomic.MARKER]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "a.txt").write_text("a")
    with pytest.raises(FileExistsError, match=r"--run-dir .*mine exists and is a directory without"):
        atomic.claim_dir(mine, "run", fresh=True, what="--run-dir")
    with pytest.raises(ValueError, match="contains the source"):
        atomic.claim_dir(tmp_path, "run", sources=[mine], what="--run-dir")
    monkeypatch.chdir(run)
    with pytest.raises(ValueError, match="current working directory"):
        atomic.claim_dir(run, "run", fresh=True)
    assert (mine / "a.txt").read_text() == "a"
    monkeypatch.chdir(tmp_path)
    atomic.remove_owned(tmp_path / "a" / "run", "run")
    assert not run.exists()


def test_a_destination_that_appears_while_writing_is_not_replaced(tmp_path):
    # Issue 29: the final rename exchanged with whatever had appeared at DST meanwhile.
    dst = tmp_path / "dst"
    with pytest.raises(FileExistsError, match="appeared while"), atomic_dir(dst) as tmp:
        (tmp / "v").write_text("ours")
        dst.mkdir()  # another program (or a user) puts a directory there before we finish
        (dst / "theirs.txt").write_text("theirs")
    assert [p.name for p in dst.iterdir()] == ["theirs.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


HOLD_LOCK = """
import sys, time
from attnlab.atomic import lock
with lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(30)
"""


def test_one_writer_per_destination(tmp_path):
    dst = tmp_path / "new" / "dst"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(dst)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with (
            pytest.raises(atomic.Busy, match=rf"being written by another attnlab process \(pid {holder.pid}"),
            atomic_dir(dst) as tmp,
        ):
            (tmp / "v").write_text("1")
        assert not dst.exists()
    finally:
        holder.kill()
        holder.wait()
    with atomic_dir(dst) as tmp:  # a killed holder's lock goes with it
        (tmp / "v").write_text("1")
    assert sorted(p.name for p in dst.parent.iterdir()) == ["dst"]  # no lock file left
    with atomic.lock(dst), atomic.lock(dst):  # re-entrant in one process
        pass


def test_a_directory_being_read_is_not_replaced_or_deleted_and_one_being_written_is_not_read(tmp_path):
    src = tmp_path / "src"
    with atomic_dir(src) as tmp:
        (tmp / "v").write_text("old")
    with atomic.reading(src, "SRC"), atomic.reading(src, "SRC"):  # readers share it
        with (
            pytest.raises(atomic.Busy, match=r"destination .*src is being read by another attnlab process"),
            atomic_dir(src, overwrite=True) as tmp,
        ):
            (tmp / "v").write_text("new")
        with pytest.raises(atomic.Busy, match="being read"):
            atomic.remove_owned(src, "checkpoint")
        assert (src / "v").read_text() == "old"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no lock file, no temporary left
    with (
        atomic.lock(src, "DST"),
        pytest.raises(atomic.Busy, match=r"SRC .*src is being written by another attnlab process"),
        atomic.reading(src, "SRC"),
    ):
        pass
    with atomic.reading(tmp_path / "missing"), atomic.reading(src / "v"):  # nothing to keep: read as before
        pass
    with atomic_dir(src, overwrite=True) as tmp:  # once the readers are gone
        (tmp / "v").write_text("new")
    assert (src / "v").read_text() == "new"


def test_a_lock_file_that_is_not_attnlabs_is_refused_and_left_as_it_is(tmp_path):
    # A QA reproduction: a user's ".dst.lock" was overwritten and deleted, and a link of that name to a training
    # file made the lock write its "pid ...: attnlab ..." line into the training file.
    data = tmp_path / "data.txt"
    data.write_text("six thousand bytes of text")
    (tmp_path / ".dst.lock").symlink_to(data)
    with (
        pytest.raises(FileExistsError, match="is a symbolic link, not attnlab's lock file"),
        atomic.lock(tmp_path / "dst"),
    ):
        pass
    assert data.read_text() == "six thousand bytes of text" and (tmp_path / ".dst.lock").is_symlink()
    (tmp_path / ".dst.lock").unlink()
    (tmp_path / ".dst.lock").write_text("precious")
    with pytest.raises(FileExistsError, match="holds 'precious'"), atomic_dir(tmp_path / "dst") as tmp:
        (tmp / "v").write_text("1")
    assert (tmp_path / ".dst.lock").read_text() == "precious" and not (tmp_path / "dst").exists()
    os.mkfifo(tmp_path / ".fifo.lock")
    with pytest.raises(FileExistsError, match="not a regular file"), atomic.lock(tmp_path / "fifo"):
        pass
    # an empty one (left by a killed holder) or an attnlab holder's text is attnlab's
    (tmp_path / ".dst.lock").write_text("pid 12: attnlab convert a dst")
    with atomic_dir(tmp_path / "dst") as tmp:
        (tmp / "v").write_text("1")
    assert not (tmp_path / ".dst.lock").exists()


def test_a_deletion_cut_short_leaves_nothing_in_place_and_the_next_write_removes_the_rest(
    tmp_path, monkeypatch
):
    """A deletion killed after its first file left a checkpoint missing a shard where readers look for it (a sweep
    then reported it as kept, and cached the failure of the jobs that read it)."""
    run = tmp_path / "run"
    claim_dir(run, "run")
    for step in ("step-00000001", "step-00000002"):
        claim_dir(run / step, "checkpoint")
        for i in range(3):
            (run / step / f"shard-{i}").write_text("x" * 100)
    real = Path.unlink
    calls = []

    def interrupted(self, *args, **kwargs):
        calls.append(self.name)
        if len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the deletion
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic.remove_owned(run, "run")
    monkeypatch.setattr(Path, "unlink", real)
    assert not run.exists()
    (left,) = tmp_path.glob(f".run.del-{os.getpid()}-*")
    assert marker_kind(left) == "run"  # what is left is still attnlab's
    dead = left.with_name(".run.del-999999999-0123abcd")  # as if the process had been killed
    left.rename(dead)
    with atomic_dir(run, kind="run") as tmp:
        (tmp / "log").write_text("new")
    assert not dead.exists() and (run / "log").read_text() == "new"


def test_a_failed_lock_or_write_removes_the_directories_it_made(tmp_path):
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "x" / "y" / "dst") as tmp:
        (tmp / "v").write_text("1")
        raise RuntimeError("a bug")
    assert list(tmp_path.iterdir()) == []


def test_files_are_replaced_only_when_attnlab_made_them(tmp_path):
    theirs = tmp_path / "results.json"
    theirs.write_text('{"mine": 1}')
    for writer in (lambda: write_atomic(theirs, "{}"), lambda: atomic.write_json(theirs, {}, by="test")):
        with pytest.raises(FileExistsError, match="without attnlab's mark"):
            writer()
    assert theirs.read_text() == '{"mine": 1}'
    ours = atomic.write_json(
        tmp_path / "ours.json", {"loss": float("nan"), "x": [float("inf"), 1.0]}, by="test"
    )
    assert atomic.is_own_file(ours)
    assert json.loads(ours.read_text()) == {"generated_by": "attnlab test", "loss": None, "x": [None, 1.0]}
    atomic.write_json(ours, {"loss": 1.0}, by="test")  # its own: replaced
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n_Generated by `benchmarks/x.py`; do not edit._\n")
    assert atomic.is_own_file(page)
    write_atomic(page, "# Title\n<!-- generated by attnlab -->\n")
    photo = tmp_path / "photo.png"
    photo.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    with pytest.raises(FileExistsError, match="not a plot attnlab made"):
        save_figure(plt.figure(figsize=(1, 1)), photo)
    assert photo.read_bytes().endswith(b"\0" * 40)


def test_json_text_is_strict_json():
    text = atomic.json_text({"a": float("nan"), "b": [float("-inf")], "c": 1.5})
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"a": None, "b": [None], "c": 1.5}


@pytest.mark.parametrize("exchange", [True, False])
def test_failed_block_leaves_the_old_destination_and_no_temporary(tmp_path, monkeypatch, exchange):
    if not exchange:  # the two-rename path of systems without renameat2(RENAME_EXCHANGE)
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    dst = tmp_path / "ckpt"
    with atomic_dir(dst) as tmp:
        (tmp / "v").write_text("1")
    with pytest.raises(RuntimeError, match="boom"), atomic_dir(dst, True) as tmp:
        (tmp / "v").write_text("2")
        raise RuntimeError("boom")
    with pytest.raises(OSError, match="No space left") as info, atomic_dir(dst, True) as tmp:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "v"))
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(dst)  # the user's path
    assert (dst / "v").read_text() == "1" and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    with atomic_dir(dst, True) as tmp:
        (tmp / "v").write_text("3")
    assert (dst / "v").read_text() == "3" and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path):
    dst = tmp_path / "ckpt"
    dead, alive = dead_pid(), os.getppid()
    stale = [tmp_path / f".ckpt.tmp-{dead}-0123abcd", tmp_path / f".out.json.tmp-{dead}-89abcdef.tmp"]
    stale[0].mkdir()
    (stale[0] / "model.safetensors").write_bytes(b"partial")
    stale[1].write_text("partial")
    live = tmp_path / f".ckpt.tmp-{alive}-0123abcd"  # another process still writing: left alone
    live.mkdir()
    other = tmp_path / ".notes.tmp-1-ab"  # not ours: left alone
    other.write_text("x")
    with atomic_dir(dst) as tmp:
        (tmp / "v").write_text("1")
    write_atomic(tmp_path / "out.json", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", "out.json", live.name, other.name])


def test_an_old_destination_renamed_aside_by_a_dead_process_is_restored(tmp_path):
    # Killed between "rename dst aside" and "rename the new one in" (the path without RENAME_EXCHANGE):
    # the next write puts the old destination back before anything else, so it is never lost.
    old = tmp_path / f".ckpt.old-{dead_pid()}-0123abcd"
    old.mkdir()
    (old / "v").write_text("old")
    assert remove_stale(tmp_path / "ckpt") == []
    assert (tmp_path / "ckpt" / "v").read_text() == "old" and not old.exists()


KILL_MID_WRITE = """
import os, signal, sys
from attnlab.atomic import atomic_dir
with atomic_dir(sys.argv[1]) as tmp:
    (tmp / "model.safetensors").write_bytes(b"x" * 100_000)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_sigkill_mid_write_then_a_successful_run_leaves_no_temporary(tmp_path):
    dst = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-c", KILL_MID_WRITE, str(dst)], capture_output=True)
    assert proc.returncode == -9
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.tmp-")]
    assert len(leftovers) == 1 and (leftovers[0] / "model.safetensors").stat().st_size == 100_000
    assert not dst.exists()
    with atomic_dir(dst) as tmp:
        (tmp / "v").write_text("1")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_a_lock_taken_for_a_command_line_in_another_encoding(tmp_path, monkeypatch):
    # a path with byte 0xff reaches sys.argv as a surrogate: writing it into the lock file raised, and left the lock
    # file behind (one more each retry)
    monkeypatch.setattr(sys, "argv", ["attnlab", "convert", "src", "cv_\udcff"])
    with atomic.lock(tmp_path / "cv_\udcff"):
        text = (tmp_path / ".cv_\udcff.lock").read_bytes()
        assert b"cv_\\udcff" in text
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(os, "write", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError, match="No space"), atomic.lock(tmp_path / "dst"):
        pass
    assert not list(tmp_path.iterdir())  # the lock file it could not fill is removed


def test_what_a_user_added_to_an_attnlab_directory_is_neither_replaced_nor_deleted(tmp_path):
    """convert/uptrain --overwrite and sweep --keep none deleted notes a user had put into an earlier output."""
    dst = tmp_path / "dst"
    with atomic_dir(dst) as tmp:
        (tmp / "model.safetensors").write_text("w")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.json").write_text("{}")
    assert atomic.foreign(dst) == []
    (dst / "NOTES.md").write_text("ask Bob")
    (dst / "my_evals").mkdir()
    (dst / "my_evals" / "run1.json").write_text("{}")
    (dst / "sub" / "b.txt").write_text("mine")
    says = r"dst holds what attnlab did not write there \(NOTES.md, my_evals, sub/b.txt\)"
    with pytest.raises(FileExistsError, match=says), atomic_dir(dst, overwrite=True):
        raise AssertionError("refused before the work")
    with pytest.raises(FileExistsError, match=r"holds what attnlab did not write there"):
        atomic.remove_owned(dst, "checkpoint")
    assert (dst / "NOTES.md").read_text() == "ask Bob" and (dst / "my_evals" / "run1.json").exists()
    for added in ("NOTES.md", "my_evals/run1.json", "my_evals", "sub/b.txt"):
        _remove_any(dst / added)
    with atomic_dir(dst, overwrite=True) as tmp:  # as attnlab wrote it: replaced
        (tmp / "model.safetensors").write_text("w2")
    assert (dst / "model.safetensors").read_text() == "w2"
    atomic.remove_owned(dst, "checkpoint")
    assert not dst.exists() and list(tmp_path.iterdir()) == []


def test_a_run_directory_answers_for_what_a_user_put_beside_its_checkpoints(tmp_path):
    """An uptrain run directory's marker lists no files (it grows over the run): only its checkpoints' additions
    were seen, so starting a run over (``fresh``, as ``--overwrite`` does) and the finished run's removal deleted a
    user's notes, folders and hidden files beside them, and a folder named like a checkpoint without a marker."""
    run = atomic.claim_dir(tmp_path / "run", "run")
    (run / "log.jsonl").write_text("{}\n")
    with atomic_dir(run / "step-00000003") as tmp:
        (tmp / "model.safetensors").write_text("w")
    (run / ".step-00000003.lock").write_text("pid 1: attnlab")
    (run / ".step-00000006.tmp-99999999-0a1b2c3d").mkdir()  # a checkpoint a kill cut short
    assert atomic.foreign(run) == []
    atomic.claim_dir(run, "run", fresh=True)  # what attnlab wrote is emptied
    assert sorted(p.name for p in run.iterdir()) == [atomic.MARKER]
    (run / "log.jsonl").write_text("{}\n")
    (run / "NOTES.txt").write_text("mine")
    (run / ".hidden").write_text("mine")
    (run / "mystuff").mkdir()
    (run / "mystuff" / "eval.txt").write_text("mine")
    (run / "step-00000002").mkdir()  # no marker: the user's
    before = {p.relative_to(run).as_posix() for p in run.rglob("*")}
    says = r"holds what attnlab did not write there \(.hidden, NOTES.txt, mystuff and 1 more\)"
    with pytest.raises(FileExistsError, match=says):
        atomic.claim_dir(run, "run", fresh=True)
    with pytest.raises(FileExistsError, match=says):
        atomic.check_claim(run, "run", fresh=True)
    assert not atomic.remove_or_keep(run, "run")
    assert {p.relative_to(run).as_posix() for p in run.rglob("*")} == before
    assert atomic.claim_dir(run, "run") == run  # continued (--resume): nothing is emptied, nothing refused


def test_a_user_file_added_while_attnlab_writes_is_kept(tmp_path):
    dst = tmp_path / "dst"
    with atomic_dir(dst) as tmp:
        (tmp / "w").write_text("1")
    late = r"holds what attnlab did not write there \(late.txt\)"
    with pytest.raises(OSError, match=late), atomic_dir(dst, overwrite=True) as tmp:
        (tmp / "w").write_text("2")
        (dst / "late.txt").write_text("mine")
    assert (dst / "late.txt").read_text() == "mine" and (dst / "w").read_text() == "1"


def test_a_directory_whose_marker_lists_nothing_is_replaced_as_before(tmp_path):
    # written over a run (claim_dir), or by attnlab before markers listed files
    old = tmp_path / "old"
    old.mkdir()
    (old / ".attnlab").write_text('{"generated_by": "attnlab", "kind": "checkpoint"}\n')
    (old / "x").write_text("1")
    assert atomic.foreign(old) == []
    with atomic_dir(old, overwrite=True) as tmp:
        (tmp / "y").write_text("2")
    assert sorted(p.name for p in old.iterdir()) == [".attnlab", "y"]


def _remove_any(path: Path) -> None:
    if path.is_dir():
        path.rmdir()
    elif path.exists():
        path.unlink()


def test_a_lock_that_cannot_be_made_names_the_destination_not_the_lock_file(tmp_path):
    # `convert SRC /proc/o1` said "/proc/.o1.lock: No such file or directory", a file the user never named
    (tmp_path / "a-file").write_text("mine")
    dst = tmp_path / "a-file" / "out"
    with pytest.raises(OSError) as caught, atomic.lock(dst, "DST"):
        pass
    err = caught.value
    assert err.errno == errno.ENOTDIR and err.filename is None
    assert (
        err.strerror == f"DST {dst}: cannot write in {dst.parent} (its lock file goes there): Not a directory"
    )
    assert (tmp_path / "a-file").read_text() == "mine"
