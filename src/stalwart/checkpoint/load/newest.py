"""Finding the checkpoint every rank can load: the newest committed one that verifies on all of them, in the
checkpoint directory or one of its mirrors (issue 46: a primary that is corrupt, down or lost with its region is
not the end of the run).

Rank 0 lists the committed steps of each location; every rank tries each, newest first (the primary first at
equal steps), and the ranks vote on it (VALID, CORRUPT,
MISMATCH, UNREADABLE from rank_state.py). A checkpoint that does not fit this job stops it with one line; one
that fails an integrity check is moved aside (nothing is deleted) once every rank has finished reading, and the
next older is tried. A store that cannot be read now is not a user error: the launcher may try again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from stalwart.checkpoint.format import layout
from stalwart.checkpoint.load.rank_state import CORRUPT, MISMATCH, VALID, Restored, try_load
from stalwart.checkpoint.storage import Storage, describe_error
from stalwart.errors import CheckpointError, CheckpointMismatchError, NoValidCheckpointError, PeerError
from stalwart.runtime.dist import Comm, IntMessage
from stalwart.telemetry.events import EventLog


@dataclass(frozen=True, slots=True)
class LoadVerdict(IntMessage):
    """One rank's verdict on one checkpoint (rank_state.py's VALID, CORRUPT, MISMATCH, UNREADABLE)."""

    value: int


@dataclass(frozen=True, slots=True)
class Candidates(IntMessage):
    """Rank 0's list of the checkpoints to try, newest first: (step, location) pairs flattened, the location an
    index into the locations (0 the primary, then the mirrors); `ok` is 0 when no location could be listed,
    `unlisted` how many could not."""

    ok: int
    unlisted: int = 0
    pairs: tuple[int, ...] = ()
    FIXED = False

    def to_ints(self) -> list[int]:
        return [self.ok, self.unlisted, *self.pairs]

    @classmethod
    def from_ints(cls, ints: list[int]) -> Candidates:
        return cls(ints[0], ints[1], tuple(ints[2:]))

    def each(self) -> list[tuple[int, int]]:
        return [(self.pairs[i], self.pairs[i + 1]) for i in range(0, len(self.pairs), 2)]


def candidates(locations: list[Storage], events: EventLog, at_most: int | None) -> Candidates:
    """Every location's committed steps (not after `at_most`) as (step, location), newest first and the primary
    first at equal steps. A location that cannot be listed now is left out, with an event: a job whose primary is
    down (or lost with its region) resumes from a mirror. Rank 0."""
    found: list[tuple[int, int]] = []
    unlisted = 0
    for index, storage in enumerate(locations):
        try:
            steps = layout.committed_steps(storage)
        except Exception as exc:
            events.emit("checkpoint_list_failed", error=describe_error(exc), location=storage.display())
            unlisted += 1
            continue
        found += [(s, index) for s in steps if at_most is None or s <= at_most]
    found.sort(key=lambda pair: (-pair[0], pair[1]))
    return Candidates(int(unlisted < len(locations)), unlisted, tuple(v for pair in found for v in pair))


def load_newest(
    locations: list[Storage], comm: Comm, events: EventLog, *, allow_world_size_change: bool, at_most: int | None
) -> Restored | None:
    """The newest checkpoint (not after step `at_most`) that verifies on every rank, in the primary
    (`locations[0]`) or a mirror, the primary first at equal steps; None when there is no such checkpoint at all.
    A copy that fails in one location falls back to the next candidate: the same step elsewhere, then older ones.
    Collective."""
    root = " or ".join(s.display() for s in locations)
    listing = candidates(locations, events, at_most) if comm.rank == 0 else Candidates(0)
    listing = comm.broadcast(listing)
    tries = listing.each()
    # Maybe passing: not a user error, so the launcher restarts and tries again. A start from step 0 needs every
    # location listed: a mirror down for a moment must not turn a resume into a fresh run.
    if not listing.ok or (not tries and listing.unlisted):
        raise CheckpointError(f"rank 0 cannot list the checkpoint directory {root}")
    corrupt: list[tuple[int, int]] = []
    first_problem: str | None = None
    unreadable_only = True
    for step, index in tries:
        storage = locations[index]
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
            quarantine(locations, comm, events, corrupt)
            return restored if index == 0 else replace(restored, mirror=storage.display())
        if problem:
            first_problem = first_problem or problem
            events.emit("checkpoint_invalid", step=step, error=problem, location=storage.display())
        if CORRUPT in votes:
            corrupt.append((step, index))
            unreadable_only = False
    if not tries:
        return None
    if unreadable_only or listing.unlisted:  # another location may hold what verifies: not final
        raise CheckpointError(f"no checkpoint in {root} can be read now ({first_problem or 'see other ranks'})")
    if first_problem is None:
        raise PeerError("no checkpoint verifies on another rank; see its error")
    step, index = tries[0]
    raise NoValidCheckpointError(
        f"none of the {len(tries)} checkpoints in {root} verifies (step {step} in {locations[index].display()}: "
        f"{first_problem}); nothing was loaded or changed. Move them aside or use another checkpoint_dir to start "
        "from step 0"
    )


def quarantine(locations: list[Storage], comm: Comm, events: EventLog, steps: list[tuple[int, int]]) -> None:
    """Move checkpoints that failed an integrity check aside, each in its location (rank 0; every rank has
    finished reading them)."""
    if not steps:
        return
    if comm.rank == 0:
        for step, index in steps:
            storage = locations[index]
            try:
                moved = layout.quarantine(storage, step)
                events.emit("checkpoint_quarantined", step=step, path=storage.display(moved))
            except Exception as exc:
                events.emit("checkpoint_quarantine_failed", step=step, error=describe_error(exc))
    comm.barrier()  # no rank writes a new save of that step until it has been moved aside


def set_aside_after(locations: list[Storage], events: EventLog, step: int, reason: str) -> list[int]:
    """Move every committed step after `step` aside in each location (`checkpoint_set_aside`); the steps moved."""
    moved: set[int] = set()
    for storage in locations:
        try:
            newer = [s for s in layout.committed_steps(storage) if s > step]
        except Exception as exc:
            events.emit("checkpoint_list_failed", error=describe_error(exc), location=storage.display())
            continue
        for newer_step in newer:
            try:
                path = layout.quarantine(storage, newer_step)
            except Exception as exc:
                events.emit("checkpoint_quarantine_failed", step=newer_step, error=describe_error(exc))
                continue
            moved.add(newer_step)
            events.emit("checkpoint_set_aside", step=newer_step, path=storage.display(path), reason=reason)
    return sorted(moved)
