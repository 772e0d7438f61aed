"""Every rank's saved shards of one committed checkpoint, read on demand: where a rank loading a checkpoint of
another world size takes the pieces of its new shards from (format/sharded.py `reshard`).

Each shard is verified against the manifest like any tensor (load/verify.py). Data files are read whole and kept
for the load (`files`, shared with the rank's own state), so a rank reads each file it needs once: for FSDP2 on 4
ranks loaded on 2, each new rank reads two of the four files, the bytes its new shards hold.
"""

from __future__ import annotations

import torch

from stalwart.checkpoint.format import layout
from stalwart.checkpoint.format.serialize import dtype_from_name
from stalwart.checkpoint.load.verify import read_tensor
from stalwart.checkpoint.storage import Storage
from stalwart.errors import CheckpointCorruptError


class DurableShards:
    """The saved shards of `manifest`'s checkpoint in `storage` (a `sharded.ShardSource`)."""

    def __init__(self, storage: Storage, manifest: layout.Manifest, files: dict[str, bytes]) -> None:
        self._storage = storage
        self._manifest = manifest
        self._files = files
        self.bytes = 0
        """Bytes of shards read so far (each shard once)."""
        self._read: dict[str, torch.Tensor] = {}

    def shard_ids(self, tensor: str) -> list[str]:
        return sorted(tid for tid in self._manifest.tensors if tid.startswith(f"{tensor}@"))

    def read(self, tid: str) -> torch.Tensor:
        if tid in self._read:
            return self._read[tid]
        entry = self._manifest.tensors.get(tid)
        if entry is None:
            raise CheckpointCorruptError(f"shard {tid} of step {self._manifest.step} is not in its manifest")
        raw = read_tensor(self._storage, entry, self._files)
        self.bytes += entry.nbytes
        dtype = dtype_from_name(entry.dtype)
        tensor = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        self._read[tid] = tensor.reshape(entry.shape)
        return self._read[tid]
