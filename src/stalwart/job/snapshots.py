"""A job's memory snapshots: when a full copy is due, light snapshots every step and their commit point, publishing
a copy left running, the peer replicas, and what a survivor keeps of its live state.

Full copies go into node memory (checkpoint/tiers/memory.py) on the schedule of policy/snapshot.py, within a cost
budget. Under re-forming with more than one rank, light snapshots copy only the per-rank state every step, taken
at the optimizer step behind a barrier (job/step_commit.py), while the replicated state stays live with the
survivors (job/live.py); their own cost is judged against `light_snapshot_budget` and they are turned off, on
every rank at the same step, if it is exceeded. Decisions that must be alike on every rank are taken from costs
agreed at their largest (job/messages.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from stalwart.checkpoint.format.serialize import flatten
from stalwart.checkpoint.manager import Checkpointer
from stalwart.checkpoint.save.overlap import UpdateFence
from stalwart.checkpoint.tiers.memory import MemoryTier
from stalwart.checkpoint.tiers.replicas import PeerReplicas
from stalwart.job.config import SnapshotOptions
from stalwart.job.live import LiveState
from stalwart.job.messages import Durations, PlanInputs, to_us
from stalwart.job.state import TrackedState
from stalwart.job.step_commit import StepCommit
from stalwart.job.step_hooks import StepHooks
from stalwart.policy.snapshot import LightCost, SnapshotSchedule, full_copy_budget
from stalwart.recovery import reform
from stalwart.recovery.in_loop import survivor
from stalwart.runtime.dist import Comm, Flag
from stalwart.runtime.local_barrier import LocalBarrier
from stalwart.telemetry.events import EventLog


class Snapshots:
    """The memory tier's schedule and commit point for one job; inert without a memory tier."""

    def __init__(
        self,
        options: SnapshotOptions,
        memory: MemoryTier | None,
        state: TrackedState,
        checkpointer: Checkpointer,
        comm: Comm,
        events: EventLog,
        hooks: StepHooks,
        *,
        token: str,
        barrier_timeout_s: float,
        local_world_size: int,
        absorb: Callable[[BaseException, Any], None] | None = None,
    ) -> None:
        """`absorb`: takes a peer's failure at the commit point's barrier instead of raising it into the user's
        optimizer step (recovery/in_loop/), see StepCommit."""
        self._absorb = absorb
        self._options = options
        self.memory = memory
        self._state = state
        self._checkpointer = checkpointer
        self._comm = comm
        self._events = events
        self._hooks = hooks
        self._token = token
        self._barrier_timeout_s = barrier_timeout_s
        self.replicas = PeerReplicas(memory, comm, events, options.peer_replicas, local_world_size)
        self.fence: UpdateFence | None = None  # set by the job on a GPU: optimizer steps wait for copies left running
        self.reform = memory is not None and reform.enabled()
        self.live = LiveState(comm.rank)  # what a survivor keeps: live tensors' versions, skeleton
        self.commit: StepCommit | None = None  # light snapshots' commit point at the optimizer step
        self._local_barrier: LocalBarrier | None = None  # its barrier when every rank is on this node
        self._commits = 0  # commit points started (each names its own barrier)
        self.schedule = SnapshotSchedule(self._fixed_every(), options.budget, 0)
        self._light_cost = LightCost(options.light_budget)
        self._light_kept = False  # whether light snapshots were judged and kept (one event says so)
        self.seconds = 0.0  # the last snapshot's cost on the training thread (step_done's snapshot_s)
        self._late_s = 0.0  # what publishing an overlapped snapshot cost at the next step's end
        self._agreement_s = 0.0  # the last plan's collective, counted in the next full copy's cost (`_plan`)
        self._push_at_publish: int | None = None  # the full snapshot the peers get at the next step's end
        self.full_copy_step: int | None = None  # the newest full copy in node memory (step_done reports it)

    # -- what is wanted ---------------------------------------------------------------------------------------

    def light_wanted(self, *, agreed: bool = False) -> bool:
        """Light snapshots: asked for, under re-forming, and not turned off by the commit point's check (with
        `agreed`: not known to every rank to be off)."""
        commit = self.commit
        off = commit is not None and (commit.agreed_off if agreed else commit.off is not None)
        every = self._options.replicated_every
        auto = self._options.every == "auto" and self._comm.world_size > 1
        asked = auto if every == "auto" else int(every) > 1
        return self.reform and asked and not off

    def light_always(self) -> bool:
        """A light snapshot every step, full copies on the budgeted schedule: replicated_snapshot_every="auto"
        where light snapshots work (a commit point exists: CPU replicated state under re-forming)."""
        return self._options.replicated_every == "auto" and self.commit is not None and self.light_wanted()

    def _light_agreed(self) -> bool:
        """light_always() as every rank knows it, for decisions taken in a collective: a rank whose own check
        turned light snapshots off tells the others only at the next commit point (job/step_commit.py)."""
        return self._options.replicated_every == "auto" and self.commit is not None and self.light_wanted(agreed=True)

    def _fixed_every(self) -> int | None:
        """The fixed snapshot interval, or None for the budgeted one. Under light snapshots with a fixed
        replicated_snapshot_every, full copies are counted in snapshots, so "auto" means every step; under
        "auto" ones (light_always), the schedule is that of the full copies."""
        every = self._options.every
        if every == "auto":
            return 1 if self._options.replicated_every != "auto" and self.light_wanted() else None
        return max(int(every), 1)  # 0: no memory tier, so no snapshot is ever due

    def _full_budget(self) -> float:
        """Under light snapshots every step, full copies only matter when no rank survives: what light snapshots
        leave of the budget, at least a quarter of it (policy/snapshot.full_copy_budget)."""
        if not self.light_always():
            return self._options.budget
        return full_copy_budget(self._options.budget, None, 0.0)

    # -- the run ------------------------------------------------------------------------------------------------

    def start(self, step: int) -> None:
        """At the start of `steps()`, with the state of `step` loaded."""
        if self.light_wanted():
            self.read_live(step, fresh=True)
            self._start_commit()
        self.schedule = SnapshotSchedule(self._fixed_every(), self._full_budget(), step)
        self._light_cost = LightCost(self._options.light_budget)

    def _start_commit(self) -> None:
        """The commit point at the replicated optimizers' step (job/step_commit.py); without live tensors (CUDA
        parameters, which are not version-checked) there is nothing for a survivor to keep and no light mode."""
        if self.memory is None or not self.live.held or not self._state.optimizers(replicated_only=True):
            return
        self.commit = StepCommit(
            self.memory,
            self._state,
            self._commit_barrier(),
            events=self._events,
            hooks=self._hooks,
            push=lambda step: self.replicas.push(step, light=True),
            absorb=self._absorb,
        )

    def _commit_barrier(self) -> Callable[[int], tuple[float | None, int]]:
        """The commit point's barrier, carrying a flag (the largest any rank brought comes back to all): through
        a shared page when every rank is on this node (a gloo barrier costs milliseconds of thread hand-offs,
        runtime/local_barrier.py), else a gather on stalwart's gloo group (its cost unknown: None)."""
        memory = self.memory
        if memory is None or memory.local_world_size != self._comm.world_size:
            return lambda flag: (None, max(m.value for m in self._comm.gather(Flag(flag))))
        self._commits += 1
        self._local_barrier = LocalBarrier(
            memory.directory,
            f"{self._token}-{self._commits}",
            memory.local_rank,
            memory.local_world_size,
            self._barrier_timeout_s,
        )
        return self._local_barrier.wait

    def arm(self, step: int, first: bool) -> None:
        """Before the loop body of the step after `step`: the commit point takes its light snapshot at the
        optimizer step if one is due (not in the first step after a start: it may create optimizer state)."""
        if self.commit is not None and not first and (self.light_always() or self.schedule.due(step + 1)):
            self.commit.arm(step, self.live.key)

    def disarm(self) -> None:
        if self.commit is not None:
            self.commit.disarm()

    def at_step_end(self, step: int) -> float:
        """Under light snapshots, read the live tensors' versions and the replicated objects' skeleton of the step
        just completed (job/live.py); returns the seconds it took (part of a light snapshot's cost).

        Read first thing after the loop body, before any collective of the step's end (the replica divergence
        check, the loss-spike vote, the save's vote): a survivor whose peer died after the step's commit point
        fails in the first of those with its parameters already at the new step, and keeps them for the
        replacement only if their versions were read at that step (a kill landing after those collectives
        found the versions of the step before and kept nothing; docs/benchmarks.md)."""
        if not self.light_wanted():
            return 0.0
        started = time.perf_counter()
        self.read_live(step)
        return time.perf_counter() - started

    def read_live(self, step: int, *, fresh: bool = False) -> None:
        """The live tensors' versions and the replicated objects' skeleton (their non-tensor state: a
        scheduler's epoch, the optimizer's hyperparameters) at the completed step: a survivor hands both over
        with its live tensors (see job/step_commit.py)."""
        self.live.read(self._state.objects, self._state.replicated, fresh=fresh)
        self.live.remember(step, self._state.objects, self._state.replicated)

    def publish(self) -> None:
        """At the step's end after a full snapshot under overlap (on a GPU), on every rank alike: the snapshot is
        valid from now on if its copy was left running (it ran under this step, whose optimizer step waited for
        it), and only now does it go to the peer replicas, whether or not this rank's copy was left running (the
        push is a collective; a rank's slots start overlapping once its own thread has registered them). What
        this costs counts towards the snapshot's cost at the next plan: the wait here, the push, and how long
        this step's optimizer step waited for the copy on the GPU (timed by the fence; a checkpoint's copy
        running at the same time is counted in with it)."""
        memory = self.memory
        push, self._push_at_publish = self._push_at_publish, None
        if memory is None or (memory.running is None and push is None):
            return
        started = time.perf_counter()
        step = push if push is not None else -1  # a snapshot whose copy ended inside snapshot()
        if memory.running is not None:
            published = memory.publish()
            if published is not None:
                self.full_copy_step = published
            step = published if published is not None else -1  # given up: an empty image
        if push is not None:
            self.replicas.push(step, light=False)
        stalled = self.fence.take_stall_s() if self.fence is not None else 0.0  # the optimizer step's wait
        self._late_s += time.perf_counter() - started + stalled

    def take(self, step: int, live_s: float) -> None:
        """At the step's end (every rank, the same steps): a snapshot if one is due, then the next one's plan."""
        full_due = self.schedule.due(step)
        if self.memory is None or not (full_due or self.light_always()):
            return
        started = time.perf_counter()
        self._snapshot(step, full_due, live_s)
        if full_due:  # every rank, at the same steps: the plan is agreed in a collective
            self._plan(step, time.perf_counter() - started)
        elif self._light_agreed() and self._light_cost.first_judgment():  # the same step on every rank
            self._judge_light(step)

    def _snapshot(self, step: int, full_due: bool, versions_s: float) -> None:
        """Copy the state into node memory: light every time under re-forming (the live tensors stay with the
        survivors) with a full copy when one is due (`full_due` under "auto" light snapshots, else every
        `replicated_snapshot_every` snapshots), or full every time without re-forming.

        A light snapshot's cost, as the budget judges it, is all that light snapshots add to a step: the commit
        point's part, and at the step's end reading the live tensors' versions (`versions_s`), the state, the
        check and the survivor's skeleton."""
        memory = self.memory
        assert memory is not None
        began = time.perf_counter()
        replicated = self._state.replicated
        if self.light_always():
            light = self.live.held
            full = not light or full_due
        else:
            fixed = self._options.replicated_every
            snapshot_every = self.schedule.interval  # fixed under light snapshots (see _fixed_every)
            every = (fixed if isinstance(fixed, int) else 1) * snapshot_every
            light = self.light_wanted() and every > snapshot_every and self.live.held
            full = not light or step % every == 0
        # The whole state only when something copies it; a light step's end reads the per-rank part and the
        # replicated objects' skeleton alone (job/live.py).
        state = self._state.state(step) if full or not light else None
        seconds = 0.0
        push = "full" if full else ""  # which image goes to the peer replicas (L3): the one this step relies on
        if light:
            live = self.live.key
            commit = self.commit
            if commit is not None and commit.committed(step):
                # Taken (and sent to the replicas) at the optimizer step; it stands if the per-rank state has not
                # changed since.
                push = ""
                if not commit.check(state if state is not None else self._state.per_rank(step)):
                    state = state if state is not None else self._state.state(step)
                    for _ in range(2):  # it changed: overwrite both light slots, and copy in full
                        memory.snapshot(step, state, replicated, live=live)
                    full, push = True, "full"
                seconds = commit.seconds
            else:
                state = state if state is not None else self._state.state(step)
                memory.snapshot(step, state, replicated, live=live)
                push = "light"
            seconds += versions_s + time.perf_counter() - began
            self._light_cost.observe(seconds)
        if full:
            assert state is not None
            if self.fence is not None:
                self.fence.take_stall_s()  # what it timed so far belongs to checkpoints, not to this snapshot
            seconds += memory.snapshot(step, state, replicated)[0]
            if memory.running is None:
                self.full_copy_step = step
            if push == "full" and self.fence is not None:
                # Sent at the step's end once published, on every rank: whether its copy still runs differs
                # between ranks (each registers its slots with CUDA on its own thread), the push is a collective.
                push, self._push_at_publish = "", step
        if push:
            self.replicas.push(step, light=push == "light")
            seconds += self.replicas.seconds
        self.seconds = seconds

    def _plan(self, step: int, seconds: float) -> None:
        """After a snapshot that took `seconds` on the training thread (gathering the state, the copy, the
        replicas): the next one's step, from costs every rank agrees on (policy/snapshot.py), in one collective
        with the light snapshots' judgment. That collective is part of what full copies cost: with copies a few
        steps apart (a small state) it was most of it, outside the budget (2026-12-02: two collectives every
        3-5 steps at 0.1 s steps on 2 CPU ranks); it now counts in the next copy's cost."""
        seconds, self._late_s = seconds + self._late_s, 0.0  # the last one's publish, if any
        judge = self._light_agreed() and self._light_cost.judged()
        if not judge and self.schedule.every is not None:  # a fixed interval, nothing to judge: no collective
            self.schedule.taken(step, seconds, lambda step_s, snapshot_s: (step_s, snapshot_s))
            return
        started = time.perf_counter()
        mine = PlanInputs(
            to_us(self._light_cost.mine()), to_us(self.schedule.step_s()), to_us(seconds), to_us(self._agreement_s)
        )
        got = self._comm.gather(mine)
        self._agreement_s = time.perf_counter() - started
        light_s = max(m.light_us for m in got) / 1e6
        step_s = max(m.step_us for m in got) / 1e6
        # The last agreement's cost on the rank that came to it last (the least): the others' longer wait for it
        # is the ranks' skew, which the step's own collectives would have waited out anyway.
        snapshot_s = (max(m.snapshot_us for m in got) + min(m.agreement_us for m in got)) / 1e6
        if judge:
            self._judge_light(step, (light_s, step_s))
        decision = self.schedule.taken(step, seconds, lambda _step_s, _snapshot_s: (step_s, snapshot_s))
        if decision is not None and self._comm.rank == 0:
            self._events.emit("snapshot_interval", **dataclasses.asdict(decision))

    def full_copy_served(self, step: int) -> None:
        """After a durable checkpoint taken on every rank (a save's vote is agreed), under light snapshots: the
        checkpoint holds all a full copy would, for the one failure full copies are kept for, a failure that
        leaves no rank alive (whenever a rank survives, light snapshots and its live state serve). So the next
        full copy is due an interval after the checkpoint: with checkpoints more frequent than full copies, the
        state is no longer copied twice over in the same stretch of steps. Light snapshots' cost is judged here
        too (a collective at the same step on every rank), as it is at a full copy, so it is still measured
        while full copies wait. Only with a local checkpoint_dir: read back from object storage, a checkpoint is
        far slower than a full copy in node memory."""
        if self.memory is None or not self._light_agreed() or self._checkpointer.storage.local_path() is None:
            return
        if self._light_cost.judged():
            self._judge_light(step)
        if self._light_agreed():
            self.schedule.served(step)

    def _largest(self, first_s: float, second_s: float) -> tuple[float, float]:
        """Each of two durations at its largest over the ranks (one collective): what every rank's decisions are
        taken from, so that all decide alike."""
        got = self._comm.gather(Durations(to_us(first_s), to_us(second_s)))
        return max(m.first_us for m in got) / 1e6, max(m.second_us for m in got) / 1e6

    def _judge_light(self, step: int, agreed: tuple[float, float] | None = None) -> None:
        """Under "auto": keep light snapshots only while they cost at most `light_snapshot_budget`, decided
        alike on every rank from the largest light cost and step time (policy/snapshot.LightCost; `agreed`: those
        two as a collective already returned them); full copies get what they leave of it."""
        light_s, step_s = (
            agreed if agreed is not None else self._largest(self._light_cost.mine(), self.schedule.step_s())
        )
        if not self._light_cost.too_dear(light_s, step_s):
            self.schedule.budget = full_copy_budget(self._options.budget, light_s, step_s)
            if not self._light_kept and self._comm.rank == 0:  # once per run: what they cost and what they may
                self._events.emit(
                    "light_snapshots_kept",
                    step=step,
                    light_s=light_s,
                    step_s=step_s,
                    budget=self._light_cost.budget,
                    full_copy_budget=self.schedule.budget,
                )
            self._light_kept = True
            return
        assert self.commit is not None
        self.commit.agreed_off = True  # every rank decides this at the same step
        self.commit.off = (
            f"light snapshots cost {light_s * 1e3:.2f} ms per step of {step_s * 1e3:.1f} ms, over their budget "
            f"of {100 * self._light_cost.budget:g}%: full copies on the budget instead"
        )
        self.schedule.budget = self._options.budget
        self._events.emit(
            "light_snapshots_off",
            step=step,
            reason=self.commit.off,
            light_s=light_s,
            step_s=step_s,
            budget=self._light_cost.budget,
            full_copy_budget=self.schedule.budget,
        )

    def rolled_back(self, step: int) -> None:
        """After a rollback to `step`: the last commit's snapshot belongs to an abandoned history, the live
        state is that of `step`, and the next snapshot is due at once."""
        if self.commit is not None:
            self.commit.forget()
        if self.live.held:
            self.read_live(step, fresh=True)
        self.schedule.next_step = min(self.schedule.next_step, step + 1)

    def log_fields(self) -> dict[str, object]:
        """What a `step_done` event says of the snapshots."""
        if self.memory is None:
            return {}
        return {
            "snapshot_s": self.seconds,
            "snapshot_every": self.schedule.interval,
            "full_copy_step": self.full_copy_step,
        }

    def keep_live_state(self, step: int, outside_loop: str | None) -> str | None:
        """After a failure: keep references to the live tensors for the next run if they still hold `step`;
        returns None when kept, else why not (for the `reforming` event). `outside_loop`: why the job was not
        inside its training loop, if it was not."""
        if outside_loop is not None:
            return outside_loop
        if not self.light_wanted():
            return "light snapshots are off"
        if self.live.void is not None:
            return self.live.void
        versions = self.live.versions
        if not versions:
            return "no live tensors were read"
        state = self._state
        with contextlib.suppress(Exception):
            if self.live.unchanged(state.objects, state.replicated):
                # Only the replicated objects: their state_dict() is local (no collective with the lost peer).
                _, items = flatten({"objects": state.replicated_states()}, self._comm.rank, state.replicated)
                live = {i.id: i.tensor for i in items if i.id.startswith("R/") and i.tensor.data_ptr() in versions}
                got = self.live.skeleton
                skeleton = got[1] if got is not None and got[0] == step else None
                survivor.keep(survivor.Stash(step, self._comm.world_size, live, skeleton))
                return None
        if self.commit is not None and self.commit.committed(step + 1):
            # The next step's commit point ran and its optimizer step too: the step's tail (a scheduler, a
            # logging all-reduce) did not finish, so the replicated state is neither step's.
            return (
                f"the failure surfaced inside the loop body after the optimizer step of step {step + 1} (a "
                "collective after optimizer.step()): the live tensors hold neither that step nor the one before"
            )
        return f"the live tensors were written after the end of step {step}"

    def close_commit(self) -> None:
        if self.commit is not None:
            self.commit.close()
        if self._local_barrier is not None:
            self._local_barrier.close()
            self._local_barrier = None
