"""Where a (re)starting job's state comes from: the choice between the tiers of the recovery ladder.

In order of preference, as long as it is at least as new as the newest durable checkpoint:
1. a light snapshot every rank holds in node memory plus the live replicated tensors a survivor of the
   failure kept (recovery/reform.py), broadcast by the lowest such rank (tier "peer", or "replica" when a
   lost node's ranks got their images back from another node first, L3);
2. a full snapshot every rank holds in node memory (tier "memory", or "replica");
3. at another world size (allowed: a shrink across nodes), a light snapshot of the old world's rank (its rank mod
   the old world size) in node memory plus a survivor's live replicated tensors, as in 1 (tier "peer");
4. at another world size (allowed), the full snapshots the old world's ranks left in node memory, resharded
   (tier "memory", checkpoint/tiers/memory_shards.py), where every rank's node holds every old rank's image;
5. the newest durable checkpoint that verifies on every rank (tier "durable", Checkpointer.load_latest).
Every step of the choice is agreed by all ranks; a rank that cannot use a tier vetoes it for everyone.
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.checkpoint.format.serialize import load_skeleton
from stalwart.checkpoint.load.rank_state import Restored
from stalwart.checkpoint.manager import Checkpointer
from stalwart.checkpoint.tiers import memory_shards
from stalwart.checkpoint.tiers.memory import MemoryTier
from stalwart.checkpoint.tiers.replicas import PeerReplicas
from stalwart.errors import CheckpointCorruptError
from stalwart.recovery import live_handover, memory_reshard, node_handover
from stalwart.recovery.in_loop import survivor
from stalwart.runtime.dist import Comm, Flag, IntMessage
from stalwart.runtime.state_wire import recv_state, send_state
from stalwart.telemetry.events import EventLog

_SLOTS = 2  # a rank keeps two snapshots of each kind (double buffering), so it reports at most two steps


@dataclass(frozen=True, slots=True)
class Holdings(IntMessage):
    """What one rank can restore from without storage, as all ranks gather it."""

    full: tuple[int, ...]
    """Steps of the full snapshots in its node memory."""
    light: tuple[int, ...]
    """Steps of its light snapshots (the per-rank rest; the replicated state comes from a survivor)."""
    live: int
    """The step its kept live replicated state holds (a survivor of a failure), or -1."""
    newest_durable: int
    """Rank 0 only: the newest committed durable checkpoint, or -1."""

    def to_ints(self) -> list[int]:
        def padded(steps: tuple[int, ...]) -> list[int]:
            return [*steps, *[-1] * _SLOTS][:_SLOTS]

        return [*padded(self.full), *padded(self.light), self.live, self.newest_durable]

    @classmethod
    def from_ints(cls, ints: list[int]) -> Holdings:
        def steps(part: list[int]) -> tuple[int, ...]:
            return tuple(s for s in part if s >= 0)

        n = _SLOTS
        return cls(steps(ints[:n]), steps(ints[n : 2 * n]), ints[2 * n], ints[2 * n + 1])


@dataclass(frozen=True, slots=True)
class LightReady(IntMessage):
    """Each rank, before the survivor's live state is broadcast for a light snapshot."""

    usable: int
    """1 if this rank's light snapshot is whole (and, on the source, its live state has every tensor)."""
    live_bytes: int
    """The size of the live tensors the snapshot needs: equal on every rank."""
    skeleton_bytes: int
    """The source's replicated objects' non-tensor state, pickled; 0 elsewhere."""
    node: int
    """recovery/node_handover.node_key: equal and not 0 on every rank when the hand-over can go through the node's
    shared memory."""
    pid: int
    """The source's node_handover.Offer, where the node's other ranks read its live state from its memory: its pid
    (0 where they cannot) ..."""
    table: int
    """... and its table of the pieces' addresses; both 0 on every other rank."""


@dataclass(frozen=True, slots=True)
class LiveElsewhere(IntMessage):
    """The live replicated state a survivor kept from a world of another size (a shrink across nodes), or -1s."""

    step: int
    world_size: int
    newest_durable: int
    """Rank 0 only: the newest committed durable checkpoint, or -1."""


