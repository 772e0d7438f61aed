"""The memory tier: each rank's latest snapshots in node shared memory that outlives the worker process (L2).

`stalwart run` gives every worker a directory in /dev/shm (STALWART_SNAPSHOT_DIR) that the agent removes when it
exits. A worker keeps two slot files there, `local<L>.slot0` and `local<L>.slot1` (L: its local rank), and
writes each snapshot into the older one, so a worker killed in the middle of a snapshot still leaves the
previous one whole. After a restart the ranks agree on the newest step that every rank holds in one of its
slots; since a rank is never more than one step ahead of its peers (a step ends with collectives), two slots
always contain a common step. If that step is at least as new as the newest durable checkpoint, the job resumes
from memory: no storage read, and at most the step that was interrupted is redone. Ward slots keep other
nodes' ranks' snapshot images (peer replicas, L3, see checkpoint/tiers/replicas.py).

A slot file (checkpoint/tiers/slot.py) is a header, a table of contents and the tensor bytes; its header is
written valid last, so a torn snapshot is never loaded. There is no checksum: the bytes never leave this node's
memory, and hashing every step would cost more than the copy (durable checkpoints carry xxh3).

This module writes the snapshots; reading them back, for a restart or a rollback, is the business of
checkpoint/tiers/memory_read.py (MemoryTier's base class).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stalwart.checkpoint.format.serialize import (
    FlattenCache,
    TensorItem,
    assign_owners,
    dtype_name,
    flatten,
    is_frozen,
)
from stalwart.checkpoint.save.overlap import UpdateFence
from stalwart.checkpoint.save.side_copy import CopyDone, SideCopy, ended, installed_side_copy
from stalwart.checkpoint.save.staging import aligned
from stalwart.checkpoint.tiers.memory_read import MemoryReader
from stalwart.checkpoint.tiers.slot import (
    HEADER as HEADER,
)
from stalwart.checkpoint.tiers.slot import (
    HEADER_BYTES,
    PAGE,
    Slot,
    SlotHeader,
    whole_image,
    write_image,
)
from stalwart.checkpoint.tiers.toc import STEP_IN_HEADER, TocCache, split_values
from stalwart.runtime.env import SNAPSHOT_DIR_ENV as SNAPSHOT_DIR_ENV

COPY_WAIT_S = 5.0
"""How long the tier waits for a snapshot's copy still running on the GPU before giving it up (a hung stream):
when it closes, and when a rollback or an installed image drops a snapshot not yet published."""


class MemoryTier(MemoryReader):
    """This rank's two snapshot slots in the node's shared-memory directory.

    Replicated objects (a DDP model and its optimizer, see `replicated` of `snapshot`) are identical on every
    rank, so the ranks of one node split them: each tensor is copied by one local rank (the same pure assignment
    as the durable checkpoint's owners, over the local ranks); a rank restoring reads the rest from its peers'.

    On a GPU a full snapshot is copied like a durable checkpoint's (save/side_copy.py): into slots registered
    with CUDA, on a side stream, the copies of the tensors only an optimizer step writes left running under the
    next step. Such a snapshot is not valid until `publish()` (the Job calls it at the next step's end, on every
    rank alike): its header is written then, so a rank that dies before it still has its previous snapshot,
    whole, and never a torn one.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        rank: int,
        world_size: int,
        local_rank: int = 0,
        local_world_size: int = 1,
        side_copy: SideCopy | None = None,
        *,
        copy_wait_s: float = COPY_WAIT_S,
        kind: str = "slot",
    ) -> None:
        super().__init__(Path(directory), rank, world_size, local_rank, local_world_size, kind)
        self.copy_wait_s = copy_wait_s
        self._tocs = TocCache()
        # snapshot_light's reused part: (live data pointers, replicated skeleton or None, live id -> dtype, shape)
        self._light_reuse: tuple[frozenset[int], dict[str, Any] | None, dict[str, Any]] | None = None
        self._per_rank = FlattenCache(rank, frozenset())  # snapshot_light's per-rank state, same shape each step
        self._next: dict[str, int] = {}  # kind -> the slot this process writes next (the older one)
        self.side = side_copy or installed_side_copy() or SideCopy()
        """What copies snapshots into the slots (save/side_copy.py); its `on_host`: CPU tensors' copies can be
        left running too, and the fence waits for them on the host."""
        self.overlap: UpdateFence | None = None
        """On a GPU (set by the Job, as Checkpointer.overlap): a full snapshot's copies of the tensors only an
        optimizer step writes are left running under the next step, and the fence orders that step's optimizer
        after them. None: every copy ends before snapshot() returns."""
        self._pending: _Pending | None = None  # the full snapshot whose copy was left running, not yet valid

    @classmethod
    def from_env(
        cls, rank: int, world_size: int, local_rank: int, local_world_size: int, side_copy: SideCopy | None = None
    ) -> MemoryTier | None:
        directory = os.environ.get(SNAPSHOT_DIR_ENV)
        if not directory or not os.path.isdir(directory):
            return None
        return cls(directory, rank, world_size, local_rank, local_world_size, side_copy)

    def forget_after(self, step: int) -> list[int]:
        """Invalidate this rank's own snapshots (full and light) of steps after `step`: after a rollback
        (recovery/rollback.py) they belong to a history the job abandoned, and a restart must not resume from
        them. Returns the steps forgotten."""
        forgotten = []
        self._next.clear()
        if self._pending is not None and self._pending.step > step:
            forgotten.append(self._pending.step)
            self._drop_pending()
        for slot in (*self._slots, *self._light):
            h = slot.header()
            if h is None or h.step <= step or h.rank != self.rank:
                continue
            forgotten.append(h.step)
            slot.invalidate()
        return sorted(forgotten)

    def snapshot(
        self,
        step: int,
        state: dict[str, Any],
        replicated: frozenset[str] = frozenset(),
        live: AbstractSet[int] | None = None,
    ) -> tuple[float, int]:
        """Copy this rank's share of `state` into the older slot; returns (seconds, bytes). The whole cost is
        this copy. `replicated` names the objects that are identical on every rank (split across local ranks).

        With `live` (the data pointers of replicated tensors that the survivors of a failure keep in their own
        memory: parameters and optimizer state), the snapshot is light: those tensors are left out, listed by
        id, dtype and shape, and everything else (per-rank objects, RNG, buffers) is copied into the light
        slots. A restore then takes the live tensors from a survivor (see `load_light`).

        On a CPU the copy is synchronous on purpose: a background thread saved no wall time when measured. On a
        GPU with `overlap` set, a full snapshot's copies of stable tensors run on a side stream and the snapshot
        is valid from `publish()` on (the class docstring); `running` says whether one is pending."""
        started = time.perf_counter()
        skeleton, items = flatten(state, self.rank, replicated)
        table, total, absent = [], 0, {}
        if live is not None:
            for item in items:
                if item.id.startswith("R/") and item.tensor.data_ptr() in live and item.nbytes:
                    absent[item.id] = [dtype_name(item.tensor.dtype), list(item.tensor.shape)]
                    continue
                table.append((item, total))
                total = aligned(total + item.nbytes)
        else:
            shared = [(i.id, i.nbytes) for i in items if i.id.startswith("R/")]
            owners = assign_owners(shared, self.local_world_size) if shared else {}
            for item in items:
                if owners.get(item.id, self.local_rank) != self.local_rank:
                    continue  # a local peer copies this replicated tensor
                table.append((item, total))
                total = aligned(total + item.nbytes)
        self._write(step, "light" if live is not None else "full", skeleton, table, total, absent)
        return time.perf_counter() - started, total

    @property
    def running(self) -> int | None:
        """The step of the full snapshot whose copy is still to be published, if any."""
        return self._pending.step if self._pending is not None else None

    def publish(self, wait_s: float | None = None) -> int | None:
        """Make the snapshot whose copy was left running valid once the copy has ended; returns its step (None
        if there was none, or it was given up). Waits for the copy (by the next step's end it has long ended:
        that step's optimizer step waited for it on the GPU), for at most `wait_s` seconds if given: a copy
        still queued then (behind a hung compute stream) is given up, and its slot with it."""
        pending = self._pending
        if pending is None or not self._settle(wait_s) or not pending.slot.mapped:
            return None
        pending.slot.write_header(pending.header)
        return pending.step

    def _drop_pending(self) -> None:
        """Let the running copy end (for at most `copy_wait_s`) and leave its snapshot invalid (a rollback
        abandoned its step): a copy queued behind a hung stream must not hang the rollback with it."""
        self._settle(self.copy_wait_s)

    def _settle(self, wait_s: float | None) -> bool:
        """Take the pending snapshot off once its copy has ended (True), or give its slot up if the copy is still
        running after `wait_s` (False): the next snapshot then goes to the slot given up (a new file), not over
        the older one."""
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        if ended(pending.done, wait_s):
            return True
        pending.slot.give_up()
        self._next.clear()
        return False

    def snapshot_light(
        self, step: int, state: dict[str, Any], replicated: Callable[[], dict[str, Any]], live: AbstractSet[int]
    ) -> tuple[float, int] | None:
        """A light snapshot from this rank's own part of the state alone: `state` holds only the per-rank
        objects (with the step, RNG and world size), and the replicated objects' part (their skeleton and the ids,
        dtypes and shapes of their live tensors) is computed from `replicated()` (name -> state_dict) once per
        set of `live` tensors and reused: walking the replicated objects every step was about half of a light
        snapshot's cost (docs/benchmarks.md).

        The reused skeleton can hold stale non-tensor state (an optimizer's learning rate), so the snapshot
        says a restore must take the replicated objects' skeletons from the survivor (`load_light` refuses one
        without). Returns None, having written nothing, when a replicated tensor is not live (a module's
        buffers, which change in the forward pass and must be copied): `snapshot` then takes the whole state."""
        started = time.perf_counter()
        key = live if isinstance(live, frozenset) else frozenset(live)
        if self._light_reuse is None or self._light_reuse[0] != key:
            self._light_reuse = (key, *self._replicated_part(replicated(), live))
        _, shared_skeleton, absent = self._light_reuse
        if shared_skeleton is None:
            return None
        flat = self._per_rank
        skeleton, items = flat.flatten({k: v for k, v in state.items() if k != "step"})  # the step: in the header
        table, total = [], 0
        for item in items:
            table.append((item, total))
            total = aligned(total + item.nbytes)
        survivor = tuple(shared_skeleton)

        def shape_of() -> dict[str, Any]:
            """The per-rank skeleton split into shape and values (as flat.values), the replicated part whole."""
            shape = split_values(skeleton, [])
            return {"step": STEP_IN_HEADER, **shape, "objects": {**shape["objects"], **shared_skeleton}}

        if flat.template is None:  # no template (shared memory between two tensors): the general way
            merged = {"step": step, **skeleton, "objects": {**skeleton["objects"], **shared_skeleton}}
            self._write(step, "light", merged, table, total, absent, survivor_skeleton=survivor)
        else:
            toc = self._tocs.toc_split(
                "light", (flat.template, shared_skeleton, absent), shape_of, flat.values, table, absent, survivor
            )
            self._write(step, "light", None, table, total, absent, survivor_skeleton=survivor, toc=toc)
        return time.perf_counter() - started, total

    def _replicated_part(
        self, objects: dict[str, Any], live: AbstractSet[int]
    ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """(skeleton of the replicated objects, their live tensors' id -> [dtype, shape]); (None, {}) if any of
        their tensors is not live."""
        skeleton, items = flatten({"objects": objects}, self.rank, frozenset(objects))
        absent: dict[str, Any] = {}
        for item in items:
            if not item.nbytes or item.tensor.data_ptr() not in live:
                return None, {}
            absent[item.id] = [dtype_name(item.tensor.dtype), list(item.tensor.shape)]
        return skeleton["objects"], absent

    def _write(
        self,
        step: int,
        kind: str,
        skeleton: Any,
        table: list[tuple[TensorItem, int]],
        total: int,
        absent: dict[str, Any],
        *,
        survivor_skeleton: tuple[str, ...] = (),
        toc: tuple[bytes, bytes] | None = None,
    ) -> None:
        """Into the older slot of `kind`: the header invalid first, then the table of contents and the tensors,
        the header valid last."""
        contents, layout = toc or self._tocs.toc(kind, skeleton, table, absent, survivor_skeleton)
        data_offset = aligned(HEADER_BYTES + len(contents), PAGE)
        slots = self._light if kind == "light" else self._slots
        index = self._next.get(kind)
        if index is None:  # the first write, or another wrote a slot: from the headers
            index = slots.index(self._older(slots))
        target = slots[index]
        if self._pending is not None and self._pending.slot is target:
            self._drop_pending()  # never published (no step's end came): its copy ends before this one starts
        m = target.ensure(data_offset + total)
        SlotHeader.writing(self.rank, self.world_size).pack_into(m)  # invalid while writing
        if target.layout is not layout or target.data_offset != data_offset:
            target.written.clear()  # another layout: what the slot held where is no longer known
            target.layout, target.data_offset = layout, data_offset
        if target.toc is not contents:
            m[HEADER_BYTES : HEADER_BYTES + len(contents)] = contents
            target.toc = contents
        written = target.written
        pairs = []
        for item, offset in table:
            at = data_offset + offset
            if written.get(at) is item.tensor:
                continue  # a frozen tensor this slot already holds there (a generator that has not moved)
            pairs.append((item.tensor, target.view(at, item.tensor.dtype, item.tensor.shape)))
            if is_frozen(item.tensor):
                written[at] = item.tensor
            else:
                written.pop(at, None)
        fence = self.overlap if kind == "full" else None
        with torch.no_grad():
            done = self.side.copy(pairs, pinned=target.pinned, stable=fence.stable() if fence else None)
        device = next((t.device for t, _ in pairs if t.is_cuda), None)
        if kind == "full" and (device is not None or self.side.on_host):
            target.pin_later(self.side, device)  # the next snapshots into this slot copy at PCIe speed, and overlap
        header = SlotHeader(1, step, self.rank, self.world_size, len(contents), data_offset, total)
        if done is not None and fence is not None:
            fence.defer(done, device)  # the next optimizer step waits for the copy (on the GPU)
            self._pending = _Pending(step, done, target, header)
        else:
            header.pack_into(m)
        self._next[kind] = 1 - index  # now the older one, as long as only this process writes them

    def install(self, image: bytes, *, light: bool) -> bool:
        """Make an image of this rank's own snapshot, brought back from the node that kept it, one of this
        rank's slots (the older); False (nothing written) if it is not a whole image of this rank."""
        header = SlotHeader.unpack(image)
        if not whole_image(image, self.world_size) or header is None or header.rank != self.rank:
            return False
        self._drop_pending()
        self._next.clear()
        write_image(self._older(self._light if light else self._slots), image)
        return True

    def close(self, wait_s: float | None = None) -> None:
        """Publish a snapshot whose copy is still running if it ends within `wait_s` (default `copy_wait_s`; 0
        after a failure: only one already done), then unmap the slots."""
        self.publish(self.copy_wait_s if wait_s is None else wait_s)
        self._next.clear()
        for slot in [*self._slots, *self._light]:
            slot.close()


@dataclass(frozen=True, slots=True)
class _Pending:
    """A full snapshot whose copy was left running: its slot's header is written when the copy has ended."""

    step: int
    done: CopyDone
    slot: Slot
    header: SlotHeader
