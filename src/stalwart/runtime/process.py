"""Process helpers every layer uses: dying with the parent, starting children that die with us, one-line errors.

Why a parent-death signal and not cleanup code: a parent killed with SIGKILL runs no `finally`, no atexit and no
signal handler, so only the kernel can end its children. Linux's PR_SET_PDEATHSIG delivers a chosen signal to
a child when the thread that started it exits; every process stalwart starts (launchers under the demo and the
benchmarks, workers, spares, persisters) arms it, so a stalwart command killed by any signal leaves nothing
running.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def die_with_parent(sig: int = signal.SIGKILL, *, parent: int | None = None) -> bool:
    """Have the kernel send `sig` to this process when its parent dies.

    `parent` is the pid the parent had when this process was started (default: the current parent). If the
    parent already died before the signal was armed, this process exits at once. Returns False where the
    signal cannot be armed (not Linux).
    """
    expected = os.getppid() if parent is None else parent
    if sys.platform != "linux":
        return False
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return False
    if os.getppid() != expected:  # the parent died before the signal was armed
        os._exit(1)
    return True


def name_process(name: bytes) -> None:
    """Set this process's short name (/proc/self/comm, 15 bytes), which top and `ps -o comm` show: a process
    forked without exec (the zygote, a persister forked ahead) is told apart from the one it was forked from."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)


def _arm_in_child(sig: int, parent: int) -> Callable[[], None]:
    def arm() -> None:  # runs in the child between fork and exec: no locks, no allocation-heavy work
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return arm


def spawn(cmd: list[str], *, death_signal: int = signal.SIGTERM, **popen: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen(cmd, **popen)` whose child gets `death_signal` when this process dies.

    The default, SIGTERM, lets a launcher child (`stalwart run`, torchrun) stop its own workers and clean up;
    the workers' own parent-death signals catch the rest. Call it from a thread that lives as long as the
    child should (the kernel signals when the starting thread exits, not only the process).
    """
    if sys.platform != "linux":
        return subprocess.Popen(cmd, **popen)
    return subprocess.Popen(cmd, preexec_fn=_arm_in_child(int(death_signal), os.getpid()), **popen)


def first_line(exc: BaseException, *, with_type: bool = False) -> str:
    """The first line of an exception's message (its type's name if it has none), for one-line reports."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    line = text.splitlines()[0]
    return f"{type(exc).__name__}: {line}" if with_type else line


def process_state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat ('R', 'S', 'D', 'T' stopped, 't' traced, 'Z'...), '?' when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def stopped(pid: int) -> bool:
    """Stopped by a signal (SIGSTOP, SIGTSTP): it cannot act on SIGTERM, or anything else, until continued. A
    process stopped by a debugger ('t') is not counted: someone is looking at it."""
    return process_state(pid) == "T"
