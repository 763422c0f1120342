"""Atomic writes: one rule for every file and checkpoint directory attnlab writes.

- **Whole or nothing.** Data goes to a temporary beside the destination, ``.{name}.tmp-{pid}-{random}``, and
  becomes the destination by one rename, so a reader sees the old version or the new one, never half of one.
  Files are flushed to disk (fsync) before the rename. A failed write (disk full, permission, a bug) removes its
  temporary and leaves the old destination as it was; the error is an ``OSError`` naming the destination.
- **Sources are never touched.** A destination may not be, contain, or lie inside any of the ``sources`` it is
  made from (paths resolved, symlinks followed), with or without ``overwrite``. ``overwrite`` never replaces
  the filesystem root, the home directory, or a directory that holds the current working directory.
- **Leftovers are cleaned.** A process killed while writing (SIGKILL, power loss) cannot remove its temporary;
  the next write to the same destination removes every temporary whose process (the pid in its name) no longer
  runs. Temporaries of live processes are left alone.
- **Modes follow the umask.** Results get ``0o666 & ~umask`` (files) and ``0o777 & ~umask`` (directories), not
  the private 0600/0700 that temporaries are created with.
- **Replacing a directory** swaps the new one in with a single ``renameat2(RENAME_EXCHANGE)`` on Linux, so the
  destination always exists; elsewhere the old one is renamed aside first (``.{name}.old-{pid}-{random}``,
  restored by the next write if the process died between the two renames).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

PathLike = str | os.PathLike


def _absolute(path: PathLike) -> Path:
    """``path`` made absolute with its parent resolved and its last component kept (a symlink stays a link)."""
    path = Path(os.path.abspath(path))
    if path.name in ("", ".", ".."):
        raise ValueError(f"destination {str(path)!r} must name a file or directory, not a filesystem root")
    return path.parent.resolve() / path.name


def check_destination(dst: PathLike, sources: Iterable[PathLike] = (), *, overwrite: bool = False) -> Path:
    """The absolute destination, after checking the rules of the module docstring (ValueError/FileExistsError)."""
    shown = str(dst)
    dst = _absolute(dst)
    target = dst.resolve()  # where the data would land, symlinks followed
    for src in sources:
        source = Path(src).resolve()
        for candidate in {dst, target}:
            if candidate == source:
                raise ValueError(f"destination {shown} is the source {src}; choose another destination")
            if candidate in source.parents:
                raise ValueError(
                    f"destination {shown} contains the source {src}; writing it would replace the source"
                )
            if source in candidate.parents:
                raise ValueError(
                    f"destination {shown} lies inside the source {src}; the source is never modified"
                )
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise FileExistsError(
                f"destination exists: {shown} (pass --overwrite / overwrite=True to replace it)"
            )
        cwd = Path.cwd().resolve()
        if target == Path(target.anchor) or target == Path.home().resolve():
            raise ValueError(f"refusing to replace {shown}: it is the filesystem root or the home directory")
        if target == cwd or target in cwd.parents:
            raise ValueError(f"refusing to replace {shown}: it holds the current working directory")
    return dst


def _temp_path(dst: Path, kind: str) -> Path:
    return dst.parent / f".{dst.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def remove_stale(dst: PathLike) -> list[Path]:
    """Remove the temporaries of ``dst`` left by processes that no longer run; returns what was removed.

    An ``old`` copy (a replaced destination renamed aside by a process that died before renaming the new one
    in) is put back when ``dst`` is missing, so nothing is lost.
    """
    dst = _absolute(dst)
    pattern = re.compile(rf"\.{re.escape(dst.name)}\.(tmp|old)-(\d+)-[0-9a-f]+(\..*)?")
    removed = []
    try:
        entries = sorted(dst.parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m is None or _pid_alive(int(m.group(2))):
            continue
        if m.group(1) == "old" and not (dst.exists() or dst.is_symlink()):
            with contextlib.suppress(OSError):
                os.rename(entry, dst)
                continue
        _remove(entry)
        removed.append(entry)
    return removed


def _umask() -> int:
    try:  # Linux >= 4.7 reports it without changing it (os.umask would, for every thread)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _finish_tree(root: Path) -> None:
    """Give everything under ``root`` (and ``root``) the umask's modes and flush the files to disk."""
    mask = _umask()
    for parent, dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(parent, name)
            if os.path.islink(path):
                continue
            os.chmod(path, 0o666 & ~mask)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        for name in dirs:
            if not os.path.islink(os.path.join(parent, name)):
                os.chmod(os.path.join(parent, name), 0o777 & ~mask)
    os.chmod(root, 0o777 & ~mask)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened for fsync
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where that is not available."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _replace(new: Path, dst: Path) -> None:
    """Make ``new`` (a directory) be ``dst``, replacing whatever ``dst`` is."""
    if not (dst.exists() or dst.is_symlink()):
        os.rename(new, dst)
    elif _exchange(new, dst):
        _remove(new)  # now holds the old destination
    else:
        old = _temp_path(dst, "old")
        os.rename(dst, old)
        try:
            os.rename(new, dst)
        except BaseException:
            os.rename(old, dst)
            raise
        _remove(old)
    _fsync_dir(dst.parent)


