"""One snapshot slot file of the memory tier (checkpoint/tiers/memory.py): its header, its mapping, and whole images
of it read and written.

A slot file is a 64-byte header (`SlotHeader`), the table of contents (checkpoint/tiers/toc.py: JSON holding the
pickled skeleton, its plain values and the tensor table) and the tensor bytes. The header's `valid` word is
cleared before anything else is written and set last, together with the step; a torn snapshot is therefore
never loaded.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stalwart.checkpoint.format.serialize import dtype_from_name
from stalwart.checkpoint.save.side_copy import SideCopy
from stalwart.checkpoint.save.staging import ViewCache, aligned, typed_view
from stalwart.checkpoint.tiers.toc import parse_toc
from stalwart.errors import CheckpointCorruptError

MAGIC = 0x5354_414C_5741_5254  # "STALWART"
HEADER = struct.Struct("<QqqqqqQQ")  # magic, valid, step, rank, world_size, toc_len, data_offset, data_len
HEADER_BYTES = 64
PAGE = 4096
_VALID_AT = 8
"""The offset of the header's `valid` word."""


@dataclass(frozen=True, slots=True)
class SlotHeader:
    """A slot file's header, its encoding in one place (HEADER, after the magic word)."""

    valid: int
    """1 once the snapshot is whole; 0 while it is written."""
    step: int
    rank: int
    world_size: int
    toc_len: int
    data_offset: int
    data_len: int

    @classmethod
    def writing(cls, rank: int, world_size: int) -> SlotHeader:
        """The header while a snapshot is written: invalid, no step."""
        return cls(0, -1, rank, world_size, 0, 0, 0)

    @classmethod
    def unpack(cls, raw: bytes | bytearray | mmap.mmap) -> SlotHeader | None:
        """The header at the start of `raw`; None if it is too short or not a slot's."""
        if len(raw) < HEADER.size:
            return None
        magic, *fields = HEADER.unpack_from(raw)
        return cls(*fields) if magic == MAGIC else None

    def pack_into(self, buffer: Any) -> None:
        HEADER.pack_into(
            buffer,
            0,
            MAGIC,
            self.valid,
            self.step,
            self.rank,
            self.world_size,
            self.toc_len,
            self.data_offset,
            self.data_len,
        )

    @property
    def image_len(self) -> int:
        """The bytes of the slot's whole image: header, table of contents and data."""
        return self.data_offset + self.data_len


_ABANDONED: list[object] = []
"""Slot mappings given up while a copy into them was still queued on the GPU: kept mapped for the rest of the
process (a DMA into freed memory would corrupt whatever reuses it); their files are unlinked, so no later
snapshot shares their pages."""


class Slot:
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

    def header(self) -> SlotHeader | None:
        """The header of a whole snapshot in this slot; None if it holds none (empty, torn, being written)."""
        if self._map is not None:  # this process's own mapping of the file: no open() per snapshot
            raw = self._map[:HEADER_BYTES]
        else:
            try:
                with open(self.path, "rb") as f:
                    raw = f.read(HEADER_BYTES)
            except OSError:
                return None
        header = SlotHeader.unpack(raw)
        return header if header is not None and header.valid == 1 else None

    @property
    def mapped(self) -> bool:
        """Whether this process holds the file mapped (a slot given up is not)."""
        return self._map is not None

    def write_header(self, header: SlotHeader) -> None:
        """Into this process's mapping (a snapshot's copy has ended: it becomes valid)."""
        assert self._map is not None
        header.pack_into(self._map)

    def invalidate(self) -> None:
        """Clear the header's `valid` word: the snapshot here is never loaded again."""
        if self._map is not None:
            struct.pack_into("<q", self._map, _VALID_AT, 0)
            return
        with contextlib.suppress(OSError), open(self.path, "r+b") as f:
            f.seek(_VALID_AT)
            f.write(struct.pack("<q", 0))

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


