"""What a launcher leaves behind and the next one removes: its log directory in /tmp (held by a lock while it
lives, so a launcher that was SIGKILLed leaves one that the next removes) and, in /dev/shm, a heartbeat board
whose lock is free and the memory-tier directories next to it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

from stalwart.detect.heartbeat import BOARD_PREFIX, Board

SNAPSHOTS_PREFIX = "stalwart-snapshots-"
LOG_DIR_PREFIX = "stalwart-logs-"


LOG_DIR_LOCK = ".launcher.lock"


def _log_dir(cleanup: contextlib.ExitStack) -> Path:
    """torch elastic's log directory for this launcher, removed when it ends. A SIGKILLed launcher cannot remove
    it (a test suite left about six a run), so it holds a lock file that the launcher keeps locked for its
    life, and the next launcher removes directories whose lock is free (_remove_stale_log_dirs). The lock is
    taken under another name and renamed into place, so no directory is ever seen with its lock file free."""
    path = Path(tempfile.mkdtemp(prefix=LOG_DIR_PREFIX))
    cleanup.callback(shutil.rmtree, path, ignore_errors=True)
    claim = path / f"{LOG_DIR_LOCK}.new"
    fd = os.open(claim, os.O_CREAT | os.O_RDWR, 0o600)  # not inherited by what this process execs
    cleanup.callback(os.close, fd)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(claim, path / LOG_DIR_LOCK)
    return path


def _remove_stale_log_dirs(tmp: Path | None = None) -> list[Path]:
    """Log directories left in the temporary directory by launchers that were SIGKILLed: their lock is free
    (Board.abandoned, which holds for a reused pid and another pid namespace). Returns what went."""
    removed = []
    for path in Path(tmp or tempfile.gettempdir()).glob(f"{LOG_DIR_PREFIX}*"):
        lock = path / LOG_DIR_LOCK
        if lock.exists() and Board.abandoned(lock):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _remove_stale_shared_memory(shm: Path = Path("/dev/shm")) -> list[Path]:
    """Heartbeat boards and memory-tier directories left in /dev/shm by launchers that were SIGKILLed.

    A launcher holds a lock on its board for its whole life; a board whose lock is free has no launcher, and
    neither has the memory-tier directory next to it (`stalwart-snapshots-<same suffix>`). Returns what went.
    """
    removed = []
    for board in shm.glob(f"{BOARD_PREFIX}*"):
        if Board.abandoned(board):
            board.unlink(missing_ok=True)
            removed.append(board)
    for snapshots in shm.glob(f"{SNAPSHOTS_PREFIX}*"):
        board = shm / (BOARD_PREFIX + snapshots.name.removeprefix(SNAPSHOTS_PREFIX))
        if not board.exists():  # its launcher's board is gone: the launcher is gone or removing it right now
            shutil.rmtree(snapshots, ignore_errors=True)
            removed.append(snapshots)
    return removed


"""The memory tier's directory in /dev/shm; its suffix is its launcher's heartbeat board's."""
