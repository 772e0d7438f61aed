"""Where checkpoint bytes live: a local directory (with fsync) or any fsspec filesystem (`memory://`, `s3://`).

Everything above this module speaks in paths relative to the checkpoint root ("step_00000120/manifest.json"),
so the commit protocol is one piece of code for every store:

- local: a file is written to a temp name, fsync'd, renamed, and its directory fsync'd, so it is whole and
  survives a power cut the moment `write` returns;
- object stores: an object becomes visible only when its upload completes, so writing it under its final
  name is already atomic; the manifest is written last and is the commit marker.

This module imports no torch: the background persister process uses it and starts in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from stalwart.errors import ConfigError
from stalwart.runtime.process import first_line

DIRECT_ALIGN = 4096
IMAGE_CHUNK = 16 << 20
RECYCLE_DIR = ".recycle"
"""Under the root: at most one retired data file per rank, overwritten by that rank's next full save."""
REMOTE_READ_TIMEOUT_S = 10
"""Connect/read timeout for object stores, so an unreachable endpoint is an error in seconds, not minutes."""


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


class FsspecStorage(Storage):
    """Any fsspec filesystem. Listing caches are off: other processes write the files we poll for."""

    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        import fsspec

        self.url = url
        protocol = url.split("://", 1)[0]
        opts = dict(options or {})
        opts.setdefault("skip_instance_cache", True)
        retries = None
        if protocol in ("s3", "s3a"):
            opts.setdefault("use_listings_cache", False)
            # botocore's own retries sit inside s3fs's and the persister's: keep them short so an outage shows
            # up in seconds and the persister's logged backoff does the waiting.
            opts.setdefault(
                "config_kwargs",
                {"connect_timeout": REMOTE_READ_TIMEOUT_S, "read_timeout": 60, "retries": {"max_attempts": 2}},
            )
            retries = opts.pop("retries", 2)  # s3fs has no such argument (it would reach the botocore session)
        self.process_local = protocol == "memory"
        self._has_dirs = protocol not in ("s3", "s3a", "gs", "gcs", "az", "abfs")
        try:
            self.fs, self.base = fsspec.url_to_fs(url, **opts)
        except (ImportError, ValueError) as exc:
            raise ConfigError(
                f"checkpoint storage {url!r} cannot be opened: {first_line(exc, with_type=True)}"
            ) from exc
        if retries is not None:
            self.fs.retries = retries  # an attribute of S3FileSystem; the instance is ours (skip_instance_cache)
        self.base = self.base.rstrip("/")

    def _p(self, rel: str) -> str:
        return f"{self.base}/{rel}" if rel else self.base

    def write(self, rel: str, chunks: Callable[[BinaryIO], None], *, atomic: bool = True) -> None:
        with self.fs.open(self._p(rel), "wb") as f:
            chunks(f)

    def read(self, rel: str) -> bytes:
        return bytes(self.fs.cat_file(self._p(rel)))

    def size(self, rel: str) -> int:
        return int(self.fs.size(self._p(rel)))

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self._p(rel)))

    def isdir(self, rel: str) -> bool:
        return bool(self.fs.isdir(self._p(rel)))

    def listdir(self, rel: str = "") -> list[str]:
        try:
            entries = self.fs.ls(self._p(rel), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        names = {str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries}
        return sorted(n for n in names if n)

    def makedirs(self, rel: str) -> None:
        """Object stores have no directories (and s3fs would create a missing bucket): nothing to do there."""
        if not self._has_dirs:
            return
        with contextlib.suppress(FileExistsError):
            self.fs.makedirs(self._p(rel), exist_ok=True)

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._p(rel))

    def remove_tree(self, rel: str) -> None:
        self.fs.rm(self._p(rel), recursive=True)

    def move_tree(self, src: str, dst: str) -> None:
        """Object stores have no rename: copy every object, then delete the originals (a crash in between
        leaves two copies, never none)."""
        for name in self.listdir(src):
            self.fs.copy(f"{self._p(src)}/{name}", f"{self._p(dst)}/{name}")
        self.remove_tree(src)


def open_storage(url: str | os.PathLike[str], options: dict[str, Any] | None = None) -> Storage:
    """A local directory for plain paths (and file://), fsspec for every other protocol."""
    text = os.fspath(url)
    if not text:
        raise ConfigError("checkpoint_dir must not be empty")
    if "://" not in text:
        return LocalStorage(text)
    if text.startswith("file://"):
        return LocalStorage(text[len("file://") :])
    return FsspecStorage(text, options)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def describe_error(exc: BaseException) -> str:
    """One line for an error from any store (OSError strerror, botocore messages, aiohttp errors)."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} ({type(exc).__name__})" if not exc.filename else exc.strerror
    return first_line(exc, with_type=True)
