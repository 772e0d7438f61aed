"""The commit point of a step under light memory snapshots: taken at the optimizer step, behind a barrier.

Why: a full memory snapshot copies the whole training state every step (a tenth of a step of the recovery bench
job, docs/benchmarks.md). Under re-forming (L1) the survivors of a failure keep the replicated state
(parameters, optimizer state) in their own memory, so each step only the small per-rank rest needs a copy (a
light snapshot, see checkpoint/tiers/memory.py). That is sound only if, whenever a survivor's parameters reach step
N+1, every rank holds a light snapshot of step N+1. Taken at the end of the step, it is not: a rank that dies
after the step's last collective lets its peers finish the step while its own snapshot of N+1 never happens, and
the restart falls back to the last full copy, up to `replicated_snapshot_every` steps back.

The commit point closes that window. A pre-hook on the replicated optimizers takes the light snapshot of step
N+1 before the optimizer changes anything, sends it to the rank's peer replicas on other nodes (L3,
checkpoint/tiers/replicas.py), then waits on a barrier of every rank (a shared page when all are on one node,
runtime/local_barrier.py; else stalwart's own gloo group). No rank changes its parameters before every rank
holds its snapshot of N+1, and every peer replica too: a rank that dies before the barrier
leaves its peers at step N (their barrier fails, their optimizer has not run), one that dies after it has left
its snapshot.

The snapshot is taken before the rest of the step runs (an LR scheduler's step, logging). Replicated objects are
restored from the survivor, non-tensor state included (a scheduler of a replicated optimizer is replicated by
default), so only per-rank state (per-rank objects, the RNG) must be final at the optimizer step. The end of
every step checks that it was: if it changed after the optimizer step, light snapshots are turned off for the
rest of the run (a `light_snapshots_off` event) and every snapshot is full again. Such a change can be one
rank's own (rank 0 alone drawing random numbers for an evaluation): that rank then still meets the others at the
next commit point's barrier, once, with a flag that turns light snapshots off on every rank at the same step
(a rank that just stopped coming would leave the others waiting). The one step in which that is
first seen is exposed: a rank dying in it between the barrier and the end of the step would be restored with
its per-rank state of the optimizer step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from stalwart.checkpoint.tiers.memory import MemoryTier
from stalwart.job.state import TrackedState
from stalwart.job.step_hooks import StepHooks
from stalwart.recovery import reform
from stalwart.recovery.in_loop import survivor
from stalwart.telemetry.events import EventLog


class StepCommit:
    """Takes each step's light snapshot at its optimizer step, then waits for every rank to have done so."""

    def __init__(
        self,
        memory: MemoryTier,
        state: TrackedState,
        barrier: Callable[[int], tuple[float | None, int]],
        *,
        events: EventLog,
        hooks: StepHooks,
        push: Callable[[int], None],
        absorb: Callable[[BaseException, Any], None] | None = None,
    ) -> None:
        """`state`: the job's tracked state, whose replicated optimizers get the pre-hook; `barrier`: every rank's,
        carrying a flag (Snapshots._commit_barrier); `push`: sends the light snapshot of a step to the peer
        replicas (L3); `absorb(exc, optimizer)`: a survivor staying in its loop (recovery/in_loop/) takes a peer's
        failure at the barrier and drops the step's update, instead of it being raised into the user's optimizer
        step."""
        self._absorb = absorb
        self._memory = memory
        self._state = state
        self._barrier = barrier
        self._events = events
        self._hooks = hooks
        self._replicated = state.replicated
        self._push = push
        optimizers = state.optimizers(replicated_only=True)
        self._handles = [opt.register_step_pre_hook(self._before_optimizer_step) for opt in optimizers]
        self._step = -1  # completed steps while armed; -1: not inside an armed step
        self._live: frozenset[int] = frozenset()
        self._committed = -1  # the step whose snapshot the last commit took
        self._rank_state: Any = None
        self.seconds = 0.0
        self.off: str | None = None
        self._told = False  # whether the other ranks know this rank's light snapshots are off
        self.agreed_off = False
        """Whether every rank knows light snapshots are off: set at the commit point where they learn it. Until
        then a rank whose own check turned them off still counts them on in decisions taken in a collective."""

    def arm(self, step: int, live: frozenset[int]) -> None:
        """The step after `step` completed steps is starting; `live` are the data pointers a survivor keeps."""
        self._step, self._live, self.seconds = step, live, 0.0

    def disarm(self) -> None:
        self._step = -1

    def forget(self) -> None:
        """The job rolled back (recovery/rollback.py): the last commit's snapshot belongs to an abandoned history."""
        self._committed = -1

    def committed(self, step: int) -> bool:
        """Whether the commit point of the step that made `step` completed steps ran."""
        return self._committed == step

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._step < 0 or self._committed == self._step + 1:
            return  # not inside an armed step, or a second optimizer of the same step
        step = self._step + 1
        self._hooks.in_optimizer(self._step, "before_snapshot")
        if self.off is not None:
            if not self._told:  # the other ranks are still committing: meet them once, saying so
                self._told = True
                if not self._meet(1, optimizer):
                    return
                self.agreed_off = True
            self._committed = step
            self._hooks.in_optimizer(self._step, "after_barrier")
            return
        started = time.perf_counter()
        state = self._state.per_rank(step)
        if self._memory.snapshot_light(step, state, self._state.replicated_states, self._live) is None:
            state = self._state.state(step)  # a replicated tensor is not live (a buffer): the whole light snapshot
            self._memory.snapshot(step, state, self._replicated, live=self._live)
        # The RNG part as captured: capture_rng's tensors are never written in place, and an unchanged generator
        # gives the same tensor again, which check() then passes at a glance.
        self._rank_state = {"objects": _copy(self._per_rank(state)["objects"]), "rng": state["rng"]}
        self._committed = step
        self._push(step)  # to the peer replicas on other nodes (L3), before any rank's parameters move
        work = time.perf_counter() - started
        met = self._meet(0, optimizer)  # a peer is gone: this rank's parameters then stay at step N
        if met is None:
            return
        cost, peer_off = met
        survivor.defer_requests()  # committed: finish the step before re-forming (the job allows them at its end)
        if peer_off and self.off is None:  # another rank turned light snapshots off: all do, at the same step
            self.off = "another rank's per-rank state changed after the optimizer step"
            self._told = True
            self._events.emit("light_snapshots_off", step=step, reason=self.off)
        if peer_off:
            self.agreed_off = True
        # A barrier that knows its own cost (the ranks' skew is not: the next collective would wait for it too)
        self.seconds += work + (time.perf_counter() - started - work if cost is None else cost)
        self._hooks.in_optimizer(self._step, "after_barrier")

    def _meet(self, flag: int, optimizer: Any) -> tuple[float | None, int] | None:
        """The barrier; None when a peer's failure met there was absorbed (the update is then dropped)."""
        try:
            return self._barrier(flag)
        except Exception as exc:
            if self._absorb is None or not reform.is_reformable(exc):
                raise
            self._absorb(exc, optimizer)
            return None

    def check(self, state: dict[str, Any]) -> bool:
        """After the end-of-step snapshot of a committed step: whether the per-rank state it took at the
        optimizer step is still the state now. If not, light snapshots are turned off (and False returned)."""
        changed = _first_difference(self._rank_state, self._per_rank(state))
        self._rank_state = None
        if changed is None:
            return True
        self.off = f"per-rank state changed after the optimizer step ({changed})"
        self._events.emit("light_snapshots_off", step=state["step"], reason=self.off)
        return False

    def _per_rank(self, state: dict[str, Any]) -> dict[str, Any]:
        objects = {n: v for n, v in state["objects"].items() if n not in self._replicated}
        return {"objects": objects, "rng": state["rng"]}

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _copy(value: Any) -> Any:
    """A copy that later in-place writes cannot change (tensors cloned, containers rebuilt)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return type(value)((k, _copy(v)) for k, v in value.items())
    if isinstance(value, list | tuple):
        return type(value)(_copy(v) for v in value)
    return value


def _first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where `a` and `b` differ first (a readable path), or None if they are equal, tensors bitwise."""
    if a is b:
        return None
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.detach().cpu(), b.detach().cpu())
        )
        return None if same else path or "a tensor"
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return path or "the keys"
        for key in a:
            found = _first_difference(a[key], b[key], f"{path}/{key}" if path else str(key))
            if found is not None:
                return found
        return None
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if type(a) is not type(b) or len(a) != len(b):
            return path or "a sequence"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = _first_difference(x, y, f"{path}/{i}")
            if found is not None:
                return found
        return None
    return None if type(a) is type(b) and a == b else path or "a value"
