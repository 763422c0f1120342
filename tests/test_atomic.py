"""attnlab.atomic: whole files or nothing, and no temporaries left behind."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from attnlab.atomic import save_figure, write_atomic


def test_write_atomic_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "out.json"
    write_atomic(path, "old")
    write_atomic(path, b"new")
    assert path.read_text() == "new"
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.json"]
    assert path.stat().st_mode & 0o777 == 0o644


def test_failed_figure_keeps_the_old_file(tmp_path):
    path = tmp_path / "plot.png"
    write_atomic(path, b"old")
    fig = plt.figure()
    with pytest.raises(TypeError):
        save_figure(fig, path, no_such_savefig_option=1)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]
    assert not plt.fignum_exists(fig.number)  # closed even on failure

    save_figure(plt.figure(figsize=(2, 1)), path, dpi=50)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
