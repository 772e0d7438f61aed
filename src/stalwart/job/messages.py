"""What the ranks of a job agree on, message by message: each a dataclass of int fields sent through `Comm.gather`
or `Comm.broadcast` (runtime/dist.IntMessage), its encoding in one place. A yes/no vote is runtime/dist.Flag.

Durations travel as integer microseconds and are agreed at their largest over the ranks, so that every rank takes
the same decision from the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from stalwart.runtime.dist import IntMessage


def to_us(seconds: float) -> int:
    return round(seconds * 1e6)


@dataclass(frozen=True, slots=True)
class Durations(IntMessage):
    """Two durations of this rank (a light snapshot's cost and the step time, say), in microseconds."""

    first_us: int
    second_us: int


@dataclass(frozen=True, slots=True)
class PlanInputs(IntMessage):
    """What the next full copy's step is planned from, this rank's (job/snapshots.py `_plan`), in microseconds:
    agreed at their largest, but for `agreement_us` (the last plan's own collective), at its least."""

    light_us: int
    step_us: int
    snapshot_us: int
    agreement_us: int


@dataclass(frozen=True, slots=True)
class RunName(IntMessage):
    """Rank 0's restart count and random bits: they name this run's files (a replacement node's agent has a
    restart count of its own, so the survivors' must be agreed, not read locally)."""

    restart: int
    token: int


@dataclass(frozen=True, slots=True)
class CheckpointInputs(IntMessage):
    """What checkpoint_every="auto" plans the next checkpoint from (policy/auto_checkpoint.py)."""

    stall_us: int
    """The newest checkpoint's stall of training."""
    step_us: int
    """The measured step time."""
    restarts: int
    """Failures this launch has seen (the launcher's restart count)."""
    age_s: int
    """Seconds since the launch started."""
