"""The training-loop integration: what the user's loop calls (`Job.track`, `Job.steps`, `Job.report`).

`steps()` resumes from the newest checkpoint that verifies on every rank, checkpoints every `checkpoint_every`
steps and at the end, and logs events; the same loop runs as one process, under `stalwart run` and `torchrun`.
The Job is a facade: its loop reads as the phases of a step, each a call into a part with one job: the tracked
state (job/state.py), the memory snapshots (job/snapshots.py), the detectors (job/detectors.py), the step-end
decisions (job/step_end.py), what a complete step does (job/completing.py), restoring (recovery/restore.py) and
rolling back (recovery/rollback.py).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import time
from collections.abc import Generator, Iterable, Iterator
from datetime import timedelta
from enum import Enum
from typing import Any

import torch

from stalwart.checkpoint.load.rank_state import Restored
from stalwart.detect.heartbeat import PHASE_DONE, PHASE_RESUME, PHASE_SAVE, PHASE_STEP
from stalwart.errors import ConfigError
from stalwart.job import completing, endings, joining, lifecycle, progress
from stalwart.job.config import JobConfig
from stalwart.job.messages import RunName
from stalwart.job.parts import Membership, make_parts
from stalwart.job.rng import capture_rng
from stalwart.job.state import Stateful, read_skip_record
from stalwart.job.step_hooks import StepHooks, step_hooks
from stalwart.job.step_loop import Step, StepLoop
from stalwart.recovery import reform, warm_spare
from stalwart.recovery.in_loop import driver, survivor
from stalwart.recovery.in_loop import late_join as late
from stalwart.runtime.dist import Comm, Placement
from stalwart.runtime.process import say
from stalwart.telemetry.events import EventLog

__all__ = ["Job", "JobConfig", "JobState", "Stateful", "Step", "StepLoop"]


class JobState(Enum):
    CREATED = "created"  # tracking objects; nothing loaded yet
    RUNNING = "running"  # resumed (or started fresh) and iterating steps
    FINISHED = "finished"  # reached max_steps (or the end of the data) and wrote the final checkpoint


_END = object()
"""What `steps()` draws from an exhausted loader."""


class Job:
    """A training job that checkpoints, resumes and reports; see the module docstring for the loop."""

    def __init__(
        self, checkpoint_dir: str | os.PathLike[str], *, hooks: StepHooks | None = None, **options: Any
    ) -> None:
        """`options`: the documented options (job/config.py). `hooks`: what runs at fixed instants of each step
        (job/step_hooks.py, fault injection's seam); by default what is installed, in production nothing."""
        lifecycle.install_worker_safety_nets()
        self.config = JobConfig.of(checkpoint_dir, **options)
        self.placement = Placement.from_env()
        timeout = timedelta(seconds=self.config.collective_timeout_s)
        self.membership = Membership(hooks)
        self.membership.deferred, self.membership.owns_process_group = joining.join_group(self.placement, timeout)
        try:
            if self.membership.deferred:
                joining.set_up_placeholder(self, JobState.CREATED)
            else:
                self.set_up_parts()
        except BaseException:
            endings.close_partial(self)  # what it made (a Job the caller never got), then the group
            raise
        # Only now: an exit handler of a half-made Job met missing attributes, and its group was never destroyed.
        atexit.register(self.close)
        survivor.register(self)
        if not warm_spare.waiting():  # a warm spare says it started once it has a rank (in_loop/late_join.py)
            self.events.emit("worker_started", world_size=self.world_size, local_rank=self.placement.local_rank)

    def set_up_parts(self, *, staying: bool = False) -> None:
        """Everything after joining the process group, made by job/parts.make_parts; `__init__` undoes what it made
        if any of it fails. `staying`: a survivor makes its parts anew inside its loop (recovery/in_loop/driver.py),
        a replacement once it joined late (recovery/in_loop/late_join.py): the state is CREATED again, to be
        restored."""
        config, placement, membership = self.config, self.placement, self.membership
        self.comm = Comm(placement, timedelta(seconds=config.collective_timeout_s))
        self.events = EventLog.from_env(rank=placement.rank, restart=placement.restart_count)
        name = self.comm.broadcast(RunName(placement.restart_count, secrets.randbits(48)))
        token = f"{name.restart}x{name.token:012x}"  # names this run's files
        hooks = self._hooks_for(placement)
        grown_at, membership.grown_at = membership.grown_at, None
        self.parts = make_parts(
            config, placement, self.comm, self.events, hooks, token, staying=staying, grown_at=grown_at
        )
        self.formation = getattr(self, "formation", 0) + 1
        """How many times this process's Job joined a group: once, and once more at each re-forming in its loop."""
        self.tracked = self.parts.tracked
        self.checkpointer = self.parts.checkpointer
        self.state = JobState.CREATED
        self.step = 0
        """Completed steps: changed only by `move_to`."""
        self.resumed_from: int | None = None

    @property
    def rank(self) -> int:
        return self.placement.rank

    @property
    def world_size(self) -> int:
        return self.placement.world_size

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that prints and writes shared outputs."""
        return self.rank == 0

    def track(self, **objects: Any) -> None:
        """Register objects with state_dict/load_state_dict (model, optimizer, scheduler, loader, your own)."""
        if self.state is not JobState.CREATED:
            raise ConfigError("track() must be called before steps() or resume()")
        self.tracked.track(**objects)

    def move_to(self, step: int) -> None:
        """The one place the step count changes: a completed step, a resume, a rollback."""
        self.step = step

    def resume(self) -> int:
        """Load the newest valid checkpoint into the tracked objects; returns the step to continue from."""
        if self.state is not JobState.CREATED:
            return self.step
        late.join_late(self)  # a replacement that deferred joining; else nothing
        self.parts.heartbeat.beat(self.step, PHASE_RESUME, self.parts.hang.grace())
        started = time.monotonic()
        self.tracked.check_loadable()
        self.checkpointer.replicated = self.tracked.choose_replicated(self.config.recovery.replicated)
        allow = lifecycle.world_size_change_allowed(self.config.recovery.allow_world_size_change)
        self.parts.rollback.skips = read_skip_record(self.comm, self.checkpointer)
        grown = late.grow(self, capture_rng)  # after training on shrunk (recovery/in_loop/shrunk.py)
        restored = (
            None
            if grown
            else self.parts.restorer.restore(
                allow_world_size_change=allow,
                meshes=self.tracked.meshes(),
                own=lambda: self.tracked.live_tensors(self.rank),
            )
        )
        self.state = JobState.RUNNING
        if self.parts.in_loop is not None:
            self.parts.in_loop.joined(self.comm)  # a replacement's collectives run for real; DDP buckets laid out alike
        if restored is None and not grown:
            self.events.emit("fresh_start")
        if restored is None:
            return self.step
        self.load_restored(restored)
        self.move_to(restored.step)
        self.resumed_from = restored.step
        survivor.drop_stash()  # the tracked objects hold their own copy now
        seconds = time.monotonic() - started
        self.events.emit(
            "resumed",
            step=restored.step,
            source=restored.source,
            tier=restored.tier,
            bytes=restored.bytes,
            seconds=seconds,
            **({"mirror": restored.mirror} if restored.mirror else {}),
        )
        if self.is_main:  # where training goes on from, for the person watching (the event log has the rest)
            mirror = ", a mirror: no newer copy in the checkpoint directory verifies" if restored.mirror else ""
            say(f"stalwart: resumed at step {restored.step} from {restored.source} ({seconds:.2f} s to load{mirror})")
        return self.step

    def load_restored(self, restored: Restored) -> None:
        """Into the tracked objects, after the copies still reading them (a rollback writes them in place)."""
        self.tracked.load(restored)
        self.parts.last_saved = restored.step if restored.tier == "durable" else None

    def steps(self, loader: Iterable[Any] | None = None, *, max_steps: int) -> Iterator[tuple[int, Any]]:
        """Yield (step, batch) from the resumed step up to `max_steps`, checkpointing as configured.

        `step` counts completed steps before this one, so a fresh job yields 0 first. A step is complete
        when the loop body returns; a failure inside it means the step is redone after recovery. The first
        driver of the step protocol (`loop()`). A peer's failure does not raise in the loop body (it is absorbed
        and the step's end recovers); an exception the body raises ends a `for` loop as it always does, and one
        thrown in with `throw()` goes to `failed()`.
        """
        with self.loop(loader, max_steps=max_steps) as loop:
            while (step := loop.begin()) is not None:
                try:
                    yield step.number, step.batch
                except Exception as exc:
                    loop.failed(exc)  # (only a throw() reaches here) raises it again unless the job recovers
                    continue
                loop.end()

    def loop(self, loader: Iterable[Any] | None = None, *, max_steps: int) -> StepLoop:
        """The step protocol (job/step_loop.py), for a loop that cannot be written around `steps()`: a framework's
        Trainer calls `begin()`, `end()` and `failed()` where it lets an integration in."""
        if max_steps < 0:
            raise ConfigError(f"max_steps must be >= 0, got {max_steps}")
        return StepLoop(
            lambda: self._run(loader, max_steps), self._update_dropped, self._redo_horizon, lambda: self.formation
        )

    def _update_dropped(self) -> bool:
        """Whether the running step's update was dropped because a peer failed (its end recovers and redoes it)."""
        in_loop = self.parts.in_loop
        return in_loop is not None and in_loop.update_dropped()

    def _redo_horizon(self) -> int:
        """The oldest completed step a recovery may take the job back to (a driver that runs steps again keeps each
        later step's batches): the older of the newest full copy in node memory (FSDP2 survivors that train on
        shrunk reshard from it) and the durable checkpoint before the last one taken (which may still be
        persisting: a restore skips a checkpoint not yet committed), but not before the step the run resumed at."""
        held = [s for s in (self.parts.snapshots.full_copy_step, self.parts.saved_before) if s is not None]
        return max(min(held, default=0), self.resumed_from or 0)

    def _run(self, loader: Iterable[Any] | None, max_steps: int) -> Generator[tuple[int, Any], None, None]:
        """The step engine behind `loop()`: yields each step to run; a step's end is the next resumption, a failure
        of its body is thrown in at the yield."""
        try:
            self.resume()
            self.start_parts()
        except Exception as exc:  # a peer lost in the first restore: re-form before the loop
            # (A replacement that failed before it joined has no parts: its failure is raised.)
            if "parts" not in self.__dict__ or self.parts.in_loop is None or not reform.is_reformable(exc):
                raise
            driver.reform_in_loop(self, exc, None, None, (self.step, None))
        progress.announce(
            self.parts.progress,
            self.config,
            loader,
            world_size=self.world_size,
            is_main=self.is_main,
            memory_tier=self.parts.snapshots.memory is not None,
            in_loop=self.parts.in_loop is not None,
            fresh=self.step == 0 and self.resumed_from is None,
        )
        iterator = iter(loader) if loader is not None and self.step < max_steps else None
        if 0 < self.step == max_steps and self.parts.last_saved != self.step:
            # Resumed at the last step from node memory or a survivor (a failure during the run's final save):
            # that save is made now, so the run's last checkpoint is durable before steps() returns all the same.
            self.save(wait=True)
        first = True
        while self.step < max_steps:
            # The heartbeat promises the next one within the step timeout; the agent kills a worker that breaks it.
            self.parts.heartbeat.beat(self.step, PHASE_STEP, self.parts.hang.step_timeout())
            self.parts.hooks.before_step(self.step)
            started = time.monotonic()
            if self.parts.detectors.stragglers is not None:
                self.parts.detectors.stragglers.step_started(started)
            self.parts.hooks.step_started(self.step, self._tensors_to_flip)
            batch = next(iterator, _END) if iterator is not None else None
            if batch is _END:  # not None: a loader may yield None as a batch
                self.events.emit("data_exhausted", step=self.step)
                if self.step != self.parts.last_saved:
                    self.save(wait=True)
                break
            drawn_at, failure = self.step, None  # the step `batch` is for
            try:
                if (
                    self.step in self.parts.rollback.skips
                ):  # a rollback skipped this batch: drawn, never seen by the loop
                    self.events.emit("batch_skipped", step=self.step)
                    self.parts.busy_step = True  # no work: keep it out of the step-time calibrations
                else:
                    yield from self._body(self.step, self.parts.hooks.batch(self.step, batch), first)
                if self.parts.in_loop is not None:
                    self.parts.in_loop.check()
                rolled_back = completing.end_step(self, started, first, max_steps, loader)
            except Exception as exc:
                in_loop = self.parts.in_loop
                failure = exc if in_loop is None or reform.is_reformable(exc) else in_loop.consequence(exc)
                if in_loop is None or failure is None or not driver.can_go_back(self):
                    raise
            if failure is not None:  # re-form (or train on shrunk meanwhile: recovery/in_loop/), then redo the step
                iterator = yield from driver.recover(self, failure, loader, iterator, (drawn_at, batch), max_steps)
                first = True  # as for the replacement: the first step of a start
                continue
            if rolled_back:
                iterator = iter(loader) if loader is not None else None  # from the restored data position
                continue
            first = False
        if self.parts.in_loop is not None:
            self.parts.in_loop.stop()  # a failed collective after the loop raises, as without stalwart
        self.parts.detectors.reads.flush()  # the last step's loss is judged before steps() returns
        self.parts.heartbeat.beat(self.step, PHASE_DONE, None)  # after the loop the worker is not watched
        if self.state is not JobState.FINISHED:
            self.state = JobState.FINISHED
            if self.is_main:
                self.events.emit("job_finished", step=self.step)

    def start_parts(self) -> None:
        """The parts a run needs, once the state is loaded: re-forming in the loop, detectors, the GPU fence,
        re-forming's deferral, the snapshots' commit point, the checkpoint interval."""
        if self.parts.in_loop is not None:
            self.parts.in_loop.start(self.tracked.optimizers())
        self.parts.detectors.start_guard(self.tracked)  # its pre-hook first: it decides whether the update happens
        self.parts.optimizer_hooks.start(self.tracked.optimizers(), overlap=self.config.checkpoint.overlap)
        self.parts.detectors.start(self.tracked, self.step)
        self.parts.snapshots.start(self.step)
        self.parts.step_end.start(self.step)

    def _body(self, step: int, batch: Any, first: bool) -> Iterator[tuple[int, Any]]:
        """The user's loop body for the step after `step` completed steps, with the guard and the commit point
        armed around it."""
        guard = self.parts.detectors.guard
        if guard is not None:
            guard.arm(step)
        if self.parts.in_loop is not None:
            self.parts.in_loop.arm()
        self.parts.snapshots.arm(step, first)
        try:
            yield step, batch
        except GeneratorExit:
            with contextlib.suppress(reform.ReformRequested):
                survivor.allow_requests()  # the loop was left: nothing to finish, nothing to re-form
            raise
        finally:
            self.parts.snapshots.disarm()
            if guard is not None:
                guard.disarm()

    @contextlib.contextmanager
    def busy(self, seconds: float | None = None) -> Iterator[None]:
        """Mark a long stretch inside a step (an evaluation, a large all-gather) so that the hang detector
        allows `seconds` (default: the grace period, 300 s) instead of the calibrated step timeout:

            with job.busy():
                evaluate(model)
        """
        self.parts.heartbeat.beat(self.step, PHASE_STEP, seconds if seconds is not None else self.parts.hang.grace())
        self.parts.busy_step = True  # this step's time says nothing about normal steps: keep it out of calibration
        try:
            yield
        finally:
            self.parts.heartbeat.beat(self.step, PHASE_STEP, self.parts.hang.step_timeout())

    def report(self, **metrics: Any) -> None:
        """Record metrics for the current step (e.g. loss). Tensors are read only when logged, which keeps the
        device from synchronising every step; the loss for the spike check rides along with the step's one read
        (detect/host_reads.py)."""
        self.parts.metrics = metrics
        self.parts.detectors.report_loss(metrics.get("loss"))

    def save(self, *, wait: bool = False) -> bool:
        """Checkpoint the full training state now. Collective: every rank calls it at the same step.

        Training stalls only while the state is copied to staging memory; it is persisted in the background.
        Returns whether a snapshot was taken (False when the previous save is still persisting, see
        docs/checkpoints.md). With `wait`, returns once the checkpoint is committed, and whether it was.
        """
        # A save that waits on the store (waited, or the first: staging is allocated) gets the grace period; any
        # other stalls only for its agreement and a memory copy and keeps the step timeout, so a hang in it is
        # caught. With when_busy="wait", the wait for a previous save still persisting gets the grace, the rest
        # of the save the step timeout (the whole save had the grace: a 6-s network partition inside its
        # agreement went undetected, the chaos quick suite, 2026-11-30).
        beat, hang, step = self.parts.heartbeat.beat, self.parts.hang, self.step
        beat(step, PHASE_SAVE, hang.grace() if wait or not self.parts.saved_once else hang.step_timeout())

        def on_store_wait(waiting: bool) -> None:
            beat(step, PHASE_SAVE, hang.grace() if waiting else hang.step_timeout())

        self.parts.saved_once = True
        self.checkpointer.poll()
        taken = self.checkpointer.save(step, self.tracked.state(step), wait=wait, on_store_wait=on_store_wait)
        if taken:
            self.parts.saved_before, self.parts.last_saved = self.parts.last_saved, self.step
        return taken

    def _tensors_to_flip(self) -> list[torch.Tensor]:
        """A bit flip's targets, once the copies reading them ended: the last snapshot holds the state before it."""
        self.parts.optimizer_hooks.wait()
        return self.tracked.replicated_tensors()

    @property
    def detector_seconds(self) -> float:
        """Seconds the guard and step-end checks took on this process's training thread (`stalwart bench overhead`)."""
        return sum(self.detector_breakdown.values())

    @property
    def detector_breakdown(self) -> dict[str, float]:
        """`detector_seconds` by detector: guard, divergence, loss, nonfinite_params, straggler, risk."""
        return self.parts.detectors.breakdown()

    @property
    def skipped_steps(self) -> list[int]:
        """Steps of this process whose update the numeric guard skipped (completed steps before each)."""
        return list(self.parts.detectors.guard.skipped) if self.parts.detectors.guard is not None else []

    def close(self) -> None:
        """Stop the persister and release the process groups this job created (also run at interpreter exit).
        A persist still in flight is abandoned; the final checkpoint of steps() is durable before it returns."""
        endings.close(self)

    def abandon(self) -> None:
        """Drop this job after its group failed, without a collective (recovery/in_loop/driver.py)."""
        driver.abandon(self)

    def renew_hooks(self, placement: Placement) -> None:
        """The step hooks of `placement`'s rank and round (training on shrunk re-arms in new rounds: fault injection
        fires by rank, step and round)."""
        self.parts.hooks = self._hooks_for(placement)

    def _hooks_for(self, placement: Placement) -> StepHooks:
        """The hooks given to `Job()`, else the installed ones for `placement`'s rank and round."""
        given = self.membership.given_hooks
        return given or step_hooks(placement.rank, placement.restart_count, self.announce_fault)

    def announce_fault(self, kind: str, details: dict[str, Any]) -> None:
        """A fault of the step hooks is about to fire: the event log says which, at which step."""
        self.events.emit("fault_injected", fault=kind, step=self.step, **details)
