"""A step is complete: what `Job.steps()` does once the user's loop body returned.

In order: the step count moves on (the commit point: a peer's failure from here on keeps this step), the memory
snapshot is read, the detectors judge the step, and either the job rolls back to the newest good state (a
divergence, a loss spike; recovery/rollback.py) or the step's snapshot, log line and checkpoint are taken and a
warning sign may evict this node or preempt the run. Kept apart from job/job.py, which reads as the phases of a
step, so that each phase's detail lives with its one job.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import Any

from stalwart.detect.heartbeat import PHASE_RESUME
from stalwart.job import leaving
from stalwart.job.parts import JobView
from stalwart.recovery.in_loop import survivor
from stalwart.recovery.rollback import RollbackRequest


def end_step(job: JobView, started: float, first: bool, max_steps: int, loader: Iterable[Any] | None) -> bool:
    """The loop body returned: the step is complete. Its snapshot, checks, log line and checkpoint; True when
    the job rolled back instead (the caller restarts the loader from the restored position)."""
    step_s = _body_done(job, started)
    snapshots, step_end = job.parts.snapshots, job.parts.step_end
    live_s = snapshots.at_step_end(job.step)  # before any collective of this step's end
    snapshots.publish()
    rollback = step_end.rollback_wanted(job.step)
    job.parts.detectors.reads.step_ended()  # a loss the guard's read of this step did not take is read now
    if rollback is not None and _roll_back(job, rollback, loader):
        job.parts.busy_step = False
        survivor.allow_requests()
        return True
    if rollback is not None and snapshots.light_wanted():
        snapshots.read_live(job.step)  # nothing to roll back to (a loss spike only reported)
    warning = step_end.warning(job.step, measured=not job.parts.busy_step)
    job.parts.busy_step = False
    snapshots.take(job.step, live_s)
    survivor.allow_requests()  # a re-forming request deferred by the commit point is raised here
    if first:  # the optimizer's state exists now: staging is allocated while the next steps run
        with contextlib.suppress(Exception):
            job.checkpointer.prepare(job.tracked.state(job.step))
    if first or job.step % job.config.log_every == 0:
        _log_step(job, step_s, max_steps)
    _checkpoint(job, max_steps, warning.reason)
    if warning.evict is not None:
        leaving.evict(
            job.step, warning.evict, job.rank, job.checkpointer, job.events, job.parts.heartbeat, job.parts.hang
        )
    if step_end.preempt(job.step, max_steps):
        leaving.preempt(
            job.step,
            job.parts.last_saved == job.step,
            lambda: job.save(wait=True),
            job.checkpointer,
            job.events,
            job.parts.heartbeat,
            is_main=job.is_main,
        )
    return False


def _body_done(job: JobView, started: float) -> float:
    """The loop body is done: the step is complete. Returns its duration (from `started`, monotonic, to after
    the fence), as the calibrations see it."""
    # The agent's request to re-form (a peer failed) waits for this step's snapshot, so the step is kept
    # wherever the peers hold it too (survivor.defer_requests). A collective of the step's end still fails at
    # once if a peer is gone.
    survivor.defer_requests()
    job.parts.optimizer_hooks.wait()  # a step without an optimizer step must not outrun the checkpoint's copy
    job.move_to(job.step + 1)
    step_s = time.monotonic() - started
    if not job.parts.busy_step:
        job.parts.hang.observe(step_s)
        job.parts.snapshots.schedule.observe_step(step_s)
    return step_s


def _checkpoint(job: JobView, max_steps: int, risk: str | None) -> None:
    """The checkpoint this step's end calls for: the run's last (durable before steps() returns), a regular one,
    or one at a warning sign, before it turns into a failure."""
    taken = None
    step_end = job.parts.step_end
    if job.step == max_steps:
        taken = job.save(wait=True)
    elif step_end.checkpoint_due(job.step) or risk is not None:
        regular = step_end.checkpoint_due(job.step)
        taken = job.save()
        if regular and step_end.interval is not None:
            step_end.plan_checkpoints(job.step)
        if taken:
            job.parts.snapshots.full_copy_served(job.step)
    if risk is not None:  # (a regular one due at this step serves)
        job.events.emit("risk_checkpoint", step=job.step, reason=risk, taken=taken)


def _roll_back(job: JobView, request: RollbackRequest, loader: Iterable[Any] | None) -> bool:
    """Go back to the newest good state and skip the batch (recovery/rollback.py). Collective. False when there
    is nothing to go back to (a loss spike is then only reported)."""
    started = time.monotonic()
    job.parts.detectors.reads.flush()  # what waits belongs to the steps being left: judged before they go
    tracked = loader is None or any(obj is loader for obj in job.tracked.objects.values())
    restored = job.parts.rollback.restore(
        request,
        job.step,
        loader_tracked=tracked,
        diverged=job.parts.step_end.diverged,
        on_start=lambda: job.parts.heartbeat.beat(job.step, PHASE_RESUME, job.parts.hang.grace()),
    )
    if restored is None:
        return False
    job.load_restored(restored)
    from_step = job.step
    job.move_to(restored.step)
    job.parts.detectors.rolled_back(job.step)
    job.parts.snapshots.rolled_back(job.step)
    job.parts.rollback.done(request, from_step, restored, time.monotonic() - started)
    return True


def _log_step(job: JobView, step_s: float, max_steps: int) -> None:
    """A `step_done` event and rank 0's progress line; the reported tensors are read in one read, with whatever
    waits for one."""
    reported = job.parts.detectors.reads.read_items(job.parts.metrics)
    job.parts.progress.say_step(job.step, max_steps, reported, is_main=job.is_main)
    metrics = {**reported, **job.parts.snapshots.log_fields()}
    job.events.emit("step_done", step=job.step, step_s=step_s, **metrics)
