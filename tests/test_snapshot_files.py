"""Snapshot files on disk: no half snapshot when the solver state cannot be written, the user's umask for
permissions, and temporary files of a killed run removed at the next start (never those of a live writer)."""
from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from test_solver import make_solver

from superneurons.errors import UserError
from superneurons.io.prototxt import open_temp_beside
from superneurons.solver import snapshot

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(old)


@pytest.mark.parametrize("mask,hdf5", [(0o022, False), (0o002, False), (0o077, False), (0o002, True)])
def test_snapshot_files_get_the_umask_permissions(tmp_path, monkeypatch, umask, mask, hdf5):
    monkeypatch.chdir(tmp_path)
    umask(mask)
    solver = make_solver('base_lr: 0.1 max_iter: 2 snapshot_prefix: "snap/x"' +
                         (" snapshot_format: HDF5" if hdf5 else ""))
    solver.solve()
    files = sorted(p.name for p in (tmp_path / "snap").iterdir())
    h5 = ".h5" if hdf5 else ""
    assert files == [f"x_iter_2.caffemodel{h5}", f"x_iter_2.solverstate{h5}", f"x_iter_2.solverstate{h5}.extra"]
    for name in files:
        assert stat.S_IMODE((tmp_path / "snap" / name).stat().st_mode) == 0o666 & ~mask, name


def test_a_failed_solver_state_write_leaves_no_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    solver = make_solver('base_lr: 0.1 max_iter: 2 snapshot_prefix: "snap/x"')
    solver.step(2)

    def disk_full(path, msg):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(snapshot, "write_binary", disk_full)
    with pytest.raises(UserError, match="snap/x_iter_2.solverstate: cannot write the solver state"):
        solver.snapshot()
    assert not (tmp_path / "snap/x_iter_2.caffemodel").exists()
    assert not list((tmp_path / "snap").iterdir())  # nor the sidecar, nor a temporary file


KILLED_WRITER = """
import os, sys
from superneurons.io.prototxt import open_temp_beside
fd, tmp = open_temp_beside(sys.argv[1])
os.write(fd, b"half a model")
os._exit(9)  # killed mid-write: the temporary file stays
"""


def test_temporary_files_of_a_killed_run_are_removed_at_the_next_start(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "snap").mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-c", KILLED_WRITER, "snap/x_iter_4.caffemodel"], env=env, timeout=60)
    (left,) = [p for p in (tmp_path / "snap").iterdir()]
    assert left.name.startswith(".x_iter_4.caffemodel.tmp-")  # hidden, and named after what it was to become
    fd, live = open_temp_beside("snap/x_iter_8.caffemodel")  # a writer that is still running: kept
    os.close(fd)
    (tmp_path / "snap/.tmp-unrelated").write_text("not ours")
    (tmp_path / "snap/.y_iter_4.caffemodel.tmp-1-abc").write_text("another prefix's")

    solver = make_solver('base_lr: 0.1 max_iter: 1 snapshot_prefix: "snap/x"')
    solver.solve()
    assert not left.exists()
    assert Path(live).exists() and (tmp_path / "snap/.tmp-unrelated").exists()
    assert (tmp_path / "snap/.y_iter_4.caffemodel.tmp-1-abc").exists()
    assert f"Removed snap/{left.name}, a temporary snapshot file left by an interrupted run" in solver.log.lines
