"""L1 inside the survivor's loop: a peer's failure costs the survivors the failure, not the user's set-up.

Under `stalwart run` a worker's default group is stalwart's re-formable one (runtime/group.py). When a peer dies:

1. the collective that meets the death (DDP's all-reduce inside `loss.backward()`) is absorbed: it completes
   without raising and the group records the failure; the agent's request to re-form (REFORM_SIGNAL) marks the
   group failed the same way instead of raising into the user's code;
2. the step's update is dropped: an optimizer pre-hook, registered before the numeric guard's, clears the
   gradients of a step whose group failed, so the parameters and the optimizer's state stay those of the last
   completed step (torch's optimizers skip parameters without a gradient), as the guard does for a non-finite step;
3. at the step boundary the job (`Job.steps`) leaves the failed group keeping its live state, tells its agent it
   re-armed and waits for the next round of the rendezvous in this process; the replacement's set-up runs
   meanwhile, its own collectives kept local until its state arrived (`ReformableGroup.join`);
4. the job re-forms: the next formation's group takes the new round (older group objects forward to it), the
   DDP modules get fresh reducers (`reset_ddp`), stalwart's parts are rebuilt, and the restore agrees on the step
   every rank can resume (the survivors' live state, broadcast to the replacement, plus every rank's light
   snapshot from node memory);
5. the step is redone with the same batch; the user's objects are the same Python objects throughout.

The script runs again (the fallback of recovery/reform.py) only when the failure cannot be absorbed: it surfaced
outside `job.steps()` (during the user's set-up, or after the loop), in a collective on another group (the user's
`dist.new_group`, a 2-D DeviceMesh's dimensions, or a group made before `stalwart.Job()`, which then never becomes
the re-formable one), or in the user's loop body as something else than a collective (an exception the job
cannot see past).
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from stalwart.recovery import ddp_layout, reform
from stalwart.recovery.in_loop import survivor
from stalwart.runtime import group as reformable
from stalwart.runtime.dist import Comm
from stalwart.runtime.process import say
from stalwart.runtime.signal_watch import SignalWatch
from stalwart.runtime.torch_compat import live_ddp_modules, register_first_step_pre_hook


class GroupFailed(reform.ReformRequested):
    """The step's group failed before its update (a peer died, or the agent asked): raised at the step boundary,
    never to the user."""


class NothingToGoBackTo(reform.ReformRequested):
    """A survivor past step 0 re-formed and the job found no state to resume from (a failure before the first
    snapshot or checkpoint): it cannot undo its own steps in place, so it leaves its loop and its host runs the
    script again, from the user's own initial state (recovery/reform.py). Its peers meet its leaving as a failure
    and re-form with it."""


class NewWorldForShards(reform.RunAgainInRound):
    """The job re-formed at another world size and holds sharded state that cannot be sharded again in place (FSDP2
    modules are, in the survivor's process: in_loop/driver.py and runtime/torch_compat_fsdp.py; not modules wrapped
    together, HSDP or tensor parallelism): its modules are built on the old device mesh, so the survivor leaves its
    loop and its host runs the script again, whose set-up builds them at the new size; the restore then reshards the
    state (from node memory where every old rank's snapshot is held, else from the durable checkpoint). Every rank
    holds the same model and sees the same new size, so all of them run it again, in the round they were activated
    for (raised before any of them made its group)."""


@dataclass(frozen=True, slots=True)
class Grow:
    """The job grows back after training on shrunk: the survivors are at `step`; `source`, the lowest of them,
    hands its state to the `receivers` (recovery/restore.Restorer.hand_over)."""

    step: int
    source: int
    receivers: tuple[int, ...]


class InLoop:
    """The job's side of re-forming inside its loop; see the module docstring."""

    def __init__(self, group: reformable.ReformableGroup) -> None:
        self.grow: Grow | None = None
        self.joined_late = False
        """This rank joined peers that stayed in their loop (a replacement) at the newest formation."""
        self.shrink_refused: str | None = None
        """Set by a driver of the step protocol whose loop is not known to grow back after training on shrunk: why
        the survivors wait for the replacement instead (recovery/in_loop/driver.py says it on the console)."""
        self._group = group
        self._handles: list[Any] = []
        self._decided: bool | None = None  # this step's update: None (no optimizer step yet), True (kept), False
        self._watch = SignalWatch(reform.REFORM_SIGNAL, self._fail_on_request)

    @property
    def group(self) -> reformable.ReformableGroup:
        """The newest formation's group (a re-formation makes a new one, runtime/group.py)."""
        return self._group.latest()

    @classmethod
    def of_process(cls) -> InLoop | None:
        """The process's re-formable group when it is the default one and the worker can re-arm in place."""
        group = reformable.current()
        if group is None or not survivor.in_loop() or dist.group.WORLD is not group:
            return None
        return cls(group)

    def start(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Arm the pre-hooks (before any other: the guard must not judge a failed step's partial gradients) and
        turn the agent's request to re-form into a failed group."""
        self.close()
        for opt in optimizers:
            self._handles.append(register_first_step_pre_hook(opt, self._before_optimizer_step))
        signal.signal(reform.REFORM_SIGNAL, self._asked)
        # The same request, seen by a thread while the main thread waits in C++ (DDP's reducer), where the
        # handler above cannot run: the group fails and its pending collectives complete (runtime/signal_watch.py).
        self._watch.start()
        self.group.absorb_failures(True)

    def stop(self) -> None:
        """The training loop is over: failed collectives raise again (the user's code after the loop)."""
        self._watch.close()
        self.group.absorb_failures(False)

    def _asked(self, signum: int, frame: FrameType | None) -> None:
        self._fail_on_request()

    def _fail_on_request(self) -> None:
        self.group.fail("the agent asked this worker to re-form: a peer failed")

    def arm(self) -> None:
        """A step's loop body starts."""
        self._decided = None

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The first optimizer step of a step decides for all of them: its update is dropped if the group has
        failed by then, and kept otherwise (a failure after it does not split the step's optimizers)."""
        if self._decided is None:
            self._decided = self.group.failed is None
        if self._decided:
            return
        for param_group in optimizer.param_groups:
            for p in param_group["params"]:
                p.grad = None

    def lose(self, exc: BaseException, optimizer: torch.optim.Optimizer) -> None:
        """A peer's failure met by stalwart's own collective inside the optimizer step (the commit point's barrier,
        job/step_commit.py) before the update: the group is failed and the update dropped, as if the failure had
        been met first by the step's all-reduce."""
        self.group.absorb(exc)
        self._decided = False
        self._before_optimizer_step(optimizer, (), {})

    def update_dropped(self) -> bool:
        """Whether this step's update is dropped: the group failed before it (or before a step without one). The
        step's end then re-forms and the step is redone (`check`)."""
        return self.group.failed is not None and not self._decided

    def consequence(self, exc: Exception) -> Exception | None:
        """The failure to recover from when the step's body raised `exc` after a peer's failure was absorbed in it:
        the collectives it computed with left their tensors as they were (an all-gather's output unwritten, a
        reduction partial), so what it raised on (a loss check's non-finite value) is the failure's consequence,
        not a fault of this rank. None when the group has not failed. A fault that is this rank's own raises again
        when the step is run again."""
        failed = self.group.failed
        if failed is None:
            return None
        consequence = GroupFailed(f"{reform.reason(failed)} (then: {type(exc).__name__}: {reform.reason(exc)})")
        consequence.__cause__ = failed
        return consequence

    def check(self) -> None:
        """At the step boundary: raise GroupFailed when the group failed before the step's update (or in a step
        without one), so the step is redone. A failure after the update leaves the step complete: the step's end
        meets it in its own collectives, or the next step does at its first one."""
        failed = self.group.failed
        if failed is not None and self.update_dropped():
            raise GroupFailed(reform.reason(failed)) from failed

    def join_if_peers_stayed(self, comm: Comm, *, staying: bool, grown_at: int | None = None) -> None:
        """A new worker whose peers stayed in their loop (a replacement) joins quietly until its state arrived
        (`ReformableGroup.join`). Collective: every rank says whether it stayed, when its Job is made or re-formed,
        and, a survivor that trained on shrunk (recovery/shrink.py), the step it reached (`grown_at`): the job then
        grows back at that step (`grow`)."""
        said = comm.all_gather_ints([int(staying), -1 if grown_at is None else grown_at])
        stayed = any(v[0] for v in said)
        self.joined_late = stayed and not staying
        self.group.join(self.joined_late)
        grown = [(rank, v[1]) for rank, v in enumerate(said) if v[0] and v[1] >= 0]
        self.grow = Grow(grown[0][1], grown[0][0], tuple(r for r, v in enumerate(said) if not v[0])) if grown else None

    def joined(self, comm: Comm) -> None:
        """The job has its state: a replacement's collectives run for real from now on, and every rank's DDP
        modules take the survivors' bucket layout (collective: recovery/ddp_layout.py)."""
        self.group.join(False)
        ddp_layout.share(comm, self.group)

    def quiet_until_step(self, quiet: bool) -> None:
        """A replacement whose loop makes collectives of its own before its first step (a Trainer's barriers and
        broadcasts at its loop's start, which the survivors made long ago): they run as while joining (locally),
        until its first step's body begins (`quiet` False). Nothing on a rank that did not join late."""
        if self.joined_late:
            self.group.join(quiet)

    def leave(self, rank: int, why: str) -> None:
        """Leave the failed group and wait for the next round: every process group is aborted (the re-formable
        group's objects forward to the next formation's), the agent learns this worker re-armed, and os.environ
        becomes the new round's."""
        say(f"stalwart: rank {rank}: {why}; re-forming in place, inside the training loop")
        self.close()
        self.group.abort_backends()
        reform.abort_process_groups()
        survivor.rearm()

    def rejoin(self) -> int:
        """After the group took the new round's backends: fresh reducers for the DDP modules on it; returns how
        many. They are found among all live objects, not among the tracked ones: a job tracks the module DDP
        wraps as often as the wrapper (its state_dict has no "module." prefix), and a replacement's new DDP
        must meet every survivor's DDP in the same state."""
        group = self.group
        ours = [
            m for m in live_ddp_modules() if isinstance(getattr(m, "process_group", None), reformable.ReformableGroup)
        ]
        ours = [m for m in ours if m.process_group.latest() is group]  # type: ignore[attr-defined]
        for m in ours:  # their rebuilt layouts, which every rank's take once it has its state (`joined`)
            ddp_layout.keep(m)
        return sum(ddp_layout.reset_ddp(m, group) for m in ours)

    def close(self) -> None:
        self._watch.close()
        for handle in self._handles:
            handle.remove()
        self._handles = []
