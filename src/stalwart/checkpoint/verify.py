"""Reading a shard back and proving it is the one its manifest committed: shared by resume and `stalwart ckpt`."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from stalwart.checkpoint.serialize import checksum
from stalwart.errors import CheckpointCorruptError

T = TypeVar("T")
READ_ATTEMPTS = 3


def retrying(read: Callable[[], T]) -> T:
    """Run an I/O read up to three times (a network filesystem may fail or lag for a moment)."""
    for attempt in range(READ_ATTEMPTS - 1):
        try:
            return read()
        except OSError:
            time.sleep(0.3 * (attempt + 1))
    return read()


def read_verified(path: Path, size: int, crc: int) -> bytes:
    """The shard's bytes if they match the manifest's size and CRC-32.

    Raises CheckpointCorruptError when the shard is missing or does not match (proof of damage), and OSError
    for any other I/O error that persists over a few attempts (maybe passing: no proof of anything).
    """
    try:
        data = retrying(path.read_bytes)
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"shard {path} is missing") from exc
    if len(data) != size:
        raise CheckpointCorruptError(f"shard {path} has {len(data)} bytes, its manifest says {size}")
    if checksum(data) != crc:
        raise CheckpointCorruptError(f"shard {path} fails its CRC-32 check")
    return data
