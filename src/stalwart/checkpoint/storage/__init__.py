"""Where checkpoint bytes live: a local directory with fsync (local.py) or any fsspec filesystem (remote.py).

Imports no torch: the background persister process uses this package and starts in a fraction of a second.
"""

from __future__ import annotations

import os
from typing import Any

from stalwart.checkpoint.storage.base import Storage, describe_error
from stalwart.checkpoint.storage.local import LocalStorage, fsync_dir
from stalwart.checkpoint.storage.remote import FsspecStorage
from stalwart.errors import ConfigError

__all__ = ["FsspecStorage", "LocalStorage", "Storage", "describe_error", "fsync_dir", "open_storage"]


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
