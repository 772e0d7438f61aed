"""L0 of the recovery ladder: go back to the last good state inside the running processes, and skip the batch
that did the harm.

Why: the numeric guard (detect/numeric.py) drops an update before it is applied when the gradients are
non-finite. Some harm is visible only after the update: a loss spike (by the time `job.report(loss=...)` sees
the loss, the optimizer has applied the update computed from it), parameters that became non-finite through a
lone NaN the guard's sample did not see, replicas that diverged with no majority to repair them
(detect/divergence.py). A restart cannot help: it resumes from the newest snapshot, which holds the harm, and
meets the same batch again.

What happens, on every rank at the same step (the triggers are agreed, see `Job.steps`):
1. the newest state from at or before the step the harm came from is chosen: a full memory snapshot every rank
   holds (node memory, no storage read), else the newest durable checkpoint not after it that verifies
   (Restorer.rollback);
2. the snapshots and checkpoints after that step are abandoned: memory snapshots invalidated, durable ones moved
   aside like a corrupt one (nothing is deleted), so that a failure from here on cannot resume into the
   abandoned history;
3. the batch is recorded as skipped in CHECKPOINT_DIR/skipped_batches.json (rank 0, atomically, before the
   replay), and the tracked objects, the RNG and the data position are loaded: the steps up to the batch are
   replayed exactly, the batch is drawn from the loader and dropped (the loop body never sees it; the step count
   still counts it, so steps and data position stay aligned), and training goes on.
Every start reads the record, so a run resumed from any earlier state skips the same batches: the outcome does
not depend on when failures happened.

What triggers it (the job's options; the checks are job/step_end.py's, carrying it out is `Rollback`'s):
- `loss_spike="rollback"`: a reported loss over `loss_spike_factor` times the recent median on any rank; the
  batch of that step is skipped. The ranks' losses differ, so they agree through one small all-gather per step
  (on only when this policy is chosen);
- non-finite parameters: after the guard skipped an update for non-finite gradients, each rank checks its
  parameters (one read, only then); if any is NaN or infinite, the previous step's update put it there unseen,
  and that batch is skipped;
- replica divergence without a majority: back to at or before the last step the replicas agreed on; nothing is
  skipped (the harm came from a corrupted replica, not from the data).
`max_rollbacks` rollbacks in a row (each within ROLLBACK_WINDOW steps of the previous one's trigger) mean the
trouble is not one bad batch: the job stops with NumericError (exit 78, not restarted).

Not invalidated: the images other nodes keep of this rank's snapshots (peer replicas, L3). A whole node lost
right after a rollback, before the replay has passed the abandoned steps, could resume from one of them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from stalwart.checkpoint.format import layout, sharded
from stalwart.checkpoint.load.rank_state import Restored
from stalwart.checkpoint.manager import Checkpointer
from stalwart.checkpoint.storage import Storage
from stalwart.checkpoint.tiers.memory import MemoryTier
from stalwart.errors import CheckpointCorruptError, NumericError, ReplicaDivergenceError
from stalwart.recovery.restore import Restorer
from stalwart.runtime.dist import Comm
from stalwart.runtime.process import first_line
from stalwart.telemetry.events import EventLog

SKIP_FILE = "skipped_batches.json"
FORMAT = "stalwart-skipped-batches"
ROLLBACK_WINDOW = 100
"""Steps after a rollback's trigger within which another rollback counts as one more in a row."""


@dataclass(frozen=True, slots=True)
class RollbackRequest:
    """What the job agreed to roll back for."""

    reason: str
    """"loss_spike", "nonfinite_parameters" or "replica_divergence"."""
    trigger: int
    """The completed steps when it was found."""
    at_most: int
    """The newest step the state may come from."""
    skip: int | None
    """The batch to skip (the step it is drawn at: completed steps before it), or None."""


class RollbackCap:
    """Counts rollbacks in a row; over `limit` the job stops instead of looping."""

    def __init__(self, limit: int, *, quiet: bool) -> None:
        self.limit = limit
        self._quiet = quiet
        self._last: int | None = None
        self.in_a_row = 0

    def count(self, request: RollbackRequest) -> None:
        """Note a rollback; NumericError when it would be one more than `limit` in a row."""
        near = self._last is not None and request.trigger <= self._last + ROLLBACK_WINDOW
        self.in_a_row = self.in_a_row + 1 if near else 1
        self._last = request.trigger
        if self.in_a_row > self.limit:
            raise NumericError(
                f"training diverged: {self.limit} rollbacks in a row did not help ({request.reason.replace('_', ' ')} "
                f"again at step {request.trigger}); the snapshots and checkpoints from before it are intact. "
                "Fix the data or lower the learning rate, then resume",
                quiet=self._quiet,
            )


def read_skips(storage: Storage) -> list[int]:
    """The batches skipped by earlier rollbacks of this run (rank 0); [] when there were none."""
    if not storage.exists(SKIP_FILE):
        return []
    where = storage.display(SKIP_FILE)
    try:
        record = json.loads(storage.read(SKIP_FILE))
        if record.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} record")
        skipped = record["skipped"]
        if not all(isinstance(s, int) and s >= 0 for s in skipped):
            raise ValueError("skipped must list steps")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointCorruptError(f"{where} cannot be read ({exc}); move it aside to skip no batch") from exc
    return sorted(set(skipped))


