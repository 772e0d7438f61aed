"""The survivors' side of training on, shrunk, while a replacement starts (recovery/shrink.py says why and when).

`recover` is what `Job.steps()` runs after a peer's failure: it either re-forms at once and waits for the
replacement (job/endings.reform_in_loop), or undoes the failed step locally, forms the survivors' own group,
trains on with the global batch kept (`_train`, yielding to the user's loop one slice of a global batch at a time)
until the replacement reached its loop, and then re-forms the whole job, which grows back at the step reached.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Generator, Iterable, Iterator
from datetime import timedelta
from typing import Any

from stalwart.checkpoint.format import sharded
from stalwart.checkpoint.load.rank_state import Restored
from stalwart.data.loader import ResumableLoader
from stalwart.detect.heartbeat import PHASE_STEP, Heartbeat
from stalwart.errors import CheckpointCorruptError
from stalwart.job import endings
from stalwart.recovery import reform, shrink
from stalwart.runtime import group as reformable
from stalwart.runtime.dist import Placement
from stalwart.telemetry.events import EventLog

Job = Any
"""A `stalwart.Job` (job/job.py imports this module)."""


FORM_TIMEOUT_S = 30.0
"""How long the survivors wait for one another to form their own group before they wait for the replacement
instead (all of them fall back alike: each times out)."""


def recover(
    job: Job,
    failure: Exception,
    loader: Iterable[Any] | None,
    iterator: Iterator[Any] | None,
    batch: tuple[int, Any],
    max_steps: int,
) -> Generator[tuple[int, Any], None, Iterator[Any] | None]:
    """After a peer's failure inside the loop: returns the iterator to go on with, as reform_in_loop does."""
    if not _may_shrink(job, loader, max_steps):
        return endings.reform_in_loop(job, failure, loader, iterator, batch)
    assert isinstance(loader, ResumableLoader) and job._in_loop is not None
    started, failed_at = time.monotonic(), job.step
    undone: list[bool] = []
    endings.abandon(job, before_close=lambda: undone.append(_undo(job)))
    job._in_loop.leave(job.rank, reform.reason(failure))
    now = Placement.from_env()
    plan = shrink.plan(now.rank, now.world_size) if undone == [True] and now.world_size == job.world_size else None
    if plan is not None:
        try:  # the survivors were all activated together: a short wait for one another
            shrink.form(plan, timedelta(seconds=min(job.config.collective_timeout_s, FORM_TIMEOUT_S)))
        except Exception:  # a survivor that did not come (a host that died as it was activated): wait instead
            reform.abort_process_groups()
            plan = None
    if plan is None:
        return endings.reform_in_loop(job, failure, loader, iterator, batch, left=True)
    job._in_loop.rejoin()  # the DDP modules' fresh reducers on the survivors' group
    yield from _train(job, loader, plan, max_steps, failed_at, started)
    reform.abort_process_groups()
    shrink.forget_round(plan)
    job._grown_at = job.step
    return endings.reform_in_loop(job, failure, loader, None, (job.step, None), left=True)


def _may_shrink(job: Job, loader: Iterable[Any] | None, max_steps: int) -> bool:
    """The conditions of recovery/shrink.py that the job can judge before leaving its group."""
    objects = job._tracked.objects
    return (
        shrink.wanted()
        and isinstance(loader, ResumableLoader)
        and any(obj is loader for obj in objects.values())
        and not sharded.meshes_of(objects.values())
        and job.step + 1 < max_steps
        and job._snapshots.memory is not None
    )


def _undo(job: Job) -> bool:
    """Put this survivor's tracked objects back at the last completed step, from its own snapshot of that step in
    node memory: a light one (the per-rank part) with its live tensors (recovery/reform.Stash), else a full one (the
    replicated tensors its local peers copied are read from their slots). No collective. Whether it did."""
    stash, memory, step = reform.stashed(), job._snapshots.memory, job.step
    if memory is None:
        return False
    try:
        snapshot = None
        if stash is not None and stash.step == step:
            with contextlib.suppress(CheckpointCorruptError):
                wanted, content = memory.light(step)
                if all(tid in stash.tensors for tid in wanted):
                    snapshot = memory.load_light(step, content, stash.tensors, stash.skeleton)
        if snapshot is None:  # no light snapshot of the step (or no live state): a full one
            snapshot = memory.load(step)
        where = f"this rank's snapshot of step {step}"
        job._tracked.load(Restored(step, job.world_size, snapshot.state, where, snapshot.bytes, tier="memory"))
    except Exception:
        return False
    return True


