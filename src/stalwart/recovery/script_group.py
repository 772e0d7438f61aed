"""The script's own `init_process_group` under `stalwart run`: the group it makes is the re-formable one.

Why: most training scripts make their process group themselves, with torch's environment rendezvous, an
`init_method` URL or a store of their own, before `stalwart.Job()` or after it. A survivor stays in its training
loop (recovery/in_loop/) only when the job's default group is stalwart's re-formable group (runtime/group.py);
with a plain group the first failure ends the script's run and the survivor runs the script again, set-up and
all. So when survivors re-form in their loop, the worker host replaces torch's `init_process_group` before it
runs the script (`adopt`), and the script's call makes what `stalwart.Job()` would have made:

- the re-formable group over the launcher's environment (rank, world size, this round's MASTER_ADDR and
  MASTER_PORT), or over the store the script passed (`store=`), which is then kept for a replacement that joins
  late (`given_store`): its TCPStore server already holds the round's port;
- the placeholder group of a replacement whose survivors may train on shrunk (recovery/shrink.py), which the Job
  swaps for the real group when its loop starts (recovery/in_loop/late_join.py);
- nothing, when `stalwart.Job()` made the group first (torch would raise "initialized twice"); a TCPStore the
  script makes after it, on the port the Job's group serves, is a client of that server (`_ScriptStore`).

An `init_method` URL is not used: the launcher's environment names the same job, and a fixed address would be
held by the previous round's store when the script runs again in the same process. A call that names another
rank or world size than the launcher's is refused with one line. A backend other than gloo or NCCL (MPI, UCC)
keeps torch's own group, and the Job says at start what that costs (`notice_if_plain`).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from stalwart.errors import ConfigError
from stalwart.recovery import shrink
from stalwart.recovery.in_loop import survivor
from stalwart.runtime import group as reformable
from stalwart.runtime.dist import Placement, init_process_group
from stalwart.runtime.env import RESTART_COUNT_ENV, WARM_SPARE_ENV
from stalwart.runtime.process import say

DEFAULT_TIMEOUT = timedelta(seconds=300)
"""The group's collective timeout when the script gives none: JobConfig.collective_timeout_s's default."""

_BACKENDS = frozenset({"gloo", "nccl", "cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo"})
"""Backends the re-formable group carries (it runs gloo for CPU tensors and NCCL for CUDA ones)."""

_torch_init: Any = None
"""torch's own `init_process_group`, once `adopt` replaced it."""

_given: tuple[str, dist.Store] | None = None
"""The store the script passed, with the round it was passed in (MASTER_PORT and restart count)."""

_noticed = False


def adopt() -> None:
    """Make `torch.distributed.init_process_group` this module's (once per process; before the script runs, so
    that `from torch.distributed import init_process_group` in the script gets it too)."""
    global _torch_init
    if _torch_init is not None:
        return
    _torch_init = dist.init_process_group
    dist.init_process_group = _init_process_group  # type: ignore[assignment]
    c10d.init_process_group = _init_process_group  # type: ignore[assignment]
    dist.TCPStore = _ScriptStore  # type: ignore[misc]


def adopted() -> bool:
    return _torch_init is not None


def given_store() -> dist.Store | None:
    """The store the script passed in this round, for the group a replacement joins late
    (recovery/in_loop/late_join.py)."""
    if _given is not None and _given[0] == _round():
        return _given[1]
    return None


def placeholder_wanted() -> bool:
    """Whether a group made now is a placeholder: a replacement whose survivors may train on shrunk, or a warm spare
    that has no rank yet (recovery/warm_spare.py)."""
    return survivor.in_loop() and (shrink.defers_joining() or os.environ.get(WARM_SPARE_ENV) == "1")


def notice_if_plain() -> None:
    """Say once, in one line, when survivors would stay in their loop but the job's group is a plain one the
    script made: each failure then costs the survivors a run of the script (its set-up) and a restore."""
    global _noticed
    if _noticed or not survivor.in_loop() or not dist.is_initialized():
        return
    current = reformable.current()
    if current is not None and dist.group.WORLD is current:
        return
    _noticed = True
    backend = dist.get_backend()
    say(
        f"stalwart: rank {os.environ.get('RANK', '?')}: the script's own process group ({backend}) cannot be "
        "re-formed in place, so after a peer's failure the survivors run the script again (its set-up) instead "
        "of staying in their loop; make the group with backend gloo or nccl, or let stalwart.Job() make it"
    )


class _ScriptStore(dist.TCPStore):
    """torch's TCPStore as the script makes it: a server asked for on the port whose server the job's group made
    in this process already (the script makes its store after `stalwart.Job()`, on MASTER_PORT, which rank 0's
    group bootstrap holds) is a client of that server instead of failing to listen. The keys are the same
    server's either way, which is what a store of the round is for."""

    def __init__(self, host_name: str, port: int, *args: Any, **kwargs: Any) -> None:
        if len(args) >= 2:
            args = (args[0], args[1] and not _group_serves(port), *args[2:])
        elif kwargs.get("is_master") and _group_serves(port):
            kwargs["is_master"] = False
        super().__init__(host_name, port, *args, **kwargs)


def _group_serves(port: int) -> bool:
    """Whether this process's re-formable default group was made over a store it serves on `port` (rank 0's)."""
    current = reformable.current()
    return (
        dist.is_initialized()
        and current is not None
        and dist.group.WORLD is current
        and not current.placeholder
        and str(port) == os.environ.get("MASTER_PORT")
        and os.environ.get("RANK") == "0"
    )


def _round() -> str:
    return f"{os.environ.get('MASTER_PORT', '')}/{os.environ.get(RESTART_COUNT_ENV, '')}"


def _init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: dist.Store | None = None,
    group_name: str = "",
    pg_options: Any = None,
    **rest: Any,
) -> None:
    """torch's signature; see the module docstring for what it makes."""
    global _given
    plain = backend is not None and str(backend).lower() not in _BACKENDS
    if not survivor.in_loop() or plain:
        return _torch_init(backend, init_method, timeout, world_size, rank, store, group_name, pg_options, **rest)
    current = reformable.current()
    if dist.is_initialized() and current is not None and dist.group.WORLD is current:
        if store is not None and current.placeholder:  # the late join meets the script's server on the port
            _given = (_round(), store)
        return None  # stalwart.Job() made it first: the script's call joins it
    if dist.is_initialized():  # torch's own error for a second default group
        return _torch_init(backend, init_method, timeout, world_size, rank, store, group_name, pg_options, **rest)
    placement = Placement.from_env()
    if placement.world_size == 1:  # nothing to re-form; torch's group serves the script's own calls
        return _torch_init(backend, init_method, timeout, world_size, rank, store, group_name, pg_options, **rest)
    if world_size not in (-1, placement.world_size) or rank not in (-1, placement.rank):
        raise ConfigError(
            f"init_process_group(rank={rank}, world_size={world_size}) disagrees with the launcher's RANK="
            f"{placement.rank} WORLD_SIZE={placement.world_size}: pass neither, or the launcher's"
        )
    _given = (_round(), store) if store is not None else None
    init_process_group(
        placement,
        timeout or DEFAULT_TIMEOUT,
        reformable=True,
        placeholder=placeholder_wanted(),
        store=store,
    )
    return None
