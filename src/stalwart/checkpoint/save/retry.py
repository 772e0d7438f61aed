"""How a persist survives a failing store: retry with backoff until the save's deadline, then give up cleanly.

A store that fails (an outage, ENOSPC, a timeout) is retried with a doubling backoff, each attempt an event, until
the persist deadline; then the rank leaves a `.failed` marker so rank 0 stops waiting for it, and the save is
skipped: the previous checkpoint stays the newest. Defects (a NameError, a KeyError) are never retried, so a bug
shows at once instead of at the deadline. Imports no torch.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from stalwart.checkpoint.format import layout
from stalwart.checkpoint.save.request import PersistRequest
from stalwart.checkpoint.storage import Storage, describe_error
from stalwart.telemetry.events import EventLog

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0

T = TypeVar("T")

NOT_RETRIED = (NameError, TypeError, AttributeError, KeyError, AssertionError, ImportError)
"""Defects, not storage trouble: retrying them would only hide them until the deadline."""


class Quit(Exception):
    """The training process asked the persister to stop (it is closing)."""


class GaveUp(Exception):
    """This save cannot be completed; the previous checkpoint stays the newest."""


class Unanswered(Exception):
    """A location did not answer within its time (`until`): the persister tries the next (the save's failover to
    a mirror, issue 46); no marker is left, since this rank's shard may yet land elsewhere."""


class Retrier:
    """Runs one storage operation of a save until it succeeds, the deadline passes or the persister quits."""

    def __init__(self, events: EventLog, quitting: threading.Event) -> None:
        self._events = events
        self._quitting = quitting
        self.target: Storage | None = None
        """Where the current save is being written: a `.failed` marker goes there."""

    def run(self, req: PersistRequest, what: str, op: Callable[[], T], until: float | None = None) -> T:
        """`op`'s result; retried until the save's deadline, or until `until` (CLOCK_MONOTONIC) where that is sooner,
        when the failure raises Unanswered instead of GaveUp."""
        deadline = req.snapshot_mono + req.deadline_s
        moving_on = until is not None and until < deadline
        if until is not None:
            deadline = min(deadline, until)
        delay = BACKOFF_START_S
        attempt = 0
        while True:
            if self._quitting.is_set():
                raise Quit
            attempt += 1
            try:
                return op()
            except NOT_RETRIED:
                raise
            except Exception as exc:
                error = describe_error(exc)
                if time.monotonic() + delay > deadline:
                    if moving_on:
                        raise Unanswered(f"{what} could not be written: {error}") from exc
                    self._events.emit("checkpoint_write_failed", step=req.step, what=what, error=error)
                    self._leave_failed_marker(req)
                    raise GaveUp(f"{what} could not be written: {error}") from exc
                self._events.emit(
                    "checkpoint_write_retry", step=req.step, what=what, attempt=attempt, error=error, backoff_s=delay
                )
                if self._quitting.wait(delay):
                    raise Quit from exc
                delay = min(delay * 2, BACKOFF_MAX_S)

    def _leave_failed_marker(self, req: PersistRequest) -> None:
        """Tell rank 0's commit not to wait for this rank any longer (best effort: the store may be down)."""
        with contextlib.suppress(Exception):
            assert self.target is not None
            self.target.write_bytes(failed_marker(req), b"")


def failed_marker(req: PersistRequest) -> str:
    """Where a rank that gives up its shard says so, relative to a location's root: rank 0's commit looks for it."""
    return f"{layout.step_dir_name(req.step)}/{layout.failed_name(req.rank, req.token)}"
