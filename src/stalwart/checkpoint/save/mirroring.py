"""A job's mirrors: each committed checkpoint copied to other locations in the background (issue 46).

Why: a job's durable checkpoints live in one store; if that store's region is lost, the run is lost with it. With
`mirrors=[...]` (paths or fsspec URLs: another region's bucket, another provider), rank 0's persister copies each
checkpoint it committed to every mirror, as a save commits one (step_copy.py: the files, the copy verified there,
the manifest last), and applies `keep_last` there after each copy. A job pointed at a mirror resumes from it.

Off the training path twice over: in the persister process, on a thread of its own, after the commit's reply went
to the trainer. A mirror that is down or slow never stalls training or the primary's saves: each mirror has at
most one step pending, the newest committed (a newer commit replaces an older one not yet copied), retried with
backoff (1 s doubling to 60 s) until it answers. Events: `mirrored` (step, location, bytes copied, seconds, lag
behind the primary's commit), `mirror_unreachable` (once per outage, with the error), `mirror_caught_up` (the
first copy after an outage, with its length). At the job's end each pending copy gets one more try, within FINISH_S
in all. One thread copies for every mirror, one step at a time.
Imports no torch.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from stalwart.checkpoint.format import layout
from stalwart.checkpoint.save.failover import location_lock
from stalwart.checkpoint.save.step_copy import copy_step
from stalwart.checkpoint.storage import Storage, describe_error, open_storage
from stalwart.telemetry.events import EventLog

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
FINISH_S = 20.0
"""At the job's end, how long the persister waits for the mirrors' pending copies (after retention's own wait): the
trainer gives its persister 30 s to exit (background.CLOSE_TIMEOUT_S). A copy cut there leaves the mirror at its
previous step."""


@dataclass(slots=True)
class _Mirror:
    url: str
    options: dict[str, Any] | None
    storage: Storage | None = None
    pending: tuple[Storage, int, float, int] | None = None
    """(the primary, the step, when it was committed, keep_last): the newest committed step not copied yet."""
    retry_at: float = 0.0
    backoff_s: float = BACKOFF_FIRST_S
    down_since: float | None = None
    newest: int = -1
    """The newest step this location holds by a copy of this thread's or its own commit."""


class Mirrors:
    """Rank 0's persister's mirrors; `committed` after each commit, `finish` at exit."""

    def __init__(self, events: EventLog) -> None:
        self._events = events
        self._mirrors: dict[str, _Mirror] = {}
        self._wake = threading.Condition()
        self._stopping = self._finishing = False
        self._thread: threading.Thread | None = None

    def committed(
        self, primary: Storage, step: int, keep_last: int, mirrors: list[dict[str, Any]], source: str = ""
    ) -> None:
        """`step` is committed in `primary`: copy it to each of `mirrors` ({"url", "options"}) in the background.
        `source`: the URL of `primary`: when this thread has copied to it before (it is a mirror a save failed over
        to, or the checkpoint directory after such a save, failover.py), its own pending copy of an older step is
        dropped, and if it was down, it is caught up now."""
        with self._wake:
            own = self._mirrors.get(source)
            if own is not None:
                own.pending, own.newest = None, max(own.newest, step)
                if own.down_since is not None:
                    outage = time.monotonic() - own.down_since
                    self._events.emit("mirror_caught_up", step=step, location=source, outage_s=outage)
                    own.down_since, own.backoff_s, own.retry_at = None, BACKOFF_FIRST_S, 0.0
            if not mirrors:
                return
            for spec in mirrors:
                mirror = self._mirrors.setdefault(spec["url"], _Mirror(spec["url"], spec.get("options")))
                mirror.pending = (primary, step, time.monotonic(), keep_last)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stalwart-mirrors", daemon=True)
                self._thread.start()
            self._wake.notify()

    def failed_over(self, url: str, options: dict[str, Any] | None, step: int, error: str) -> None:
        """A save could not be written at `url` (it went to another location, failover.py): that location is down
        from now (`mirror_unreachable`, once per outage) until a copy to it or a commit there works."""
        with self._wake:
            self._down(self._mirrors.setdefault(url, _Mirror(url, options)), step, error)

    def wait_copied(self, step: int, urls: list[str], deadline: float) -> list[str]:
        """Wait until each of `urls` holds `step` (or a newer one), at most until `deadline` (CLOCK_MONOTONIC); the
        URLs that do not (`durable_in="all"`)."""
        with self._wake:
            while True:
                missing = [u for u in urls if u not in self._mirrors or self._mirrors[u].newest < step]
                left = deadline - time.monotonic()
                if not missing or left <= 0:
                    return missing
                self._wake.wait(min(left, 0.5))

    def finish(self, timeout_s: float = FINISH_S) -> None:
        """Give the pending copies up to `timeout_s` (one try each at least), then stop."""
        deadline = time.monotonic() + timeout_s
        with self._wake:
            self._finishing = True  # one more try each, without backoff; a mirror that fails it is given up
            for m in self._mirrors.values():
                m.retry_at = 0.0
            self._wake.notify_all()
            while self._thread is not None and any(m.pending for m in self._mirrors.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._wake.wait(min(left, 0.5))
            self._stopping = True
            self._wake.notify_all()

    def _run(self) -> None:
        while True:
            with self._wake:
                due = self._due()
                while due is None and not self._stopping:
                    waits = [m.retry_at - time.monotonic() for m in self._mirrors.values() if m.pending]
                    self._wake.wait(max(0.01, min(waits)) if waits else None)
                    due = self._due()
                if due is None:
                    return
                mirror, job = due, due.pending
                assert job is not None
            failure = self._copy(mirror, *job)
            with self._wake:
                # A copy whose location committed a newer step itself meanwhile (which pruned this one there, as an
                # interrupted save) failed for nothing: that location is up (`committed` cleared its pending copy).
                if failure is not None and mirror.pending is not None:
                    self._down(mirror, job[1], failure)
                if (failure is None or self._finishing) and mirror.pending == job:
                    mirror.pending = None  # else a newer step came meanwhile: it is next
                self._wake.notify_all()

    def _due(self) -> _Mirror | None:
        now = time.monotonic()
        return next((m for m in self._mirrors.values() if m.pending and m.retry_at <= now), None)

    def _down(self, mirror: _Mirror, step: int, error: str) -> None:
        """A copy failed: retried with backoff; `mirror_unreachable` once per outage."""
        if mirror.down_since is None:
            mirror.down_since = time.monotonic()
            self._events.emit("mirror_unreachable", step=step, location=mirror.url, error=error)
        mirror.retry_at = time.monotonic() + mirror.backoff_s
        mirror.backoff_s = min(BACKOFF_MAX_S, mirror.backoff_s * 2)

    def _copy(self, mirror: _Mirror, primary: Storage, step: int, committed: float, keep_last: int) -> str | None:
        """Copy `step` there; None when it worked, else why not."""
        started = time.monotonic()
        try:
            if mirror.storage is None:
                storage = open_storage(mirror.url, mirror.options)
                layout.prepare_root(storage, create=True)
                mirror.storage = storage
            if not primary.exists(f"{layout.step_dir_name(step)}/{layout.MANIFEST}"):
                return None  # set aside there since (a rollback) or pruned: nothing to copy, and no outage
            with location_lock(mirror.storage.display()):  # no retention there meanwhile (the committer's)
                copy = copy_step(primary, mirror.storage, step)
                if copy.problem:
                    raise OSError(copy.problem)
                layout.prune(mirror.storage, keep_last, layout.read_manifest(mirror.storage, step))
        except Exception as exc:
            if not _still_committed(primary, step):
                # Pruned (or set aside) at the primary while it was copied: superseded. Or the primary, the copy's
                # source, stopped answering: its outage, not this location's (saves fail over and say so).
                return None
            return describe_error(exc)
        now = time.monotonic()
        if mirror.down_since is not None:
            self._events.emit("mirror_caught_up", step=step, location=mirror.url, outage_s=now - mirror.down_since)
            mirror.down_since = None
        mirror.backoff_s, mirror.retry_at = BACKOFF_FIRST_S, 0.0
        mirror.newest = max(mirror.newest, step)
        self._events.emit(
            "mirrored",
            step=step,
            location=mirror.url,
            bytes=copy.bytes,
            seconds=now - started,
            lag_s=now - committed,
        )
        return None


def _still_committed(primary: Storage, step: int) -> bool:
    """Whether `step` is still committed at the primary and the primary answers: a copy that failed because the
    primary's retention removed the step meanwhile (keep_last, while an older step was still being copied) failed
    for nothing, and one whose source stopped answering failed for the source's outage (fc137's run of the S3 test,
    2026-12-01: the copy's error named the primary, the event the mirror)."""
    try:
        return primary.exists(f"{layout.step_dir_name(step)}/{layout.MANIFEST}")
    except Exception:  # the primary itself does not answer
        return False
