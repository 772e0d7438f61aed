"""Peer replicas of memory snapshots (L3): each rank's snapshot is also kept in the memory of ranks on other nodes.

Why: node memory (L2, checkpoint/tiers/memory.py) outlives a dead worker but not a dead node. When a node is lost, its
ranks' snapshots went with it, and without a copy elsewhere every rank falls back to the durable checkpoint:
up to `checkpoint_every` steps back, plus a read from storage. As in Gemini (SOSP'23), a rank's snapshot image is
sent to ranks on other nodes, which keep it in their own node memory; a replacement node gets it back from them.

Placement: replica k (1..R) of rank r lives on rank (r + k * local_world_size) mod world_size, the same local rank
k nodes further round the ring of nodes, so the R copies sit on R other nodes (failure domains) and any R
nodes can be lost at once as long as no rank loses every holder. Each rank thus sends R images and keeps R.

What is sent is what the snapshot copied: the small light image (per-rank state; the replicated state is then
taken from a survivor) or, with full snapshots, the whole image (this rank's share of it: with several ranks
per node the replicated tensors are split across the node's ranks, and a lost node's ranks all come back
together). Light images are sent at the commit point, before the barrier (job/step_commit.py), so no rank's
parameters reach step N+1 before every rank's image of N+1 is on another node; full images are sent after the
step's snapshot, so a node lost between that snapshot and the send costs its one finished step.

Restore (collective, at resume): a rank whose own slots hold no snapshot of its own (a replacement node, or
ranks handed out in another order by the rendezvous) gets every image of its rank from the one rank that holds
the newest: its ward slots or, after a reshuffle of ranks, its own. Then the usual agreement of the memory tier
runs on the restored slots.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stalwart.checkpoint.tiers.memory import MemoryTier
from stalwart.runtime.dist import IntMessage
from stalwart.telemetry.events import EventLog

if TYPE_CHECKING:
    from stalwart.runtime.dist import Comm

MAX_REPLICAS = 3
"""The most peer replicas a job may ask for; it bounds the fixed-size exchange of what each rank holds."""
_HELD = 4 + 4 * MAX_REPLICAS  # slots a rank may hold: its own 2 full and 2 light, and 4 per replica
_EMPTY = (-1, -1, -1, -1)


@dataclass(frozen=True, slots=True)
class Holding(IntMessage):
    """What a rank holds and needs, agreed at a restore: the replicas it asks for (-1: no memory tier), whether
    it needs its own images back, and its whole images (slot, light, rank, step). A fixed length: _HELD entries,
    padded with _EMPTY."""

    wanted: int
    needy: int
    held: tuple[tuple[int, int, int, int], ...] = ()

    def to_ints(self) -> list[int]:
        ints = [self.wanted, self.needy]
        for entry in [*self.held, *[_EMPTY] * _HELD][:_HELD]:
            ints += [int(v) for v in entry]
        return ints

    @classmethod
    def from_ints(cls, ints: list[int]) -> Holding:
        held = tuple((a, b, c, d) for a, b, c, d in (ints[i : i + 4] for i in range(2, len(ints), 4)) if c >= 0)
        return cls(ints[0], ints[1], held)


class PeerReplicas:
    """Sends this rank's snapshot images to its holders, keeps its wards', and brings a lost rank's back."""

    def __init__(
        self, memory: MemoryTier | None, comm: Comm, events: EventLog, replicas: int, local_world_size: int
    ) -> None:
        self._memory = memory
        self._comm = comm
        self._events = events
        self._lws = max(1, local_world_size)
        nodes = comm.world_size // self._lws if comm.world_size % self._lws == 0 else 0
        self.wanted = max(0, min(replicas, MAX_REPLICAS, nodes - 1))
        self.replicas = 0  # set by restore(), once every rank agrees on it
        self.seconds = 0.0  # the last push's
        self.bytes = 0

    def push(self, step: int, *, light: bool) -> None:
        """Send this rank's image of `step` to its R holders and keep the images its R wards send. Every rank
        calls it at the same point; a dead peer makes it raise, like any collective."""
        if not self.replicas or self._memory is None:
            return
        started = time.perf_counter()
        image = self._memory.image(step, light=light)
        rank, world = self._comm.rank, self._comm.world_size
        for k in range(1, self.replicas + 1):
            theirs = self._comm.exchange(image, (rank + k * self._lws) % world, (rank - k * self._lws) % world)
            self._memory.store_ward(k - 1, theirs, light=light)
        self.seconds, self.bytes = time.perf_counter() - started, len(image) * self.replicas

    def restore(self) -> bool:
        """Bring back the images of every rank whose own slots hold none of its own; returns whether this rank
        got any. Collective: every rank calls it, with or without a memory tier; it also settles `replicas` for
        the run: 0 unless every rank has a memory tier and asks for the same number."""
        started = time.monotonic()
        memory = self._memory
        held = memory.held(self.wanted) if memory is not None else []
        needy = memory is not None and not any(rank == self._comm.rank for _, _, rank, _ in held)
        own = Holding(
            self.wanted if memory is not None else -1, int(needy), tuple((s, int(li), r, st) for s, li, r, st in held)
        )
        gathered = self._comm.gather(own)
        agreed = {g.wanted for g in gathered}
        self.replicas = agreed.pop() if len(agreed) == 1 and min(agreed) > 0 else 0
        if not self.replicas:
            return False
        holdings = [list(g.held) for g in gathered]
        transfers = []  # (needy rank, holder, [(source, light, step)]), the same list on every rank
        for rank, g in enumerate(gathered):
            if not g.needy:
                continue
            offers = {}
            for h, held_by in enumerate(holdings):
                mine = [(s, bool(li), st) for s, li, r, st in held_by if r == rank]
                if mine:
                    offers[h] = mine
            if offers:
                holder = max(offers, key=lambda h: (max(st for _, _, st in offers[h]), -h))
                transfers.append((rank, holder, sorted(offers[holder], key=lambda o: o[2])))
        received: list[tuple[bool, bytes]] = []
        me = self._comm.rank
        for rank, holder, images in transfers:
            if me not in (rank, holder):
                continue
            for source, light, _ in images:
                if holder == me:
                    assert memory is not None
                    image = memory.held_image(self.replicas, source)
                    if rank == me:
                        received.append((light, image))
                    else:
                        self._comm.send_bytes(image, rank)
                else:
                    received.append((light, self._comm.recv_bytes(holder)))
        if not received:
            return False
        assert memory is not None
        installed = [(light, len(image)) for light, image in received if memory.install(image, light=light)]
        source = next(h for r, h, _ in transfers if r == me)
        self._events.emit(
            "replica_restored",
            holder=source,
            images=len(installed),
            bytes=sum(n for _, n in installed),
            seconds=time.monotonic() - started,
        )
        return bool(installed)
