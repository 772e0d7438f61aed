"""Resharding from node memory: a job restarted at another world size takes its state from the full snapshots
the previous world's ranks left in this node's memory, instead of from the durable checkpoint.

Why: when the world size changes (a node lost or back under `stalwart run --nnodes MIN:MAX`), the workers start
again, but the node memory of the agents that stay (checkpoint/tiers/memory.py) still holds every old rank's
newest snapshots: its own local ranks' slots, and the ward slots where peer replicas keep other nodes' ranks'
images (checkpoint/tiers/replicas.py). These are newer than the durable checkpoint (up to `checkpoint_every`
steps) and are read at memory speed instead of from storage.

A node can reshard from memory at a step when it holds a whole full image of that step for every old rank (light
images lack the replicated state: it came from a survivor's live state, and no survivor kept it across a
restart); a rank whose node lacks some reads them from their heads and the parts of them it fetched from a node
that has them (recovery/memory_reshard.py, which chooses the step: the newest the nodes hold together, if at least
as new as the newest durable checkpoint).
Each new rank then reads, like a durable resharding
(checkpoint/load/shards.py): the skeleton and per-rank tensors of old rank (its rank mod the old world size), the
replicated tensors from whichever image holds them, and of the sharded tensors only the byte ranges of the old
shards that overlap its new shards (format/sharded.py `reshard`), each read straight from the slot file.

A slot is written again only by the new world's snapshots, which come after every rank's restore (the first
step's collectives wait for it) and go into the older of a local rank's two slots; every read still checks the
slot's header afterwards, so an image overwritten meanwhile is reported as unusable, never loaded torn.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stalwart.checkpoint.format.serialize import dtype_from_name, unflatten
from stalwart.checkpoint.format.sharded import row_range
from stalwart.checkpoint.tiers.slot import (
    HEADER_BYTES,
    SlotContent,
    SlotHeader,
    live_shapes,
    read_image,
    whole_image,
)
from stalwart.checkpoint.tiers.toc import parse_toc
from stalwart.errors import CheckpointCorruptError


def _slot_files(directory: Path, kind: str = "slot") -> list[Path]:
    """Every slot file of one kind in a node's memory directory: full snapshots (`slot`: own slots
    `local<L>.slot<i>` and ward slots `local<L>.ward<k>.slot<i>`) or light ones (`light`: `...light<i>`)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    suffix = f".{kind}"
    return sorted(directory / n for n in names if n.startswith("local") and n[-len(suffix) - 1 : -1] == suffix)


def _header(path: Path) -> SlotHeader | None:
    try:
        with open(path, "rb") as f:
            header = SlotHeader.unpack(f.read(HEADER_BYTES))
    except OSError:
        return None
    return header if header is not None and header.valid == 1 else None


def holdings(directory: Path, world_size: int, kind: str = "slot") -> dict[tuple[int, int], dict[int, Path]]:
    """(old world size, step) -> {old rank: its slot file} of every whole full image of another world size than
    `world_size` (-1: of any) that this node's memory holds (its own slots and ward slots; of `kind`: "stretch", the
    images FSDP2 survivors leave at a grow, slot_files.py)."""
    held: dict[tuple[int, int], dict[int, Path]] = {}
    for path in _slot_files(directory, kind):
        h = _header(path)
        if h is not None and h.world_size != world_size and 0 <= h.rank < h.world_size:
            held.setdefault((h.world_size, h.step), {}).setdefault(h.rank, path)
    return held


def light_image_of(directory: Path, world_size: int, step: int, rank: int) -> bytes:
    """Old rank `rank`'s light snapshot of `step` at `world_size` as a slot image, from this node's memory (its own
    light slots, the ward light slots where peer replicas keep another node's ranks' images): the per-rank part a
    rank takes after a change of world size, the replicated part coming from a survivor's live state
    (recovery/restore.py). Empty if the node holds none whole."""
    for path in _slot_files(directory, "light"):
        h = _header(path)
        if h is not None and (h.world_size, h.step, h.rank) == (world_size, step, rank):
            image = read_image(path, h)
            if image:
                return image
    return b""


def light_content(image: bytes, step: int) -> tuple[dict[str, tuple[torch.dtype, list[int]]], SlotContent]:
    """A light snapshot's image (`light_image_of`, here or from another node) as MemoryTier.light gives its own: the
    tensors left to the live state, and the content for `load_light`. CheckpointCorruptError if not whole."""
    h = SlotHeader.unpack(image)
    if h is None or h.step != step or not whole_image(image, h.world_size):
        raise CheckpointCorruptError(f"the light memory snapshot of step {step} is not whole")
    try:
        skeleton, table, live, survivor = parse_toc(image[HEADER_BYTES : HEADER_BYTES + h.toc_len], step)
    except Exception as exc:
        raise CheckpointCorruptError(f"the light memory snapshot of step {step} cannot be read: {exc}") from exc
    content = SlotContent(skeleton, table, bytearray(image[h.data_offset : h.image_len]), live, survivor)
    return live_shapes(content), content


