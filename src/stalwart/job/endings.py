"""How a Job's parts end: closed when the job ends, dropped when its group fails, made anew when it stays in its loop.

`close` at the end of the script (or at interpreter exit), `close_partial` when `Job()` itself fails. Two ways on
from a peer's failure (recovery/reform.py, recovery/in_loop.py):
- `reform_in_loop`, the default under `stalwart run`: the survivor stays in `Job.steps()`. It drops its parts
  (`abandon`), waits for the next round of the rendezvous, makes its parts anew in the same process with the same
  tracked objects and the same process group object, restores the step every rank agrees on and goes on;
- `abandon` alone, the fallback: the script's run ends and the worker host runs it again (a failure met outside
  `steps()`, or in a collective stalwart cannot absorb).

Kept out of job/job.py, the facade: each reaches into most of the Job's parts, in an order that matters.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from stalwart.checkpoint.format import sharded
from stalwart.data.loader import ResumableLoader
from stalwart.detect.heartbeat import PHASE_RESUME
from stalwart.job.parts import JobView
from stalwart.recovery import reform
from stalwart.recovery.in_loop import InLoop, NewWorldForShards, NothingToGoBackTo
from stalwart.runtime.dist import Placement, init_process_group


def close(job: JobView) -> None:
    """Every part, the process group last (if the job made it), the event log after it."""
    if job.membership.deferred:  # a replacement that never reached its loop (job/joining.py): it made only these
        close_partial(job)
        return
    for close_part in (job.parts.snapshots.close_commit, job.parts.optimizer_hooks.close, job.parts.detectors.close):
        close_part()
    job.parts.heartbeat.close()
    if job.parts.snapshots.memory is not None:
        job.parts.snapshots.memory.close()
    job.checkpointer.close()
    job.comm.close()
    if job.membership.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
        job.membership.owns_process_group = False
    job.events.close()


def close_partial(job: JobView) -> None:
    """After a failed `Job()`: close what it made (a Job the caller never got; job/parts.make_parts closes its own
    when one of them fails), then leave the group."""
    for name in ("comm", "events"):
        part = getattr(job, name, None)
        if part is not None:
            with contextlib.suppress(Exception):
                part.close()
    if job.membership.owns_process_group and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        job.membership.owns_process_group = False


def abandon(job: JobView, before_close: Callable[[], None] | None = None) -> None:
    """Drop `job` after its group failed, without a collective: the persister is killed, so a save in flight never
    commits, the live state is kept for the next formation when it still holds the last completed step, and nothing
    runs at interpreter exit. The process groups are aborted by the caller, all at once. `before_close`: runs once
    the live state is kept, while node memory is still open (job/shrunk.py undoes the failed step there)."""
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


def can_go_back(job: JobView) -> bool:
    """Whether a survivor has a state to go back to, as far as it knows: it resumed from one, holds a memory
    snapshot, or finds a committed checkpoint (listed only once it has taken one: a save in flight commits later).
    Without one (a failure before the first), re-forming in the loop could only end in NothingToGoBackTo and a
    second round; the script is run again at once instead (recovery/reform.py)."""
    memory = job.parts.snapshots.memory
    if job.resumed_from is not None or (memory is not None and (memory.steps() or memory.steps(light=True))):
        return True
    return job.parts.last_saved is not None and job.checkpointer.newest_committed() >= 0


def reform_in_loop(
    job: JobView,
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
    (job/shrunk.py)."""
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


def _reform_once(job: JobView, in_loop: InLoop, failure: Exception, objects: dict[str, Any], *, left: bool) -> int:
    """One attempt: leave (unless `left`), wait for the next round, make the parts anew and restore. Returns the DDP
    modules reset."""
    if not left:
        abandon(job)
        in_loop.leave(job.rank, reform.reason(failure))
    old_world, old_rank, job.placement = job.world_size, job.rank, Placement.from_env()
    if job.placement.world_size != old_world and sharded.meshes_of(objects.values()):
        raise NewWorldForShards(
            f"the job re-formed at {job.placement.world_size} ranks from {old_world} and holds sharded state; running "
            "the script again so that its set-up builds the modules at the new size"
        )
    if (job.placement.world_size, job.placement.rank) != (old_world, old_rank):  # a loader's slice follows its rank
        for obj in objects.values():
            if isinstance(obj, ResumableLoader):
                obj.rebind(job.placement.rank, job.placement.world_size)
    timeout = timedelta(seconds=job.config.collective_timeout_s)
    job.membership.owns_process_group = init_process_group(job.placement, timeout, reformable=True)
    job.set_up_parts(staying=True)
    job.tracked.track(**objects)
    ddp_modules = in_loop.rejoin()
    atexit.register(job.close)
    reform.register(job)
    job.parts.heartbeat.beat(job.step, PHASE_RESUME, job.parts.hang.grace())  # the restore may wait for the replacement
    job.resume()
    return ddp_modules
