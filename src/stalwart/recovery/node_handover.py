"""A survivor's live tensors handed to the other ranks of its own node: read straight from its memory, else through a
file in the node's shared memory.

Straight from its memory (`read_directly`, runtime/cross_memory.py): each other rank copies the survivor's tensors
into its own tensors for them where it has them (a replacement's model, built), else into new memory: one copy,
the floor of a hand-over on one node. Where the kernel refuses that (a Yama scope or seccomp profile that forbids
it), every rank takes the file.

Why the file: on one node the replacement and the survivors share memory, so the hand-over can run at the speed of a
copy instead of the transport's (issue #43, on the 2-core VM: a gloo broadcast of 1 GB between two processes took
1.04 s, a memory copy about 0.07 s). The source writes its tensors into the file (the kernel copies them into
the page cache, one copy, without a page fault in the source); the others map the file copy-on-write: their
tensors read the pages where they are, and a page is copied only when that rank writes it (its optimizer's next
step), so no two ranks ever share a tensor's memory. The source takes its own live tensors as they are. The file
is removed once every rank has mapped it; a mapping keeps its pages until its tensors are gone.

Only where every rank's node memory is the same directory (a job on one node); elsewhere the state is broadcast
(recovery/restore.py).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from stalwart.runtime import cross_memory
from stalwart.runtime.dist import Comm

PREFIX = "handover-"
"""The files' names in the node's snapshot directory: `handover-<step>-<source>.bin`."""


def node_key(directory: Path | None, local_world_size: int, world_size: int) -> int:
    """A number equal on every rank exactly when they share one node memory directory and the job has no other
    node; 0 where this rank cannot take part (no node memory, or ranks on other nodes)."""
    if directory is None or local_world_size != world_size:
        return 0
    return zlib.crc32(str(Path(directory).resolve()).encode()) or 1


def path_of(directory: Path, step: int, source: int) -> Path:
    return Path(directory) / f"{PREFIX}{step}-{source}.bin"


def write(path: Path, pieces: list[tuple[int, torch.Tensor]], size: int) -> None:
    """The file of `size` bytes with each tensor's bytes at its offset (`pieces`), complete when it appears under
    `path` (written under another name first)."""
    partial = path.with_suffix(".partial")
    fd = os.open(partial, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)
        for offset, tensor in pieces:
            data = tensor.detach().reshape(-1).view(torch.uint8)
            if data.device.type != "cpu":
                data = data.cpu()
            view = data.contiguous().numpy().data
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
    finally:
        os.close(fd)
    os.replace(partial, path)


def read(path: Path, size: int) -> torch.Tensor:
    """The file's `size` bytes as a uint8 tensor over a private (copy-on-write) mapping of it."""
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mapped, dtype=torch.uint8)  # the tensor holds the mapping


def remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


class Offer(NamedTuple):
    """Where a node's other ranks read a source's pieces: its pid and the address of a table of the pieces'
    addresses (int64s, in the pieces' order); Offer(0, 0) where they cannot be read so, and on every other rank."""

    pid: int
    table: int


NO_OFFER = Offer(0, 0)


@contextlib.contextmanager
def offering(pieces: list[torch.Tensor] | None) -> Iterator[Offer]:
    """On the source (`pieces` given): its pieces readable by any process of its user while inside, and the Offer
    saying where, for the other ranks to learn in a message they exchange anyway before the read (recovery/restore.py's
    LightReady), so the read needs no collective of its own before it. NO_OFFER where a piece is not in CPU memory
    as one block, and on every other rank (`pieces` None). The table lives until the block ends."""
    if pieces is None or not all(t.device.type == "cpu" and t.is_contiguous() for t in pieces):
        yield NO_OFFER
        return
    table = torch.tensor([t.data_ptr() for t in pieces] or [0], dtype=torch.int64)
    with cross_memory.readable_by_any():
        yield Offer(os.getpid(), table.data_ptr())


def read_directly(
    comm: Comm,
    source: int,
    pieces: list[torch.Tensor] | None,
    spans: list[tuple[int, int]],
    size: int,
    into: list[torch.Tensor | None] | None = None,
    offer: Offer | None = None,
) -> list[torch.Tensor] | None:
    """Rank `source`'s `pieces` (its live tensors, then its skeleton's bytes) on every other rank of a one-node job,
    each copied straight from the source's memory: into the reader's own tensor for it (`into`, by piece: one that
    already holds such a tensor, its model's parameters), else into one buffer of `size` bytes at its (offset, bytes)
    of `spans` (alike on every rank). On a reader each piece's bytes (a flat uint8 view of where it went), on the
    source none; None on every rank where any cannot (a piece not in CPU memory, a kernel that refuses):
    the caller takes the file. `offer`: the source's, as every rank learned it before, the source inside its
    `offering` of these `pieces` still; without it the source broadcasts it first. Collective: one all-gather of
    every reader's verdict (the source's tensors stay as they are until every read ended), and the broadcast."""
    if offer is None:
        with offering(pieces if comm.rank == source else None) as mine:
            message = torch.tensor(mine, dtype=torch.int64)
            comm.broadcast_tensor(message, source)
            told = Offer(int(message[0]), int(message[1]))
            return read_directly(comm, source, pieces, spans, size, into, told)
    if offer.pid == 0:
        return None
    got = read_offered(comm.rank, source, offer, spans, size, into)
    everyone = comm.all_gather_ints([int(got is not None)])
    return got if all(ok for [ok] in everyone) else None


def read_offered(
    rank: int,
    source: int,
    offer: Offer,
    spans: list[tuple[int, int]],
    size: int,
    into: list[torch.Tensor | None] | None,
) -> list[torch.Tensor] | None:
    """This rank's part of `read_directly` where `offer` is a real one, without agreeing on it: the pieces read (none
    on the source), or None where this rank could not read them. Not collective: the caller must agree on every
    rank's outcome before the source leaves its `offering` (and take the file where any failed). Why apart: the
    agreement can ride on one the caller makes anyway (recovery/live_handover.py's `hand_over_and_load`, with the
    load's verdict); on its own it was a quarter of a 10 MB hand-over (0.7-1.4 ms of 4 ms, 2-core VM, 2026-11-30)."""
    got: list[torch.Tensor] = []
    if rank == source:
        return got
    table = torch.empty(max(1, len(spans)), dtype=torch.int64)
    why = cross_memory.read_into(offer.pid, [(table.data_ptr(), offer.table, 8 * len(spans))])
    if why:
        return None
    buf = torch.empty(size, dtype=torch.uint8)  # its pages are only touched where a piece is read into it
    targets = into if into is not None else [None] * len(spans)
    for (offset, nbytes), target in zip(spans, targets, strict=True):
        if target is not None and _holds(target, nbytes):
            got.append(target.view(-1).view(torch.uint8))
        else:
            got.append(buf[offset : offset + nbytes])
    addresses = table.tolist()
    why = cross_memory.read_into(
        offer.pid, [(t.data_ptr(), address, t.numel()) for t, address in zip(got, addresses, strict=False)]
    )
    return None if why else got


def _holds(tensor: torch.Tensor, nbytes: int) -> bool:
    """Whether `tensor` can take a piece of `nbytes` bytes read into its memory as they are."""
    return (
        tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and tensor.numel() * tensor.element_size() == nbytes
        and tensor.numel() > 0
    )