def write_skips(storage: Storage, skipped: Iterable[int], request: RollbackRequest, to_step: int) -> None:
    """Record the skipped batches (rank 0), with this rollback appended to the history, atomically."""
    history: list[dict[str, object]] = []
    if storage.exists(SKIP_FILE):
        try:
            history = list(json.loads(storage.read(SKIP_FILE)).get("rollbacks", []))
        except (ValueError, AttributeError):
            history = []
    history.append({"reason": request.reason, "trigger": request.trigger, "to": to_step, "skip": request.skip})
    record = {"format": FORMAT, "version": 1, "skipped": sorted(set(skipped)), "rollbacks": history}
    layout.prepare_root(storage, create=True)  # the directory and its marker, if no checkpoint was written yet
    storage.write_bytes(SKIP_FILE, json.dumps(record, indent=1).encode())


def all_finite(optimizers: Iterable[torch.optim.Optimizer]) -> bool:
    """Whether every parameter of `optimizers` (this rank's shard of a sharded one) is finite: one read of them."""
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                t = p.detach()
                if sharded.is_dtensor(t):
                    t = t.to_local()
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    return False
    return True


class Rollback:
    """Carries out the rollbacks the ranks agreed on (the steps in the module docstring); collective."""

    def __init__(
        self,
        restorer: Restorer,
        checkpointer: Checkpointer,
        memory: MemoryTier | None,
        comm: Comm,
        events: EventLog,
        *,
        max_rollbacks: int,
    ) -> None:
        self._restorer = restorer
        self._checkpointer = checkpointer
        self._memory = memory
        self._comm = comm
        self._events = events
        self._cap = RollbackCap(max_rollbacks, quiet=comm.rank != 0)
        self.skips: set[int] = set()
        """Batches skipped after rollbacks: read from the record at the start, added to by each rollback."""

    def restore(
        self,
        request: RollbackRequest,
        step: int,
        *,
        loader_tracked: bool,
        diverged: ReplicaDivergenceError | None,
        on_start: Callable[[], None],
    ) -> Restored | None:
        """The state to go back to, with the newer snapshots and checkpoints abandoned and the batch recorded as
        skipped; None when there is none: a loss spike is then only reported, while non-finite parameters and
        diverged replicas (`diverged`) stop the job. `on_start`: called once a rollback is possible."""
        why = None
        if not loader_tracked:
            why = "the loader given to steps() is not tracked, so its position cannot go back"
        elif request.at_most < 0:
            why = "no state from before it exists"
        restored = None
        if why is None:
            on_start()
            self._cap.count(request)
            self._checkpointer.wait_durable()  # nothing is set aside while a save of it may still commit
            restored = self._restorer.rollback(request.at_most, lambda: self._abandon_after(request))
            if restored is None:
                why = f"no snapshot or checkpoint from step {request.at_most} or before"
        if restored is None:
            self._events.emit("rollback_impossible", step=step, reason=request.reason, why=why)
            if request.reason == "replica_divergence" and diverged is not None:
                raise diverged
            if request.reason == "nonfinite_parameters":
                raise NumericError(
                    f"parameters became non-finite by step {step} and the job cannot roll back: {why}",
                    quiet=self._comm.rank != 0,
                )
            if self._comm.rank == 0:
                print(f"stalwart: cannot roll back for the loss spike at step {step}: {why}", file=sys.stderr)
            return None
        if request.skip is not None:
            self.skips.add(request.skip)
            if self._comm.rank == 0:
                try:
                    write_skips(self._checkpointer.storage, self.skips, request, restored.step)
                except Exception as exc:  # this process still skips it; a restart from before it would not
                    self._events.emit("skip_record_failed", step=request.skip, error=first_line(exc))
        return restored

    def done(self, request: RollbackRequest, from_step: int, restored: Restored, seconds: float) -> None:
        """The state of `restored` is loaded: the event, and one line from rank 0."""
        self._events.emit(
            "rolled_back",
            step=restored.step,
            reason=request.reason,
            trigger=request.trigger,
            from_step=from_step,
            skip=request.skip,
            tier=restored.tier,
            source=restored.source,
            seconds=seconds,
        )
        if self._comm.rank == 0:
            skipping = f"; batch {request.skip} will be skipped" if request.skip is not None else ""
            print(
                f"stalwart: {request.reason.replace('_', ' ')} at step {request.trigger}: rolled back to step "
                f"{restored.step} from {restored.source}{skipping}",
                file=sys.stderr,
                flush=True,
            )

    def _abandon_after(self, request: RollbackRequest) -> None:
        """Invalidate the snapshots and set aside the checkpoints after `request.at_most` (every rank its own
        memory; rank 0 the durable ones), before the rollback loads anything."""
        if self._memory is not None:
            self._memory.forget_after(request.at_most)
        if self._comm.rank == 0:
            self._checkpointer.set_aside_after(request.at_most, f"rolled back for {request.reason}")
        self._comm.barrier()
