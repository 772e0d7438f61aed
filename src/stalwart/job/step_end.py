"""The checks at a step's end that decide what happens next: a rollback, a checkpoint (regular or at a warning
sign), an eviction, a preemption.

Every rank runs them at the same steps, and each decision is the same on every rank: either it follows from
state every rank shares (the replicas' fingerprints, DDP's all-reduced gradients) or it is agreed in a
collective (job/messages.py). The loop that acts on them is `Job.steps`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

from stalwart.checkpoint.manager import Checkpointer
from stalwart.errors import ReplicaDivergenceError
from stalwart.job.config import JobConfig
from stalwart.job.detectors import Detectors
from stalwart.job.messages import CheckpointInputs, to_us
from stalwart.job.snapshots import Snapshots
from stalwart.job.state import TrackedState
from stalwart.policy.auto_checkpoint import CheckpointInterval
from stalwart.recovery.rollback import RollbackRequest, all_finite
from stalwart.runtime.dist import Comm, Flag
from stalwart.runtime.env import LAUNCH_TIME_ENV
from stalwart.telemetry.events import EventLog


@dataclass(frozen=True, slots=True)
class WarningSign:
    """A warning sign agreed at this step: why a checkpoint is taken now, and the straggler to evict, if any."""

    reason: str | None = None
    evict: int | None = None


class StepEnd:
    """The step-end checks of one job."""

    def __init__(
        self,
        config: JobConfig,
        detectors: Detectors,
        snapshots: Snapshots,
        state: TrackedState,
        checkpointer: Checkpointer,
        comm: Comm,
        events: EventLog,
        *,
        restart_count: int,
    ) -> None:
        self._config = config
        self._detectors = detectors
        self._snapshots = snapshots
        self._state = state
        self._checkpointer = checkpointer
        self._comm = comm
        self._events = events
        self._restart_count = restart_count
        every = config.checkpoint.every
        self.interval = CheckpointInterval(config.checkpoint.expected_mtbf_s) if every == "auto" else None
        self._created_wall = time.time()  # this launch's age, when the launcher does not say (plain torchrun)
        self.diverged: ReplicaDivergenceError | None = None  # what a divergence without majority raises

    def start(self, step: int) -> None:
        if self.interval is not None:
            self.interval.start(step)

    # -- rollbacks (L0, recovery/rollback.py) -------------------------------------------------------------------

    def rollback_wanted(self, step: int) -> RollbackRequest | None:
        """Whether the step just done calls for a rollback, agreed by every rank. Runs the divergence check, the
        loss-spike check and, after a skipped update, the parameters' finiteness."""
        rollbacks = self._config.recovery.max_rollbacks > 0
        # Each check runs every step on every rank (each may hold a collective); the first to ask wins.
        divergence = self._divergence(step, rollbacks)
        loss = self._loss_spike(step, rollbacks)
        nonfinite = self._nonfinite_parameters(step, rollbacks)
        request = divergence or loss or nonfinite
        if request is not None:
            self._snapshots.live.forbid(f"step {step} is to be rolled back ({request.reason.replace('_', ' ')})")
        return request

    def _divergence(self, step: int, rollbacks: bool) -> RollbackRequest | None:
        divergence = self._detectors.divergence
        started = time.perf_counter()
        request = None
        if divergence is not None and divergence.due(step):  # every rank, same steps
            live = self._snapshots.live
            odd = f"the replicas differed at step {step}"
            try:
                if not divergence.check(step, on_odd=lambda: live.forbid(odd)) and self._snapshots.light_wanted():
                    self._snapshots.read_live(step)  # repaired (in place, versions unmoved): this step's state again
            except ReplicaDivergenceError as exc:
                if not rollbacks or exc.last_agreed is None:
                    raise
                self.diverged = exc
                request = RollbackRequest("replica_divergence", step, exc.last_agreed, None)
        self._detectors.seconds["divergence"] += time.perf_counter() - started
        return request

    def _loss_spike(self, step: int, rollbacks: bool) -> RollbackRequest | None:
        watch = self._detectors.loss_watch
        started = time.perf_counter()
        loss = self._detectors.take_loss()  # only a loss reported in this step
        request = None
        if watch is not None:
            rolls = rollbacks and self._config.detect.loss_spike in ("rollback", "skip")
            action = "rollback" if rolls else "warned"
            # Without a rollback to decide now, a loss tensor waits for the guard's read in the next step.
            now = rolls or self._detectors.guard is None
            spiked = loss is not None and watch.observe(step, loss, action=action, now=now)
            if rolls and spiked:
                self._snapshots.live.forbid(f"a loss spike at step {step} calls for a rollback")
            # The ranks' losses differ: they agree, at one all-gather per step, only when a spike rolls back.
            if rolls and any(m.value for m in self._comm.gather(Flag(int(spiked)))):
                request = RollbackRequest("loss_spike", step, step - 1, step - 1)
        self._detectors.seconds["loss"] += time.perf_counter() - started
        return request

    def _nonfinite_parameters(self, step: int, rollbacks: bool) -> RollbackRequest | None:
        """The guard kept this step's update out; if a parameter is already non-finite, the update before it put
        it there unseen (a lone NaN outside the guard's sample): go back to before that one."""
        guard = self._detectors.guard
        started = time.perf_counter()
        request = None
        if guard is not None and rollbacks and self._detectors.guard_agreed and guard.nonfinite_at == step - 1:
            finite = all_finite(self._state.optimizers())
            if not finite:
                self._snapshots.live.forbid(f"non-finite parameters at step {step}")
            if not all(m.value for m in self._comm.gather(Flag(int(finite)))):
                request = RollbackRequest("nonfinite_parameters", step, step - 2, step - 2)
        self._detectors.seconds["nonfinite_params"] += time.perf_counter() - started
        return request

    # -- warning signs: stragglers, the agents' GPU watch, preemption ---------------------------------------------

    def warning(self, step: int, *, measured: bool) -> WarningSign:
        """The stragglers flagged and the agents' warning signs at this step, agreed at the same step on every rank
        (a window's end is a collective); `measured`: this step's time says something about normal steps."""
        detectors = self._detectors
        reason = None
        evict = None
        started = time.perf_counter()
        if detectors.stragglers is not None:
            detectors.stragglers.step_done(step, measured=measured)
            if detectors.stragglers.newly_flagged:  # the same verdict on every rank, so a save at the same step
                reason = f"rank {min(detectors.stragglers.newly_flagged)} is a straggler"
                if self._config.detect.straggler_policy == "evict":
                    evict = min(detectors.stragglers.newly_flagged)
        risk_started = time.perf_counter()
        detectors.seconds["straggler"] += risk_started - started
        if detectors.risk is not None:
            warned = detectors.risk.step_done(step)
            if warned is not None:
                reason = reason or f"a GPU warning on the node of rank {', '.join(map(str, warned))}"
        detectors.exchange.flush()  # the window's one all-gather for both (nothing to send between windows)
        detectors.seconds["risk"] += time.perf_counter() - risk_started
        return WarningSign(reason, evict)

    def preempt(self, step: int, max_steps: int) -> bool:
        """Whether the agents agreed on a preemption at this step (and the run is not ending anyway)."""
        risk = self._detectors.risk
        return risk is not None and risk.preempt and step < max_steps

    # -- regular checkpoints ----------------------------------------------------------------------------------

    def checkpoint_due(self, step: int) -> bool:
        if self.interval is not None:
            return self.interval.due(step)
        return step % int(self._config.checkpoint.every) == 0

    def plan_checkpoints(self, step: int) -> None:
        """After a regular save under checkpoint_every="auto": the next one's step, from inputs every rank agrees on
        (the largest of each over the ranks: one collective per checkpoint; policy/auto_checkpoint.py)."""
        assert self.interval is not None
        launched = float(os.environ.get(LAUNCH_TIME_ENV, self._created_wall))
        mine = CheckpointInputs(
            stall_us=to_us(self._checkpointer.last_stall_s or 0.0),
            step_us=to_us(self._snapshots.schedule.step_s()),
            restarts=self._restart_count,
            age_s=round(max(time.time() - launched, 0.0)),
        )
        got = self._comm.gather(mine)
        stall_s, step_s = max(m.stall_us for m in got) / 1e6, max(m.step_us for m in got) / 1e6
        failures, elapsed = max(m.restarts for m in got), float(max(m.age_s for m in got))
        if stall_s <= 0 or step_s <= 0:
            self.interval.start(step)  # nothing measured yet: the same interval again
            return
        decision = self.interval.decide(step, stall_s, step_s, failures, elapsed)
        if decision is not None and self._comm.rank == 0:
            self._events.emit("checkpoint_interval", **dataclasses.asdict(decision))