class Restorer:
    """Chooses the tier and loads from it. Collective: every rank calls `restore()` together."""

    def __init__(
        self,
        comm: Comm,
        events: EventLog,
        checkpointer: Checkpointer,
        memory: MemoryTier | None,
        replicas: PeerReplicas,
    ) -> None:
        self._comm = comm
        self._events = events
        self._checkpointer = checkpointer
        self._memory = memory
        self._replicas = replicas
        self._own: Callable[[], dict[str, torch.Tensor]] | None = None

    def restore(
        self,
        *,
        allow_world_size_change: bool,
        meshes: dict[Any, Any] | None = None,
        own: Callable[[], dict[str, torch.Tensor]] | None = None,
    ) -> Restored | None:
        """The newest state the job can resume from; None when there is none (a fresh start). `meshes`: the tracked
        objects' device meshes (format/sharded.py `meshes_of`), which a reshard from node memory plans for. `own`:
        this rank's replicated tensors by id as they are (job/state.py `live_tensors`), which a survivor's live
        state on the same node is read straight into."""
        self._own = own
        try:
            return self._restore(allow_world_size_change, meshes)
        finally:
            self._own = None

    def _restore(self, allow_world_size_change: bool, meshes: dict[Any, Any] | None) -> Restored | None:
        memory, comm = self._memory, self._comm
        directory = memory.directory if memory is not None else None
        newest_durable = self._checkpointer.newest_committed() if comm.rank == 0 else -1
        other = memory_reshard.survey(comm, directory, comm.world_size, newest_durable)
        resized = self._live_elsewhere(newest_durable) if allow_world_size_change else None
        if resized is not None and other is not None and resized[0] < other.step:
            resized = None  # full images of the old world are newer: resharded from those (4. below)
        newer_than = max(other.step if other is not None else -1, resized[0] if resized is not None else -1)
        restored = self._from_memory(newest_durable, newer_than=newer_than)
        if restored is None and resized is not None:
            restored = self._from_light(*resized)
        if restored is None and other is not None:
            restored = memory_reshard.restore(
                comm, self._events, directory, other, meshes, allowed=allow_world_size_change
            )
        return restored or self._checkpointer.load_latest(allow_world_size_change=allow_world_size_change)

    def rollback(self, at_most: int, abandon: Callable[[], None]) -> Restored | None:
        """The newest state from at or before step `at_most` (an L0 rollback, recovery/rollback.py): a full snapshot
        every rank holds in node memory, else the newest durable checkpoint not after it that verifies; None
        when there is neither. Light snapshots do not count: their replicated part would come from the live state
        the rollback abandons. `abandon()` runs once a target exists, before anything is loaded (it invalidates
        the newer snapshots and checkpoints, so a failure during the load resumes from before `at_most`).
        Collective."""
        comm, memory = self._comm, self._memory
        mine = Holdings(
            full=tuple(s for s in memory.steps() if s <= at_most) if memory is not None else (),
            light=(),
            live=-1,
            newest_durable=self._checkpointer.newest_committed(at_most) if comm.rank == 0 else -1,
        )
        every = comm.gather(mine)
        step = max(set.intersection(*[set(h.full) for h in every]), default=-1)
        if step < 0 and every[0].newest_durable < 0:
            return None
        abandon()
        if step >= 0 and step >= every[0].newest_durable:
            snapshot, problem = None, ""
            try:
                assert memory is not None
                snapshot = memory.load(step)
            except CheckpointCorruptError as exc:
                problem = str(exc)
            if self._all_agree(snapshot is not None, step, problem):
                assert snapshot is not None
                where = f"node memory (step {step})"
                return Restored(step, comm.world_size, snapshot.state, where, snapshot.bytes, tier="memory")
        return self._checkpointer.load_latest(at_most=at_most)

    def _from_memory(self, newest_durable: int, newer_than: int = -1) -> Restored | None:
        """The newest state the ranks can rebuild from memory if it is at least as new as the newest durable
        checkpoint and newer than `newer_than` (a state of another world size in node memory: after a shrink and a
        grow back, this world size's images are older); None otherwise. `newest_durable`: rank 0's newest committed
        checkpoint (-1 on the others), read once per restore. Collective: every rank calls it, with or without a
        memory tier."""
        comm, memory = self._comm, self._memory
        from_replica = self._replicas.restore()  # a lost node's ranks get their images back first (L3)
        stash = survivor.stashed()
        mine = Holdings(
            full=tuple(memory.steps()) if memory is not None else (),
            light=tuple(memory.steps(light=True)) if memory is not None else (),
            live=stash.step if stash is not None and stash.world_size == comm.world_size else -1,
            newest_durable=newest_durable,
        )
        every = comm.gather(mine)
        newest_durable = every[0].newest_durable
        common_full = set.intersection(*[set(h.full) for h in every])
        common_light = set.intersection(*[set(h.light) for h in every])
        holders = {h.live: r for r, h in reversed(list(enumerate(every))) if h.live >= 0}  # step -> lowest rank
        by_live = max((s for s in common_light if s in holders), default=-1)
        by_full = max(common_full, default=-1)
        step = max(by_live, by_full)
        if step < 0 or step < newest_durable or step <= newer_than:
            return None
        if by_live > by_full:
            restored = self._from_light(by_live, holders[by_live])
            if restored is not None:
                return dataclasses.replace(restored, tier="replica") if from_replica else restored
            if by_full < 0 or by_full < newest_durable:
                return None
            step = by_full
        snapshot, problem = None, ""
        try:
            assert memory is not None
            snapshot = memory.load(step)
        except CheckpointCorruptError as exc:
            problem = str(exc)
        if not self._all_agree(snapshot is not None, step, problem):
            return None
        assert snapshot is not None
        where = f"{'a peer replica in another node' if from_replica else 'node'}'s memory (step {step})"
        tier = "replica" if from_replica else "memory"
        return Restored(step, comm.world_size, snapshot.state, where, snapshot.bytes, tier=tier)

    def _live_elsewhere(self, newest_durable: int) -> tuple[int, int, int] | None:
        """After a shrink across nodes (the world size changed under survivors that stayed in their loop): the step
        of the survivors' live replicated state, the lowest rank keeping it and the old world size, if at least as
        new as the newest durable checkpoint (`newest_durable`: rank 0's, -1 elsewhere; agreed here); None
        otherwise. Collective."""
        comm, stash = self._comm, survivor.stashed()
        mine = LiveElsewhere(-1, -1, newest_durable)
        if stash is not None and stash.world_size != comm.world_size:
            mine = LiveElsewhere(stash.step, stash.world_size, newest_durable)
        every = comm.gather(mine)
        held = [(m.step, -rank, m.world_size) for rank, m in enumerate(every) if m.step >= 0]
        if not held or max(held)[0] < every[0].newest_durable:
            return None
        step, lowest, old_world = max(held)  # the newest step, then the lowest rank keeping it
        return step, -lowest, old_world

    def _from_light(self, step: int, source: int, old_world: int | None = None) -> Restored | None:
        """Every rank's light snapshot of `step`, with the live tensors broadcast from rank `source`'s stash.
        `old_world`: the snapshots are of that other world size (a shrink, a grow): each rank takes the one of old
        rank (its rank mod `old_world`), as a durable resize takes per-rank objects (docs/checkpoints.md), from its
        node's memory (own or ward slots) or from a rank holding it (`_old_light`)."""
        comm, memory = self._comm, self._memory
        wanted: dict[str, tuple[torch.dtype, list[int]]] = {}
        content, problem = None, ""
        image = self._old_light(step, old_world) if old_world is not None else b""  # every rank takes part
        try:
            if old_world is not None and not image:
                raise CheckpointCorruptError(f"no rank holds old rank {comm.rank % old_world}'s light snapshot")
            if memory is None:
                raise CheckpointCorruptError("this rank has no memory tier")
            if old_world is None:
                wanted, content = memory.light(step)
            else:
                wanted, content = memory_shards.light_content(image, step)
        except CheckpointCorruptError as exc:
            problem = str(exc)
        stash = survivor.stashed()
        if comm.rank == source and content is not None:
            have = stash.tensors if stash is not None else {}
            missing = [
                t
                for t, (dt, shape) in wanted.items()
                if t not in have or have[t].dtype != dt or list(have[t].shape) != shape
            ]
            if missing:
                content, problem = None, f"the survivor's live state lacks {missing[0]}"
        layout, total = {}, 0
        for tid in sorted(wanted):
            dtype, shape = wanted[tid]
            nbytes = math.prod(shape) * dtype.itemsize
            layout[tid] = (total, nbytes, dtype, shape)
            total += -(-nbytes // 64) * 64  # 64-byte aligned, so each view can take its dtype
        skeleton = b""  # the survivor's replicated objects' non-tensor state (see job/step_commit.py)
        if comm.rank == source and stash is not None and stash.skeleton is not None:
            out = io.BytesIO()
            torch.save(stash.skeleton, out)
            skeleton = out.getvalue()
        node = node_handover.node_key(
            memory.directory if memory is not None else None,
            memory.local_world_size if memory is not None else 0,
            comm.world_size,
        )
        with live_handover.offered(source, comm.rank, layout, skeleton, node) as pieces:
            ready = LightReady(int(content is not None), total, len(skeleton), node, *pieces.offer)
            agreed = comm.gather(ready)
            if not all(a.usable for a in agreed) or len({a.live_bytes for a in agreed}) != 1:
                error = problem or "another rank's is not whole, or lists other live tensors"
                self._events.emit("memory_snapshot_unusable", step=step, error=error)
                return None
            skeleton_len, offer = (
                agreed[source].skeleton_bytes,
                node_handover.Offer(agreed[source].pid, agreed[source].table),
            )
            on_node = node != 0 and all(a.node == node for a in agreed)
            directory = memory.directory if on_node and memory is not None else None

            def load(live: dict[str, torch.Tensor], skeleton: bytes) -> Any:
                assert memory is not None
                return memory.load_light(step, content, live, load_skeleton(skeleton) if skeleton_len else None)

            def hand(direct: str) -> live_handover.Handed | None:
                args = (comm, source, pieces, offer, layout, total, skeleton, skeleton_len, step, directory, self._own)
                return live_handover.hand_over(*args, direct=direct)

            # The load's verdict and the read's in one gather, the source's memory offered until then.
            snapshot, route, problem = live_handover.hand_over_and_load(
                comm, hand, directory is not None and offer.pid != 0, load
            )
        if snapshot is None:
            self._events.emit("memory_snapshot_unusable", step=step, error=problem)
            return None
        where = f"node memory (step {step}) and rank {source}'s live state"
        if old_world is not None:
            where += f" of {old_world} ranks"
        where += f" ({route})"
        world = old_world if old_world is not None else comm.world_size
        return Restored(step, world, snapshot.state, where, snapshot.bytes + total, tier="peer")

    def _old_light(self, step: int, old_world: int) -> bytes:
        """The image of old rank (this rank mod `old_world`)'s light snapshot of `step`: from this node's memory, or,
        where the node lacks it (a node that joined), sent by the lowest rank that holds that old rank's (a light
        image is the per-rank part only: kilobytes). Empty where none holds it. Collective."""
        comm, memory = self._comm, self._memory
        image = b""
        if memory is not None:
            image = memory_shards.light_image_of(memory.directory, old_world, step, comm.rank % old_world)
        held = [f.value for f in comm.gather(Flag(int(bool(image))))]
        for receiver, has in enumerate(held):
            senders = [r for r, h in enumerate(held) if h and r % old_world == receiver % old_world]
            if has or not senders:
                continue
            if comm.rank == senders[0]:
                comm.send_bytes(image, receiver)
            elif comm.rank == receiver:
                image = comm.recv_bytes(senders[0])
        return image

    def hand_over(
        self, step: int, source: int, receivers: tuple[int, ...], state: Callable[[], Any]
    ) -> Restored | None:
        """The job grows back after training on shrunk (recovery/shrink.py): rank `source` sends its whole state at
        `step` (`state()`) to each of `receivers`, which get it back; the other survivors hold it already and get
        None. The caller keeps a receiver's own random generators: two ranks must not draw the same dropout masks."""
        comm = self._comm
        if comm.rank == source:
            state_now = state()  # once, whatever the number of receivers
            for rank in receivers:
                send_state(comm, state_now, rank)
            return None
        if comm.rank not in receivers:
            return None
        restored, size = recv_state(comm, source)
        where = f"rank {source}'s live state (the job grew back at step {step})"
        return Restored(step, comm.world_size, restored, where, size, tier="peer")

    def _all_agree(self, usable: bool, step: int, problem: str) -> bool:
        """Whether every rank can use its snapshot of `step`; if not, an event names the first problem."""
        if all(v.value for v in self._comm.gather(Flag(int(usable)))):
            return True
        self._events.emit("memory_snapshot_unusable", step=step, error=problem or "another rank's is not whole")
        return False
