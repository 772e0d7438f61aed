"""Reading checkpoint files back and proving they are the ones the manifest committed: shared by resume and
`stalwart ckpt`. Every tensor carries the xxh3 of its raw bytes, every rank's meta file the xxh3 of its bytes."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

from stalwart.checkpoint.format import layout
from stalwart.checkpoint.storage import Storage, describe_error
from stalwart.errors import CheckpointCorruptError

T = TypeVar("T")
READ_ATTEMPTS = 3


def retrying(read: Callable[[], T]) -> T:
    """Run a read up to three times (a network filesystem or object store may fail or lag for a moment).
    Proof of damage (CheckpointCorruptError, a missing file) is not retried."""
    for attempt in range(READ_ATTEMPTS - 1):
        try:
            return read()
        except (CheckpointCorruptError, FileNotFoundError):
            raise
        except Exception:
            time.sleep(0.3 * (attempt + 1))
    return read()


def read_verified_meta(storage: Storage, rel: str, entry: layout.RankEntry) -> dict[str, Any]:
    where = storage.display(rel)
    try:
        data = retrying(lambda: storage.read(rel))
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"shard {where} is missing") from exc
    if len(data) != entry.bytes:
        raise CheckpointCorruptError(f"shard {where} has {len(data)} bytes, its manifest says {entry.bytes}")
    if layout.xxh3(data) != entry.xxh3:
        raise CheckpointCorruptError(f"shard {where} fails its xxh3 check")
    try:
        meta = json.loads(data)
    except ValueError as exc:
        raise CheckpointCorruptError(f"shard {where} is malformed: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != "stalwart-shard":
        raise CheckpointCorruptError(f"shard {where} is not a stalwart shard")
    return meta


def read_tensor(
    storage: Storage, entry: layout.TensorEntry, files: dict[str, bytes] | None, into: memoryview | None = None
) -> bytes | memoryview:
    """The raw bytes of one tensor, decompressed and checked against its xxh3.

    `files` caches whole data files: one read serves all the tensors a caller needs from a file. None: read only
    this tensor's byte range (a rank that needs a few tensors of another rank's file), straight into `into` when
    given (writable, the tensor's size; raw tensors only) and checked there."""
    where = f"{storage.display(entry.file)} at byte {entry.offset}"
    stored: bytes | memoryview
    try:
        if files is None and into is not None and entry.codec == "raw":
            target = into[: entry.stored_bytes]
            stored = target[: retrying(lambda: storage.read_range_into(entry.file, entry.offset, target))]
        elif files is None:
            stored = retrying(lambda: storage.read_range(entry.file, entry.offset, entry.stored_bytes))
        else:
            if entry.file not in files:
                files[entry.file] = retrying(lambda: storage.read(entry.file))
            stored = memoryview(files[entry.file])[entry.offset : entry.offset + entry.stored_bytes]
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"data file {storage.display(entry.file)} is missing") from exc
    if len(stored) != entry.stored_bytes:
        raise CheckpointCorruptError(f"tensor {where} is truncated ({len(stored)} of {entry.stored_bytes} bytes)")
    raw: bytes | memoryview
    if entry.codec == "zstd":
        import zstandard

        try:
            raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=entry.nbytes)
        except zstandard.ZstdError as exc:
            raise CheckpointCorruptError(f"tensor {where} cannot be decompressed: {exc}") from exc
    else:
        raw = stored
    if len(raw) != entry.nbytes:
        raise CheckpointCorruptError(f"tensor {where} has {len(raw)} bytes, its manifest says {entry.nbytes}")
    if layout.xxh3(raw) != entry.xxh3 or (entry.blocks and layout.blocks_of(raw, entry.block_bytes) != entry.blocks):
        raise CheckpointCorruptError(f"tensor {where} fails its xxh3 check")
    return raw


def tensor_problems(storage: Storage, manifest: layout.Manifest) -> list[str]:
    """Every tensor of `manifest` read back from `storage` and checked, one data file in memory at a time: a line
    for each that fails (`stalwart ckpt verify`, and a mirror's copy before it is committed)."""
    problems = []
    files: dict[str, bytes] = {}
    for tid, entry in sorted(manifest.tensors.items(), key=lambda item: (item[1].file, item[1].offset)):
        if files and entry.file not in files:
            files.clear()
        try:
            read_tensor(storage, entry, files)
        except CheckpointCorruptError as exc:
            problems.append(f"{tid}: {exc}")
        except Exception as exc:
            problems.append(f"{tid}: {storage.display(entry.file)} cannot be read: {describe_error(exc)}")
    return problems


def read_tensor_part(
    storage: Storage, entry: layout.TensorEntry, start: int, length: int
) -> tuple[memoryview, int] | None:
    """Bytes [start, start + length) of a tensor's raw bytes, reading and checking only the blocks that hold them
    (`TensorEntry.blocks`), and the bytes read; None when the entry has no blocks (the caller reads the whole
    tensor)."""
    if not entry.blocks or entry.codec != "raw" or start < 0 or length <= 0 or start + length > entry.nbytes:
        return None
    size = entry.block_bytes
    first, last = start // size, (start + length - 1) // size
    low, high = first * size, min((last + 1) * size, entry.nbytes)
    where = f"{storage.display(entry.file)} at byte {entry.offset + low}"
    try:
        data = memoryview(retrying(lambda: storage.read_range(entry.file, entry.offset + low, high - low)))
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"data file {storage.display(entry.file)} is missing") from exc
    if len(data) != high - low:
        raise CheckpointCorruptError(f"tensor {where} is truncated ({len(data)} of {high - low} bytes)")
    for block in range(first, last + 1):
        at = (block - first) * size
        if layout.xxh3(data[at : at + size]) != entry.blocks[block]:
            raise CheckpointCorruptError(f"tensor {where} fails its xxh3 check (block {block})")
    return data[start - low : start - low + length], high - low
