"""Faults of the checkpoint store (issue 46): the store down for a while, and a region lost with its store.

`store_outage`: the job's checkpoint directory does not answer for `duration_s` seconds (or until rank 0 has logged
step `until_step`: the same saves meet it whatever the machine's load), its data kept: the harness
moves it aside and puts a file in its place, so that every write and listing there fails with an error (as a store
that does not answer fails), then puts it back. With mirrors (`stalwart run --mirror`), saves go on in a mirror
meanwhile and the directory is caught up when it answers (checkpoint/save/failover.py); the run must end bitwise.

`region_loss`: every host and the checkpoint directory lost for good: the harness kills the node (launcher and
workers), moves the directory out of the job's reach and launches the job again, as a new launch in another region
with the same configuration: it must resume from a mirror (checkpoint/load/newest.py) and end bitwise. It fires
once a checkpoint has reached a mirror, so that there is one to resume from.
Imports no torch.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable
from pathlib import Path

from stalwart.telemetry.events import EventLog

LOST_SUFFIX = ".lost-region"
"""Where a lost region's checkpoint directory goes (kept for inspection, never read by the job)."""


class StoreOutages:
    """The store_outage faults of one run: each cut now, mended `duration_s` later (`mend_due`), every one mended
    when the run ends (`close`), so that the verdict reads the directory as the store holds it."""

    def __init__(self, root: Path, log: EventLog, progress: Callable[[str], None]) -> None:
        self._root, self._away = root, root.with_name(root.name + ".unreachable")
        self._log, self._progress = log, progress
        self._ends: float | None = None  # seconds after the launch, or
        self._until_step: int | None = None  # a step of rank 0's

    def cut(self, duration_s: float | None, until_step: int | None, now: float) -> str:
        """The store stops answering for `duration_s` or until step `until_step`; what was done, for the report."""
        if self._ends is not None or self._until_step is not None:
            return "the checkpoint directory was unreachable already"
        how = f"until step {until_step}" if until_step is not None else f"for {duration_s:g} s"
        self._log.emit("fault_injected", fault="store_outage", lasts=how, by="harness")
        if self._root.exists():
            self._root.rename(self._away)
        self._root.write_text("stalwart chaos: this store is down (store_outage)\n")
        self._until_step = until_step
        self._ends = None if until_step is not None else now + float(duration_s or 0.0)
        self._progress(f"store_outage: the checkpoint directory is unreachable {how}")
        return f"made the checkpoint directory unreachable {how}"

    def mend_due(self, now: float, step: int) -> None:
        timed_out = self._ends is not None and now >= self._ends
        if timed_out or (self._until_step is not None and step >= self._until_step):
            self.close()

    def close(self) -> None:
        """The store answers again, with what it held and anything written to it meanwhile."""
        if self._ends is None and self._until_step is None:
            return
        self._ends = self._until_step = None
        with contextlib.suppress(FileNotFoundError):
            self._root.unlink()
        if self._away.exists():
            self._away.rename(self._root)
        self._log.emit("fault_ended", fault="store_outage", by="harness")
        self._progress("store_outage: the checkpoint directory answers again")


def lose_region(root: Path) -> str:
    """The checkpoint directory lost for good (moved out of the job's reach); what was done. Call it after the
    node is dead, so that no persister writes there afterwards."""
    lost = root.with_name(root.name + LOST_SUFFIX)
    shutil.rmtree(lost, ignore_errors=True)
    if root.exists():
        root.rename(lost)
    return f"lost the checkpoint directory (moved to {lost.name})"
