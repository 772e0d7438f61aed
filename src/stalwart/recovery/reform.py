"""L1, the worker's side: a survivor of a peer's failure leaves its process group and waits to re-form in place.

Under `stalwart run` every worker runs in a host process (supervisor/worker_host.py) that can run the training script
again. When a collective fails because a peer died, or the agent asks with REFORM_SIGNAL (a peer died or hung
while this worker was computing), the exception ends the script's run but not the process: the host calls
`abandon()`, which drops every live `stalwart.Job` without a collective (its persister is killed, which leaves an
unfinished save uncommitted, exactly as a dead worker's would), aborts every process group and frees their
memory. The host then tells its agent it is re-armed, the agent joins the next round of torch elastic's
rendezvous, and the host runs the script again with the new round's environment. Nothing is imported again and
the device context stays; the new Job agrees with its peers on the newest step it can restore and restores
it, so the interrupted step is redone and no finished step is lost.

What a survivor keeps: when its failed run's replicated parameters and optimizer state were not modified since
its last completed step (their version counters say so; a failure inside DDP's backward, before the optimizer
step, is the usual case), `abandon()` keeps references to them (`Stash`). The replacement rank then receives
them from the survivor by one broadcast, and the node memory tier only needs the small per-rank rest of the
state every step (a light snapshot) plus a full copy now and then (`JobConfig.replicated_snapshot_every`).

Why re-run the script rather than rewind inside it: the failure surfaces inside the user's loop body (DDP's
allreduce raises from `loss.backward()`), where no library code can catch it and go on. Running the user's
`main` again is what NVIDIA's in-process restart does too; here its cost is the script's set-up code, without
the interpreter start, the imports and the first-use costs that a new process pays.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import signal
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, Protocol

from stalwart.runtime.env import IN_LOOP_ENV
from stalwart.runtime.env import REFORM_ENV as REFORM_ENV

REFORM_SIGNAL: int = signal.SIGRTMIN + 4
"""Sent by the agent to a worker that must leave its group (a peer failed). A real-time signal, so that it meets
no handler of the user's (Slurm's warning signals are SIGUSR1/SIGUSR2, SIGTERM is a shutdown)."""


class ReformRequested(RuntimeError):
    """Raised in the main thread by REFORM_SIGNAL: a peer failed and this worker must re-form."""


class RunAgainInRound(ReformRequested):
    """A survivor that must run the script again in the round it has just been activated for, before it used the
    round (no process group of it made yet): its host runs the script again at once, without re-arming, so no other
    round of the rendezvous is needed (supervisor/worker_host.py)."""


class Abandonable(Protocol):
    def abandon(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Stash:
    """The replicated tensors (parameters, optimizer state) a survivor kept from its failed run, by checkpoint
    id, as they were after `step` completed; the next run hands them to every rank instead of reading a copy.
    `skeleton`: the replicated objects' state at that step with tensors as references (their non-tensor part,
    e.g. a scheduler's), when the job recorded it; restores take it instead of the light snapshot's."""

    step: int
    world_size: int
    tensors: dict[str, Any]
    skeleton: dict[str, Any] | None = None


class Survivor:
    """What a worker process keeps across its runs of the script and its re-formations, in one place: the live
    Jobs to drop when their group fails, the stash of live tensors, the way back to its agent, and the state of the
    agent's request to re-form (deferred from a step's commit point to its end, and whether one came meanwhile).
    One per process (`SURVIVOR`); the module's functions below are its methods, for the modules that call them."""

    def __init__(self) -> None:
        self._live: weakref.WeakSet[Abandonable] = weakref.WeakSet()
        self._stash: Stash | None = None
        self._rearm: Callable[[bool], None] | None = None
        self._deferring = False
        self._pending = False

    def keep(self, stash: Stash) -> None:
        self._stash = stash

    def stashed(self) -> Stash | None:
        return self._stash

    def drop_stash(self) -> None:
        """After a resume, the tensors belong to the new run's objects or were copied into them."""
        self._stash = None

    def register(self, job: Abandonable) -> None:
        """Called by every Job: `abandon()` drops it when its group fails."""
        self._live.add(job)

    def offer_rearm(self, rearm: Callable[[bool], None] | None) -> None:
        """The worker host's way back to its agent while the script runs (supervisor/worker_host.py):
        `rearm(parked)` says the worker left its failed group (or, `parked`, that a warm spare reached its loop),
        waits for the next activation and takes its environment. None: none."""
        self._rearm = rearm

    def can_rearm(self) -> bool:
        return self._rearm is not None

    def rearm(self, *, parked: bool = False) -> None:
        """Tell the agent this worker left its group and wait for the next round; os.environ is then that round's.
        `parked`: a warm spare reached its loop and waits to be given a rank (recovery/warm_spare.py)."""
        if self._rearm is None:
            raise RuntimeError("re-arming needs a worker host (stalwart run)")
        self._rearm(parked)

    def defer_requests(self) -> None:
        """From a step's commit point to its end (job/step_commit.py): every rank holds its snapshot of the step,
        so a survivor finishes the step (optimizer, scheduler, bookkeeping; no collective) and re-forms after it,
        with state that a replacement can match, instead of being interrupted half-way through its optimizer
        step. Also from the end of every step's loop body to its snapshot (job/completing.py): a survivor that has
        computed the step keeps it. Without that, once the agent learned of a death within milliseconds
        (supervisor/exit_watch.py), a survivor still finishing the step its dead peer had completed was
        interrupted and the step redone."""
        self._deferring = True

    def allow_requests(self) -> None:
        """End of the deferral: a request that came in the meantime is raised now."""
        self._deferring = False
        if self._pending:
            self._pending = False
            raise ReformRequested("the agent asked this worker to re-form: a peer failed")

    def _raise_reform(self, signum: int, frame: FrameType | None) -> None:
        if self._deferring:
            self._pending = True
            return
        raise ReformRequested("the agent asked this worker to re-form: a peer failed")

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """While the script runs, REFORM_SIGNAL raises ReformRequested in the main thread (at the next bytecode: a
        thread blocked in a collective gets there when the collective fails, as it does once the peer is gone)."""
        self._deferring = self._pending = False
        signal.signal(REFORM_SIGNAL, self._raise_reform)
        try:
            yield
        finally:
            ignore_requests()
            self._deferring = self._pending = False

    def abandon(self) -> int:
        """Drop every live Job and process group of this process without communicating; returns how many Jobs."""
        jobs = list(self._live)
        for job in jobs:
            with contextlib.suppress(Exception):
                job.abandon()
        self._live.clear()
        abort_process_groups()
        gc.collect()  # the failed run's model, optimizer and DDP buckets, before the next run allocates its own
        _release_device_memory()
        return len(jobs)


