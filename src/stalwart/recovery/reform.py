"""L1, the worker's side: a survivor of a peer's failure leaves its process group and waits to re-form in place;
what the fallback (the script run again in the same process) shares with in-loop recovery (recovery/in_loop/).

Under `stalwart run` every worker runs in a host process (supervisor/worker_host.py) that can run the training script
again. When a collective fails because a peer died, or the agent asks with REFORM_SIGNAL (a peer died or hung while this
worker was computing), the exception ends the script's run but not the process: the host calls `abandon()`
(recovery/in_loop/survivor.py), which drops every live `stalwart.Job` without a collective (its persister is killed,
which leaves an unfinished save uncommitted, exactly as a dead worker's would), aborts every process group and frees
their memory. The host then tells its agent it is re-armed, the agent joins the next round of torch elastic's
rendezvous, and the host runs the script again with the new round's environment. Nothing is imported again and the
device context stays; the new Job agrees with its peers on the newest step it can restore and restores it, so the
interrupted step is redone and no finished step is lost.

What a survivor keeps: when its failed run's replicated parameters and optimizer state were not modified since its last
completed step (their version counters say so; a failure inside DDP's backward, before the optimizer step, is the usual
case), `abandon()` keeps references to them (`Stash`). The replacement rank then receives them from the survivor
(through node memory on one node, recovery/node_handover.py; else by one broadcast), and the node memory tier only needs
the small per-rank rest of the state every step (a light snapshot) plus a full copy now and then
(`JobConfig.replicated_snapshot_every`).

Why re-run the script rather than rewind inside it: the failure surfaces inside the user's loop body (DDP's allreduce
raises from `loss.backward()`), where no library code can catch it and go on. Running the user's `main` again is what
NVIDIA's in-process restart does too; here its cost is the script's set-up code, without the interpreter start, the
imports and the first-use costs that a new process pays.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from types import FrameType
from typing import Protocol

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


def enabled() -> bool:
    return os.environ.get(REFORM_ENV) == "1"


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


def release_device_memory() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
