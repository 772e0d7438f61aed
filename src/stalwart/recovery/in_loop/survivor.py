"""What a worker process keeps across its runs of the script and its re-formations, in one owner (`Survivor`).

The live Jobs to drop when their group fails, the stash of live tensors a survivor hands to a replacement, the
worker host's way back to its agent, and the state of the agent's request to re-form (REFORM_SIGNAL: deferred from
a step's commit point to its end, and whether one came meanwhile). One per process, `SURVIVOR`; the functions below
are its methods, for the modules that call them. recovery/reform.py says why a survivor keeps its process.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

from stalwart.recovery.reform import (
    REFORM_SIGNAL,
    Abandonable,
    ReformRequested,
    abort_process_groups,
    enabled,
    ignore_requests,
    release_device_memory,
)
from stalwart.runtime.env import IN_LOOP_ENV
from stalwart.runtime.torch_compat_groups import forget_sharding_caches


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
        forget_sharding_caches()  # the next run may hold another rank in meshes equal to this run's
        gc.collect()  # the failed run's model, optimizer and DDP buckets, before the next run allocates its own
        release_device_memory()
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


def in_loop() -> bool:
    """Whether a survivor re-forms inside its training loop (recovery/in_loop/): re-forming is on, the worker
    runs in a host that can re-arm, and the launcher did not ask for re-running the script instead."""
    return enabled() and SURVIVOR.can_rearm() and os.environ.get(IN_LOOP_ENV, "1") == "1"
