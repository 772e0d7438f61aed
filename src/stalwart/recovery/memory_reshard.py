"""A restart at another world size from the old world's memory snapshots, where the nodes of the new world hold them
(checkpoint/tiers/memory_shards.py reads them; this module decides and moves what a node lacks).

Why here and not in each node alone: after a shrink every surviving node may hold every old rank's full image (its
own ranks' slots, and the lost node's ranks' images in the ward slots of peer replicas), but after a grow the
joining node holds none: its state must come from the live nodes' memory, not from the durable checkpoint, which
is older (up to `checkpoint_every` steps). So every rank reports which old images its node holds (`survey`), all
agree on the newest step whose images the nodes hold together, and every rank of a node that lacks some gets their
heads (header and table of contents) from a node that holds them, works out which parts of them its restore will
read (a dry run of it: the old rank's state, and the resharding onto its tracked objects' meshes on meta tensors),
and fetches only those (`_fetch`): of the sharded tensors, the byte ranges of the old shards that overlap its new
ones, as each rank reads from its own node's memory; nothing is written to the node's memory directory.
"""

from __future__ import annotations

import socket
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalwart.checkpoint.format import sharded
from stalwart.checkpoint.load.rank_state import Restored
from stalwart.checkpoint.tiers.memory_shards import MemoryImages, Part, head_of, holdings
from stalwart.errors import CheckpointCorruptError, CheckpointMismatchError
from stalwart.runtime.dist import Comm
from stalwart.telemetry.events import EventLog

_PAIRS = 4
"""The most (old world size, step) pairs a rank reports: its node's newest."""


@dataclass(frozen=True, slots=True)
class ReshardPlan:
    """The old world's state to reshard from: its size and step, and the parts of images each rank of a node that
    lacks them must first receive, as (receiving rank, sending rank, old rank), the same list on every rank."""

    world_size: int
    step: int
    transfers: tuple[tuple[int, int, int], ...]
    moved: int = 0
    """Old images some node lacks (each received in part by every rank of that node)."""
    kind: str = "slot"
    """The images' slot kind (checkpoint/tiers/memory_shards.holdings)."""


def _node_key(directory: Path | None) -> int:
    """The same number for the ranks of one node (they share the agent's memory directory)."""
    return zlib.crc32(f"{socket.gethostname()}:{directory}".encode()) if directory is not None else -1


def _gather(comm: Comm, values: list[int]) -> list[list[int]]:
    """Every rank's list of ints, of any length (padded with zeros to the longest)."""
    longest = max(n for [n] in comm.all_gather_ints([len(values)]))
    return comm.all_gather_ints(values + [0] * (longest - len(values)))


def survey(
    comm: Comm, directory: Path | None, world_size: int, newest_durable: int, kind: str = "slot"
) -> ReshardPlan | None:
    """The newest (old world, step) whose every old rank's full image some node holds, if at least as new as
    `newest_durable` (rank 0's, -1 elsewhere: agreed here), and the transfers that give every node all of them.
    None when there is none. Collective: every rank calls it, with or without a memory tier (`directory`)."""
    held = holdings(directory, world_size, kind) if directory is not None else {}
    newest = sorted(held, key=lambda pair: (pair[1], pair[0]), reverse=True)[:_PAIRS]
    mine = [newest_durable, _node_key(directory), len(newest)]
    for old_world, step in newest:
        ranks = sorted(held[(old_world, step)])
        mine += [old_world, step, len(ranks), *ranks]
    reports = [_parse(row) for row in _gather(comm, mine)]
    durable = reports[0][0]
    nodes: dict[int, list[int]] = {}  # node -> its ranks, lowest first
    for rank, (_, node, _) in enumerate(reports):
        nodes.setdefault(node, []).append(rank)
    pairs = {pair for _, _, by_pair in reports for pair in by_pair}
    for old_world, step in sorted(pairs, key=lambda pair: (pair[1], pair[0]), reverse=True):
        if step < durable:
            return None
        holders: dict[int, int] = {}  # old rank -> the lowest rank whose node holds its image
        for rank, (_, _, by_pair) in enumerate(reports):
            for old in by_pair.get((old_world, step), ()):
                holders.setdefault(old, rank)
        if set(holders) != set(range(old_world)):
            continue
        transfers, moved = [], 0
        for ranks in sorted(nodes.values()):
            has = set(reports[ranks[0]][2].get((old_world, step), ()))
            lacking = [old for old in range(old_world) if old not in has]
            moved += len(lacking)
            transfers += [(rank, holders[old], old) for rank in ranks for old in lacking]
        return ReshardPlan(old_world, step, tuple(transfers), moved, kind)
    return None


def _parse(row: list[int]) -> tuple[int, int, dict[tuple[int, int], tuple[int, ...]]]:
    durable, node, count = row[0], row[1], row[2]
    by_pair, at = {}, 3
    for _ in range(count):
        old_world, step, n = row[at], row[at + 1], row[at + 2]
        by_pair[(old_world, step)] = tuple(row[at + 3 : at + 3 + n])
        at += 3 + n
    return durable, node, by_pair


