"""Stale /dev/shm cleanup judges a launcher's shared memory by the lock its launcher holds, not by a pid."""

from __future__ import annotations

import os
from pathlib import Path

from stalwart.detect.heartbeat import Board
from stalwart.supervisor.launcher import _remove_stale_shared_memory


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
