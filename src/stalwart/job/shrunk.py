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
from collections.abc import Callable, Generator, Iterable, Iterator
from datetime import timedelta
from typing import Any

from stalwart.checkpoint.format import sharded
from stalwart.checkpoint.load.rank_state import Restored
from stalwart.data.loader import ResumableLoader
from stalwart.detect.heartbeat import PHASE_STEP, Heartbeat
from stalwart.job import endings
from stalwart.job.parts import JobView
from stalwart.job.step_hooks import step_hooks
from stalwart.recovery import reform, shrink
from stalwart.runtime import group as reformable
from stalwart.runtime.dist import Placement
from stalwart.runtime.process import say
from stalwart.telemetry.events import EventLog

FORM_TIMEOUT_S = 30.0
"""How long the survivors wait for one another to form their own group before they wait for the replacement
instead (all of them fall back alike: each times out)."""


def recover(
    job: JobView,
    failure: Exception,
    loader: Iterable[Any] | None,
    iterator: Iterator[Any] | None,
    batch: tuple[int, Any],
    max_steps: int,
) -> Generator[tuple[int, Any], None, Iterator[Any] | None]:
    """After a peer's failure inside the loop: returns the iterator to go on with, as reform_in_loop does. When the
    survivors wait for the replacement instead of training on, the `reforming` event (or, once the job was left,
    a `waiting_for_replacement` event) says why."""
    why = _why_not_shrink(job, loader, max_steps)
    if why is not None:
        job.events.emit("waiting_for_replacement", step=job.step, why=why)
        return endings.reform_in_loop(job, failure, loader, iterator, batch)
    assert job.parts.in_loop is not None
    own_data = _own_data(job, loader)
    started, failed_at = time.monotonic(), job.step
    undone: list[int | None] = []
    endings.abandon(job, before_close=lambda: undone.append(_undo(job)))
    job.parts.in_loop.leave(job.rank, reform.reason(failure))
    now = Placement.from_env()
    back_to = undone[0] if undone else None
    same_world = back_to is not None and now.world_size == job.world_size
    if back_to is not None and same_world and back_to != job.step:
        job.move_to(back_to)  # back to its newest snapshot: the failure came before the step's own
    plan = shrink.plan(now.rank, now.world_size, own_data=own_data) if same_world else None
    why = None
    if back_to is None:
        why = f"no snapshot of step {job.step} or before in node memory to undo the failed step from"
    elif not same_world:
        why = "the next round has another world size"
    elif plan is None:
        why = "not wanted, no replacement named, or the survivors do not divide the world size"
    if plan is not None:
        try:  # the survivors were all activated together: a short wait for one another
            shrink.form(plan, timedelta(seconds=min(job.config.collective_timeout_s, FORM_TIMEOUT_S)))
        except Exception:  # a survivor that did not come (a host that died as it was activated): wait instead
            reform.abort_process_groups()
            plan, why = None, "the survivors' own group did not form"
    if plan is None:
        with contextlib.closing(EventLog.from_env(rank=now.rank, restart=now.restart_count)) as events:
            events.emit("waiting_for_replacement", step=job.step, why=why)
        return endings.reform_in_loop(job, failure, loader, iterator, batch, left=True)
    job.parts.in_loop.rejoin()  # the DDP modules' fresh reducers on the survivors' group
    if own_data:  # the failed step is redone with the batch drawn for it; then the script's own iterator goes on
        drawn_at, drawn = batch
        own = itertools.chain([drawn], iterator) if iterator is not None and drawn_at == job.step else iterator
        yield from _train_own(job, own, plan, max_steps, failed_at, started)
    else:
        assert isinstance(loader, ResumableLoader)
        own = None
        yield from _train(job, loader, plan, max_steps, failed_at, started)
    reform.abort_process_groups()
    shrink.forget_round(plan)
    job.membership.grown_at = job.step
    # (-1, None): nothing drawn to redo after growing; a tracked loader restarts from the grown step's position
    return endings.reform_in_loop(job, failure, loader, own, (-1, None), left=True)