def _write_error(err: OSError, dst: PathLike) -> OSError:
    """The error a failed write raises: the OS reason, the user's path (not the temporary's)."""
    reason = err.strerror or str(err)
    return OSError(err.errno, f"{reason} (nothing was written; any previous version is unchanged)", str(dst))


@contextlib.contextmanager
def atomic_dir(dst: PathLike, overwrite: bool = False, *, sources: Iterable[PathLike] = ()) -> Iterator[Path]:
    """Yield an empty temporary directory that becomes ``dst`` when the block succeeds (removed if it fails).

    ``overwrite`` replaces an existing ``dst``; ``sources``: the paths the result is made from, which ``dst``
    may not be, contain or lie inside (see the module docstring).
    """
    shown = dst
    dst = check_destination(dst, sources, overwrite=overwrite)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(dst)
        tmp = _temp_path(dst, "tmp")
        tmp.mkdir(mode=0o700)  # private while it is being written
    except OSError as err:
        raise _write_error(err, shown) from err
    try:
        yield tmp
        _finish_tree(tmp)
        _replace(tmp, dst)
    except BaseException as err:
        _remove(tmp)
        if isinstance(err, OSError):
            raise _write_error(err, shown) from err
        raise


@contextlib.contextmanager
def _temp_file(path: Path, suffix: str) -> Iterator[str]:
    remove_stale(path)
    tmp = str(_temp_path(path, "tmp")) + suffix
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # private while it is being written
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _prepare_file(path: PathLike, sources: Iterable[PathLike]) -> Path:
    path = check_destination(path, sources, overwrite=True)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a directory; give a file name", str(path))
    return path


def write_atomic(path: PathLike, data: str | bytes, *, sources: Iterable[PathLike] = ()) -> Path:
    """Write ``data`` (text is UTF-8 encoded) to ``path`` atomically, replacing it; returns the path.

    Missing parent directories are created. ``sources``: files or directories ``path`` may not be or lie in.
    """
    shown = path
    path = _prepare_file(path, sources)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _temp_file(path, ".tmp") as tmp:
            Path(tmp).write_bytes(data.encode() if isinstance(data, str) else data)
    except OSError as err:
        raise _write_error(err, shown) from err
    return path


def check_figure_path(path: PathLike) -> Path:
    """The rule for every ``--plot``: a PNG file name (``.png``); missing directories are created on write."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"--plot writes a PNG image: give a file name ending in .png, got {str(path)!r}")
    if path.is_dir():
        raise ValueError(f"--plot {str(path)!r} is a directory; give a file name ending in .png")
    parent = next((p for p in path.parents if p.exists()), None)  # the closest existing ancestor
    if parent is not None and not parent.is_dir():
        raise ValueError(f"--plot {str(path)!r}: {str(parent)!r} is a file, not a directory")
    return path


def save_figure(fig: Any, path: PathLike, *, sources: Iterable[PathLike] = (), **savefig: Any) -> Path:
    """Save a matplotlib figure as PNG at ``path`` (see ``check_figure_path``) atomically and close it."""
    import matplotlib.pyplot as plt

    try:
        shown = path
        check_figure_path(path)
        path = _prepare_file(path, sources)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with _temp_file(path, ".tmp.png") as tmp:
                fig.savefig(tmp, format="png", **savefig)
        except OSError as err:
            raise _write_error(err, shown) from err
    finally:
        plt.close(fig)
    return Path(path)
