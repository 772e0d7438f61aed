"""Any fsspec filesystem (`memory://`, `s3://`, `gs://`, ...).

An object becomes visible only when its upload completes, so writing it under its final name is already
atomic; the manifest is written last and is the commit marker. Imports no torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, BinaryIO

from stalwart.checkpoint.storage.base import Storage
from stalwart.errors import ConfigError
from stalwart.runtime.process import first_line

REMOTE_READ_TIMEOUT_S = 10
"""Connect/read timeout for object stores, so an unreachable endpoint is an error in seconds, not minutes."""


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

    def read_range(self, rel: str, offset: int, length: int) -> bytes:
        return bytes(self.fs.cat_file(self._p(rel), start=offset, end=offset + length))

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
