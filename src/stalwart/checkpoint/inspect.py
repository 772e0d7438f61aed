"""What is in a checkpoint directory, for people: listing, full verification, and a summary of a checkpoint.

Used by `stalwart ckpt`. Everything here only reads; verification reads every shard of every rank (resume reads
only a rank's own), checks size and CRC-32 against the manifest and parses it the weights-only way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stalwart.checkpoint import layout
from stalwart.checkpoint.serialize import loads
from stalwart.checkpoint.verify import read_verified
from stalwart.errors import CheckpointCorruptError, CheckpointMismatchError, ConfigError


@dataclass(slots=True)
class Entry:
    """One step directory: committed (has a manifest), interrupted (no manifest) or quarantined."""

    step: int
    status: str
    path: Path
    world_size: int | None = None
    bytes: int = 0
    created: float | None = None
    problem: str | None = None


@dataclass(slots=True)
class ObjectSummary:
    tensors: int = 0
    bytes: int = 0
    dtypes: set[str] = field(default_factory=set)


def open_root(root: Path) -> Path:
    """The directory, if it exists and is stalwart's; otherwise one clear error."""
    if not root.exists():
        raise ConfigError(f"{root} does not exist")
    if not root.is_dir():
        raise ConfigError(f"{root} is a file, not a checkpoint directory")
    if not (root / layout.ROOT_MARKER).exists():
        raise ConfigError(f"{root} is not a stalwart checkpoint directory (no {layout.ROOT_MARKER})")
    return root


def list_entries(root: Path) -> list[Entry]:
    entries = []
    for step, path in layout.step_dirs(root):
        if not (path / layout.MANIFEST).exists():
            size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
            entries.append(Entry(step, "interrupted", path, bytes=size))
            continue
        try:
            m = layout.read_manifest(root, step)
            entries.append(Entry(step, "committed", path, m.world_size, sum(s[1] for s in m.shards), m.created))
        except (CheckpointCorruptError, CheckpointMismatchError, OSError) as exc:
            entries.append(Entry(step, "committed", path, problem=str(exc)))
    for step, path in layout.quarantined(root):
        entries.append(Entry(step, "quarantined", path))
    return sorted(entries, key=lambda e: (e.step, e.status))


def verify(root: Path, step: int) -> list[str]:
    """Every problem of a committed checkpoint, over all of its shards; an empty list means it verifies."""
    try:
        manifest = layout.read_manifest(root, step)
    except (CheckpointCorruptError, CheckpointMismatchError) as exc:
        return [str(exc)]
    except OSError as exc:
        return [f"the manifest of step {step} cannot be read: {exc.strerror or exc}"]
    problems = []
    for name, size, crc in manifest.shards:
        path = root / layout.step_dir_name(step) / name
        try:
            loads(read_verified(path, size, crc), str(path))
        except CheckpointCorruptError as exc:
            problems.append(str(exc))
        except OSError as exc:
            problems.append(f"shard {path} cannot be read: {exc.strerror or exc}")
    return problems


def read_shard(root: Path, step: int, rank: int) -> tuple[layout.Manifest, dict[str, Any], Path]:
    """The manifest, and one rank's shard verified against it and parsed the weights-only way."""
    manifest = layout.read_manifest(root, step)
    if not 0 <= rank < manifest.world_size:
        raise ConfigError(f"--rank {rank} is outside the checkpoint's {manifest.world_size} ranks")
    name, size, crc = manifest.shards[rank]
    path = root / layout.step_dir_name(step) / name
    state = loads(read_verified(path, size, crc), str(path))
    return manifest, state, path


def summarize(root: Path, step: int, rank: int = 0) -> tuple[layout.Manifest, dict[str, Any]]:
    """The manifest and a summary of one rank's shard: step, world size, and per tracked object its tensors."""
    manifest, state, _ = read_shard(root, step, rank)
    objects = {}
    for obj_name, obj_state in state.get("objects", {}).items():
        summary = ObjectSummary()
        _walk(obj_state, summary)
        objects[obj_name] = summary
    return manifest, {"step": state.get("step"), "world_size": state.get("world_size"), "objects": objects}


def _walk(value: Any, summary: ObjectSummary) -> None:
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
