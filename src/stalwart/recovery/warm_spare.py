"""A warm spare: a process that ran the script's set-up before any rank failed, parked at `job.steps()`.

Why: a replacement started after a failure runs the script's whole set-up (imports, data indexing, the model built
and wrapped, compilation) while the survivors train on shrunk or wait; at scale that is minutes per failure. With
`stalwart run --spares N --warm-spares` the agent activates each spare with a worker's environment marked
WARM_SPARE_ENV before it is needed (supervisor/host_pool.py). Its `stalwart.Job()` makes a placeholder group
(collectives local, as for a replacement that joins late: recovery/in_loop/late_join.py), the script's set-up runs, and
`job.steps()` parks (`park`): the process tells its agent it is PARKED and waits. When a rank is lost, the agent
gives that rank's activation of the next round to a parked spare; `park` returns with os.environ that rank's, and
the Job joins the job's group as a late replacement does: the survivors hand over the live state at their next step
boundary, whatever the set-up costs.

What a script may not do before `job.steps()`: keep the rank it reads there in objects stalwart does not track. A
spare runs its set-up as the node's last local rank and may be given another. Tracked objects are safe: a
replacement takes its lost rank's own objects and generators from node memory (recovery/in_loop/late_join.py). A
`DistributedSampler(rank=...)`, a seed offset or a device index made from the rank are not; a spare that read its
rank (os.environ's RANK or LOCAL_RANK, `torch.distributed.get_rank()`) before its loop and is given another says so
in one line. The spare's run of the script is watched, and runs at idle CPU priority, from its first line
(supervisor/worker_host.py; `stalwart.Job()` too, outside a worker host).
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from stalwart.recovery.in_loop import survivor
from stalwart.runtime.dist import Placement
from stalwart.runtime.env import WARM_SPARE_ENV
from stalwart.runtime.process import memory_mb, say

_RANK_KEYS = frozenset({"RANK", "LOCAL_RANK"})


def waiting() -> bool:
    """Whether this run of the script is a warm spare's that has not been given a rank yet."""
    return os.environ.get(WARM_SPARE_ENV) == "1" and survivor.in_loop()


class _RankReads:
    """What the script read of its rank while it ran as a spare: os.environ's RANK and LOCAL_RANK (the mapping's
    class is swapped for one that notes those keys) and torch.distributed.get_rank (wrapped)."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.since = time.monotonic()
        self._environ_class = type(os.environ)
        self._get_rank = dist.get_rank
        reads = self

        class Watched(self._environ_class):  # type: ignore[name-defined]
            def __getitem__(self, key: str) -> Any:
                if key in _RANK_KEYS:
                    reads.note(f"os.environ[{key!r}]")
                return super().__getitem__(key)

        def get_rank(*args: Any, **kwargs: Any) -> int:
            reads.note("torch.distributed.get_rank()")
            return int(reads._get_rank(*args, **kwargs))

        os.environ.__class__ = Watched
        dist.get_rank = get_rank
        c10d.get_rank = get_rank

    def note(self, what: str) -> None:
        """A read by the script (or a library it calls): not by torch or stalwart themselves, whose reads follow
        the rank the Job is given (a DDP module's constructor asks its group, for instance)."""
        if what not in self.seen and not _from_torch_or_stalwart(sys._getframe(2)):
            self.seen.append(what)

    def stop(self) -> list[str]:
        os.environ.__class__ = self._environ_class
        dist.get_rank = self._get_rank
        c10d.get_rank = self._get_rank
        return self.seen


_OURS = (
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep,
)
"""torch's, stalwart's and the standard library's directories (not its site-packages): reads from there are not the
script's."""


def _from_torch_or_stalwart(frame: Any) -> bool:
    """Whether the first caller outside the standard library's mapping code (os.environ.get goes through it) is in
    torch, stalwart or the standard library (a copy of the whole environment for a child process reads every key)."""
    while frame is not None and _mapping_code(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return True
    path = os.path.abspath(frame.f_code.co_filename)
    if path.startswith(_OURS[:2]):
        return True
    return path.startswith(_OURS[2]) and "-packages" + os.sep not in path


def _mapping_code(filename: str) -> bool:
    return filename.startswith("<frozen ") or os.path.basename(filename) in ("os.py", "_collections_abc.py")


_reads: _RankReads | None = None


def set_up_started() -> None:
    """`stalwart.Job()` of a warm spare: from here on, the script's reads of its rank are noted, and its set-up runs
    at idle CPU priority (SCHED_IDLE): on the training's own node it takes only CPU time nobody else wants."""
    global _reads
    if _reads is None:
        _reads = _RankReads()
        _set_policy([threading.get_native_id()], os.SCHED_IDLE)


def _set_policy(threads: list[int], policy: int) -> bool:
    """Every thread of `threads` to `policy` (priority 0); False if one could not be. Going back from SCHED_IDLE to
    SCHED_OTHER needs no privilege (Linux 2.6.39 on, nice 0 within RLIMIT_NICE)."""
    done = True
    for tid in threads:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except (OSError, AttributeError):
            done = False
    return done


def _own_threads() -> list[int]:
    """This process's threads, the ones torch started during the set-up too (they inherited its priority), and
    those of the processes it started then (DataLoader workers kept for the run), which inherited it as well."""
    found: list[int] = []
    pids = [os.getpid()]
    while pids:
        pid = pids.pop()
        try:
            tids = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        found += tids
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    pids += [int(child) for child in f.read().split()]
            except (OSError, ValueError):
                continue
    return found or [threading.get_native_id()]


def park(events: Any, provisional: Placement) -> Placement:
    """At `job.steps()`: tell the agent this spare is parked and wait for a rank's activation (its environment
    becomes os.environ). Returns that rank's placement; says in one line what the set-up read of the rank it ran
    as, when it is given another. State the set-up sharded as another rank is the joining spare's to shard again
    (in_loop/late_join.py)."""
    global _reads
    reads, _reads = _reads, None
    set_up_s = time.monotonic() - reads.since if reads is not None else None
    # What a parked spare costs the node: its memory (most of it shared with the zygote it was forked from, so its
    # own part is what it adds) and the GPU memory its set-up reserved. Its CPU while parked is nothing: it waits on
    # a pipe (`stalwart bench overhead` measures it).
    memory = memory_mb() or {}
    gpu_mb = torch.cuda.memory_reserved() / 2**20 if torch.cuda.is_initialized() else 0.0
    events.emit("spare_parked", set_up_s=set_up_s, provisional_rank=provisional.rank, **memory, gpu_mb=gpu_mb)
    try:
        survivor.rearm(parked=True)  # returns once the agent gave this process a rank
    finally:
        seen = reads.stop() if reads is not None else []
        if not _set_policy(_own_threads(), os.SCHED_OTHER):
            say("stalwart: a warm spare could not leave idle CPU priority (SCHED_IDLE); its steps may be slow")
    placement = Placement.from_env()
    if seen and (placement.rank, placement.local_rank) != (provisional.rank, provisional.local_rank):
        say(
            f"stalwart: a warm spare became rank {placement.rank} (local rank {placement.local_rank}) after its "
            f"set-up ran as rank {provisional.rank}, which it read there ({', '.join(seen)}): objects built from it "
            "that stalwart does not track (a DistributedSampler, a seed offset, a device index) still hold rank "
            f"{provisional.rank}; track them with job.track() or read the rank after job.steps() starts"
        )
    return placement