def _own_data(job: JobView, loader: Iterable[Any] | None) -> bool:
    """Whether the script draws its own batches: no loader given to `steps()`, or one stalwart does not track as a
    ResumableLoader (it cannot re-slice it among the survivors)."""
    return not (isinstance(loader, ResumableLoader) and any(obj is loader for obj in job.tracked.objects.values()))


def _why_not_shrink(job: JobView, loader: Iterable[Any] | None, max_steps: int) -> str | None:
    """Why the survivors cannot train on shrunk, of the conditions of recovery/shrink.py the job can judge before
    leaving its group; None when they may."""
    if not shrink.wanted():
        return "--wait-for-replacement"
    if sharded.meshes_of(job.tracked.objects.values()):
        return "the job holds sharded state (FSDP2)"
    if job.step + 1 >= max_steps:
        return "the failure came at the last step"
    if job.parts.snapshots.memory is None:
        return "no node memory (snapshot_every=0)"
    return None


def _undo(job: JobView) -> int | None:
    """Put this survivor's tracked objects back at the last completed step, from its own snapshot of that step in
    node memory: a light one (the per-rank part) with its live tensors (recovery/reform.Stash), else a full one (the
    replicated tensors its local peers copied are read from their slots). Without one of that step (the failure
    came in the step's end, before its snapshot; or snapshots are taken every few steps), the newest full one before
    it: those steps are redone. No collective. The step it went back to; None if it could not."""
    stash, memory, step = reform.stashed(), job.parts.snapshots.memory, job.step
    if memory is None:
        return None
    snapshot = None
    if stash is not None and stash.step == step:
        with contextlib.suppress(Exception):
            wanted, content = memory.light(step)
            if all(tid in stash.tensors for tid in wanted):
                snapshot = memory.load_light(step, content, stash.tensors, stash.skeleton)
    # No light snapshot of the step (or no live state): a full one, the newest that reads back whole (one whose
    # copy the failure interrupted does not).
    for older in [] if snapshot is not None else [s for s in memory.steps() if s <= step]:
        with contextlib.suppress(Exception):
            snapshot, step = memory.load(older), older
            break
    if snapshot is None:
        return None
    if step != job.step:  # the live tensors are about to hold an older step: the stash of the failed one is void
        reform.drop_stash()
    try:
        where = f"this rank's snapshot of step {step}"
        job.tracked.load(Restored(step, job.world_size, snapshot.state, where, snapshot.bytes, tier="memory"))
    except Exception:
        return None
    return step


def _train(
    job: JobView, loader: ResumableLoader, plan: shrink.Plan, max_steps: int, failed_at: int, started: float
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
        yield from _shrunk_steps(job, plan, max_steps, failed_at, started, step)
    finally:
        micro.close()
        loader.take_shares(None)


def _train_own(
    job: JobView, iterator: Iterator[Any] | None, plan: shrink.Plan, max_steps: int, failed_at: int, started: float
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

    yield from _shrunk_steps(job, plan, max_steps, failed_at, started, step)


_END = object()


def _shrunk_steps(
    job: JobView,
    plan: shrink.Plan,
    max_steps: int,
    failed_at: int,
    started: float,
    step: Callable[[], Generator[tuple[int, Any], None, bool]],
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
    asked = shrink.Asked()
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


def _round_hooks(job: JobView, placement: Placement) -> None:
    """The step hooks of this round (fault injection fires by rank, step and round), as `Job()` makes them."""
    job.parts.hooks = job.membership.given_hooks or step_hooks(
        placement.rank, placement.restart_count, job.announce_fault
    )


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
        f"stalwart: trained steps {first}-{last} ({last - first} steps) on {plan.size} of {plan.world_size} ranks "
        f"while rank(s) {list(plan.missing)} started again; {batch}"
    )


def _rearm(job: JobView, plan: shrink.Plan, asked: shrink.Asked, events: EventLog) -> tuple[shrink.Plan, EventLog]:
    """Re-arm in the shrunk loop: the agent's next round keeps this process; the survivors' group stays. The same
    survivors must be kept (a survivor lost is a failure of their group, met by its collectives first). Returns the
    next round's plan and event log (its events carry the round's restart count)."""
    started = time.monotonic()
    reform.rearm()
    asked.asked = False
    now = Placement.from_env()
    again = shrink.plan(now.rank, now.world_size, own_data=plan.own_data)
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
