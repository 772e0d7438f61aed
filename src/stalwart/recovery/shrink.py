"""Training on, shrunk, while a replacement starts: the survivors of a failure do not wait for its set-up.

The default under `stalwart run` (in-loop re-forming; `--wait-for-replacement` turns it off). After a
peer's failure the survivors re-arm as in recovery/in_loop/; the agent's next round activates them again and
starts the replacement, and every worker of that round learns which ranks were kept (KEPT_RANKS_ENV). Then:

1. the replacement's `stalwart.Job()` does not join the job's group yet: its group is a placeholder that runs no
   collective (`ReformableGroup(connect=False)`), so the user's set-up (DDP's constructor included) runs beside
   training; it announces itself ready when it reaches `job.steps()` (`announce_ready`, a file on the node or a key
   in the rendezvous store on several nodes), and
   only then joins;
2. the survivors undo the failed step locally (their own snapshot of the last completed step) and form a group of
   their own (`form`; on several nodes through the rendezvous store, supervisor/round_kept.py), at W' of the
   job's W ranks. Each goes on with the global batch kept: it takes its own slice
   of every global batch and W/W' - 1 slices of the missing ranks (ResumableLoader.take_shares), one loop body per
   slice (`MicroSteps`: the user's `optimizer.step()`, `zero_grad()` and `scheduler.step()` take effect only where
   one step of the full job would), and the gradients, summed over the slices and averaged over W' ranks by DDP,
   are scaled by W'/W: the update is the full job's average over W slices;
3. at the first step boundary after the replacement announced itself, the survivors leave their group and the whole
   job forms again (recovery/in_loop/driver.py); the replacement receives the state from the lowest survivor.

Which results stay bitwise: with `--wait-for-replacement` the job ends bitwise identical to a run without the
failure (docs/architecture.md). Shrunk, the same samples make the same update in exact arithmetic, but the
missing rank's slices draw from a survivor's random generators (dropout, noise) instead of its own, and
floating-point sums run in another order; results stay within a tolerance (tests/test_shrink.py measures it for a
model without randomness in its steps).

Shrinking applies when W' divides W (every survivor takes as many slices), the job tracks the ResumableLoader it
iterates (or the script draws its own data), its state is replicated or FSDP2 that can be sharded again in place
(recovery/in_loop/sharded_stretch.py), the failed step is not
the last one, and the survivor's own snapshot of the last completed step is in node memory. Otherwise the
survivors wait for the replacement, still inside their loop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from stalwart.recovery import reform
from stalwart.runtime.env import (
    KEPT_RANKS_ENV,
    RESTART_COUNT_ENV,
    SHRUNK_STORE_ENV,
    SNAPSHOT_DIR_ENV,
    WAIT_FOR_REPLACEMENT_ENV,
)
from stalwart.runtime.torch_compat import carry_scheduler_mark


class ShrunkFailed(reform.ReformRequested):
    """A survivor's group failed while the job ran shrunk (another death): the survivor leaves its loop and its
    host runs the script again, from the last snapshot (recovery/reform.py's fallback). Rare: two failures within
    one replacement's set-up."""


@dataclass(frozen=True, slots=True)
class Plan:
    """Who trains on while the replacements start, and on which slices of each global batch."""

    kept: tuple[int, ...]
    """The survivors' ranks in the full job, ascending."""
    world_size: int
    """W: the full job's ranks."""
    rank: int
    """This survivor's rank in the full job."""
    own_data: bool = False
    """The script draws its own batches (no tracked ResumableLoader): each survivor goes on with its own, and the
    global batch of the shrunk steps is the survivors' (W'/W of the full job's), as with torchft's fewer replicas."""
    sharded: bool = False
    """The job's state is sharded (FSDP2): the survivors shard it again among themselves
    (recovery/in_loop/sharded_stretch.py) and a tracked ResumableLoader gives each its slice of W' ranks."""

    @property
    def size(self) -> int:
        """W': the survivors."""
        return len(self.kept)

    @property
    def shrunk_rank(self) -> int:
        return self.kept.index(self.rank)

    @property
    def missing(self) -> tuple[int, ...]:
        return tuple(r for r in range(self.world_size) if r not in self.kept)

    @property
    def shares(self) -> tuple[int, ...]:
        """This survivor's own rank first, then the missing ranks it stands for (every W'-th one); with own data
        only its own."""
        if self.own_data or self.sharded:
            return (self.rank,)
        return (self.rank, *self.missing[self.shrunk_rank :: self.size])

    @property
    def scale(self) -> float:
        """W'/W: what turns DDP's average over W' ranks of gradients summed over W/W' slices into the full job's
        average over W slices."""
        return self.size / self.world_size


def wanted() -> bool:
    """Whether this run shrinks after a failure (not `--wait-for-replacement`)."""
    return os.environ.get(WAIT_FOR_REPLACEMENT_ENV, "0") != "1"


def kept_ranks() -> tuple[int, ...] | None:
    """The survivors of this round (KEPT_RANKS_ENV), None when the agents named none (a first start, every rank
    kept, or several nodes whose agents could not agree in time)."""
    text = os.environ.get(KEPT_RANKS_ENV, "")
    try:
        kept = tuple(sorted(int(r) for r in text.split(",") if r))
    except ValueError:
        return None
    return kept or None


def plan(rank: int, world_size: int, *, own_data: bool = False) -> Plan | None:
    """This survivor's plan for the round that just activated it; None when the job does not shrink (see the
    module docstring: not wanted, no replacement, or W' not dividing W where the survivors keep the global batch)."""
    kept = kept_ranks()
    if not wanted() or kept is None or rank not in kept or len(kept) >= world_size:
        return None
    if world_size % len(kept) and not own_data:
        return None
    return Plan(kept, world_size, rank, own_data)


def defers_joining() -> bool:
    """Whether a `stalwart.Job()` made in this round joins the group only when its training loop starts (see the
    module docstring): a replacement whose survivors may be training on shrunk (whatever W', since survivors that
    draw their own data shrink at any size). Every Job() of such a round does, a kept process that runs its script
    again too (a survivor whose shrunk group failed): DDP's constructor then runs its collectives locally on every
    new Job alike, and the restore brings the state. Survivors that wait instead meet the replacement when its
    loop starts, as they would have met it at its restore."""
    kept = kept_ranks()
    return wanted() and kept is not None


def _round_file(name: str) -> Path:
    """A file of this round on this node: in the memory tier's directory (removed with the job), else the
    temporary directory; named by the round's MASTER_PORT and restart count, which no other round shares."""
    directory = os.environ.get(SNAPSHOT_DIR_ENV) or tempfile.gettempdir()
    port = os.environ.get("MASTER_PORT", "0")
    restart = os.environ.get(RESTART_COUNT_ENV, "0")
    return Path(directory) / f"stalwart-{name}-{port}-{restart}"


SHARED_STORE_TIMEOUT_S = 30.0
"""How long a worker waits to reach the rendezvous store on several nodes (it is up: the agents use it)."""

_shared: tuple[str, dist.Store] | None = None  # SHRUNK_STORE_ENV's value and this process's client of it


def _shared_store() -> dist.Store | None:
    """Where survivors and replacements meet on several nodes: the rendezvous store, under the round's token
    (SHRUNK_STORE_ENV, supervisor/round_kept.py); one client per process, for the round it was made for. None on
    one node, where files on the node serve."""
    global _shared
    text = os.environ.get(SHRUNK_STORE_ENV, "")
    if not text:
        return None
    if _shared is None or _shared[0] != text:
        from stalwart.runtime.store import tcp_store

        address, _, token = text.rpartition("/")
        host, _, port = address.rpartition(":")
        client = tcp_store(
            host.strip("[]"), int(port), is_server=False, timeout=timedelta(seconds=SHARED_STORE_TIMEOUT_S)
        )
        _shared = (text, dist.PrefixStore(f"stalwart/shrunk/{token}", client))
    return _shared[1]


def announce_ready(rank: int) -> None:
    """A replacement reached its training loop: the survivors grow back at their next step boundary."""
    with contextlib.suppress(Exception):  # unheard, the survivors train on shrunk until the round fails
        store = _shared_store()
        if store is not None:
            store.set(f"ready-{rank}", "1")
            return
    path = _round_file(f"ready-{rank}")
    with contextlib.suppress(OSError):
        path.write_bytes(b"")


def replacements_ready(p: Plan) -> bool:
    try:
        store = _shared_store()
        if store is not None:
            return bool(store.check([f"ready-{r}" for r in p.missing]))
    except Exception:  # the store is gone: the survivors train on until their round fails
        return False
    return all(_round_file(f"ready-{r}").exists() for r in p.missing)


def forget_round(p: Plan) -> None:
    """The lowest survivor removes the round's files (or keys) once the job grew back."""
    if p.shrunk_rank != 0:
        return
    for r in p.missing:
        with contextlib.suppress(Exception):
            store = _shared_store()
            if store is not None:
                store.delete_key(f"ready-{r}")
                continue
        with contextlib.suppress(OSError):
            _round_file(f"ready-{r}").unlink()


def form(p: Plan, timeout: timedelta) -> None:
    """The survivors' own formation: the default group at W' ranks (one store file on the node, or on several
    nodes the rendezvous store under the round's token; none for one survivor). The job's re-formable group
    objects forward to it (runtime/group.py)."""
    from stalwart.runtime import group

    shared = _shared_store() if p.size > 1 else None
    if p.size == 1:
        store: dist.Store = dist.HashStore()
    elif shared is not None:
        store = dist.PrefixStore("group", shared)
    else:
        store = dist.FileStore(str(_round_file("shrunk")), p.size)
    dist.init_process_group(
        backend=group.BACKEND,
        store=dist.PrefixStore("shrunk", store),
        rank=p.shrunk_rank,
        world_size=p.size,
        timeout=timeout,
    )


def agree(p: Plan, *flags: bool) -> tuple[bool, ...]:
    """Whether any survivor says each of `flags` (one collective of a few ints; none for one survivor)."""
    if p.size == 1:
        return flags
    t = torch.tensor([int(f) for f in flags], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(bool(v) for v in t.tolist())


class Asked:
    """The agent's request to re-form (REFORM_SIGNAL) while the job runs shrunk: its round failed again (the
    replacement died in its set-up, or a survivor did). It is recorded, not raised: at the next step boundary the
    survivors re-arm together and, when the same survivors are kept, train on in the next round."""

    def __init__(self) -> None:
        self.asked = False
        self._before: Any = signal.signal(reform.REFORM_SIGNAL, self._ask)
        self._closed = False

    def _ask(self, signum: int, frame: FrameType | None) -> None:
        self.asked = True

    def close(self) -> None:
        """The handler before it again (once: a second call changes nothing)."""
        if not self._closed:
            self._closed = True
            signal.signal(reform.REFORM_SIGNAL, self._before)


class MicroSteps:
    """One step of the full job as `count` loop bodies of one survivor: its optimizers step in the last one, with
    the gradients summed over all of them, their gradients are cleared only before the first body's backward or
    after the last body's optimizer step, and its schedulers step in the last one.

    Every gradient is scaled by `scale` as the backward pass makes it (a hook on each parameter, before DDP's
    all-reduce sees it), so the sum after the last body is the full job's average, and gradient clipping in the
    last body (`torch.nn.utils.clip_grad_norm_`/`clip_grad_value_`, called through the module) clips what the full
    job would; in the bodies before it, clipping only measures (the sum is partial).

    It replaces the instance's methods for the duration of one body (`begin`, `end`), whatever pattern the loop
    uses (zero_grad before backward or after the optimizer step). `module.zero_grad()` is not held back: a loop
    that clears gradients through its module clears the slices' sums."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], schedulers: list[Any], scale: float) -> None:
        self._optimizers = optimizers
        self._schedulers = schedulers
        self._scale = scale
        self._saved: list[tuple[Any, str, Any]] = []
        self._stepped = False
        params = {id(p): p for o in optimizers for g in o.param_groups for p in g["params"] if p.requires_grad}
        self._hooks = [p.register_hook(self._scaled) for p in params.values()]

    def _scaled(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self._scale

    def close(self) -> None:
        """The job grows back: gradients are the backward pass's again."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def begin(self, index: int, count: int) -> None:
        last = index == count - 1
        self._stepped = False
        for opt in self._optimizers:
            self._patch(opt, "step", self._step(opt, last))
            self._patch(opt, "zero_grad", self._zero_grad(opt, index == 0, last))
        if not last:
            for sched in self._schedulers:
                self._patch(sched, "step", lambda *a, **k: None)
            clip = torch.nn.utils.clip_grad
            for module in (torch.nn.utils, clip):
                self._patch(module, "clip_grad_norm_", _measure_only(clip.clip_grad_norm_))
                self._patch(module, "clip_grad_value_", lambda *a, **k: None)

    def end(self) -> None:
        for obj, name, before in reversed(self._saved):
            if before is _ABSENT:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = before
        self._saved = []

    def _patch(self, obj: Any, name: str, replacement: Any) -> None:
        self._saved.append((obj, name, obj.__dict__.get(name, _ABSENT)))
        obj.__dict__[name] = replacement

    def _step(self, opt: torch.optim.Optimizer, last: bool) -> Any:
        real = opt.step

        def step(*args: Any, **kwargs: Any) -> Any:
            self._stepped = True
            return real(*args, **kwargs) if last else None

        carry_scheduler_mark(real, step)
        return step

    def _zero_grad(self, opt: torch.optim.Optimizer, first: bool, last: bool) -> Any:
        real = opt.zero_grad

        def zero_grad(*args: Any, **kwargs: Any) -> None:
            if (first and not self._stepped) or (last and self._stepped):
                real(*args, **kwargs)

        return zero_grad


def _measure_only(clip_grad_norm: Any) -> Any:
    """`clip_grad_norm_` that returns the norm and clips nothing (an infinite limit)."""

    def measure(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
        return clip_grad_norm(parameters, float("inf"), *args, **kwargs)

    return measure


_ABSENT = object()


def schedulers(objects: dict[str, Any]) -> list[Any]:
    """The tracked learning-rate schedulers (their step counts steps of the full job)."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    return [o for o in objects.values() if isinstance(o, LRScheduler | ReduceLROnPlateau)]
