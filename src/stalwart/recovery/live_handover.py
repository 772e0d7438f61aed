"""A survivor's live tensors handed to every rank at a restore from a light snapshot (recovery/restore.py), by the
fastest way the ranks share: on one node read straight from the survivor's memory into each rank's own tensors
where it has them (its model, built), else into new memory; where the kernel refuses that, through a file in node
memory (recovery/node_handover.py); across nodes by one gloo broadcast. The survivor keeps its own tensors."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple, TypeVar

import torch

from stalwart.recovery import node_handover
from stalwart.recovery.in_loop import survivor
from stalwart.runtime.dist import Comm, Flag
from stalwart.runtime.process import first_line

Layout = dict[str, tuple[int, int, torch.dtype, list[int]]]
"""Each live tensor's id -> (offset, bytes, dtype, shape) in the hand-over's bytes (64-byte aligned offsets)."""
Handed = tuple[dict[str, torch.Tensor], bytes, str]
"""`hand_over`'s answer: the live tensors by id, the skeleton's bytes, the way they came."""
T = TypeVar("T")


class Pieces(NamedTuple):
    """What the source hands over, made before the ranks agree to it (so that they learn its Offer then)."""

    mine: dict[str, torch.Tensor]
    """The source's live tensors by id (its stash's, as they are); empty on every other rank."""
    flat: list[torch.Tensor] | None
    """The source's tensors as flat views, then its skeleton's bytes; None on every other rank."""
    offer: node_handover.Offer
    """Where the node's other ranks read `flat` from the source's memory (node_handover.offering)."""


@contextlib.contextmanager
def offered(source: int, rank: int, layout: Layout, skeleton: bytes, node: int) -> Iterator[Pieces]:
    """The pieces rank `source` hands over (`layout`'s ids of its stash, then `skeleton`), readable from its memory by
    its node's other ranks while inside where the job may be of one node (`node`, node_handover.node_key, not 0)."""
    stash = survivor.stashed()
    mine = {tid: stash.tensors[tid] for tid in layout} if rank == source and stash is not None else {}
    flat = None
    if rank == source:
        flat = [t.detach().reshape(-1) for t in mine.values()]
        flat += [torch.frombuffer(bytearray(skeleton), dtype=torch.uint8)] if skeleton else []
    with node_handover.offering(flat if node else None) as offer:
        yield Pieces(mine, flat, offer)


def hand_over(
    comm: Comm,
    source: int,
    pieces: Pieces,
    offer: node_handover.Offer,
    layout: Layout,
    total: int,
    skeleton: bytes,
    skeleton_len: int,
    step: int,
    directory: Path | None,
    own: Callable[[], dict[str, torch.Tensor]] | None,
    *,
    direct: str = "agreed",
) -> Handed | None:
    """Rank `source`'s live tensors (laid out by `layout` in `total` bytes) and its skeleton (`skeleton_len` bytes
    after them), on every rank, and the way they came. `pieces`: this rank's of `offered`, inside it still;
    `offer`: the source's, as every rank learned it. `directory`: the node memory every rank shares (a job of one
    node), else None. `own`: this rank's tensors by id as they are (a replacement's model), read into where they
    have the dtype and shape. Collective. `direct`: on one node with an offer, the read from the source's memory
    "agreed" on (the file where any rank could not), "unagreed" (the caller agrees: None on a rank that could not
    read, and the source must stay inside `offered` until then; `hand_over_and_load`), or "off" (the file)."""
    stash = survivor.stashed()
    size = total + skeleton_len
    mine = pieces.mine
    skeleton_bytes = pieces.flat[len(mine) :] if pieces.flat is not None else []
    if directory is not None and direct != "off":
        spans = [(offset, nbytes) for offset, nbytes, _, _ in layout.values()]
        spans += [(total, skeleton_len)] if skeleton_len else []
        into = None
        if comm.rank != source:  # a survivor's own tensors are its stash's, which a later try may still hand over
            into = [*_own_tensors(own if stash is None else None, layout), *([None] if skeleton_len else [])]
        if direct == "unagreed" and offer.pid != 0:
            got = node_handover.read_offered(comm.rank, source, offer, spans, size, into)
            if got is None:
                return None
        else:
            got = node_handover.read_directly(comm, source, pieces.flat, spans, size, into, offer)
        if got is not None:
            route = "read from its memory"
            if comm.rank == source:
                return mine, skeleton, route
            live = {
                tid: piece.view(dtype).reshape(shape)
                for (tid, (_, _, dtype, shape)), piece in zip(layout.items(), got, strict=False)
            }
            return live, got[-1].numpy().tobytes() if skeleton_len else b"", route
    if directory is not None and comm.rank == source:
        path = node_handover.path_of(directory, step, source)
        written = [(offset, mine[tid]) for tid, (offset, _, _, _) in layout.items()]
        written += [(total, t) for t in skeleton_bytes]
        try:  # removed whatever happens: a peer failing in these barriers must not leave the state in /dev/shm
            node_handover.write(path, written, size)
            comm.barrier()  # written
            comm.barrier()  # mapped by every other rank
        finally:
            node_handover.remove(path)
        return mine, skeleton, "handed over through node memory"
    if directory is not None:
        comm.barrier()
        buf = node_handover.read(node_handover.path_of(directory, step, source), size)
        comm.barrier()
        return *_views(buf, layout, total, skeleton_len), "handed over through node memory"
    buf = torch.empty(size, dtype=torch.uint8)
    if comm.rank == source:
        with torch.no_grad():
            for tid, (offset, nbytes, _, _) in layout.items():
                buf[offset : offset + nbytes].copy_(mine[tid].reshape(-1).view(torch.uint8))
            for t in skeleton_bytes:
                buf[total:].copy_(t)
    comm.broadcast_tensor(buf, source)
    return *_views(buf, layout, total, skeleton_len), "broadcast"


def hand_over_and_load(
    comm: Comm,
    hand: Callable[[str], Handed | None],
    directly: bool,
    load: Callable[[dict[str, torch.Tensor], bytes], T],
) -> tuple[T | None, str, str]:
    """`hand(direct)` (`hand_over` with its arguments bound), then `load(live, skeleton)` on every rank, agreed: (what
    `load` made, or None on every rank where any rank could not use its own, the way the state came, the first
    problem). Inside `offered` still. `directly`: on one node with the source's offer, the read from its memory and
    the load are agreed on in one gather (a read that failed anywhere: every rank takes the file, and loads and
    agrees again). `load` raising is a problem agreed on, not an error."""
    handed = hand("unagreed" if directly else "agreed")
    loaded, problem = _load(load, handed)
    votes = [f.value for f in comm.gather(Flag(2 * int(handed is not None) + int(loaded is not None)))]
    if not all(v & 2 for v in votes):  # a rank could not read the source's memory (the source is still offering)
        handed = hand("off")
        loaded, problem = _load(load, handed)
        votes = [f.value for f in comm.gather(Flag(2 + int(loaded is not None)))]
    route = handed[2] if handed is not None else ""
    if all(v & 1 for v in votes):
        return loaded, route, ""
    return None, route, problem or "another rank's is not whole"


def _load(load: Callable[[dict[str, torch.Tensor], bytes], T], handed: Handed | None) -> tuple[T | None, str]:
    if handed is None:
        return None, "this rank could not read the survivor's memory"
    try:
        return load(handed[0], handed[1]), ""
    except Exception as exc:  # a skeleton naming tensors nobody holds, an unreadable one: agreed on by the caller
        return None, first_line(exc)


def _own_tensors(own: Callable[[], dict[str, torch.Tensor]] | None, layout: Layout) -> list[torch.Tensor | None]:
    """This rank's own tensors for `layout`'s ids where they have the dtype and shape, else None. A tensor read into
    is then loaded onto itself, which copies nothing (a copy between the same memory returns at once)."""
    try:  # between two collectives: a failure here must not leave the other ranks waiting
        tensors = own() if own is not None else {}
    except Exception:
        tensors = {}
    into: list[torch.Tensor | None] = []
    for tid, (_, _, dtype, shape) in layout.items():
        t = tensors.get(tid)
        into.append(t if t is not None and t.dtype == dtype and list(t.shape) == shape else None)
    return into


def _views(buf: torch.Tensor, layout: Layout, total: int, skeleton_len: int) -> tuple[dict[str, torch.Tensor], bytes]:
    """The live tensors as views of `buf` (laid out by `layout`), and the skeleton's bytes after them."""
    live = {
        tid: buf[offset : offset + nbytes].view(dtype).reshape(shape)
        for tid, (offset, nbytes, dtype, shape) in layout.items()
    }
    return live, buf[total:].numpy().tobytes() if skeleton_len else b""
