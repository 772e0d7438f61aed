"""Reading one rank's state of one committed checkpoint, and the verdict each rank votes on before any loads it.

Every byte is verified against the manifest (load/verify.py). The skeleton is read with
`torch.load(weights_only=True)`, so loading a checkpoint never executes code from it. The verdict separates proof
of damage (CORRUPT: the checkpoint is quarantined) from an I/O error that may pass (UNREADABLE: reported, never
quarantined) and from a valid checkpoint that does not fit this job (MISMATCH: one clear error).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.checkpoint.format import layout
from stalwart.checkpoint.format.serialize import dtype_from_name, load_skeleton, unflatten
from stalwart.checkpoint.format.sharded import ShardSource
from stalwart.checkpoint.load.shards import DurableShards
from stalwart.checkpoint.load.verify import read_tensor, read_verified_meta, retrying
from stalwart.checkpoint.storage import Storage, describe_error
from stalwart.errors import CheckpointCorruptError, CheckpointMismatchError

VALID, CORRUPT, UNREADABLE, MISMATCH = 1, 0, -1, -2  # a rank's vote on a checkpoint it tried to load


@dataclass(frozen=True, slots=True)
class Restored:
    """A checkpoint that was loaded: its step, the world size that wrote it, and this rank's state."""

    step: int
    world_size: int
    state: dict[str, Any]
    source: str
    bytes: int = 0
    tier: str = "durable"
    """Where it came from: "durable" (the checkpoint directory), "memory" (node shared memory), "peer" (a light
    snapshot in node memory and a survivor's live state) or "replica" (a snapshot kept by another node)."""
    shards: ShardSource | None = None
    """Every rank's saved shards, for a checkpoint of another world size: sharded tensors are resharded from them
    onto this job's mesh (format/sharded.py)."""
    mirror: str = ""
    """The mirror a durable checkpoint came from (checkpoint/load/newest.py); empty for the checkpoint directory."""


def try_load(
    storage: Storage, step: int, rank: int, world_size: int, *, allow_resize: bool
) -> tuple[Restored | None, int, str | None]:
    """(restored, verdict, problem). Size, checksum and format failures are CORRUPT; an I/O error that
    persists over a few attempts is UNREADABLE (maybe passing: reported, never quarantined); a valid
    checkpoint written at another world size, when that is not allowed, is MISMATCH."""
    where = storage.display(layout.step_dir_name(step))
    try:
        manifest = retrying(lambda: layout.read_manifest(storage, step))
    except CheckpointMismatchError as exc:
        return None, MISMATCH, str(exc)
    except CheckpointCorruptError as exc:
        return None, CORRUPT, str(exc)
    except FileNotFoundError:
        return None, CORRUPT, f"{where}/{layout.MANIFEST} disappeared"
    except Exception as exc:
        return None, UNREADABLE, f"{where}/{layout.MANIFEST} cannot be read: {describe_error(exc)}"
    if manifest.world_size != world_size and not allow_resize:
        return (
            None,
            MISMATCH,
            (
                f"checkpoint {where} was written by {manifest.world_size} ranks and this job has "
                f"{world_size}; relaunch with the same world size or allow a world-size change "
                "(docs/checkpoints.md)"
            ),
        )
    source = rank % manifest.world_size
    shards = DurableShards(storage, manifest) if manifest.world_size != world_size else None
    try:
        state, nbytes = load_rank_state(storage, manifest, source, resharding=shards is not None)
    except CheckpointCorruptError as exc:
        return None, CORRUPT, str(exc)
    except Exception as exc:
        return None, UNREADABLE, f"checkpoint {where} cannot be read: {describe_error(exc)}"
    return Restored(step, manifest.world_size, state, where, nbytes, shards=shards), VALID, None


def load_rank_state(
    storage: Storage,
    manifest: layout.Manifest,
    rank: int,
    *,
    tensors: bool = True,
    resharding: bool = False,
) -> tuple[dict[str, Any], int]:
    """Rank `rank`'s state of a checkpoint, every byte verified: (state, bytes of tensors read). Without
    `tensors`, only the meta file and skeleton are read and checked (tensors come back empty). With `resharding`
    (a load at another world size), each tensor's own bytes are read, not whole files, and sharded tensors come
    back empty, of their dtype: a DurableShards reads the shards this rank needs.

    Raises CheckpointCorruptError on proof of damage (a checksum, a size, a missing file or tensor) and other
    exceptions for I/O errors (maybe passing)."""
    step_dir = layout.step_dir_name(manifest.step)
    meta = read_verified_meta(storage, f"{step_dir}/{manifest.ranks[rank].meta}", manifest.ranks[rank])
    try:
        skeleton_bytes = base64.b64decode(str(meta["skeleton"]).encode("ascii"), validate=True)
        skeleton = load_skeleton(skeleton_bytes)
    except Exception as exc:  # pickle and zip errors come in many types
        raise CheckpointCorruptError(f"the skeleton of rank {rank} in {step_dir} cannot be read safely: {exc}") from exc
    files: dict[str, bytes] | None = None if resharding else {}
    # On a local filesystem each tensor is read into its own memory (one copy, from the page cache or the disk); an
    # object store serves a whole data file in one request, and its tensors are cut from it.
    local = storage.local_path() is not None
    read = 0

    def fetch(tid: str) -> torch.Tensor:
        nonlocal read
        entry = manifest.tensors.get(tid)
        if entry is None:
            raise CheckpointCorruptError(f"tensor {tid} of {step_dir} is not in its manifest")
        if not tensors:
            return torch.empty(0)
        if resharding and tid.startswith("D/"):
            return torch.empty(0, dtype=dtype_from_name(entry.dtype))
        dtype = dtype_from_name(entry.dtype)
        if local and entry.codec == "raw":  # one read, straight into the tensor's memory, checked there
            t = torch.empty(entry.shape, dtype=dtype)
            if t.numel() * t.element_size() != entry.nbytes:
                raise CheckpointCorruptError(f"tensor {tid} of {step_dir}: its shape and its size disagree")
            target = t.view(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(bytearray())
            read_tensor(storage, entry, None, into=target)
            read += entry.nbytes
            return t
        raw = read_tensor(storage, entry, files)
        read += entry.nbytes
        if not raw:
            return torch.empty(entry.shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(entry.shape)

    state = unflatten(skeleton, fetch)
    if not isinstance(state, dict) or "objects" not in state:
        raise CheckpointCorruptError(f"rank {rank} of {step_dir} does not hold a stalwart state")
    return state, read