def read_image(path: Path, header: SlotHeader) -> bytes:
    """A slot file's image (header, table of contents, data), or empty if it was overwritten while read."""
    with open(path, "rb") as f:
        image = f.read(header.image_len)
    again = SlotHeader.unpack(image)
    same = again is not None and (again.valid, again.step, again.rank) == (1, header.step, header.rank)
    return image if same else b""


def whole_image(image: bytes, world_size: int) -> bool:
    """Whether `image` is a valid slot image of this world size whose header covers exactly its bytes."""
    h = SlotHeader.unpack(image)
    return (
        h is not None
        and (h.valid, h.world_size) == (1, world_size)
        and 0 <= h.rank < h.world_size
        and h.image_len == len(image)
        and HEADER_BYTES + h.toc_len <= h.data_offset
    )


def write_image(target: Slot, image: bytes) -> None:
    """Write a slot image received from elsewhere: invalid while the body is written, its header last."""
    m = target.ensure(len(image))
    target.toc = target.layout = None
    target.written.clear()
    SlotHeader.writing(0, 0).pack_into(m)
    m[HEADER_BYTES : len(image)] = image[HEADER_BYTES:]
    m[:HEADER_BYTES] = image[:HEADER_BYTES]


@dataclass(frozen=True, slots=True)
class SlotContent:
    skeleton: Any
    table: dict[str, list[Any]]
    data: bytearray | memoryview
    live: dict[str, list[Any]]
    survivor_skeleton: tuple[str, ...] = ()
    """The replicated objects whose skeletons must come from the survivor (snapshot_light's reused part)."""


def live_shapes(content: SlotContent) -> dict[str, tuple[torch.dtype, list[int]]]:
    """The tensors a light snapshot left to the survivors' live state: id -> (dtype, shape)."""
    return {k: (dtype_from_name(v[0]), list(v[1])) for k, v in content.live.items()}


def tensor_at(entry: list[Any], data: bytearray | memoryview) -> torch.Tensor:
    offset, nbytes, dtype_text, shape = entry
    dtype = dtype_from_name(dtype_text)
    if not nbytes:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype, offset=offset, count=nbytes // dtype.itemsize).reshape(shape)


def read_buffer(nbytes: int, *, pinned: bool) -> bytearray | memoryview:
    """Where a slot's data is read to. `pinned`: page-locked host memory (torch's pinned allocator, which keeps the
    block for the next restore), for a state whose tensors are on a GPU: their copies in then run at the link's
    speed instead of being staged through pageable memory by the driver (on an H200, 600 MB per rank restored
    from node memory took 1.3 s, 0.46 GB/s, issue #33)."""
    if pinned and nbytes:
        return memoryview(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy())  # type: ignore[arg-type]
    return bytearray(nbytes)


def restores_to_gpu() -> bool:
    """Whether this process's state lives on a GPU (CUDA is in use): its restores read into pinned memory."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def read_slot(path: Path, header: SlotHeader, step: int) -> SlotContent:
    """A slot's content; its data in pinned memory when this process uses CUDA (`read_buffer`)."""
    data = read_buffer(header.data_len, pinned=restores_to_gpu())
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        toc_raw = f.read(header.toc_len)
        f.seek(header.data_offset)
        got = f.readinto(data)
        f.seek(0)
        again = SlotHeader.unpack(f.read(HEADER_BYTES))
    if got != header.data_len or again is None or (again.valid, again.step) != (1, step):  # overwritten meanwhile
        raise CheckpointCorruptError(f"the memory snapshot of step {step} changed while it was read")
    try:
        skeleton, table, live, survivor_skeleton = parse_toc(toc_raw, step)
    except Exception as exc:
        raise CheckpointCorruptError(f"the memory snapshot of step {step} cannot be read: {exc}") from exc
    return SlotContent(skeleton, table, data, live, survivor_skeleton)