@dataclass(frozen=True, slots=True)
class _Image:
    path: Path | None
    """None: an image held by another node, of which this rank has the head (`head_of`) and the parts it fetched."""
    header: SlotHeader
    skeleton: Any
    table: dict[str, list[Any]]


Part = tuple[int, int, int]
"""(old rank, first byte in its image's data, bytes): a part of an image another node holds."""


def head_of(directory: Path, world_size: int, step: int, rank: int, kind: str = "slot") -> bytes:
    """The head of old rank `rank`'s full image of `step` (its header and table of contents, no data): what a node
    lacking the image needs to know which parts of it to fetch; empty if this node holds it no longer."""
    path = holdings(directory, -1, kind).get((world_size, step), {}).get(rank)
    h = _header(path) if path is not None else None
    if path is None or h is None:
        return b""
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES + h.toc_len)
    return head if _header(path) == h and len(head) == HEADER_BYTES + h.toc_len else b""


class MemoryImages:
    """Every old rank's full image of one step (a `sharded.ShardSource`), and each old rank's state from them: from
    this node's memory, and for images only another node holds, from their heads and the parts of their data this
    rank fetched (recovery/memory_reshard.py). With `recording` set (a list), a read of such a part is only noted
    there (what to fetch) and leaves its tensor as it is."""

    def __init__(
        self,
        directory: Path,
        world_size: int,
        step: int,
        remote: dict[int, bytes] | None = None,
        kind: str = "slot",
    ) -> None:
        """`world_size`: the old world's; `remote`: old rank -> the head of its image, for images this node lacks;
        `kind`: as `holdings`'. Raises CheckpointCorruptError if an old rank's image is not whole."""
        self.step, self.world_size = step, world_size
        self.bytes = 0
        """Bytes of tensors read so far."""
        self.recording: list[Any] | None = None  # of Part
        self.fetched: dict[Part, bytes] = {}
        self._images: dict[int, _Image] = {}
        for rank, head in (remote or {}).items():
            h = SlotHeader.unpack(head)
            if h is None or (h.valid, h.world_size, h.step, h.rank) != (1, world_size, step, rank):
                raise CheckpointCorruptError(f"the memory snapshot of rank {rank} at step {step} did not arrive whole")
            self._images[rank] = self._parsed(None, h, head[HEADER_BYTES : HEADER_BYTES + h.toc_len])
        for path in _slot_files(directory, kind):
            h = _header(path)
            if h is None or (h.world_size, h.step) != (world_size, step) or h.rank in self._images:
                continue
            with open(path, "rb") as f:
                f.seek(HEADER_BYTES)
                raw = f.read(h.toc_len)
            self._images[h.rank] = self._parsed(path, h, raw)
            self._check(self._images[h.rank])
        missing = sorted(set(range(world_size)) - set(self._images))
        if missing:
            raise CheckpointCorruptError(f"node memory holds no whole snapshot of step {step} for ranks {missing}")
        self._where: dict[str, int] = {}  # tensor id -> the old rank whose image holds it (shared ones: a local one)
        for rank, image in sorted(self._images.items(), key=lambda item: (item[1].path is not None, -item[0])):
            self._where.update(dict.fromkeys(image.table, rank))
        self._shards: dict[str, list[str]] | None = None

    def _parsed(self, path: Path | None, h: SlotHeader, toc: bytes) -> _Image:
        try:
            skeleton, table, _, _ = parse_toc(toc, self.step)
        except Exception as exc:
            raise CheckpointCorruptError(f"the memory snapshot of rank {h.rank} at step {self.step}: {exc}") from exc
        return _Image(path, h, skeleton, table)

    def local_part(self, part: Part) -> bytes:
        """A part of an image this node holds, for a rank of another node that lacks it; CheckpointCorruptError if
        the image changed meanwhile or ends before it."""
        rank, start, length = part
        image = self._images.get(rank)
        if image is None or image.path is None or start < 0 or start + length > image.header.data_len:
            raise CheckpointCorruptError(f"node memory holds no part {part} of rank {rank}'s snapshot")
        with open(image.path, "rb", buffering=0) as f:
            f.seek(image.header.data_offset + start)
            data = f.read(length)
        self._check(image)
        if len(data) != length:
            raise CheckpointCorruptError(f"the memory snapshot of rank {rank} ends inside part {part}")
        return data

    def shard_ids(self, tensor: str) -> list[str]:
        if self._shards is None:  # once: a model has thousands of tensors, each asked for
            self._shards = {}
            for tid in sorted(t for t in self._where if t.startswith("D/")):
                self._shards.setdefault(tid.rsplit("@", 1)[0], []).append(tid)
        return self._shards.get(tensor, [])

    def _locate(self, tid: str, rank: int | None = None) -> tuple[_Image, list[Any]]:
        owner = rank if rank is not None else self._where.get(tid)
        image = self._images.get(owner) if owner is not None else None
        entry = image.table.get(tid) if image is not None else None
        if image is None or entry is None:
            raise CheckpointCorruptError(f"no memory snapshot of step {self.step} holds tensor {tid}")
        return image, entry

    def _read(
        self, tid: str, out: torch.Tensor | None, rank: int | None = None, part: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Tensor `tid` (or the bytes `part` = (start, length) of it) into `out` (a new tensor if None)."""
        image, (offset, nbytes, dtype_text, shape) = self._locate(tid, rank)
        dtype = dtype_from_name(dtype_text)
        if out is None:  # in a dry run, no memory: the state it makes is only walked
            out = torch.empty(shape, dtype=dtype, device="meta" if self.recording is not None else "cpu")
        start, length = part if part is not None else (0, nbytes)
        key = (image.header.rank, offset + start, length)
        if self.recording is not None:  # a dry run: nothing is read, another node's parts are noted
            if length and image.path is None:
                self.recording.append(key)
            return out
        if length and image.path is None:  # another node's image: the part this rank fetched
            got = self.fetched.get(key)
            if got is None or len(got) != length:
                raise CheckpointCorruptError(f"the memory snapshot of step {self.step}: part {key} was not fetched")
            out.view(-1).view(torch.uint8).numpy()[:] = np.frombuffer(got, dtype=np.uint8)
        elif length:
            assert image.path is not None
            target = out.view(-1).view(torch.uint8).numpy().data
            with open(image.path, "rb", buffering=0) as f:
                f.seek(image.header.data_offset + offset + start)
                read = f.readinto(target)
            if read != length:
                raise CheckpointCorruptError(f"the memory snapshot of step {self.step} ends inside tensor {tid}")
            self._check(image)
        self.bytes += length
        return out

    def _check(self, image: _Image) -> None:
        if image.path is None:
            return
        again = _header(image.path)
        if again is None or (again.step, again.rank, again.world_size) != (
            image.header.step,
            image.header.rank,
            image.header.world_size,
        ):
            raise CheckpointCorruptError(f"the memory snapshot of rank {image.header.rank} changed while it was read")

    def read(self, tid: str) -> torch.Tensor:
        return self._read(tid, None)

    def read_into(self, tid: str, out: torch.Tensor) -> None:
        _, (_, nbytes, dtype_text, shape) = self._locate(tid)
        fits = out.is_contiguous() and list(out.shape) == list(shape) and out.dtype == dtype_from_name(dtype_text)
        if fits and out.numel() * out.element_size() == nbytes:
            self._read(tid, out)
        else:
            out.copy_(self.read(tid))

    def state(self, rank: int) -> dict[str, Any]:
        """Old rank `rank`'s state: its own tensors from its image, replicated ones from whichever image holds
        them, sharded ones empty (resharded afterwards from this source, format/sharded.py)."""
        image = self._images[rank]

        def fetch(tid: str) -> torch.Tensor:
            if tid.startswith("D/"):
                _, entry = self._locate(tid)
                return torch.empty(0, dtype=dtype_from_name(entry[2]))
            return self._read(tid, None, rank if tid in image.table else None)

        state = unflatten(image.skeleton, fetch)
        if not isinstance(state, dict) or "objects" not in state:
            raise CheckpointCorruptError(f"the memory snapshot of step {self.step} is not a stalwart state")
        return state

    def read_region(self, tid: str, shape: list[int], region: tuple[slice, ...], out: torch.Tensor) -> bool:
        """The part `region` of shard `tid` into `out`, read as one byte range, when it is one (whole rows of the
        row-major shard, as where Shard(0) shards overlap): no byte of the shard outside it is read. False when it
        is not; the caller then reads the whole shard."""
        _, (_, nbytes, dtype_text, _) = self._locate(tid)
        part = row_range(shape, region, dtype_from_name(dtype_text), out)
        if part is None or nbytes != math.prod(shape) * out.element_size():
            return False
        if part[0] + part[1] > nbytes:
            raise CheckpointCorruptError(f"the memory snapshot of step {self.step} ends inside tensor {tid}")
        self._read(tid, out, part=part)
        return True
