"""Starting and closing a job's detectors, and the time they take on the training thread.

The numeric guard (detect/numeric.py) hooks the tracked optimizers; the straggler detector (detect/straggler.py)
the tracked modules' backward passes; the divergence check (detect/divergence.py) compares the replicated
objects' fingerprints; the risk watch (detect/risk.py) reads the agent's warning signs; the loss watch judges
reported losses. Each is started once, at the first `steps()`, when the options and the tracked objects call
for it. What they decide at a step's end is job/step_end.py's.
"""

from __future__ import annotations

from stalwart.checkpoint.format import sharded
from stalwart.detect.divergence import DivergenceCheck, broadcast_on_default_group
from stalwart.detect.heartbeat import Heartbeat
from stalwart.detect.host_reads import HostReads
from stalwart.detect.numeric import GuardConfig, LossWatch, NumericGuard
from stalwart.detect.risk import RiskWatch
from stalwart.detect.straggler import StragglerDetector
from stalwart.job.config import JobConfig
from stalwart.job.state import TrackedState
from stalwart.runtime.dist import Comm, GatherBatch
from stalwart.telemetry.events import EventLog


class Detectors:
    """The job's detectors, once started; None where the options or the tracked objects leave one out."""

    def __init__(self, config: JobConfig, comm: Comm, events: EventLog, heartbeat: Heartbeat) -> None:
        self._config = config
        self._comm = comm
        self._events = events
        self._heartbeat = heartbeat
        self.reads = HostReads()
        """Every value read to the host on the training thread: at most one read a step (detect/host_reads.py)."""
        detect = config.detect
        factor = detect.loss_spike_factor
        self.loss_watch = LossWatch(events, float(factor), self.reads) if detect.loss_watched and factor else None
        self.exchange = GatherBatch(comm.all_gather_ints_later)  # the detectors' all-gathers of a window, as one
        self.guard: NumericGuard | None = None
        self.guard_agreed = False  # whether every rank's guard decides alike (replicated or sharded optimizers)
        self.stragglers: StragglerDetector | None = None
        self.divergence: DivergenceCheck | None = None
        self.risk: RiskWatch | None = None
        self.seconds = {"divergence": 0.0, "loss": 0.0, "nonfinite_params": 0.0, "straggler": 0.0, "risk": 0.0}
        """Time each step-end check took on the training thread (`Job.detector_seconds`)."""
        self._loss: object = None  # the loss given to report() in this step, for the loss-spike check

    def report_loss(self, loss: object) -> None:
        self._loss = loss

    def take_loss(self) -> object:
        """The loss reported in this step (None if none), once."""
        loss, self._loss = self._loss, None
        return loss

    def start(self, state: TrackedState, step: int) -> None:
        """The other detectors the options and the tracked objects call for; `step`: the state now loaded."""
        self._start_stragglers(state)
        self._start_divergence(state)
        if self.risk is None and self._heartbeat.active:  # under stalwart run: its agent may warn
            self.risk = RiskWatch(
                self._heartbeat.risk,
                self.exchange.gather,
                self._comm.world_size,
                preempted=self._heartbeat.preemption_requested,
            )
        if self.divergence is not None:
            self.divergence.last_agreed = step  # one copy of the replicated state was loaded, or DDP's own

    def start_guard(self, state: TrackedState) -> None:
        """The numeric guard on every tracked optimizer, unless both its checks are off. Started before any other
        optimizer hook: its pre-hook must decide whether the update happens before the commit point's
        (job/step_commit.py) and the fence's."""
        guard = self._config.guard
        if self.guard is not None or not guard.on:
            return
        optimizers = state.optimizers()
        if not optimizers:
            return
        config = GuardConfig(
            nonfinite=guard.nonfinite_grads,
            spike=guard.grad_spike,
            spike_factor=float(guard.grad_spike_factor),
            max_skips=guard.max_skipped_steps,
            sample=guard.grad_check_sample,
        )
        replicated = all(n in state.replicated for n, o in state.objects.items() if o in optimizers)
        quiet = replicated and self._comm.rank != 0
        self.guard = NumericGuard(optimizers, self._events, config, quiet=quiet, reads=self.reads)
        shards = any(sharded.is_dtensor(p) for o in optimizers for g in o.param_groups for p in g["params"])
        self.guard_agreed = replicated or shards or self._comm.world_size == 1

    def _start_stragglers(self, state: TrackedState) -> None:
        """With more than one rank and a tracked module."""
        threshold = self._config.detect.straggler_threshold
        world = self._comm.world_size
        if self.stragglers is not None or threshold is None or world < 2 or not state.modules():
            return
        self.stragglers = StragglerDetector(
            self._comm.rank,
            world,
            self._events,
            self.exchange.gather,
            threshold=threshold,
            announce=self._comm.rank == 0,
        )
        self.stragglers.watch(state.modules())
        self.stragglers.watch_optimizers(state.optimizers())

    def _start_divergence(self, state: TrackedState) -> None:
        """With more than one rank and replicated objects."""
        every = self._config.detect.divergence_every
        if self.divergence is not None or every is None or self._comm.world_size < 2 or not state.replicated:
            return
        self.divergence = DivergenceCheck(
            self._comm.rank,
            self._comm.world_size,
            self._events,
            state.replicated_tensors,
            self._comm.all_gather_ints,
            broadcast_on_default_group,
            every,
        )

    def rolled_back(self, step: int) -> None:
        """The job went back to `step`: one copy of the replicated state was loaded, the guard starts afresh."""
        if self.guard is not None:
            self.guard.rolled_back()
        if self.divergence is not None:
            self.divergence.last_agreed = step

    def breakdown(self) -> dict[str, float]:
        """Seconds on the training thread by detector: guard, divergence, loss, nonfinite_params, straggler, risk."""
        return {"guard": self.guard.seconds if self.guard is not None else 0.0, **self.seconds}

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()
        if self.stragglers is not None:
            self.stragglers.close()