def restore(
    comm: Comm,
    events: EventLog,
    directory: Path | None,
    plan: ReshardPlan,
    meshes: dict[Any, Any] | None,
    *,
    allowed: bool,
    old_rank: int | None = None,
) -> Restored | None:
    """This rank's part of `plan`'s state: from its node's memory, and where its node lacks old images, from their
    heads and only the parts of them this rank will read, fetched from a node that holds them (`_fetch`); sharded
    tensors are then resharded from those (format/sharded.py) onto `meshes` (the tracked objects' device meshes).
    Not `allowed`: CheckpointMismatchError, as for a durable checkpoint of another world size, instead of a silent
    fresh start. Collective. None (on every rank) when an image cannot be read whole; the caller goes on to the
    durable checkpoint. `old_rank`: whose per-rank objects this rank takes (its rank mod the old world size unless
    given: survivors training on shrunk take their own, recovery/in_loop/sharded_stretch.py)."""
    reads = comm.rank % plan.world_size if old_rank is None else old_rank
    if not allowed:
        raise CheckpointMismatchError(
            f"node memory holds step {plan.step} of a job of {plan.world_size} ranks and this job has "
            f"{comm.world_size}; allow a world-size change (docs/checkpoints.md) or relaunch with the same world size"
        )
    problem, remote = "", {}
    for receiver, sender, old in plan.transfers:  # the heads of the images a receiver's node lacks
        if comm.rank == sender:
            head = head_of(directory, plan.world_size, plan.step, old, plan.kind) if directory else b""
            comm.send_bytes(head, receiver)
        elif comm.rank == receiver:
            remote[old] = comm.recv_bytes(sender)
    images, state, fetched = None, None, 0
    try:
        if directory is None:
            raise CheckpointCorruptError("this rank has no memory tier")
        images = MemoryImages(directory, plan.world_size, plan.step, remote, plan.kind)
    except CheckpointCorruptError as exc:
        problem = str(exc)
    if plan.transfers:
        problem, fetched = _fetch(comm, plan, images, meshes, problem, reads)
    try:
        if problem or images is None:
            raise CheckpointCorruptError(problem or "this rank has no memory tier")
        state = images.state(reads)
    except CheckpointCorruptError as exc:
        problem = str(exc)
    if not all(ok for [ok] in comm.all_gather_ints([int(state is not None)])):
        events.emit("memory_snapshot_unusable", step=plan.step, error=problem or "another rank's is not whole")
        return None
    assert images is not None and state is not None
    moved = f", {fetched} bytes of {plan.moved} images moved between nodes" if plan.transfers else ""
    where = f"node memory (step {plan.step} of {plan.world_size} ranks{moved})"
    return Restored(plan.step, plan.world_size, state, where, images.bytes, tier="memory", shards=images)


def _fetch(
    comm: Comm, plan: ReshardPlan, images: MemoryImages | None, meshes: dict[Any, Any] | None, problem: str, reads: int
) -> tuple[str, int]:
    """Every rank of a node lacking old images gets the parts of them it will read, not whole images: a dry run of
    its restore (the old rank's state, and the resharding onto `meshes` on meta tensors) lists them, every rank
    learns every rank's list, and each holder sends each rank what it asked of it, in one global order (deadlock
    free: each pair's send and receive are the same step of it). A part left out of the list is never read as
    zeros: reading it raises CheckpointCorruptError, which stops the load; a dry run that fails, or parts that do not
    arrive whole, are agreed on (`problem`) and the ranks go on to the durable checkpoint. Collective. Returns
    (problem, bytes received). `reads`: the old rank whose per-rank objects this rank reads."""
    wanted: list[Part] = []
    if images is not None and not problem:
        images.recording = wanted
        try:
            state = images.state(reads)
            if meshes is not None:
                sharded.rebuild(state["objects"], meshes, "node memory", images)
        except Exception as exc:  # a mismatch is met again by the real load, which reports it
            problem = problem or f"planning the parts to fetch: {exc}"
        images.recording, images.bytes = None, 0
    asked = _gather(comm, [v for part in sorted(set(wanted)) for v in part])
    holder = {(r, old): sender for r, sender, old in plan.transfers}
    pairs: dict[tuple[int, int], list[Part]] = {}  # (asking rank, holder) -> parts, in one order on every rank
    for rank, row in enumerate(asked):
        for i in range(0, len(row) - 2, 3):
            part = (row[i], row[i + 1], row[i + 2])
            if part[2] > 0 and (rank, part[0]) in holder:
                pairs.setdefault((rank, holder[(rank, part[0])]), []).append(part)
    received = 0
    for (rank, sender), parts in sorted(pairs.items()):
        if comm.rank == sender:
            data = b""
            try:
                assert images is not None
                data = b"".join(images.local_part(p) for p in parts)
            except (AssertionError, CheckpointCorruptError, OSError):
                pass  # an empty answer: the asking rank reports it
            comm.send_bytes(data, rank)
        elif comm.rank == rank:
            data = comm.recv_bytes(sender)
            if len(data) != sum(p[2] for p in parts) or images is None:
                problem = problem or f"the parts of rank {parts[0][0]}'s memory snapshot did not arrive whole"
                continue
            at = 0
            for p in parts:
                images.fetched[p] = data[at : at + p[2]]
                at += p[2]
            received += len(data)
    return problem, received
