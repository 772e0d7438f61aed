"""Stale /dev/shm cleanup judges a launcher's shared memory by the lock its launcher holds, not by a pid."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from stalwart.detect.heartbeat import Board
from stalwart.supervisor.leftovers import _remove_stale_shared_memory


def _snapshots_of(board: Path) -> Path:
    path = board.with_name(board.name.replace("stalwart-heartbeat-", "stalwart-snapshots-"))
    path.mkdir()
    (path / "local00000.slot0").write_bytes(b"a rank's snapshot")
    return path


def test_a_live_launchers_memory_is_kept_even_when_its_pid_is_not_visible(tmp_path: Path) -> None:
    # A launcher in another pid namespace sharing /dev/shm: the pid in its names means nothing here.
    board = Board(2, directory=str(tmp_path))
    foreign = board.path.with_name(f"stalwart-heartbeat-{2**22 + 17}-{board.path.name.rsplit('-', 1)[1]}")
    os.rename(board.path, foreign)
    board.path = foreign
    snapshots = _snapshots_of(foreign)
    try:
        assert _remove_stale_shared_memory(tmp_path) == []
        assert foreign.exists() and (snapshots / "local00000.slot0").exists()
    finally:
        board.close()
    assert _remove_stale_shared_memory(tmp_path) == [snapshots], "once its launcher is gone, it goes"


def test_a_dead_launchers_memory_goes_even_when_its_pid_was_reused(tmp_path: Path) -> None:
    # The launcher was SIGKILLed (its lock went with it) and its pid now belongs to a live process: this one.
    board = tmp_path / f"stalwart-heartbeat-{os.getpid()}-0badcafe"
    board.write_bytes(bytes(128))
    snapshots = _snapshots_of(board)
    assert sorted(_remove_stale_shared_memory(tmp_path)) == sorted([board, snapshots])
    assert not board.exists() and not snapshots.exists()


def test_log_directories_of_sigkilled_launchers_go_and_live_ones_stay(tmp_path: Path, monkeypatch: Any) -> None:
    # torch elastic's log directory: the launcher holds its lock file locked for its life. One left by a dead
    # launcher (a lock file nobody holds) goes; a live launcher's stays, and so does a directory without a lock
    # file (not one of ours to judge, or from before the lock).
    import contextlib

    from stalwart.supervisor.leftovers import LOG_DIR_LOCK, LOG_DIR_PREFIX, _log_dir, _remove_stale_log_dirs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = tmp_path / f"{LOG_DIR_PREFIX}dead"
    (dead / "attempt_0").mkdir(parents=True)
    (dead / LOG_DIR_LOCK).write_bytes(b"")
    old = tmp_path / f"{LOG_DIR_PREFIX}old"
    old.mkdir()
    with contextlib.ExitStack() as cleanup:
        live = _log_dir(cleanup)
        assert live.parent == tmp_path and (live / LOG_DIR_LOCK).exists()
        assert _remove_stale_log_dirs() == [dead]
        assert live.exists() and old.exists() and not dead.exists()
    assert not live.exists(), "the launcher removes its own on the way out"
    assert _remove_stale_log_dirs() == [] and old.exists()
