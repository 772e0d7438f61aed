"""What `dist.get_backend` says of stalwart's process group: the backend its collectives run on (gloo on CPU,
NCCL where CUDA tensors go to NCCL), not the name stalwart registered its group under.

Why: code written for torch's backends branches on that name. Lightning reduces a mean over gloo as a sum it
divides (gloo has no AVG for integer tensors) and sends AVG to any other; torch's monitored_barrier is gloo's only.
Named "stalwart", a Lightning validation logged with `sync_dist=True` on CPU failed in gloo's AVG of an integer
count (2026-12-02). torch's own groups and subgroups are made from the registered name, which stays as it is:
only the answer of `get_backend` changes, for torch's module, `torch.distributed` and DeviceMesh's import of it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def underlying(cuda_backend: str) -> str:
    """The backend stalwart's group runs collectives on, as `get_backend` names it: NCCL where CUDA is there and its
    tensors go to NCCL (`cuda_backend` not "gloo"), else gloo."""
    if torch.cuda.is_available() and cuda_backend != "gloo":
        return str(dist.Backend.NCCL)
    return str(dist.Backend.GLOO)


def report_underlying(registered: str, name: Callable[[], str]) -> None:
    """From now on `dist.get_backend` answers `name()` for a group made under `registered` (once per process)."""
    c10d = dist.distributed_c10d
    if getattr(c10d.get_backend, "_stalwart", False):
        return
    reported = _reporting(c10d.get_backend, registered, name)
    c10d.get_backend = reported
    dist.get_backend = reported
    mesh = sys.modules.get("torch.distributed.device_mesh")  # imported the name; it may not be imported yet
    if mesh is not None and hasattr(mesh, "get_backend"):
        setattr(mesh, "get_backend", reported)  # noqa: B010  (a module torch may not have imported)


def _reporting(original: Any, registered: str, name: Callable[[], str]) -> Any:
    def get_backend(group: Any = None) -> Any:
        got = original(group)
        return dist.Backend(name()) if got == registered else got

    get_backend._stalwart = True  # type: ignore[attr-defined]
    get_backend.__doc__ = original.__doc__
    return get_backend
