"""The training process's handle on its persister: submit a request, ask whether one is in flight, wait for it.

The persister is a process of its own (see persister.py) started when the job starts, so its start-up overlaps
the first training steps: forked by this process's forker (forked.py), else a new interpreter. A thread reads its
replies; it only wakes when a persist finishes, so it costs the training thread no GIL time. If the persister
dies, the save in flight counts as failed, an event says so, and the next save starts a new one.
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO, Any, TypeAlias

from stalwart.checkpoint.save import forked
from stalwart.checkpoint.save.forked import ForkedPersister
from stalwart.checkpoint.save.persister import Persister
from stalwart.checkpoint.save.request import PersistReply, PersistRequest
from stalwart.telemetry.events import EventLog

CLOSE_TIMEOUT_S = 30.0

PersisterProcess: TypeAlias = subprocess.Popen[str] | ForkedPersister
"""A persister in a process: forked by this process's forker (forked.py), or started as an interpreter."""


class Background:
    """One persister, in a process (default) or, for process-local stores, in a thread."""

    def __init__(self, events: EventLog, *, in_process: bool) -> None:
        self._events = events
        self._in_process = in_process
        self._lock = threading.Condition()
        self._in_flight: int | None = None
        self._last: PersistReply | None = None
        self._proc: PersisterProcess | None = None
        self._thread_queue: queue.Queue[PersistRequest | None] | None = None
        self._thread_persister: Persister | None = None
        self._started = False
        self._reader: threading.Thread | None = None
        self._outbox: queue.Queue[tuple[int, Callable[[], PersistRequest]] | None] = queue.Queue()
        self._sender: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        if self._in_process:
            self._start_thread()
        else:
            self._start_process()

    def _start_process(self) -> None:
        log = {"path": str(self._events.path) if self._events.path else None, "common": self._events.common}
        proc: PersisterProcess | None = forked.claim(log)  # a fork of this process's forker, if it can
        if proc is None:
            cmd = [sys.executable, "-m", "stalwart.checkpoint.save.persister", json.dumps(log)]
            proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, close_fds=True
            )
        self._proc = proc
        assert proc.stdout is not None
        self._reader = threading.Thread(
            target=self._read_replies, args=(proc, proc.stdout), daemon=True, name="persister-replies"
        )
        self._reader.start()

    def _start_thread(self) -> None:
        q: queue.Queue[PersistRequest | None] = queue.Queue()
        persister = Persister(self._events, self._on_reply)
        self._thread_queue, self._thread_persister = q, persister

        def loop() -> None:
            while (req := q.get()) is not None:
                persister.handle(req)
            persister.finish()

        threading.Thread(target=loop, daemon=True, name="persister").start()

    def _read_replies(self, proc: PersisterProcess, stream: IO[str]) -> None:
        with contextlib.suppress(OSError, ValueError):
            for line in stream:
                with contextlib.suppress(json.JSONDecodeError):
                    reply = PersistReply.from_json(json.loads(line))
                    if reply is not None:
                        self._on_reply(reply)
        stream.close()
        code = proc.wait()
        with self._lock:
            if self._proc is proc:
                self._proc, self._started = None, False
                _close_stdin(proc)
                if self._in_flight is not None:
                    self._events.emit("persister_died", step=self._in_flight, exit_code=code)
                    self._last = PersistReply.failed(self._in_flight)
                    self._in_flight = None
                self._lock.notify_all()

    def _on_reply(self, reply: PersistReply) -> None:
        with self._lock:
            if reply.step != self._in_flight:  # a reply to a save already reported failed is not this save's
                return
            self._last = reply
            self._in_flight = None
            self._lock.notify_all()

    def close(self) -> None:
        """Stop the persister: an unfinished persist is abandoned (its checkpoint never commits)."""
        if self._sender is not None:  # send what is queued first, so nothing writes to a closed pipe
            self._outbox.put(None)
            self._sender.join(CLOSE_TIMEOUT_S)
            self._sender = None
        if self._thread_queue is not None and self._thread_persister is not None:
            self._thread_persister.quitting.set()
            self._thread_queue.put(None)
            self._thread_queue = None
        proc, self._proc = self._proc, None
        self._started = False
        if proc is None:
            return
        try:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        except (OSError, ValueError):
            pass  # it died: the reader thread may have seen it, or not yet (this took `_proc` from it)
        _close_stdin(proc)
        try:
            proc.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if self._reader is not None:
            self._reader.join(CLOSE_TIMEOUT_S)
            self._reader = None

    def abandon(self) -> None:
        """Kill the persister now (the training process is re-forming after a peer failed): what it was writing
        stays uncommitted, as when a worker dies, and no thread waits on anything."""
        self._outbox.put(None)
        self._sender = None
        if self._thread_persister is not None:
            self._thread_persister.quitting.set()
        if self._thread_queue is not None:
            self._thread_queue.put(None)
            self._thread_queue = None
        proc, self._proc = self._proc, None
        self._started = False
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.kill()
            proc.wait()
            _close_stdin(proc)

    # -- requests ----------------------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int | None:
        """The step being persisted, or None."""
        return self._in_flight

    def settled(self) -> tuple[int | None, PersistReply | None]:
        """(the step in flight or None, the reply of the last finished persist), read together: a reply that
        arrives between two separate reads would be neither in flight nor noted."""
        with self._lock:
            return self._in_flight, (self._last if self._in_flight is None else None)

    def submit(self, step: int, build: Callable[[], PersistRequest]) -> None:
        """Mark `step` in flight now and send the request `build()` returns from the sender thread.

        Building the request (pickling the skeleton, encoding a few hundred tensor entries) and writing it to
        the pipe take about a millisecond; done on the sender thread, that time is not part of the stall.
        """
        self.start()
        with self._lock:
            assert self._in_flight is None, "one save in flight at a time"
            self._in_flight = step
            self._last = None
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_loop, daemon=True, name="persister-sender")
            self._sender.start()
        self._outbox.put((step, build))

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            step, build = item
            try:
                req = build()
            except Exception as exc:  # a request that cannot be built fails this save only
                self._fail(step, "checkpoint_failed", error=f"the save request could not be built: {exc}")
                continue
            with self._lock:
                if self._in_flight != step:  # the persister died meanwhile; that save is already reported
                    continue
                # The process this save was meant for, read with the check: if it dies after this, the write
                # fails; it must never go to a successor started for the next save.
                proc = self._proc
            if self._thread_queue is not None:
                self._thread_queue.put(req)
                continue
            try:
                assert proc is not None and proc.stdin is not None
                proc.stdin.write(req.to_json() + "\n")
                proc.stdin.flush()
            except (AssertionError, OSError, ValueError) as exc:
                self._fail(step, "persister_died", dead=proc, error=str(exc) or "no persister")

    def _fail(self, step: int, event: str, dead: PersisterProcess | None = None, **fields: Any) -> None:
        """Report `step` failed. `dead` is a persister whose pipe broke: it is let go here, with the failure, so a
        save made as soon as this one is reported starts a new persister; the reader thread may notice the
        death only later, and then must neither report it again nor take the successor's save for it."""
        with self._lock:
            if dead is not None and self._proc is dead:
                self._proc, self._started = None, False
                with contextlib.suppress(OSError, ValueError):
                    dead.kill()
                    assert dead.stdin is not None
                    dead.stdin.close()
            if self._in_flight != step:
                return
            # The event first: whoever wakes from wait() may read the event log at once.
            self._events.emit(event, step=step, **fields)
            self._in_flight = None
            self._last = PersistReply.failed(step)
            self._lock.notify_all()

    def wait(self, timeout: float | None = None) -> PersistReply | None:
        """Block until nothing is in flight; the reply of the last persist (None if there was none)."""
        with self._lock:
            self._lock.wait_for(lambda: self._in_flight is None, timeout)
            return self._last if self._in_flight is None else None


def _close_stdin(proc: PersisterProcess) -> None:
    """Close the pipe to a persister that was told to quit or is gone, whichever thread saw it go: a pipe left to
    the collector is a ResourceWarning (once a test failure: close() took the process from the reader thread, then
    its quit met the broken pipe and skipped the close). Closing flushes; a broken pipe still closes it."""
    if proc.stdin is not None:
        with contextlib.suppress(OSError, ValueError):
            proc.stdin.close()
