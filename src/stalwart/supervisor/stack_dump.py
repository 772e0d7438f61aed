"""Where a stuck survivor is stuck: its Python stack, written to its output before it is replaced.

Why: a survivor that neither leaves its failed group nor answers the agent's ask to re-form within
host_pool.REARM_TIMEOUT_S is killed and replaced. The run goes on, but what held the survivor (a C++ wait that the
absorbing waits do not reach, a user's blocking call) would be lost with it, and it is exactly what needs fixing.
Every worker host arms Python's faulthandler on a real-time signal that nothing else uses; the agent sends it to
each stuck survivor, and the C-level handler writes every thread's stack to the worker's stderr at once, whatever
the main thread is doing (it needs neither the GIL nor the interpreter's eval loop).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import time

STACK_SIGNAL = signal.SIGRTMIN + 6
"""A real-time signal: SIGUSR1/SIGUSR2 are often a training script's own (Slurm's --signal, checkpoint-on-signal)."""
WRITE_GRACE_S = 0.2
"""How long the agent lets the handlers write before it ends the stuck survivors."""


def arm() -> None:
    """In a worker host: dump every thread's stack to stderr when STACK_SIGNAL arrives."""
    with contextlib.suppress(AttributeError, OSError, RuntimeError, ValueError):  # no such signal here
        faulthandler.register(STACK_SIGNAL, file=2, all_threads=True)  # fd 2, whatever it is then


def request(pids: list[int]) -> None:
    """In the agent: ask each of `pids` for its stacks, and give the handlers their moment to write."""
    sent = False
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, STACK_SIGNAL)
            sent = True
    if sent:
        time.sleep(WRITE_GRACE_S)
