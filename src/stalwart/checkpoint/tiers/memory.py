"""The memory tier: each rank's latest snapshots in node shared memory that outlives the worker process (L2).

`stalwart run` gives every worker a directory in /dev/shm (STALWART_SNAPSHOT_DIR) that the agent removes when it
exits. A worker keeps two slot files there, `local<L>.slot0` and `local<L>.slot1` (L: its local rank), and
writes each snapshot into the older one, so a worker killed in the middle of a snapshot still leaves the
previous one whole. After a restart the ranks agree on the newest step that every rank holds in one of its
slots; since a rank is never more than one step ahead of its peers (a step ends with collectives), two slots
always contain a common step. If that step is at least as new as the newest durable checkpoint, the job resumes
from memory: no storage read, and at most the step that was interrupted is redone. Ward slots keep other
nodes' ranks' snapshot images (peer replicas, L3, see checkpoint/tiers/replicas.py).

A slot file is a 64-byte header (magic, valid, step, rank, world size, and where the rest lies), the table of
contents (checkpoint/tiers/toc.py: JSON holding the pickled skeleton, its plain values and the tensor table) and
the tensor bytes. The header's `valid` word is cleared before anything else is written and set last, together with
the step; a torn snapshot is therefore never loaded. There is no checksum: the bytes never leave this node's
memory, and hashing every step would cost more than the copy (durable checkpoints carry xxh3).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import threading
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
    dtype_from_name,
    dtype_name,
    flatten,
    is_frozen,
    unflatten,
)
from stalwart.checkpoint.save.overlap import UpdateFence
from stalwart.checkpoint.save.side_copy import CopyDone, SideCopy
from stalwart.checkpoint.save.staging import ViewCache, aligned, typed_view
from stalwart.checkpoint.tiers.toc import STEP_IN_HEADER, TocCache, parse_toc, split_values
from stalwart.errors import CheckpointCorruptError
from stalwart.runtime import seams
from stalwart.runtime.env import SNAPSHOT_DIR_ENV as SNAPSHOT_DIR_ENV

MAGIC = 0x5354_414C_5741_5254  # "STALWART"
HEADER = struct.Struct("<QqqqqqQQ")  # magic, valid, step, rank, world_size, toc_len, data_offset, data_len
HEADER_BYTES = 64
PAGE = 4096
COPY_WAIT_S = 5.0
"""How long the tier waits for a snapshot's copy still running on the GPU before giving it up (a hung stream):
when it closes, and when a rollback or an installed image drops a snapshot not yet published."""
_ABANDONED: list[object] = []
"""Slot mappings given up while a copy into them was still queued on the GPU: kept mapped for the rest of the
process (a DMA into freed memory would corrupt whatever reuses it); their files are unlinked, so no later
snapshot shares their pages."""


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    step: int
    state: dict[str, Any]
    bytes: int


class _Slot:
    """One slot file, mapped while this process lives; grows when the state does."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._map: mmap.mmap | None = None
        self._views: ViewCache = {}
        self._buf: torch.Tensor | None = None
        self.toc: bytes | None = None  # the table of contents this process last wrote here (TocCache's bytes)
        self.layout: bytes | None = None  # and its layout token, with the data offset it put the tensors at
        self.data_offset = -1
        self.written: dict[int, torch.Tensor] = {}
        """Offset -> the frozen tensor (serialize.frozen) this process last copied there: not copied again."""
        self.pinned = False  # registered with CUDA (cudaHostRegister): a GPU copy into it can run asynchronously
        self._pinning: threading.Thread | None = None
        self._pin_failed = False
        self._pin_side: SideCopy | None = None
        self._pin_device: torch.device | None = None

    def header(self) -> tuple[int, ...] | None:
        if self._map is not None:  # this process's own mapping of the file: no open() per snapshot
            raw = self._map[:HEADER_BYTES]
        else:
            try:
                with open(self.path, "rb") as f:
                    raw = f.read(HEADER_BYTES)
            except OSError:
                return None
        if len(raw) < HEADER.size:
            return None
        fields = HEADER.unpack_from(raw)
        return fields if fields[0] == MAGIC and fields[1] == 1 else None

    def ensure(self, size: int) -> mmap.mmap:
        if self._map is not None and len(self._map) >= size:
            return self._map
        self.close()
        size = aligned(int(size * 1.1) + PAGE, PAGE)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            else:
                size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._buf = torch.frombuffer(self._map, dtype=torch.uint8)
        return self._map

    def view(self, offset: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        assert self._buf is not None
        return typed_view(self._buf, self._views, offset, dtype, shape)

    def pin_later(self, side: SideCopy, device: torch.device | None) -> None:
        """Register the mapping for copies from `device` through `side` on a background thread, once (after a
        first snapshot has faulted its pages in: registering untouched pages was measured slower, see
        save/staging.py). Until it is done, copies into this slot are the synchronous pageable ones; afterwards
        they run at PCIe bandwidth and can be left running under the next step."""
        if self.pinned or self._pinning is not None or self._pin_failed or self._buf is None:
            return
        buf = self._buf
        self._pin_side, self._pin_device = side, device

        def register() -> None:
            if side.register(buf, device):
                self.pinned = True
            else:
                self._pin_failed = True

        self._pinning = threading.Thread(target=register, daemon=True, name="memory-slot-pin")
        self._pinning.start()

    def _unpin(self) -> bool:
        """Unregister the mapping; True if it may be unmapped (CUDA no longer counts it as pinned)."""
        if self._pinning is not None:
            self._pinning.join()
            self._pinning = None
        released = True
        if self.pinned and self._buf is not None and self._pin_side is not None:
            released = self._pin_side.unregister(self._buf, self._pin_device)
        self.pinned = False
        return released

    def give_up(self) -> None:
        """A copy into this slot is still queued on a GPU that may never run it: keep the mapping alive for the
        rest of the process and unlink the file, so that whatever writes this slot next gets new pages."""
        if self._pinning is not None:
            self._pinning.join()
            self._pinning = None
        _ABANDONED.append((self._map, self._buf))
        with contextlib.suppress(OSError):
            self.path.unlink()
        self._map = self._buf = None
        self.pinned = False
        self.toc = self.layout = None
        self.written.clear()
        self._views.clear()

    def close(self) -> None:
        if not self._unpin():  # still registered: unmapping it would leave CUDA a stale pinned range
            _ABANDONED.append((self._map, self._buf))
            self._map = self._buf = None
        self.toc = self.layout = None
        self.written.clear()
        self._views.clear()
        self._buf = None
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None


class MemoryTier:
    """This rank's two snapshot slots in the node's shared-memory directory.

    Replicated objects (a DDP model and its optimizer, see `replicated` of `snapshot`) are identical on every
    rank, so the ranks of one node split them: each tensor is copied by one local rank (the same pure assignment
    as the durable checkpoint's owners, over the local ranks), and a rank restoring reads the tensors it did not
    copy from its local peers' slots of the same step. With 2 ranks per node each copies half.

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
    ) -> None:
        self.directory = Path(directory)
        self.copy_wait_s = copy_wait_s
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.local_world_size = max(1, local_world_size)
        self._slots = [_Slot(self._slot_path(local_rank, i)) for i in (0, 1)]
        self._light = [_Slot(self._slot_path(local_rank, i, "light")) for i in (0, 1)]
        self._tocs = TocCache()
        # snapshot_light's reused part: (live data pointers, replicated skeleton or None, live id -> dtype, shape)
        self._light_reuse: tuple[frozenset[int], dict[str, Any] | None, dict[str, Any]] | None = None
        self._per_rank = FlattenCache(rank, frozenset())  # snapshot_light's per-rank state, same shape each step
        self._next: dict[str, int] = {}  # kind -> the slot this process writes next (the older one)
        self.side = side_copy or _installed_side_copy() or SideCopy()
        """What copies snapshots into the slots (save/side_copy.py); its `on_host`: CPU tensors' copies can be
        left running too, and the fence waits for them on the host."""
        self.overlap: UpdateFence | None = None
        """On a GPU (set by the Job, as Checkpointer.overlap): a full snapshot's copies of the tensors only an
        optimizer step writes are left running under the next step, and the fence orders that step's optimizer
        after them. None: every copy ends before snapshot() returns."""
        self._pending: _Pending | None = None  # the full snapshot whose copy was left running, not yet valid

    def _slot_path(self, local_rank: int, index: int, kind: str = "slot") -> Path:
        # kind: slot, light, and ward<k>.slot, ward<k>.light for the images kept for another node's rank (L3)
        return self.directory / f"local{local_rank:05d}.{kind}{index}"

    @classmethod
    def from_env(
        cls, rank: int, world_size: int, local_rank: int, local_world_size: int, side_copy: SideCopy | None = None
    ) -> MemoryTier | None:
        directory = os.environ.get(SNAPSHOT_DIR_ENV)
        if not directory or not os.path.isdir(directory):
            return None
        return cls(directory, rank, world_size, local_rank, local_world_size, side_copy)

    def _own(self, header: tuple[int, ...] | None, step: int) -> bool:
        """Whether a slot's header is a whole snapshot of `step` by this rank at this world size: a rank of
        another world size's run may have left the same file name behind."""
        return header is not None and (header[2], header[3], header[4]) == (step, self.rank, self.world_size)

    def steps(self, *, light: bool = False) -> list[int]:
        """The steps this rank holds whole (or, with `light`, light snapshots of), newest first, for this rank
        and world size only."""
        found = []
        for slot in self._light if light else self._slots:
            h = slot.header()
            if h is not None and h[3] == self.rank and h[4] == self.world_size:
                found.append(int(h[2]))
        return sorted(found, reverse=True)

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
            if h is None or h[2] <= step or h[3] != self.rank:
                continue
            forgotten.append(int(h[2]))
            if slot._map is not None:
                struct.pack_into("<q", slot._map, 8, 0)
            else:
                with contextlib.suppress(OSError), open(slot.path, "r+b") as f:
                    f.seek(8)
                    f.write(struct.pack("<q", 0))
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

        On a CPU the copy is synchronous on purpose: copying parameters on a background thread while the next
        step runs was measured here (2 cores, 2 workers) to save no wall time. On a GPU with `overlap` set, a full
        snapshot's copies of stable tensors run on a side stream and the snapshot is valid from `publish()` on
        (the class docstring); `running` says whether one is pending."""
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
        if pending is None or not self._settle(wait_s):
            return None
        m = pending.slot._map
        if m is None:
            return None
        HEADER.pack_into(m, 0, *pending.header)
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
        if _ended(pending.done, wait_s):
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
        set of `live` tensors and reused. Walking the replicated objects every step was about half of a light
        snapshot's cost (flattening 95-146 us of 270-310 us, warm, 4M-parameter MLP with AdamW, 2-core VM).

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
            toc = self._tocs.toc_split("light", (flat.template, shared_skeleton, absent), shape_of, flat.values,
                                       table, absent, survivor)  # fmt: skip
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
        HEADER.pack_into(m, 0, MAGIC, 0, -1, self.rank, self.world_size, 0, 0, 0)  # invalid while writing
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
        header = (MAGIC, 1, step, self.rank, self.world_size, len(contents), data_offset, total)
        if done is not None and fence is not None:
            fence.defer(done, device)  # the next optimizer step waits for the copy (on the GPU)
            self._pending = _Pending(step, done, target, header)
        else:
            HEADER.pack_into(m, 0, *header)
        self._next[kind] = 1 - index  # now the older one, as long as only this process writes them

    @staticmethod
    def _older(slots: list[_Slot]) -> _Slot:
        headers = [s.header() for s in slots]
        steps = [h[2] if h is not None else -1 for h in headers]
        return slots[0] if steps[0] <= steps[1] else slots[1]

    def load(self, step: int) -> MemorySnapshot:
        """The state of `step` from whichever slot holds it, replicated tensors it did not copy from its local
        peers' slots of the same step; CheckpointCorruptError if any part is missing or not whole."""
        for slot in self._slots:
            h = slot.header()
            if self._own(h, step):
                assert h is not None
                return self._assemble(_read_slot(slot.path, h, step), step)
        raise CheckpointCorruptError(f"no memory slot holds step {step}")

    # ---- peer replicas (L3, see checkpoint/tiers/replicas.py): images of whole slots, sent to and kept by other nodes

    def image(self, step: int, *, light: bool) -> bytes:
        """This rank's full (or light) snapshot of `step` as one slot image (header, table of contents, data),
        to keep on another node; empty if no slot holds it whole."""
        for slot in self._light if light else self._slots:
            h = slot.header()
            if self._own(h, step):
                assert h is not None
                return _read_image(slot.path, h)
        return b""

    def _ward_slots(self, replica: int, light: bool) -> list[_Slot]:
        return [_Slot(self._slot_path(self.local_rank, i, f"ward{replica}.{'light' if light else 'slot'}"))
                for i in (0, 1)]  # fmt: skip

    def store_ward(self, replica: int, image: bytes, *, light: bool) -> bool:
        """Keep another rank's slot image (from `image`) in the older of this rank's two ward slots of
        `replica`; False (nothing written) if it is not a whole image of this world size."""
        if not _whole_image(image, self.world_size):
            return False
        target = self._older(self._ward_slots(replica, light))
        try:
            _write_image(target, image)
        finally:
            target.close()
        return True

    def held(self, replicas: int) -> list[tuple[int, bool, int, int]]:
        """Every whole image of this world size in this rank's slots, its own and the ward slots of `replicas`
        replicas: (source, light, rank, step). A source is a slot's number for `held_image`."""
        found = []
        for source, (slot, light) in enumerate(self._all_slots(replicas)):
            h = slot.header()
            if h is not None and h[4] == self.world_size:
                found.append((source, light, int(h[3]), int(h[2])))
        return found

    def held_image(self, replicas: int, source: int) -> bytes:
        """The image in slot `source` of `held`; empty if it is no longer whole."""
        slot = self._all_slots(replicas)[source][0]
        h = slot.header()
        return _read_image(slot.path, h) if h is not None else b""

    def _all_slots(self, replicas: int) -> list[tuple[_Slot, bool]]:
        found = [(s, False) for s in self._slots] + [(s, True) for s in self._light]
        for replica in range(replicas):
            for light in (False, True):
                found += [(s, light) for s in self._ward_slots(replica, light)]
        return found

    def install(self, image: bytes, *, light: bool) -> bool:
        """Make an image of this rank's own snapshot, brought back from the node that kept it, one of this
        rank's slots (the older); False (nothing written) if it is not a whole image of this rank."""
        if not _whole_image(image, self.world_size) or HEADER.unpack_from(image)[3] != self.rank:
            return False
        self._drop_pending()
        self._next.clear()
        _write_image(self._older(self._light if light else self._slots), image)
        return True

    def light(self, step: int) -> tuple[dict[str, tuple[torch.dtype, list[int]]], Any]:
        """The tensors a light snapshot of `step` left to the survivors (id -> dtype, shape), and a handle for
        `load_light`; CheckpointCorruptError if this rank holds no light snapshot of `step`."""
        for slot in self._light:
            h = slot.header()
            if self._own(h, step):
                assert h is not None
                content = _read_slot(slot.path, h, step)
                return {k: (dtype_from_name(v[0]), list(v[1])) for k, v in content.live.items()}, content
        raise CheckpointCorruptError(f"no light memory slot holds step {step}")

    def load_light(
        self, step: int, content: Any, live: dict[str, torch.Tensor], replicated: dict[str, Any] | None = None
    ) -> MemorySnapshot:
        """The state of `step`: the light snapshot's own tensors, and `live` (from a survivor) for the rest.
        `replicated`: the survivor's skeletons of replicated objects (by name), which replace this snapshot's:
        taken at the optimizer step, its non-tensor state of those objects may predate the step's end."""

        def fetch(tid: str) -> torch.Tensor:
            if tid in content.table:
                return _tensor(content.table[tid], content.data)
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

    def _assemble(self, own: _SlotContent, step: int) -> MemorySnapshot:
        peers: dict[int, tuple[dict[str, list[Any]], bytearray]] = {}

        def fetch(tid: str) -> torch.Tensor:
            if tid in own.table:
                return _tensor(own.table[tid], own.data)
            if not tid.startswith("R/"):
                raise CheckpointCorruptError(f"tensor {tid} is missing from the memory snapshot")
            for peer in range(self.local_world_size):
                if peer == self.local_rank:
                    continue
                if peer not in peers:
                    peers[peer] = self._peer(peer, step)
                table, data = peers[peer]
                if tid in table:
                    return _tensor(table[tid], data)
            raise CheckpointCorruptError(f"no local rank's memory snapshot holds {tid} of step {step}")

        state = unflatten(own.skeleton, fetch)
        if not isinstance(state, dict) or "objects" not in state:
            raise CheckpointCorruptError(f"the memory snapshot of step {step} is not a stalwart state")
        return MemorySnapshot(step, state, len(own.data))

    def _peer(self, local_rank: int, step: int) -> tuple[dict[str, list[Any]], bytearray]:
        for index in (0, 1):
            path = self._slot_path(local_rank, index)
            h = _Slot(path).header()
            if h is not None and h[2] == step and h[4] == self.world_size:
                got = _read_slot(path, h, step)
                return got.table, got.data
        return {}, bytearray()

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
    slot: _Slot
    header: tuple[int, ...]


def _installed_side_copy() -> SideCopy | None:
    """The copier plugged into runtime/seams.SIDE_COPY (the tests' threaded stand-in), if any."""
    factory = seams.installed(seams.SIDE_COPY)
    side: SideCopy | None = factory() if factory is not None else None
    return side


def _ended(done: CopyDone, wait_s: float | None) -> bool:
    """Whether the copy has ended, waiting for it for at most `wait_s` seconds (None: as long as it takes)."""
    if wait_s is None:
        done.synchronize()
        return True
    deadline = time.monotonic() + wait_s
    while not done.query():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


def _read_image(path: Path, header: tuple[int, ...]) -> bytes:
    """A slot file's image (header, table of contents, data), or empty if it was overwritten while read."""
    with open(path, "rb") as f:
        image = f.read(header[6] + header[7])
    again = HEADER.unpack_from(image) if len(image) >= HEADER_BYTES else None
    return image if again is not None and again[1:4] == (1, header[2], header[3]) else b""


def _whole_image(image: bytes, world_size: int) -> bool:
    """Whether `image` is a valid slot image of this world size whose header covers exactly its bytes."""
    if len(image) < HEADER_BYTES:
        return False
    magic, valid, _, rank, size, toc_len, data_offset, data_len = HEADER.unpack_from(image)
    return (
        (magic, valid, size) == (MAGIC, 1, world_size)
        and 0 <= rank < size
        and data_offset + data_len == len(image)
        and HEADER_BYTES + toc_len <= data_offset
    )


def _write_image(target: _Slot, image: bytes) -> None:
    """Write a slot image received from elsewhere: invalid while the body is written, its header last."""
    m = target.ensure(len(image))
    target.toc = target.layout = None
    target.written.clear()
    HEADER.pack_into(m, 0, MAGIC, 0, -1, 0, 0, 0, 0, 0)
    m[HEADER_BYTES : len(image)] = image[HEADER_BYTES:]
    m[:HEADER_BYTES] = image[:HEADER_BYTES]


@dataclass(frozen=True, slots=True)
class _SlotContent:
    skeleton: Any
    table: dict[str, list[Any]]
    data: bytearray
    live: dict[str, list[Any]]
    survivor_skeleton: tuple[str, ...] = ()
    """The replicated objects whose skeletons must come from the survivor (snapshot_light's reused part)."""


def _tensor(entry: list[Any], data: bytearray) -> torch.Tensor:
    offset, nbytes, dtype_text, shape = entry
    dtype = dtype_from_name(dtype_text)
    if not nbytes:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype, offset=offset, count=nbytes // dtype.itemsize).reshape(shape)


def _read_slot(path: Path, header: tuple[int, ...], step: int) -> _SlotContent:
    _, _, _, _, _, toc_len, data_offset, data_len = header
    data = bytearray(data_len)
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        toc_raw = f.read(toc_len)
        f.seek(data_offset)
        got = f.readinto(data)
        f.seek(0)
        again = HEADER.unpack_from(f.read(HEADER_BYTES))
    if got != data_len or again[1:3] != (1, step):  # overwritten while we read
        raise CheckpointCorruptError(f"the memory snapshot of step {step} changed while it was read")
    try:
        skeleton, table, live, survivor_skeleton = parse_toc(toc_raw, step)
    except Exception as exc:
        raise CheckpointCorruptError(f"the memory snapshot of step {step} cannot be read: {exc}") from exc
    return _SlotContent(skeleton, table, data, live, survivor_skeleton)
