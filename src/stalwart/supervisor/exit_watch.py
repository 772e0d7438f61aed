"""Waking the agent's monitor loop when a worker ends, instead of at its next tick.

torch elastic's agent sleeps `monitor_interval` (0.1 s by default) between looks at its workers, so it learns of
a dead worker 50 ms after the death on average and up to 100 ms after it: in a recovery of a few tenths of a
second that wait was the largest single share after the script's own re-run (docs/benchmarks.md). Here the
agent waits on a pidfd of each worker (readable once the process has ended) and on the zygote's socket (which
says how a forked worker ended), with the monitor interval as the timeout, so a death is looked at within about
a millisecond and a quiet job is looked at as often as before.

A pidfd stays readable after its process has ended; a pid seen ended is not waited on again, so a dead worker
whose group has not been restarted yet cannot turn the wait into a busy loop. Where pidfds do not exist (Linux
before 5.3, other systems) this is the plain sleep.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from collections.abc import Callable, Iterable
from typing import Any

from stalwart.supervisor.zygote import Zygote


class ExitWatch:
    """Pidfds of the current workers, opened as they appear and closed once seen ended or gone from the group."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}  # pid -> pidfd
        self._ended: set[int] = set()  # pids seen ended: not waited on again
        self._usable = hasattr(os, "pidfd_open")

    def wait(self, pids: Iterable[int], timeout: float, zygote: Zygote | None = None) -> bool:
        """Return once a worker in `pids` ends or the zygote reports (True), or after `timeout` (False)."""
        current = set(pids)
        for pid in [p for p in self._fds if p not in current]:
            self._close(pid)
        self._ended &= current
        if self._usable:
            for pid in current - self._fds.keys() - self._ended:
                try:
                    self._fds[pid] = os.pidfd_open(pid)
                except ProcessLookupError:  # already gone: look now
                    self._ended.add(pid)
                    return True
                except OSError:  # no pidfds here (ENOSYS), or none left: sleep as torch elastic does
                    self._usable = False
                    break
        if not self._usable:
            self.close()
            time.sleep(timeout)
            return False
        waited: list[Any] = list(self._fds.values())
        sock = getattr(zygote, "_sock", None) if zygote is not None and zygote.alive else None
        if sock is not None:
            waited.append(sock)
        if not waited:
            time.sleep(timeout)
            return False
        try:
            readable = select.select(waited, [], [], timeout)[0]
        except (OSError, ValueError):  # a socket closed meanwhile (the zygote went away)
            time.sleep(timeout)
            return False
        for pid, fd in list(self._fds.items()):
            if fd in readable:
                self._ended.add(pid)
                self._close(pid)
        if sock is not None and sock in readable and zygote is not None:
            _drain(zygote.exit_code)  # read its reports now, so that its socket is not readable still next time
        return bool(readable)

    def _close(self, pid: int) -> None:
        fd = self._fds.pop(pid, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        for pid in list(self._fds):
            self._close(pid)


def _drain(exit_code: Callable[[int], int | None]) -> None:
    """Zygote.exit_code reads every message waiting on the zygote's socket before it answers; the pid is none."""
    with contextlib.suppress(Exception):
        exit_code(-1)
