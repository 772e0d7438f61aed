"""What is in a checkpoint root, for people: listing, full verification, and a summary of a checkpoint.

Used by `stalwart ckpt`. Everything here only reads. Verification reads every rank's meta file and every tensor
(resume reads only what its rank needs), checks sizes and xxh3 against the manifest and parses every skeleton
the weights-only way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from stalwart.checkpoint.format import layout
from stalwart.checkpoint.format.sharded import SavedShard
from stalwart.checkpoint.load.rank_state import load_rank_state
from stalwart.checkpoint.load.verify import tensor_problems
from stalwart.checkpoint.storage import Storage, describe_error, open_storage
from stalwart.errors import CheckpointCorruptError, CheckpointMismatchError, ConfigError
from stalwart.runtime import torch_compat


@dataclass(slots=True)
class Entry:
    """One step directory: committed (has a manifest), interrupted (no manifest) or quarantined."""

    step: int
    status: str
    path: str
    world_size: int | None = None
    bytes: int = 0
    written_bytes: int = 0
    kind: str = ""
    created: float | None = None
    problem: str | None = None


@dataclass(slots=True)
class ObjectSummary:
    tensors: int = 0
    bytes: int = 0
    dtypes: set[str] = field(default_factory=set)
    content: str = ""
    """What a person wants to know of it beyond its tensors (`describe`): a loader's position, an optimizer's step
    count and rate, a scheduler's last rate."""


def open_root(path: str | os.PathLike[str], options: dict[str, Any] | None = None) -> Storage:
    """The checkpoint root, if it exists and is stalwart's; otherwise one clear error."""
    storage = open_storage(path, options)
    local = storage.local_path()
    try:
        if local is not None and not local.exists():
            raise ConfigError(f"{path} does not exist")
        if local is not None and not local.is_dir():
            raise ConfigError(f"{path} is a file, not a checkpoint directory")
        if not storage.exists(layout.ROOT_MARKER):
            raise ConfigError(f"{path} is not a stalwart checkpoint directory (no {layout.ROOT_MARKER})")
    except ConfigError:
        raise
    except Exception as exc:  # an unreachable object store, no credentials...
        raise ConfigError(f"{path} cannot be read: {describe_error(exc)}") from exc
    return storage


def list_entries(storage: Storage) -> list[Entry]:
    entries = []
    for step, name in layout.step_dirs(storage):
        files = storage.listdir(name)
        if layout.MANIFEST not in files:
            size = sum(storage.size(f"{name}/{f}") for f in files)
            entries.append(Entry(step, "interrupted", storage.display(name), bytes=size))
            continue
        try:
            m = layout.read_manifest(storage, step)
            kind = "full" if m.base is None else f"delta of {m.base}"
            entries.append(
                Entry(
                    step,
                    "committed",
                    storage.display(name),
                    m.world_size,
                    m.state_bytes,
                    m.written_bytes,
                    kind,
                    m.created,
                )
            )
        except (CheckpointCorruptError, CheckpointMismatchError, OSError) as exc:
            entries.append(Entry(step, "committed", storage.display(name), problem=str(exc)))
    for step, name in layout.quarantined(storage):
        entries.append(Entry(step, "quarantined", storage.display(name)))
    return sorted(entries, key=lambda e: (e.step, e.status))


def verify(storage: Storage, step: int) -> list[str]:
    """Every problem of a committed checkpoint, over all of its ranks; an empty list means it verifies."""
    try:
        manifest = layout.read_manifest(storage, step)
    except (CheckpointCorruptError, CheckpointMismatchError) as exc:
        return [str(exc)]
    except Exception as exc:
        return [f"the manifest of step {step} cannot be read: {describe_error(exc)}"]
    problems = []
    for rank in range(manifest.world_size):
        try:
            load_rank_state(storage, manifest, rank, tensors=False)
        except CheckpointCorruptError as exc:
            problems.append(str(exc))
        except Exception as exc:
            problems.append(f"rank {rank}'s shard cannot be read: {describe_error(exc)}")
    return problems + tensor_problems(storage, manifest)


def read_shard(storage: Storage, step: int, rank: int) -> tuple[layout.Manifest, dict[str, Any]]:
    """The manifest, and one rank's state verified against it and parsed the weights-only way."""
    manifest = layout.read_manifest(storage, step)
    if not 0 <= rank < manifest.world_size:
        raise ConfigError(f"--rank {rank} is outside the checkpoint's {manifest.world_size} ranks")
    state, _ = load_rank_state(storage, manifest, rank)
    return manifest, state


def summarize(storage: Storage, step: int, rank: int = 0) -> tuple[layout.Manifest, dict[str, Any]]:
    """The manifest and a summary of one rank's state: step, world size, and per tracked object its tensors."""
    manifest, state = read_shard(storage, step, rank)
    objects = {}
    for obj_name, obj_state in state.get("objects", {}).items():
        summary = ObjectSummary()
        _walk(obj_state, summary)
        summary.content = describe(obj_state)
        objects[obj_name] = summary
    return manifest, {"step": state.get("step"), "world_size": state.get("world_size"), "objects": objects}


def _walk(value: Any, summary: ObjectSummary) -> None:
    if isinstance(value, SavedShard):  # this rank's shard of a sharded tensor
        value = value.local
    if isinstance(value, torch.Tensor):
        summary.tensors += 1
        summary.bytes += value.numel() * value.element_size()
        summary.dtypes.add(str(value.dtype).removeprefix("torch."))
    elif isinstance(value, dict):
        for item in value.values():
            _walk(item, summary)
    elif isinstance(value, list | tuple):
        for item in value:
            _walk(item, summary)


def describe(state: Any) -> str:
    """One line on a tracked object's state, by its shape: a ResumableLoader's global position, an optimizer's step
    count and learning rate, a scheduler's epoch and last rate, else up to four of its numbers by name; '' when
    none of these is there."""
    if not isinstance(state, dict):
        return ""
    if {"epoch", "batch", "num_samples"} <= state.keys():  # data/loader.py's state_dict
        per_rank = state.get("batch_size_per_rank")
        if per_rank is not None:
            return f"position: epoch {state['epoch']}, sample {state['batch']} of {state['num_samples']}"
        per_epoch = int(state["num_samples"]) // max(int(state.get("global_batch_size", 1)), 1)
        return f"position: epoch {state['epoch']}, global batch {state['batch']} of {per_epoch}"
    if isinstance(state.get("param_groups"), list) and isinstance(state.get("state"), dict):  # an optimizer
        steps = [_number(v["step"]) for v in state["state"].values() if isinstance(v, dict) and "step" in v]
        parts = [f"{len(state['state'])} parameters with state"]
        if any(s is not None for s in steps):
            parts.append(f"step {int(max(s for s in steps if s is not None))}")
        rates = sorted({g["lr"] for g in state["param_groups"] if isinstance(g.get("lr"), int | float)})
        if rates:
            parts.append("lr " + ", ".join(f"{r:.4g}" for r in rates))
        return ", ".join(parts)
    last = torch_compat.saved_last_lr(state)
    if last is not None:  # a learning-rate scheduler
        return f"last_epoch {state['last_epoch']}, last lr {', '.join(f'{r:.4g}' for r in last)}"
    numbers = [f"{k}={v}" for k, v in state.items() if isinstance(v, int | float) and not isinstance(v, bool)]
    return ", ".join(numbers[:4]) + (", ..." if len(numbers) > 4 else "")


def _number(value: Any) -> float | None:
    """A step count as saved (a number, a one-element tensor), else None."""
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None
