"""The agent's wait between looks at its workers (supervisor/exit_watch.py): woken by a worker's end, never a busy
loop after it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from stalwart.supervisor.exit_watch import ExitWatch

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfds (Linux 5.3)")


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_worker_ending_wakes_the_wait_and_a_quiet_group_times_out() -> None:
    a, b = _sleeper(), _sleeper()
    watch = ExitWatch()
    try:
        assert watch.wait([a.pid, b.pid], 0.05) is False, "woken with every worker alive"
        threading.Timer(0.2, lambda: os.kill(b.pid, signal.SIGKILL)).start()
        started = time.monotonic()
        assert watch.wait([a.pid, b.pid], 60.0) is True, "the end of a worker did not wake the wait"
        assert time.monotonic() - started < 30, "woken by the timeout, not by the end"
        b.wait(10)
        # The dead worker's pidfd stays readable; it is not waited on again, so the wait does not spin.
        assert watch.wait([a.pid, b.pid], 0.05) is False, "a worker seen ended woke the wait again"
        assert watch.wait([a.pid], 0.05) is False
    finally:
        watch.close()
        for p in (a, b):
            p.kill()
            p.wait(10)


def test_a_worker_already_gone_is_looked_at_at_once() -> None:
    p = _sleeper()
    p.kill()
    p.wait(10)  # reaped: its pid no longer exists
    watch = ExitWatch()
    try:
        assert watch.wait([p.pid], 60.0) is True
    finally:
        watch.close()


def test_without_pidfds_it_is_the_plain_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    p = _sleeper()
    watch = ExitWatch()
    try:
        monkeypatch.setattr(os, "pidfd_open", lambda pid: (_ for _ in ()).throw(OSError(38, "ENOSYS")))
        assert watch.wait([p.pid], 0.05) is False
        assert watch._usable is False and not watch._fds
    finally:
        watch.close()
        p.kill()
        p.wait(10)
