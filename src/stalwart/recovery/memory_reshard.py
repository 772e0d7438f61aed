"""A restart at another world size from the old world's memory snapshots, where the nodes of the new world hold them
(checkpoint/tiers/memory_shards.py reads them; this module decides and moves them).

Why here and not in each node alone: after a shrink every surviving node may hold every old rank's full image (its
own ranks' slots, and the lost node's ranks' images in the ward slots of peer replicas), but after a grow the
joining node holds none: its state must come from the live nodes' memory, not from the durable checkpoint, which
is older (up to `checkpoint_every` steps). So every rank reports which old images its node holds (`survey`), all
agree on the newest step whose images the nodes hold together, and a node that lacks some receives them from a
node that has them (one rank of each node writes them into its memory directory, `memory_shards.import_image`)
before every rank reshards from its own node's memory. What moves is whole images: a joining node receives every
old rank's snapshot it lacks, its share of the state plus the rest (reading only the overlapping byte ranges from
another node would move less; not built).
"""

from __future__ import annotations

import socket
import zlib
from dataclasses import dataclass
from pathlib import Path

from stalwart.checkpoint.load.rank_state import Restored
from stalwart.checkpoint.tiers.memory_shards import MemoryImages, holdings, image_of, import_image
from stalwart.errors import CheckpointCorruptError, CheckpointMismatchError
from stalwart.runtime.dist import Comm
from stalwart.telemetry.events import EventLog

_PAIRS = 4
"""The most (old world size, step) pairs a rank reports: its node's newest."""


@dataclass(frozen=True, slots=True)
class ReshardPlan:
    """The old world's state to reshard from: its size and step, and the images each node must first receive,
    as (receiving rank, sending rank, old rank), the same list on every rank."""

    world_size: int
    step: int
    transfers: tuple[tuple[int, int, int], ...]


def _node_key(directory: Path | None) -> int:
    """The same number for the ranks of one node (they share the agent's memory directory)."""
    return zlib.crc32(f"{socket.gethostname()}:{directory}".encode()) if directory is not None else -1


def _gather(comm: Comm, values: list[int]) -> list[list[int]]:
    """Every rank's list of ints, of any length (padded with zeros to the longest)."""
    longest = max(n for [n] in comm.all_gather_ints([len(values)]))
    return comm.all_gather_ints(values + [0] * (longest - len(values)))


def survey(comm: Comm, directory: Path | None, world_size: int, newest_durable: int) -> ReshardPlan | None:
    """The newest (old world, step) whose every old rank's full image some node holds, if at least as new as
    `newest_durable` (rank 0's, -1 elsewhere: agreed here), and the transfers that give every node all of them.
    None when there is none. Collective: every rank calls it, with or without a memory tier (`directory`)."""
    held = holdings(directory, world_size) if directory is not None else {}
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
        transfers = []
        for ranks in sorted(nodes.values()):
            has = set(reports[ranks[0]][2].get((old_world, step), ()))
            transfers += [(ranks[0], holders[old], old) for old in range(old_world) if old not in has]
        return ReshardPlan(old_world, step, tuple(transfers))
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
    comm: Comm, events: EventLog, directory: Path | None, local_rank: int, plan: ReshardPlan, *, allowed: bool
) -> Restored | None:
    """This rank's part of `plan`'s state: moves the images nodes lack, then reads its node's memory (sharded
    tensors to be resharded from there, format/sharded.py). Not `allowed`: CheckpointMismatchError, as for a
    durable checkpoint of another world size, instead of a silent fresh start. Collective. None (on every rank)
    when an image cannot be read whole; the caller goes on to the durable checkpoint."""
    if not allowed:
        raise CheckpointMismatchError(
            f"node memory holds step {plan.step} of a job of {plan.world_size} ranks and this job has "
            f"{comm.world_size}; allow a world-size change (docs/checkpoints.md) or relaunch with the same world size"
        )
    problem = ""
    for receiver, sender, old in plan.transfers:  # a receiver's node lacks the image its sender's holds
        if comm.rank == sender:
            comm.send_bytes(image_of(directory, plan.world_size, plan.step, old) if directory else b"", receiver)
        elif comm.rank == receiver:
            image = comm.recv_bytes(sender)
            if not image or directory is None or not import_image(directory, local_rank, image):
                problem = f"the memory snapshot of rank {old} at step {plan.step} did not arrive whole"
    if plan.transfers:
        comm.barrier()  # every node's imports written before any rank of it reads them
    images, state = None, None
    try:
        if problem or directory is None:
            raise CheckpointCorruptError(problem or "this rank has no memory tier")
        images = MemoryImages(directory, plan.world_size, plan.step)
        state = images.state(comm.rank % plan.world_size)
    except CheckpointCorruptError as exc:
        problem = str(exc)
    if not all(ok for [ok] in comm.all_gather_ints([int(state is not None)])):
        events.emit("memory_snapshot_unusable", step=plan.step, error=problem or "another rank's is not whole")
        return None
    assert images is not None and state is not None
    moved = f", {len(plan.transfers)} images moved between nodes" if plan.transfers else ""
    where = f"node memory (step {plan.step} of {plan.world_size} ranks{moved})"
    return Restored(plan.step, plan.world_size, state, where, images.bytes, tier="memory", shards=images)
