"""The Job's parts, made by one factory, and how the Job stands in its process group.

A Job is a facade (job/job.py): what it does in a step is done by parts with one job each. `make_parts` builds all
of them, in the order their dependencies need, into one `Parts`; a Job that stays in its loop after a peer's
failure gets a new `Parts` from the same factory (recovery/in_loop/driver.py), never a constructor run again on a
live object.
The modules of the job's step (job/completing.py), its endings and recovery's drivers reach the parts through the
Job's typed `parts` and `membership`, not through its private attributes (tests/test_house.py holds them to it).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Protocol

from stalwart.checkpoint.load.rank_state import Restored
from stalwart.checkpoint.manager import Checkpointer
from stalwart.checkpoint.tiers.memory import MemoryTier
from stalwart.detect.hang import HangTimer, hang_timer
from stalwart.detect.heartbeat import Heartbeat
from stalwart.job.config import JobConfig
from stalwart.job.detectors import Detectors
from stalwart.job.optimizer_hooks import OptimizerHooks
from stalwart.job.progress import Progress
from stalwart.job.snapshots import Snapshots
from stalwart.job.state import TrackedState
from stalwart.job.step_end import StepEnd
from stalwart.job.step_hooks import StepHooks
from stalwart.recovery.in_loop import InLoop
from stalwart.recovery.restore import Restorer
from stalwart.recovery.rollback import Rollback
from stalwart.runtime.dist import Comm, Placement
from stalwart.telemetry.events import EventLog


@dataclass(slots=True)
class Parts:
    """Everything a Job makes once it has its group, and what its steps record between them. Made anew, whole, when
    the job re-forms in its loop; `tracked` then tracks the same objects."""

    hooks: StepHooks
    """What runs at fixed instants of each step (job/step_hooks.py): fault injection's seam."""
    in_loop: InLoop | None
    """Re-forming inside the loop (recovery/in_loop/); None where the worker cannot."""
    heartbeat: Heartbeat
    hang: HangTimer
    detectors: Detectors
    tracked: TrackedState
    checkpointer: Checkpointer
    snapshots: Snapshots
    restorer: Restorer
    rollback: Rollback
    step_end: StepEnd
    optimizer_hooks: OptimizerHooks
    busy_step: bool = False
    """This step's time says nothing of normal steps (`job.busy()`, a skipped batch): kept out of calibrations."""
    saved_once: bool = False
    last_saved: int | None = None
    """The step of the last checkpoint this run took or resumed from durable storage."""
    saved_before: int | None = None
    """The step of the checkpoint this run took before `last_saved` (`last_saved` may still be persisting)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """What the loop reported for the current step (`job.report`)."""
    progress: Progress = field(default_factory=Progress)
    """Rank 0's lines for the person watching (job/progress.py)."""


@dataclass(slots=True)
class Membership:
    """How a Job stands in its process group; kept when its parts are made anew."""

    given_hooks: StepHooks | None
    """The step hooks given to `Job()`; None: the installed ones, made for each rank and round."""
    deferred: bool = False
    """A replacement that joins its group for real only when its loop starts (job/joining.py)."""
    owns_process_group: bool = False
    """The Job made the default group, so it destroys it."""
    grown_at: int | None = None
    """The step survivors reached training on shrunk (recovery/in_loop/shrunk.py), said once when the parts are made
    anew."""


class JobView(Protocol):
    """What the modules of a Job's step, endings and joining see of it (job/job.Job is one): its public face, its
    parts and membership, and the few operations that change its step or its parts. Typed, so that mypy checks
    every use; those modules never touch a Job's private attributes (tests/test_house.py)."""

    config: JobConfig
    placement: Placement
    comm: Comm
    events: EventLog
    checkpointer: Checkpointer
    tracked: TrackedState
    parts: Parts
    membership: Membership
    state: Any
    """The JobState (job/job.py; an enum of that module)."""
    step: int
    resumed_from: int | None

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def is_main(self) -> bool: ...
    def close(self) -> None: ...
    def abandon(self) -> None: ...
    def resume(self) -> int: ...
    def save(self, *, wait: bool = False) -> bool: ...
    def move_to(self, step: int) -> None: ...
    def load_restored(self, restored: Restored) -> None: ...
    def set_up_parts(self, *, staying: bool = False) -> None: ...
    def start_parts(self) -> None: ...
    def announce_fault(self, kind: str, details: dict[str, Any]) -> None: ...


def make_parts(
    config: JobConfig,
    placement: Placement,
    comm: Comm,
    events: EventLog,
    hooks: StepHooks,
    token: str,
    *,
    staying: bool,
    grown_at: int | None,
) -> Parts:
    """Every part, each given the ones it needs. `staying`: a survivor re-forming in its loop; `grown_at`: see
    `Membership`. Collective (a replacement agrees with its peers whether they stayed in their loop). A part that
    fails closes the heartbeat and checkpointer made before it: a half-made Job never reaches its caller."""
    in_loop = InLoop.of_process()
    if in_loop is not None:  # a replacement whose peers stayed in their loop joins them quietly
        in_loop.join_if_peers_stayed(comm, staying=staying, grown_at=grown_at)
    with contextlib.ExitStack() as undo:
        heartbeat = Heartbeat.from_env(placement.local_rank)
        undo.callback(heartbeat.close)
        memory = (
            MemoryTier.from_env(placement.rank, placement.world_size, placement.local_rank, placement.local_world_size)
            if config.snapshot.every != 0
            else None
        )
        detectors = Detectors(config, comm, events, heartbeat)
        tracked = TrackedState(
            placement.rank, placement.world_size, events, detectors.loss_watch, lr_scaling=config.recovery.lr_scaling
        )
        ck = config.checkpoint
        checkpointer = Checkpointer(
            ck.dir,
            comm,
            events,
            keep_last=ck.keep_last,
            token=token,
            full_every=ck.full_every,
            when_busy=ck.when_busy,
            persist_timeout_s=ck.persist_timeout_s,
            storage_options=ck.storage_options,
            save_faults=hooks.save_faults,
            mirrors=ck.mirror_specs(),
            failover_s=ck.failover_s,
            durable_in=ck.durable_in,
        )
        undo.callback(checkpointer.close)
        snapshots = Snapshots(
            config.snapshot,
            memory,
            tracked,
            checkpointer,
            comm,
            events,
            hooks,
            token=token,
            barrier_timeout_s=config.collective_timeout_s,
            local_world_size=placement.local_world_size,
            absorb=in_loop.lose if in_loop is not None else None,
        )
        restorer = Restorer(comm, events, checkpointer, memory, snapshots.replicas)
        rollback = Rollback(restorer, checkpointer, memory, comm, events, max_rollbacks=config.recovery.max_rollbacks)
        step_end = StepEnd(
            config, detectors, snapshots, tracked, checkpointer, comm, events, restart_count=placement.restart_count
        )
        parts = Parts(
            hooks=hooks,
            in_loop=in_loop,
            heartbeat=heartbeat,
            hang=hang_timer(config.detect.hang_timeout_s),
            detectors=detectors,
            tracked=tracked,
            checkpointer=checkpointer,
            snapshots=snapshots,
            restorer=restorer,
            rollback=rollback,
            step_end=step_end,
            optimizer_hooks=OptimizerHooks(checkpointer, snapshots),
        )
        undo.pop_all()  # made whole: the Job owns them now
    return parts
