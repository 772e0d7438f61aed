"""Finding the checkpoint every rank can load: the newest committed one that verifies on all of them.

Rank 0 lists the committed steps; every rank tries each, newest first, and the ranks vote on it (VALID, CORRUPT,
MISMATCH, UNREADABLE from rank_state.py). A checkpoint that does not fit this job stops it with one line; one
that fails an integrity check is moved aside (nothing is deleted) once every rank has finished reading, and the
next older is tried. A store that cannot be read now is not a user error: the launcher may try again.
"""

from __future__ import annotations

from dataclasses import dataclass

from stalwart.checkpoint.format import layout
from stalwart.checkpoint.load.rank_state import CORRUPT, MISMATCH, VALID, Restored, try_load
from stalwart.checkpoint.storage import Storage, describe_error
from stalwart.errors import CheckpointError, CheckpointMismatchError, NoValidCheckpointError, PeerError
from stalwart.runtime.dist import Comm, IntMessage, StepList
from stalwart.telemetry.events import EventLog


@dataclass(frozen=True, slots=True)
class LoadVerdict(IntMessage):
    """One rank's verdict on one checkpoint (rank_state.py's VALID, CORRUPT, MISMATCH, UNREADABLE)."""

    value: int


def load_newest(
    storage: Storage, comm: Comm, events: EventLog, *, allow_world_size_change: bool, at_most: int | None
) -> Restored | None:
    """The newest checkpoint (not after step `at_most`) that verifies on every rank; None when there is no such
    checkpoint at all. Collective."""
    root = storage.display()
    listing = StepList(0)  # rank 0's listing of the committed steps, newest first
    if comm.rank == 0:
        try:
            listing = StepList(1, tuple(s for s in layout.committed_steps(storage) if at_most is None or s <= at_most))
        except Exception as exc:
            events.emit("checkpoint_list_failed", error=describe_error(exc))
    listing = comm.broadcast(listing)
    if not listing.ok:  # maybe passing: not a user error, so the launcher restarts and tries again
        raise CheckpointError(f"rank 0 cannot list the checkpoint directory {root}")
    steps = listing.steps
    corrupt: list[int] = []
    first_problem: str | None = None
    unreadable_only = True
    for step in steps:
        restored, verdict, problem = try_load(
            storage, step, comm.rank, comm.world_size, allow_resize=allow_world_size_change
        )
        votes = [v.value for v in comm.gather(LoadVerdict(verdict))]
        if MISMATCH in votes:
            if verdict == MISMATCH:
                raise CheckpointMismatchError(problem)
            raise PeerError("the checkpoint does not fit this job; see another rank's error")
        if all(v == VALID for v in votes):
            assert restored is not None
            quarantine(storage, comm, events, corrupt)
            return restored
        if problem:
            first_problem = first_problem or problem
            events.emit("checkpoint_invalid", step=step, error=problem)
        if CORRUPT in votes:
            corrupt.append(step)
            unreadable_only = False
    if not steps:
        return None
    if unreadable_only:
        raise CheckpointError(f"no checkpoint in {root} can be read now ({first_problem or 'see other ranks'})")
    if first_problem is None:
        raise PeerError("no checkpoint verifies on another rank; see its error")
    raise NoValidCheckpointError(
        f"none of the {len(steps)} checkpoints in {root} verifies (step {steps[0]}: {first_problem}); "
        "nothing was loaded or changed. Move them aside or use another checkpoint_dir to start from step 0"
    )


def quarantine(storage: Storage, comm: Comm, events: EventLog, steps: list[int]) -> None:
    """Move checkpoints that failed an integrity check aside (rank 0; every rank has finished reading them)."""
    if not steps:
        return
    if comm.rank == 0:
        for step in steps:
            try:
                moved = layout.quarantine(storage, step)
                events.emit("checkpoint_quarantined", step=step, path=storage.display(moved))
            except Exception as exc:
                events.emit("checkpoint_quarantine_failed", step=step, error=describe_error(exc))
    comm.barrier()  # no rank writes a new save of that step until it has been moved aside
