"""The interface every store implements, and the one-line error text shared by all of them.

Everything above the storage package speaks in paths relative to the checkpoint root
("step_00000120/manifest.json"), so the commit protocol is one piece of code for every store. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from stalwart.runtime.process import first_line


class Storage:
    """The operations the checkpoint engine needs; paths are relative to the root and use '/'."""

    url: str
    process_local = False
    """True when only this process can see the files (memory://): persist then runs in a thread, not a process."""

    def write(self, rel: str, chunks: Callable[[BinaryIO], None], *, atomic: bool = True) -> None:
        """Create or replace `rel` durably; `chunks(f)` writes the content into `f`. With `atomic` (the
        default) readers see the old content or the new, never a part. Without it, a local file is written in
        place and fsync'd, and its directory entry is made durable by a later atomic write in the same directory
        (for files under unique names that nothing reads until the manifest refers to them)."""
        raise NotImplementedError

    def read(self, rel: str) -> bytes:
        raise NotImplementedError

    def read_range(self, rel: str, offset: int, length: int) -> bytes:
        """`length` bytes of `rel` from `offset` (fewer at its end): what a rank reads of another rank's file when
        it needs one tensor of it (resharding)."""
        return self.read(rel)[offset : offset + length]

    def read_range_into(self, rel: str, offset: int, into: memoryview) -> int:
        """Fill `into` (writable bytes) from `rel` at `offset`; returns the bytes read (fewer at its end). A local
        file reads straight into it: the bytes land where they are used, with no copy in between."""
        data = self.read_range(rel, offset, len(into))
        into[: len(data)] = data
        return len(data)

    def size(self, rel: str) -> int:
        raise NotImplementedError

    def exists(self, rel: str) -> bool:
        raise NotImplementedError

    def isdir(self, rel: str) -> bool:
        raise NotImplementedError

    def listdir(self, rel: str = "") -> list[str]:
        """Names (not paths) of the files and directories directly under `rel`; [] when it does not exist."""
        raise NotImplementedError

    def makedirs(self, rel: str) -> None:
        raise NotImplementedError

    def remove(self, rel: str) -> None:
        raise NotImplementedError

    def remove_tree(self, rel: str) -> None:
        raise NotImplementedError

    def move_tree(self, src: str, dst: str) -> None:
        raise NotImplementedError

    def local_path(self, rel: str = "") -> Path | None:
        """The file's path when the store is a local directory (lets callers use mmap and os calls)."""
        return None

    def recycle(self, rel: str, slot: str) -> bool:
        """Keep a file retention would delete under `slot` for a later write to reuse; False: not kept (the
        store does not recycle, or the slot is taken), so the caller deletes it."""
        return False

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.write(rel, lambda f: f.write(data))  # type: ignore[arg-type]

    def display(self, rel: str = "") -> str:
        return f"{self.url.rstrip('/')}/{rel}" if rel else self.url


def describe_error(exc: BaseException) -> str:
    """One line for an error from any store (OSError strerror, botocore messages, aiohttp errors)."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} ({type(exc).__name__})" if not exc.filename else exc.strerror
    return first_line(exc, with_type=True)