def _train(
    job: Job, loader: ResumableLoader, plan: shrink.Plan, max_steps: int, failed_at: int, started: float
) -> Iterator[tuple[int, Any]]:
    """Steps of the full job at the survivors' size until the replacements reached their loop (or the step before
    the last: the run's final checkpoint is taken by the whole job)."""
    placement = Placement.from_env()
    events = EventLog.from_env(rank=placement.rank, restart=placement.restart_count)
    heartbeat = Heartbeat.from_env(placement.local_rank)
    micro = shrink.MicroSteps(job._tracked.optimizers(), shrink.schedulers(job._tracked.objects), plan.scale)
    group = reformable.current()
    assert group is not None
    group.absorb_failures(True)
    asked = shrink.Asked()
    loader.take_shares(plan.shares)
    iterator = iter(loader)
    first = job.step
    seconds = round(time.monotonic() - started, 4)
    events.emit(
        "shrunk",
        failed_at=failed_at,
        step=job.step,
        world_size=plan.size,
        full_world_size=plan.world_size,
        shares=list(plan.shares),
        seconds=seconds,
    )
    lost = sorted(set(range(plan.world_size)) - set(plan.kept))
    events.emit(
        "world_resized",
        **{"from": plan.world_size, "to": plan.size},
        step=job.step,
        tier="peer",
        why=f"rank(s) {lost} failed: training on while the replacement starts",
        seconds=seconds,
    )
    try:
        while job.step + 1 < max_steps:
            ready, again = shrink.agree(plan, plan.shrunk_rank == 0 and shrink.replacements_ready(plan), asked.asked)
            _check(group)
            if again:  # the round failed again (its replacement died): re-arm, train on in the next one
                plan, events = _rearm(job, plan, asked, events)
                continue
            if ready:
                break
            heartbeat.beat(job.step, PHASE_STEP, job._hang.grace())  # k slices a step: not the calibrated time
            step_started = time.monotonic()
            items = list(itertools.islice(iterator, len(plan.shares)))
            if len(items) < len(plan.shares):
                break  # the data ran out: the whole job ends it
            for index, item in enumerate(items):
                micro.begin(index, len(items))
                try:
                    yield job.step, item
                finally:
                    micro.end()
            _check(group)
            job._move_to(job.step + 1)
            events.emit("step_done", step=job.step, step_s=time.monotonic() - step_started, world_size=plan.size)
        events.emit("growing", step=job.step, shrunk_steps=job.step - first)
    finally:
        micro.close()
        asked.close()
        loader.take_shares(None)
        group.absorb_failures(False)
        heartbeat.close()
        events.close()


def _rearm(job: Job, plan: shrink.Plan, asked: shrink.Asked, events: EventLog) -> tuple[shrink.Plan, EventLog]:
    """Re-arm in the shrunk loop: the agent's next round keeps this process; the survivors' group stays. The same
    survivors must be kept (a survivor lost is a failure of their group, met by its collectives first). Returns the
    next round's plan and event log (its events carry the round's restart count)."""
    started = time.monotonic()
    reform.rearm()
    asked.asked = False
    now = Placement.from_env()
    again = shrink.plan(now.rank, now.world_size)
    if again is None or again.kept != plan.kept or again.world_size != plan.world_size:
        raise shrink.ShrunkFailed(
            f"the next round keeps other ranks ({again.kept if again else 'none'}) than "
            f"the survivors' group ({plan.kept})"
        )
    events.close()
    events = EventLog.from_env(rank=now.rank, restart=now.restart_count)
    events.emit("shrunk_rearmed", step=job.step, seconds=round(time.monotonic() - started, 4))
    return again, events


def _check(group: reformable.ReformableGroup) -> None:
    if group.failed is not None:
        raise shrink.ShrunkFailed(f"a survivor failed while the job ran shrunk: {reform.reason(group.failed)}")
