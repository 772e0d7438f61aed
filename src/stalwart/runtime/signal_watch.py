"""Learning of a signal while the main thread is blocked in C++.

Why: Python runs a signal's handler in the main thread between two bytecodes, and a main thread blocked in C++
runs none: DDP's reducer waits for its buckets' all-reduce in C++, inside `loss.backward()`. A survivor blocked
there for a peer that left without a connection error (a peer on this node that met the failure first and left
the collective alive, a host cut off by the network) would wait for gloo's collective timeout, though its agent
has asked it to re-form. Python's wakeup fd is written by the C-level handler at once, whatever the main thread
does: a thread reading it calls back for the watched signal, and the callback (the group marked failed,
runtime/group.py) completes the pending collectives' futures that the reducer waits on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable


class SignalWatch:
    """A daemon thread that calls `callback` (on itself) each time `signum` arrives, while started.

    There is one wakeup fd per process: one set before (asyncio's, say) is replaced while watching and put back by
    `close`. Start and close from the main thread (Python's rule for the wakeup fd)."""

    def __init__(self, signum: int, callback: Callable[[], None]) -> None:
        self._signum = signum
        self._callback = callback
        self._read = self._write = -1
        self._previous = -1
        self._thread: threading.Thread | None = None
        self._stopping = False

    def start(self) -> bool:
        """Watch from now on; False where the wakeup fd cannot be set (not the main thread)."""
        if self._thread is not None:
            return True
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            self._previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:  # not the main thread
            os.close(read)
            os.close(write)
            return False
        self._read, self._write = read, write
        self._stopping = False
        self._thread = threading.Thread(target=self._watch, args=(read,), name="stalwart-signal-watch", daemon=True)
        self._thread.start()
        return True

    def _watch(self, read: int) -> None:
        while True:
            try:
                data = os.read(read, 512)
            except OSError:
                return
            if not data or self._stopping:  # closed, or `close` woke it
                return
            if self._signum in data:
                with contextlib.suppress(Exception):  # a callback's failure must not end the watch
                    self._callback()

    def close(self) -> None:
        """Stop watching and put back the wakeup fd that was set before."""
        if self._thread is None:
            return
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(self._previous)
        # Woken by a byte, not by the pipe's end: a child forked meanwhile (a DataLoader worker) holds the write end
        # too, so closing ours ends nothing, and the join waited out its timeout at every re-formation.
        self._stopping = True
        with contextlib.suppress(OSError):
            os.write(self._write, b"\0")
        self._thread.join(timeout=1.0)
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._thread = None
        self._read = self._write = -1
