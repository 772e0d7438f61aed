"""Every rank's saved shards of one committed checkpoint, read on demand: where a rank loading a checkpoint of
another world size takes the pieces of its new shards from (format/sharded.py `reshard`).

Each shard is verified against the manifest like any tensor (load/verify.py), read as its own byte range of the
data file that holds it (not the whole file), so a rank reads the saved shards that overlap its new ones and
nothing else: for FSDP2 on 4 ranks loaded on 2, half of the shards of every tensor. The bytes are not copied
again on the way: the new shard's regions are copied from a read-only view of them.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from stalwart.checkpoint.format import layout
from stalwart.checkpoint.format.serialize import dtype_from_name
from stalwart.checkpoint.format.sharded import row_range
from stalwart.checkpoint.load.verify import read_tensor, read_tensor_part
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
        self.recording: list[Any] | None = None  # never a dry run (sharded.ShardSource)

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
        """The part `region` of shard `tid` into `out`, reading and checking only the blocks of the shard that hold
        it, when the part is one byte range and the shard has per-block checksums (layout.BLOCK_BYTES); False
        otherwise: a shard's whole xxh3 cannot check a part of it, so the caller reads the whole shard."""
        entry = self._entry(tid)
        part = row_range(shape, region, dtype_from_name(entry.dtype), out)
        got = read_tensor_part(self._storage, entry, *part) if part is not None and part[1] else None
        if got is None:
            return False
        data, read = got
        self.bytes += read
        out.view(-1).view(torch.uint8).numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        return True
