"""Torch's internals for process groups made in Python: the part of runtime/torch_compat.py that runtime/group.py
uses, apart because a group made outside `init_process_group` needs the most of them and they differ most between
releases (torch 2.4 fixes a group's default backend when it is made, later releases set it afterwards).

The rules of runtime/torch_compat.py hold here: each entry says what it relies on, why no public way serves, and the
torch releases on which tests/test_torch_compat.py passed ("checked on"); that test holds every other module to
importing these from here.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

AllgatherOptions = _c10d.AllgatherOptions
"""The options of an all-gather: the one collective's options class torch.distributed does not export (the others
are `dist.AllreduceOptions` and the like), needed by a Python ProcessGroup (runtime/group.py) that is called
without them. Checked on torch 2.4.1 and 2.13.0."""


def _options_given_when_made() -> bool:
    """torch 2.4's ProcessGroup takes `ProcessGroup.Options` (its backend's name, which fixes the default backend)
    in its constructor and has no `_set_default_backend`; later releases dropped both. By feature."""
    return not hasattr(dist.ProcessGroup, "_set_default_backend")


def group_args(
    store: dist.Store, rank: int, size: int, made: Mapping[str, tuple[Any, Any]], *, subclass: bool = False
) -> tuple[Any, ...]:
    """What torch's ProcessGroup constructor takes for a group of `rank` in `size` whose backends will be `made`
    (`register_backends`' argument; empty: none yet). The default backend, what C++ callers get that ask for none
    by device, is the CPU one: torch 2.4 fixes it when the group is made, from `ProcessGroup.Options(backend=...)`
    next to the store (as its `_new_process_group_helper` does), later releases take it in `register_backends`.
    `subclass`: for a Python subclass's `super().__init__`, which on later releases takes the rank and size only
    (torch's constructor for Python groups). Checked on torch 2.4.1 and 2.13.0."""
    if _options_given_when_made():
        default = made["cpu"][0].name.lower() if "cpu" in made else "undefined"  # "gloo": the type torch 2.4 reads
        return (store, rank, size, dist.ProcessGroup.Options(backend=default))  # type: ignore[attr-defined]
    return (rank, size) if subclass else (store, rank, size)


def register_backends(group: dist.ProcessGroup, made: Mapping[str, tuple[Any, Any]]) -> None:
    """Give a ProcessGroup made in Python (with `group_args`) its backends, `made`: device ("cpu", "cuda") ->
    (BackendType, backend), the CPU one its default. torch does this in C++ for the groups `init_process_group`
    makes and has no public way for others; C++ callers ask a group for its backend by device. Relies on
    `ProcessGroup._register_backend` and, after torch 2.4 (where `group_args` gave the default),
    `_set_default_backend`. Checked on torch 2.4.1 and 2.13.0."""
    for device, (kind, backend) in made.items():
        group._register_backend(torch.device(device), kind, backend)
    if not _options_given_when_made():
        group._set_default_backend(made["cpu"][0])


def nccl_options(timeout: timedelta) -> Any:
    """ProcessGroupNCCL's options with collective timeout `timeout`: settable only through the private `_timeout`
    of its base (Backend.Options; ProcessGroup.Options on torch 2.4), with no constructor argument and no public
    setter. Checked on torch 2.4.1 (set and read back, no NCCL backend made: no GPU there) and 2.13.0 (the base's
    attribute only: a CPU build has no NCCL)."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return options


def forget_sharding_caches() -> bool:
    """Forget what DTensor cached about device meshes, before a process runs the script again (possibly as another
    rank). DTensor's sharding propagation caches an op's output sharding by its input shardings, and those compare
    their device meshes by the ranks and shape alone: two meshes over the same ranks are equal whatever rank this
    process holds in them (within one process it never changes, except in stalwart's). A warm spare that ran its
    set-up as rank 1 and runs it again as rank 0 (recovery/warm_spare.py) got its new FSDP2 parameters back on the
    old mesh, at rank 1's coordinate, and its restore refused them. No public API clears them. Returns whether a
    cache was cleared: none where DTensor was never imported (a DDP job's rerun imports nothing for this). Checked on
    torch 2.13.0."""
    module = sys.modules.get("torch.distributed.tensor")
    propagator = getattr(getattr(getattr(module, "DTensor", None), "_op_dispatcher", None), "sharding_propagator", None)
    if propagator is None:
        return False
    cleared = False
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ fast path's cache
    if native is not None:
        native()
        cleared = True
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        clear = getattr(getattr(propagator, name, None), "cache_clear", None)
        if callable(clear):
            clear()
            cleared = True
    return cleared
