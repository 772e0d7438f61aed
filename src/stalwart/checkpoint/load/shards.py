"""Every rank's saved shards of one committed checkpoint, read on demand: where a rank loading a checkpoint of
another world size takes the pieces of its new shards from (format/sharded.py `reshard`).

Each shard is verified against the manifest like any tensor (load/verify.py), read as its own byte range of the
data file that holds it (not the whole file), so a rank reads the saved shards that overlap its new ones and
nothing else: for FSDP2 on 4 ranks loaded on 2, half of the shards of every tensor. The bytes are not copied
again on the way: the new shard's regions are copied from a read-only view of them.
"""

from __future__ import annotations

import warnings

import torch

from stalwart.checkpoint.format import layout
from stalwart.checkpoint.format.serialize import dtype_from_name
from stalwart.checkpoint.load.verify import read_tensor
from stalwart.checkpoint.storage import Storage
from stalwart.errors import CheckpointCorruptError


class DurableShards:
    """The saved shards of `manifest`'s checkpoint in `storage` (a `sharded.ShardSource`)."""

    def __init__(self, storage: Storage, manifest: layout.Manifest) -> None:
        self._storage = storage
        self._manifest = manifest
        self.bytes = 0
        """Bytes of shards read so far."""
        self._by_tensor: dict[str, list[str]] | None = None

    def shard_ids(self, tensor: str) -> list[str]:
        if self._by_tensor is None:  # once: a model has thousands of tensors, each asked for
            self._by_tensor = {}
            for tid in sorted(t for t in self._manifest.tensors if t.startswith("D/")):
                self._by_tensor.setdefault(tid.rsplit("@", 1)[0], []).append(tid)
        return self._by_tensor.get(tensor, [])

    def _entry(self, tid: str) -> layout.TensorEntry:
        entry = self._manifest.tensors.get(tid)
        if entry is None:
            raise CheckpointCorruptError(f"shard {tid} of step {self._manifest.step} is not in its manifest")
        return entry

    def read(self, tid: str) -> torch.Tensor:
        entry = self._entry(tid)
        raw = read_tensor(self._storage, entry, None)
        self.bytes += entry.nbytes
        dtype = dtype_from_name(entry.dtype)
        with warnings.catch_warnings():  # read-only bytes: only copied from (format/sharded.py reshard)
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.frombuffer(raw, dtype=dtype) if len(raw) else torch.empty(0, dtype=dtype)
        return tensor.reshape(entry.shape)

    def read_into(self, tid: str, out: torch.Tensor) -> None:
        """Shard `tid` straight into `out` (contiguous, its shape and dtype), verified there: no copy on the way."""
        entry = self._entry(tid)
        if entry.codec != "raw" or tuple(out.shape) != tuple(entry.shape) or not out.is_contiguous():
            out.copy_(self.read(tid))
            return
        target = out.view(-1).view(torch.uint8).numpy().data if out.numel() else memoryview(bytearray())
        read_tensor(self._storage, entry, None, into=target)
        self.bytes += entry.nbytes

    def read_region(self, tid: str, shape: list[int], region: tuple[slice, ...], out: torch.Tensor) -> bool:
        """Never: a shard's xxh3 covers the whole shard, so a part of it cannot be checked on its own."""
        return False