SURVIVOR = Survivor()
keep = SURVIVOR.keep
stashed = SURVIVOR.stashed
drop_stash = SURVIVOR.drop_stash
register = SURVIVOR.register
offer_rearm = SURVIVOR.offer_rearm
rearm = SURVIVOR.rearm
defer_requests = SURVIVOR.defer_requests
allow_requests = SURVIVOR.allow_requests
interruptible = SURVIVOR.interruptible
abandon = SURVIVOR.abandon


def enabled() -> bool:
    return os.environ.get(REFORM_ENV) == "1"


def in_loop() -> bool:
    """Whether a survivor re-forms inside its training loop (recovery/in_loop.py): re-forming is on, the worker
    runs in a host that can re-arm, and the launcher did not ask for re-running the script instead."""
    return enabled() and SURVIVOR.can_rearm() and os.environ.get(IN_LOOP_ENV, "1") == "1"


def is_reformable(exc: BaseException) -> bool:
    """True when `exc` (or what caused it) says a peer or the group is gone, not that this rank's code is wrong."""
    from stalwart.runtime.torch_compat import is_peer_failure

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ReformRequested) or is_peer_failure(current):
            return True
        current = current.__cause__ or current.__context__
    return False


def reason(exc: BaseException) -> str:
    """The first sentence, without gloo's source location: "Read error [127.0.0.1]:17032: Connection reset by
    peer" rather than the two lines of advice that follow it."""
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", str(exc).strip())
    return text.splitlines()[0].split(". ")[0] if text else type(exc).__name__


def _ignore(signum: int, frame: FrameType | None) -> None:
    pass


def ignore_requests() -> None:
    """Outside the script's run (warming up, waiting, abandoning) a request has nothing to interrupt."""
    signal.signal(REFORM_SIGNAL, _ignore)


def abort_process_groups() -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    from stalwart.runtime.torch_compat import abort_process_group

    with contextlib.suppress(Exception):
        if abort_process_group():  # NCCL needs it to unblock
            return
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _release_device_memory() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
