"""A local directory: every file is whole and durable the moment `write` returns.

A file is written to a temp name, fsync'd, renamed, and its directory fsync'd, so it survives a power cut. Full
checkpoints' data files are written with O_DIRECT where the filesystem allows it and recycle the blocks of a
retired data file (see `recycle`). Imports no torch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from stalwart.checkpoint.storage.base import Storage

DIRECT_ALIGN = 4096
IMAGE_CHUNK = 16 << 20
RECYCLE_DIR = ".recycle"
"""Under the root: at most one retired data file per rank, overwritten by that rank's next full save."""


class LocalStorage(Storage):
    """A directory on a local or network filesystem; every write is fsync'd before it is renamed into place."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.url = str(self.root)

    def _p(self, rel: str) -> Path:
        return self.root / rel if rel else self.root

    def write(self, rel: str, chunks: Callable[[BinaryIO], None], *, atomic: bool = True) -> None:
        path = self._p(rel)
        if not atomic:
            with open(path, "wb", buffering=0) as f:
                chunks(f)
                os.fsync(f.fileno())
            return
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb", buffering=0) as f:
                chunks(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        fsync_dir(path.parent)

    def recycle(self, rel: str, slot: str) -> bool:
        """Move an old data file to `.recycle/<slot>` instead of deleting it (see write_image)."""
        target = self._p(f"{RECYCLE_DIR}/{slot}")
        if target.exists():
            return False
        target.parent.mkdir(exist_ok=True)
        os.rename(self._p(rel), target)
        return True

    def write_image(
        self, rel: str, view: memoryview, length: int, on_half: Callable[[], None] | None, slot: str | None = None
    ) -> None:
        """Write the first `length` bytes of `view` (page-aligned memory, at least `length` rounded up to
        4 KiB long) to `rel` in place and fsync it. O_DIRECT where the filesystem allows it: the disk reads
        straight from the staging memory, so persisting costs almost no CPU and leaves the page cache alone.

        With `slot`, a file that retention recycled under that name becomes `rel` and is overwritten in place:
        its blocks are already allocated, so the write allocates nothing and retention unlinks nothing (on
        ext4 here, unlinking an old 100 MB file took 18 ms and slowed the write running beside it). Its old
        bytes past `length` are truncated before the fsync, and no manifest refers to the file until the
        write has finished."""
        path = self._p(rel)
        reuse = 0
        if slot is not None:
            try:
                os.rename(self._p(f"{RECYCLE_DIR}/{slot}"), path)
            except FileNotFoundError:
                pass
            else:
                reuse = os.O_TRUNC  # dropped from the flags below: keep the allocated blocks
        padded = (length + DIRECT_ALIGN - 1) // DIRECT_ALIGN * DIRECT_ALIGN
        try:
            fd = os.open(path, (os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)) & ~reuse, 0o644)
            direct = True
        except OSError:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            direct = False
        try:
            end = padded if direct else length
            half = end // 2 // DIRECT_ALIGN * DIRECT_ALIGN
            pos = 0
            while pos < end:
                if on_half is not None and pos >= half:
                    on_half()
                    on_half = None
                stop = half if on_half is not None else end  # the first chunks end where the fault fires
                n = min(IMAGE_CHUNK, stop - pos)
                try:
                    pos += os.write(fd, view[pos : pos + n])
                except OSError as exc:
                    if not direct or exc.errno != errno.EINVAL:
                        raise
                    os.close(fd)  # this filesystem refuses O_DIRECT writes: write through the page cache
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    direct, end, pos = False, length, 0
                    half = end // 2
            if direct or reuse:
                os.ftruncate(fd, length)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, rel: str) -> bytes:
        return self._p(rel).read_bytes()

    def read_range(self, rel: str, offset: int, length: int) -> bytes:
        with open(self._p(rel), "rb") as f:
            f.seek(offset)
            return f.read(length)

    def read_range_into(self, rel: str, offset: int, into: memoryview) -> int:
        done = 0
        with open(self._p(rel), "rb", buffering=0) as f:
            f.seek(offset)
            while done < len(into):
                got = f.readinto(into[done:])
                if not got:
                    break
                done += got
        return done

    def size(self, rel: str) -> int:
        return self._p(rel).stat().st_size

    def exists(self, rel: str) -> bool:
        return self._p(rel).exists()

    def isdir(self, rel: str) -> bool:
        return self._p(rel).is_dir()

    def listdir(self, rel: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._p(rel)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def makedirs(self, rel: str) -> None:
        path = self._p(rel)
        if not path.is_dir():
            path.mkdir(parents=True, exist_ok=True)
            fsync_dir(path.parent)

    def remove(self, rel: str) -> None:
        self._p(rel).unlink(missing_ok=True)

    def remove_tree(self, rel: str) -> None:
        shutil.rmtree(self._p(rel))

    def move_tree(self, src: str, dst: str) -> None:
        os.rename(self._p(src), self._p(dst))
        fsync_dir(self._p(dst).parent)

    def local_path(self, rel: str = "") -> Path | None:
        return self._p(rel)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
