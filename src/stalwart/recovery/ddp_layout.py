"""After a re-formation, every rank's DDP modules take the survivors' bucket layout (`reset_ddp` below says why).

A survivor's DDP rebuilt its buckets after its first iteration; a replacement's DDP was just made, with the
constructor's, and the re-formation gave the survivor's a fresh reducer with the constructor's too (so that a
re-formation cut short leaves every rank alike). Once the job has its state (`share`, from `Job.resume` on every
rank), the lowest rank that kept a rebuilt layout sends it, and every rank rebuilds its reducers with it. Modules
are matched by their parameters' sizes; where that cannot match them one to one on every rank (two modules alike,
another number of modules), every rank goes back to the constructor's layout instead: consistent, as before, if
not bitwise on 3 ranks and more.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from stalwart.runtime import group as reformable
from stalwart.runtime.dist import Comm
from stalwart.runtime.torch_compat import ddp_bucket_layout, live_ddp_modules, rebuild_ddp_reducer

Layout = list[list[int]] | None


def _signature(module: torch.nn.Module) -> int:
    """The module's parameters' sizes, as one int64: what matches a module across ranks."""
    sizes = ",".join(str(p.numel()) for p in module.parameters())
    return int.from_bytes(hashlib.blake2b(sizes.encode(), digest_size=7).digest(), "big")


def _encode(signatures: list[int], layouts: list[Layout]) -> list[int]:
    ints = [len(signatures)]
    for signature, layout in zip(signatures, layouts, strict=True):
        ints += [signature, -1 if layout is None else len(layout)]
        for bucket in layout or []:
            ints += [len(bucket), *bucket]
    return ints


def _decode(ints: list[int]) -> tuple[list[int], list[Layout]]:
    signatures: list[int] = []
    layouts: list[Layout] = []
    at = 1
    for _ in range(ints[0]):
        signature, buckets = ints[at], ints[at + 1]
        at += 2
        layout: Layout = None if buckets < 0 else []
        for _ in range(max(buckets, 0)):
            n = ints[at]
            layout.append(ints[at + 1 : at + 1 + n])  # type: ignore[union-attr]
            at += 1 + n
        signatures.append(signature)
        layouts.append(layout)
    return signatures, layouts


KEPT = "_stalwart_kept_layout"
"""The attribute a survivor's DDP module carries its layout in, from its reset to `share` (the Job's parts are
made anew in between, the module is the same object)."""


def keep(module: torch.nn.Module) -> None:
    """Before a survivor's DDP module is reset: remember the layout it had rebuilt (None if it had not)."""
    setattr(module, KEPT, ddp_bucket_layout(module))  # type: ignore[arg-type]


def share(comm: Comm, group: reformable.ReformableGroup) -> int:
    """Collective: the DDP modules on `group` take the lowest rank's rebuilt layout (a survivor's, `keep`); returns
    how many this rank rebuilt. Nothing to do (no collective beyond the first) when no rank kept one."""
    modules = [
        m
        for m in live_ddp_modules()
        if isinstance(held := getattr(m, "process_group", None), reformable.ReformableGroup)
        and held.latest() is group.latest()
    ]
    modules.sort(key=_signature)
    signatures = [_signature(m) for m in modules]
    offered = [m.__dict__.pop(KEPT) if KEPT in m.__dict__ else ddp_bucket_layout(m) for m in modules]
    mine = _encode(signatures, offered)
    lengths = comm.all_gather_ints([len(mine), int(any(layout is not None for layout in offered))])
    sources = [rank for rank, (_, rebuilt) in enumerate(lengths) if rebuilt]
    if not sources:
        return 0
    source = sources[0]
    sent = torch.tensor(mine if comm.rank == source else [0] * lengths[source][0], dtype=torch.int64)
    comm.broadcast_tensor(sent, source)
    their_signatures, layouts = _decode([int(v) for v in sent.tolist()])
    matched = their_signatures == signatures and len(set(signatures)) == len(signatures)
    agreed = all(v[0] for v in comm.all_gather_ints([int(matched)]))
    rebuilt = 0
    for module, layout in zip(modules, layouts if agreed else [None] * len(modules), strict=True):
        if ddp_bucket_layout(module) != layout:
            reset_ddp(module, group.latest(), layout)
            rebuilt += 1
    return rebuilt


def reset_ddp(module: torch.nn.Module, group: dist.ProcessGroup, layout: list[list[int]] | None = None) -> bool:
    """Give a DDP module a fresh reducer on `group`; returns whether it is one. `layout`: its buckets, as lists
    of parameter indices (`torch_compat.ddp_bucket_layout`), taken as already rebuilt; None: the constructor's.

    Why a fresh reducer: torch's `_update_process_group` keeps the reducer's state of the failed step. Why the
    layout: after its first iteration DDP rebuilds its buckets in the order the gradients became ready (rank 0's,
    broadcast), and an all-reduce sums each element in an order that depends on its place in the bucket (gloo,
    3 ranks and more: the last bit can differ). A survivor keeps its rebuilt layout and a replacement's new DDP takes
    the same one (recovery/ddp_layout.py), so the step after a re-formation sums as a run without the failure does.
    With the constructor's layout on every rank for that step (what a re-formation makes until the ranks agree on
    the survivors' layout) it is consistent, but not bitwise on 3 ranks (tests/test_in_loop.py, two failures at
    once). Comm hooks registered on the module carry over."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(module, DistributedDataParallel):
        return False
    rebuild_ddp_reducer(module, group, layout)  # through DDP's private members: runtime/torch_compat.py
    return True
