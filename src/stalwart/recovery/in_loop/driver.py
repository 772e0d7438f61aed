"""After a peer's failure inside the training loop: the survivor's way back to training, and how it leaves its parts.

`recover` is what `Job.steps()` runs after such a failure: it either re-forms at once and waits for the
replacement (`reform_in_loop`), or undoes the failed step locally, forms the survivors' own group, trains on
shrunk (in_loop/shrunk.py) until the replacement reached its loop, and then re-forms the whole job, which grows
back at the step reached (in_loop/late_join.py). `reform_in_loop`: the survivor drops its parts (`abandon`), waits
for the next round of the rendezvous, makes its parts anew in the same process with the same tracked objects and
the same process group object, restores the step every rank agrees on and goes on. `abandon` alone is also the
fallback's (the script's run ends and the worker host runs it again: recovery/reform.py). The Job is reached
through in_loop/port.LoopJob only.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from datetime import timedelta
from typing import Any

from stalwart.checkpoint.format import sharded
from stalwart.checkpoint.load.rank_state import Restored
from stalwart.data.loader import ResumableLoader
from stalwart.detect.heartbeat import PHASE_RESUME
from stalwart.recovery import reform, shrink
from stalwart.recovery.in_loop import sharded_stretch, shrunk, survivor
from stalwart.recovery.in_loop.group_side import InLoop, NewWorldForShards, NothingToGoBackTo
from stalwart.recovery.in_loop.port import LoopJob
from stalwart.runtime import torch_compat_fsdp
from stalwart.runtime.dist import Placement, init_process_group
from stalwart.runtime.process import say
from stalwart.telemetry.events import EventLog

WAITING_ASKED = "--wait-for-replacement"
"""Why survivors wait for the replacement when the user asked them to (nothing to explain on the console)."""

FORM_TIMEOUT_S = 30.0
"""How long the survivors wait for one another to form their own group before they wait for the replacement
instead (all of them fall back alike: each times out)."""


def recover(
    job: LoopJob,
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
        if why != WAITING_ASKED:  # the default trains on shrunk: say why it does not
            say(f"stalwart: rank {job.rank}: waiting for the replacement, not training on shrunk: {why}")
        return reform_in_loop(job, failure, loader, iterator, batch)
    assert job.parts.in_loop is not None
    started, failed_at = time.monotonic(), job.step
    undone: list[int | None] = []
    abandon(job, before_close=lambda: undone.append(_undo(job)))
    job.parts.in_loop.leave(job.rank, reform.reason(failure))
    # From here a request to re-form is the next round's (its replacement died in its set-up): recorded, not raised
    # in the middle of forming or sharding; the survivors re-arm at their first step boundary (shrunk.py).
    asked = shrink.Asked()
    try:
        back_to = undone[0] if undone else None
        args = (failure, loader, iterator, batch, max_steps, asked, back_to, started, failed_at)
        return (yield from _train_on(job, *args))
    finally:
        asked.close()


def _train_on(
    job: LoopJob,
    failure: Exception,
    loader: Iterable[Any] | None,
    iterator: Iterator[Any] | None,
    batch: tuple[int, Any],
    max_steps: int,
    asked: shrink.Asked,
    back_to: int | None,
    started: float,
    failed_at: int,
) -> Generator[tuple[int, Any], None, Iterator[Any] | None]:
    """`recover` once this survivor left its group and undid the failed step (to `back_to`, None: it could
    not): train on shrunk when the survivors can, else wait for the replacement."""
    assert job.parts.in_loop is not None
    own_data = _own_data(job, loader)
    now = Placement.from_env()
    same_world = back_to is not None and now.world_size == job.world_size
    if back_to is not None and same_world and back_to != job.step:
        job.move_to(back_to)  # back to its newest snapshot: the failure came before the step's own
    shards = bool(sharded.meshes_of(job.tracked.objects.values()))
    # Sharded with a loader: the survivors' slices grow (sharded_stretch), so the global batch must divide among
    # them, not W' divide W; any W' then, as with the script's own data.
    any_size = own_data or (
        shards and sharded_stretch.loaders_divide(job.tracked.objects.values(), shrink.kept_ranks())
    )
    plan = shrink.plan(now.rank, now.world_size, own_data=any_size) if same_world else None
    if plan is not None and shards:
        plan = dataclasses.replace(plan, own_data=own_data, sharded=True)
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
    if plan is not None and shards:  # FSDP2: sharded again among the survivors, the lost rank's from node memory
        why = sharded_stretch.shard_among_survivors(job, plan)
        if why is not None:
            reform.abort_process_groups()
            plan = None
    if plan is None:
        with contextlib.closing(EventLog.from_env(rank=now.rank, restart=now.restart_count)) as events:
            events.emit("waiting_for_replacement", step=job.step, why=why)
        asked.close()
        if asked.asked:  # as before this round's formation: the script runs again (its round is gone)
            raise reform.ReformRequested("the agent asked this worker to re-form: a peer failed")
        return reform_in_loop(job, failure, loader, iterator, batch, left=True)
    job.parts.in_loop.rejoin()  # the DDP modules' fresh reducers on the survivors' group
    if own_data:  # the failed step is redone with the batch drawn for it; then the script's own iterator goes on
        drawn_at, drawn = batch
        own = itertools.chain([drawn], iterator) if iterator is not None and drawn_at == job.step else iterator
        yield from shrunk.train_own(job, own, plan, max_steps, failed_at, started, asked)
    else:
        assert isinstance(loader, ResumableLoader)
        own = None
        if shards:  # the loader's slices of W' ranks (sharded_stretch): one loop body a step, the global batch kept
            yield from shrunk.train_own(job, iter(loader), plan, max_steps, failed_at, started, asked)
        else:
            yield from shrunk.train(job, loader, plan, max_steps, failed_at, started, asked)
    if shards:
        sharded_stretch.leave_snapshot(job, plan)
    reform.abort_process_groups()
    shrink.forget_round(plan)
    job.membership.grown_at = job.step
    # (-1, None): nothing drawn to redo after growing; a tracked loader restarts from the grown step's position
    return reform_in_loop(job, failure, loader, own, (-1, None), left=True)


def _own_data(job: LoopJob, loader: Iterable[Any] | None) -> bool:
    """Whether the script draws its own batches: no loader given to `steps()`, or one stalwart does not track as a
    ResumableLoader (it cannot re-slice it among the survivors)."""
    return not (isinstance(loader, ResumableLoader) and any(obj is loader for obj in job.tracked.objects.values()))


def _why_not_shrink(job: LoopJob, loader: Iterable[Any] | None, max_steps: int) -> str | None:
    """Why the survivors cannot train on shrunk, of the conditions of recovery/shrink.py the job can judge before
    leaving its group; None when they may."""
    if not shrink.wanted():
        return WAITING_ASKED
    refused = getattr(job.parts.in_loop, "shrink_refused", None)
    if refused:
        return str(refused)
    if sharded.meshes_of(job.tracked.objects.values()):
        why = sharded_stretch.why_not(job.tracked.objects.values(), job.world_size, job.world_size - 1)
        if why is not None:
            return why
    if job.step + 1 >= max_steps:
        return "the failure came at the last step"
    if job.parts.snapshots.memory is None:
        return "no node memory (snapshot_every=0)"
    return None


def _undo(job: LoopJob) -> int | None:
    """Put this survivor's tracked objects back at the last completed step, from its own snapshot of that step in
    node memory: a light one (the per-rank part) with its live tensors (recovery/survivor.Stash), else a full one (the
    replicated tensors its local peers copied are read from their slots). Without one of that step (the failure
    came in the step's end, before its snapshot; or snapshots are taken every few steps), the newest full one before
    it: those steps are redone. No collective. The step it went back to; None if it could not."""
    stash, memory, step = survivor.stashed(), job.parts.snapshots.memory, job.step
    if memory is None:
        return None
    snapshot, why = None, f"no live state of step {step} was kept"
    if stash is not None and stash.step == step:
        try:
            wanted, content = memory.light(step)
            missing = sorted(set(wanted) - set(stash.tensors))
            why = f"the light snapshot of step {step} wants tensors the survivor does not hold: {missing[:3]}"
            if not missing:
                snapshot = memory.load_light(step, content, stash.tensors, stash.skeleton)
        except Exception as exc:
            why = str(exc)
    # No light snapshot of the step (or no live state): a full one, the newest that reads back whole (one whose
    # copy the failure interrupted does not).
    for older in [] if snapshot is not None else [s for s in memory.steps() if s <= step]:
        with contextlib.suppress(Exception):
            snapshot, step = memory.load(older), older
            break
    if snapshot is None:
        return None
    if step != job.step:  # the live tensors are about to hold an older step: the stash of the failed one is void
        survivor.drop_stash()
        # Steps redone: why its own state of the failed step did not serve (for the person reading the events).
        job.events.emit("went_back", step=step, failed_at=job.step, why=why)
    try:
        where = f"this rank's snapshot of step {step}"
        job.tracked.load(Restored(step, job.world_size, snapshot.state, where, snapshot.bytes, tier="memory"))
    except Exception:
        return None
    return step


def abandon(job: LoopJob, before_close: Callable[[], None] | None = None) -> None:
    """Drop `job` after its group failed, without a collective: the persister is killed, so a save in flight never
    commits, the live state is kept for the next formation when it still holds the last completed step, and nothing
    runs at interpreter exit. The process groups are aborted by the caller, all at once. `before_close`: runs once
    the live state is kept, while node memory is still open (`recover` undoes the failed step there)."""
    atexit.unregister(job.close)
    with contextlib.suppress(Exception):
        job.checkpointer.abandon()  # first: the persister dies before anything else can go wrong
    running = job.state.value == "running"
    outside = None if running else f"the job was {job.state.value}, not inside its training loop"
    lost = job.parts.snapshots.keep_live_state(job.step, outside)
    closers = [
        job.parts.snapshots.close_commit,
        job.parts.optimizer_hooks.close,
        job.parts.detectors.close,
        job.parts.heartbeat.close,
        job.comm.forget,
    ]
    if job.parts.in_loop is not None:
        closers.append(job.parts.in_loop.close)
    for close in closers:
        with contextlib.suppress(Exception):
            close()
    if before_close is not None:
        before_close()
    memory = job.parts.snapshots.memory
    if memory is not None:
        with contextlib.suppress(Exception):
            memory.close(wait_s=0.0)  # a snapshot's copy on a GPU that may hang: only if already done
    job.membership.owns_process_group = False
    with contextlib.suppress(Exception):
        why = {} if lost is None else {"why": lost}
        job.events.emit("reforming", step=job.step, kept_live_state=lost is None, **why)
    job.events.close()


def can_go_back(job: LoopJob) -> bool:
    """Whether a survivor has a state to go back to, as far as it knows: it resumed from one, holds a memory
    snapshot, or finds a committed checkpoint (listed only once it has taken one: a save in flight commits later).
    Without one (a failure before the first), re-forming in the loop could only end in NothingToGoBackTo and a
    second round; the script is run again at once instead (recovery/reform.py)."""
    memory = job.parts.snapshots.memory
    if job.resumed_from is not None or (memory is not None and (memory.steps() or memory.steps(light=True))):
        return True
    return job.parts.last_saved is not None and job.checkpointer.newest_committed() >= 0


def reform_in_loop(
    job: LoopJob,
    failure: Exception,
    loader: Iterable[Any] | None,
    iterator: Iterator[Any] | None,
    batch: tuple[int, Any],
    *,
    left: bool = False,
) -> Iterator[Any] | None:
    """L1 in the loop: leave the failed group keeping the live state, wait for the next round, re-form in this
    process with the same tracked objects and restore the step every rank agrees on (an event `reformed_in_loop`).
    A failure during the re-formation itself (a peer dying in the restore) starts it again. `batch`: (the step it
    is for, the batch last drawn; `loader` None: the failure came before the loop, in the job's first restore).
    Returns the iterator to go on with: the loader's from the restored position when the job tracks it; else the
    same batch again when its step is redone, the iterator as it is when the restored step is the next one (an
    untracked loader cannot go back further). `left`: the job was abandoned and its worker re-armed already
    (recovery/in_loop/shrunk.py)."""
    in_loop = job.parts.in_loop
    assert in_loop is not None
    failed_at, started, ran = job.step, time.monotonic(), job.state.value == "running"
    objects = dict(job.tracked.objects)
    while True:
        try:
            ddp_modules = _reform_once(job, in_loop, failure, objects, left=left)
            break
        except (NothingToGoBackTo, NewWorldForShards):
            raise
        except Exception as exc:
            if not reform.is_reformable(exc):
                raise
            failure, left = exc, False  # another failure while re-forming: leave again
    if job.resumed_from is None and ran:
        why = f"no snapshot or checkpoint to go back to from step {failed_at}; running the script again"
        raise NothingToGoBackTo(why)
    job.start_parts()
    job.events.emit(
        "reformed_in_loop",
        failed_at=failed_at,
        step=job.step,
        world_size=job.world_size,
        ddp_modules=ddp_modules,
        seconds=time.monotonic() - started,
    )
    if loader is not None and any(obj is loader for obj in objects.values()):
        return iter(loader)
    drawn_at, drawn = batch
    if job.step == drawn_at and iterator is not None:
        return itertools.chain([drawn], iterator)
    return iterator


def _reform_once(job: LoopJob, in_loop: InLoop, failure: Exception, objects: dict[str, Any], *, left: bool) -> int:
    """One attempt: leave (unless `left`), wait for the next round, make the parts anew and restore. Returns the DDP
    modules reset."""
    if not left:
        abandon(job)
        in_loop.leave(job.rank, reform.reason(failure))
    old_world, old_rank, job.placement = job.world_size, job.rank, Placement.from_env()
    # The modules' own meshes say what they are sharded for: after a failed attempt job.world_size is the new one.
    now = torch_compat_fsdp.sharded_as(objects.values())
    target = (job.placement.world_size, job.placement.rank)
    if now is not None:
        reshard = now != target
    else:
        reshard = job.placement.world_size != old_world and bool(sharded.meshes_of(objects.values()))
    if reshard:
        size = now[0] if now is not None else old_world
        why = torch_compat_fsdp.why_not(objects.values(), size, target[0]) if now is not None else "no fully_shard"
        if why is not None:
            raise NewWorldForShards(
                f"the job re-formed as rank {target[1]} of {target[0]} and holds state sharded for {size} ranks that "
                f"cannot be sharded again in place ({why}); running the script again so that its set-up builds the "
                "modules at the new size"
            )
    if (job.placement.world_size, job.placement.rank) != (old_world, old_rank):  # a loader's slice follows its rank
        for obj in objects.values():
            if isinstance(obj, ResumableLoader):
                obj.rebind(job.placement.rank, job.placement.world_size)
    timeout = timedelta(seconds=job.config.collective_timeout_s)
    job.membership.owns_process_group = init_process_group(job.placement, timeout, reformable=True)
    at, resharded = job.step, None
    if reshard and now is not None:
        again = "sharding the FSDP2 modules again in place failed ({}); running the script again"
        resharded = sharded_stretch.reshard_in_place(objects, now[0], lambda why: NewWorldForShards(again.format(why)))
    job.set_up_parts(staying=True)
    if resharded is not None:
        job.events.emit(
            "resharded_in_place",
            step=at,
            world_from=now[0] if now is not None else old_world,
            world_to=job.world_size,
            modules=resharded[0],
            seconds=resharded[1],
        )
    job.tracked.track(**objects)
    ddp_modules = in_loop.rejoin()
    atexit.register(job.close)
    survivor.register(job)
    job.parts.heartbeat.beat(job.step, PHASE_RESUME, job.parts.hang.grace())  # the restore may wait for the replacement
    job.resume()
    return ddp_modules
