"""The steps survivors train on shrunk while a replacement starts (recovery/shrink.py says why and when).

`train` (the job's ResumableLoader: the global batch kept, one loop body per slice a survivor takes) and
`train_own` (the script's own data: one loop body a step, each survivor drawing its own batch) run the job's steps
at the survivors' size until the replacement reached its loop; in_loop/driver.recover runs them and then re-forms
the whole job.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

from stalwart.data.loader import ResumableLoader
from stalwart.detect.heartbeat import PHASE_STEP, Heartbeat
from stalwart.recovery import reform, shrink
from stalwart.recovery.in_loop import survivor
from stalwart.recovery.in_loop.port import LoopJob
from stalwart.runtime import group as reformable
from stalwart.runtime.dist import Placement
from stalwart.runtime.process import say
from stalwart.telemetry.events import EventLog


def train(
    job: LoopJob,
    loader: ResumableLoader,
    plan: shrink.Plan,
    max_steps: int,
    failed_at: int,
    started: float,
    asked: shrink.Asked,
) -> Iterator[tuple[int, Any]]:
    """Steps of the full job at the survivors' size, the global batch kept: each step is one loop body per slice
    this survivor takes (its own and the missing ranks' it stands for), the update made in the last."""
    micro = shrink.MicroSteps(job.tracked.optimizers(), shrink.schedulers(job.tracked.objects), plan.scale)
    loader.take_shares(plan.shares)
    iterator = iter(loader)

    def step() -> Generator[tuple[int, Any], None, bool]:
        items = list(itertools.islice(iterator, len(plan.shares)))
        if len(items) < len(plan.shares):
            return False  # the data ran out: the whole job ends it
        for index, item in enumerate(items):
            micro.begin(index, len(items))
            try:
                yield job.step, item
            finally:
                micro.end()
        return True

    try:
        yield from _shrunk_steps(job, plan, max_steps, failed_at, started, step, asked)
    finally:
        micro.close()
        loader.take_shares(None)


def train_own(
    job: LoopJob,
    iterator: Iterator[Any] | None,
    plan: shrink.Plan,
    max_steps: int,
    failed_at: int,
    started: float,
    asked: shrink.Asked,
) -> Iterator[tuple[int, Any]]:
    """Steps at the survivors' size with the script's own data: one loop body a step, as before the failure, each
    survivor drawing its own batch (from `iterator`, or in the loop body when the script gave no loader); DDP
    averages the gradients over the survivors."""

    def step() -> Generator[tuple[int, Any], None, bool]:
        item = next(iterator, _END) if iterator is not None else None
        if item is _END:
            return False  # the data ran out: the whole job ends it
        yield job.step, item
        return True

    yield from _shrunk_steps(job, plan, max_steps, failed_at, started, step, asked)


_END = object()


def _shrunk_steps(
    job: LoopJob,
    plan: shrink.Plan,
    max_steps: int,
    failed_at: int,
    started: float,
    step: Callable[[], Generator[tuple[int, Any], None, bool]],
    asked: shrink.Asked,
) -> Iterator[tuple[int, Any]]:
    """Steps of the job at the survivors' size (each `step()`'s loop bodies, False when the data ran out) until the
    replacements reached their loop, or the step before the last: the run's final checkpoint is taken by the whole
    job. Events at the start (`shrunk`, `world_resized`) and the end (`growing`), and one line from the lowest
    survivor saying what the stretch did to the global batch."""
    placement = Placement.from_env()
    events = job.events = EventLog.from_env(rank=placement.rank, restart=placement.restart_count)
    _round_hooks(job, placement)
    heartbeat = Heartbeat.from_env(placement.local_rank)
    group = reformable.current()
    assert group is not None
    group.absorb_failures(True)
    first = job.step
    seconds = round(time.monotonic() - started, 4)
    events.emit(
        "shrunk",
        failed_at=failed_at,
        step=job.step,
        world_size=plan.size,
        full_world_size=plan.world_size,
        shares=list(plan.shares),
        own_data=plan.own_data,
        global_batch=_global_batch(plan),
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
                job.events = events
                _round_hooks(job, Placement.from_env())
                continue
            if ready:
                break
            job.parts.hooks.before_step(job.step)  # fault injection's seam (a kill), as in the loop of the whole job
            heartbeat.beat(job.step, PHASE_STEP, job.parts.hang.grace())  # k slices a step: not the calibrated time
            step_started = time.monotonic()
            if not (yield from step()):
                break
            _check(group)
            job.move_to(job.step + 1)
            events.emit("step_done", step=job.step, step_s=time.monotonic() - step_started, world_size=plan.size)
        events.emit("growing", step=job.step, shrunk_steps=job.step - first, global_batch=_global_batch(plan))
        if plan.shrunk_rank == 0 and job.step > first:
            _say_stretch(plan, first, job.step)
    finally:
        asked.close()
        group.absorb_failures(False)
        heartbeat.close()
        events.close()


def _round_hooks(job: LoopJob, placement: Placement) -> None:
    """The step hooks of this round (fault injection fires by rank, step and round), as `Job()` makes them."""
    job.renew_hooks(placement)


def _global_batch(plan: shrink.Plan) -> str:
    """What training shrunk does to each step's global batch (the events' `global_batch`)."""
    if not plan.own_data:
        return "kept"
    return f"{plan.size}/{plan.world_size}"


def _say_stretch(plan: shrink.Plan, first: int, last: int) -> None:
    """One line for the person watching the run: the stretch trained shrunk and what it did to the global batch."""
    if plan.own_data:
        batch = (
            f"those steps' global batch was the survivors' own, {plan.size}/{plan.world_size} of the full one (the "
            "script draws its own data; --wait-for-replacement keeps every step whole)"
        )
    else:
        batch = "each step's global batch was kept whole (the survivors took the missing ranks' slices)"
    say(
        f"stalwart: trained {_steps(first, last)} on {plan.size} of {plan.world_size} ranks "
        f"while rank(s) {list(plan.missing)} started again; {batch}"
    )


def _steps(first: int, last: int) -> str:
    """The steps trained from `first` completed steps to `last`, numbered as the progress lines count them."""
    return f"step {last}" if last - first == 1 else f"{last - first} steps ({first + 1}-{last})"


def _rearm(job: LoopJob, plan: shrink.Plan, asked: shrink.Asked, events: EventLog) -> tuple[shrink.Plan, EventLog]:
    """Re-arm in the shrunk loop: the agent's next round keeps this process; the survivors' group stays. The same
    survivors must be kept (a survivor lost is a failure of their group, met by its collectives first). Returns the
    next round's plan and event log (its events carry the round's restart count)."""
    started = time.monotonic()
    survivor.rearm()
    asked.asked = False
    now = Placement.from_env()
    # Any survivors' size where the first plan allowed it (own data, or sharded state whose slices grow).
    again = shrink.plan(now.rank, now.world_size, own_data=plan.own_data or plan.sharded)
    if again is not None:
        again = dataclasses.replace(again, own_data=plan.own_data, sharded=plan.sharded)
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
