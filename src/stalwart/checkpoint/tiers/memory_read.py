"""Reading the memory tier back: the snapshots of a step that a rank holds in node shared memory (L2).

Why apart from checkpoint/tiers/memory.py, which writes them: a snapshot is written on the training path every
few steps (the older slot, a side-stream copy, published at the next step's end), and read back only by a restart
or a rollback, with rules of its own. A full snapshot is assembled from this rank's slot and, for the replicated
tensors a local peer copied instead, that peer's slot of the same step. A light one is completed with a
survivor's live tensors and its skeletons of the replicated objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stalwart.checkpoint.format.serialize import unflatten
from stalwart.checkpoint.tiers.slot import Slot, SlotContent, live_shapes, read_slot, tensor_at
from stalwart.checkpoint.tiers.slot_files import SlotFiles
from stalwart.errors import CheckpointCorruptError


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    step: int
    state: dict[str, Any]
    bytes: int


class MemoryReader(SlotFiles):
    """This rank's snapshots read back from its slots (and its local peers'); the base of MemoryTier, which
    writes them."""

    def __init__(
        self, directory: Path, rank: int, world_size: int, local_rank: int, local_world_size: int, kind: str = "slot"
    ) -> None:
        super().__init__(directory, rank, world_size, local_rank, kind)
        self.local_world_size = max(1, local_world_size)

    def steps(self, *, light: bool = False) -> list[int]:
        """The steps this rank holds whole (or, with `light`, light snapshots of), newest first, for this rank
        and world size only."""
        found = []
        for slot in self._light if light else self._slots:
            h = slot.header()
            if h is not None and h.rank == self.rank and h.world_size == self.world_size:
                found.append(h.step)
        return sorted(found, reverse=True)

    def load(self, step: int) -> MemorySnapshot:
        """The state of `step` from whichever slot holds it, replicated tensors it did not copy from its local
        peers' slots of the same step; CheckpointCorruptError if any part is missing or not whole."""
        for slot in self._slots:
            h = slot.header()
            if self._own(h, step):
                assert h is not None
                return self._assemble(read_slot(slot.path, h, step), step)
        raise CheckpointCorruptError(f"no memory slot holds step {step}")

    def light(self, step: int) -> tuple[dict[str, tuple[torch.dtype, list[int]]], Any]:
        """The tensors a light snapshot of `step` left to the survivors (id -> dtype, shape), and a handle for
        `load_light`; CheckpointCorruptError if this rank holds no light snapshot of `step`."""
        for slot in self._light:
            h = slot.header()
            if self._own(h, step):
                assert h is not None
                content = read_slot(slot.path, h, step)
                return live_shapes(content), content
        raise CheckpointCorruptError(f"no light memory slot holds step {step}")

    def load_light(
        self, step: int, content: Any, live: dict[str, torch.Tensor], replicated: dict[str, Any] | None = None
    ) -> MemorySnapshot:
        """The state of `step`: the light snapshot's own tensors, and `live` (from a survivor) for the rest.
        `replicated`: the survivor's skeletons of replicated objects (by name), which replace this snapshot's:
        taken at the optimizer step, its non-tensor state of those objects may predate the step's end."""

        def fetch(tid: str) -> torch.Tensor:
            if tid in content.table:
                return tensor_at(content.table[tid], content.data)
            if tid in live:
                return live[tid]
            raise CheckpointCorruptError(f"tensor {tid} is in neither the light snapshot of step {step} nor a peer's")

        skeleton = content.skeleton
        if content.survivor_skeleton and not replicated:
            raise CheckpointCorruptError(
                f"the light snapshot of step {step} takes the replicated objects' state from the survivor, "
                "which sent none"
            )
        if replicated:
            if not isinstance(skeleton, dict) or not isinstance(skeleton.get("objects"), dict):
                raise CheckpointCorruptError(f"the memory snapshot of step {step} is not a stalwart state")
            unknown = sorted(set(replicated) - set(skeleton["objects"]))
            stale = sorted(set(content.survivor_skeleton) - set(replicated))  # this snapshot's may be stale
            if stale:
                raise CheckpointCorruptError(f"the survivor's state lacks replicated objects {stale}")
            if unknown:
                raise CheckpointCorruptError(f"the survivor's state names objects this snapshot lacks: {unknown}")
            skeleton = {**skeleton, "objects": {**skeleton["objects"], **replicated}}
        state = unflatten(skeleton, fetch)
        if not isinstance(state, dict) or "objects" not in state:
            raise CheckpointCorruptError(f"the memory snapshot of step {step} is not a stalwart state")
        return MemorySnapshot(step, state, len(content.data))

    def _assemble(self, own: SlotContent, step: int) -> MemorySnapshot:
        peers: dict[int, tuple[dict[str, list[Any]], bytearray | memoryview]] = {}

        def fetch(tid: str) -> torch.Tensor:
            if tid in own.table:
                return tensor_at(own.table[tid], own.data)
            if not tid.startswith("R/"):
                raise CheckpointCorruptError(f"tensor {tid} is missing from the memory snapshot")
            for peer in range(self.local_world_size):
                if peer == self.local_rank:
                    continue
                if peer not in peers:
                    peers[peer] = self._peer(peer, step)
                table, data = peers[peer]
                if tid in table:
                    return tensor_at(table[tid], data)
            raise CheckpointCorruptError(f"no local rank's memory snapshot holds {tid} of step {step}")

        state = unflatten(own.skeleton, fetch)
        if not isinstance(state, dict) or "objects" not in state:
            raise CheckpointCorruptError(f"the memory snapshot of step {step} is not a stalwart state")
        return MemorySnapshot(step, state, len(own.data))

    def _peer(self, local_rank: int, step: int) -> tuple[dict[str, list[Any]], bytearray | memoryview]:
        for index in (0, 1):
            path = self._slot_path(local_rank, index)
            h = Slot(path).header()
            if h is not None and h.step == step and h.world_size == self.world_size:
                got = read_slot(path, h, step)
                return got.table, got.data
        return {}, bytearray()
