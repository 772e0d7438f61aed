"""The on-disk layout of a checkpoint directory and the durable file operations it rests on.

    <root>/stalwart-checkpoints.json        marks the directory as ours; nothing else is ever written
    <root>/step_00000120/rank00000.<tok>.pt  one shard per rank, <tok> unique to one save attempt
    <root>/step_00000120/manifest.json       written last, atomically: its presence is the commit

A step directory without a manifest is an interrupted save and is never loaded; one whose shards fail verification
is renamed `step_XXXXXXXX.invalid-<time>` and kept. A save repeated at the same step
(after a restart) writes shards under a new token, so the previous manifest keeps pointing at whole files until
the new manifest replaces it in one rename.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalwart.errors import CheckpointCorruptError, CheckpointMismatchError, ConfigError

FORMAT = "stalwart-checkpoint"
FORMAT_VERSION = 1
ROOT_MARKER = "stalwart-checkpoints.json"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_QUARANTINED_DIR = re.compile(r"^step_(\d{8,})\.invalid-(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def shard_name(rank: int, token: str) -> str:
    return f"rank{rank:05d}.{token}.pt"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes, *, on_half_written: Any = None) -> None:
    """Write `data` to `path` so that after return it survives a power cut: temp file, fsync, rename, fsync dir.

    `on_half_written` is a fault-injection seam: called after half the bytes reached the temp file.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        half = len(view) // 2
        _write_all(fd, view[:half])
        if on_half_written is not None:
            on_half_written()
        _write_all(fd, view[half:])
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        n = os.write(fd, view)
        view = view[n:]


@dataclass(frozen=True, slots=True)
class Manifest:
    """What a committed checkpoint holds; `shards[rank]` is (file name, bytes, crc32)."""

    step: int
    world_size: int
    token: str
    shards: list[tuple[str, int, int]]
    created: float

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "step": self.step,
                "world_size": self.world_size,
                "token": self.token,
                "created": self.created,
                "shards": [{"file": f, "bytes": n, "crc32": c} for f, n, c in self.shards],
            },
            indent=1,
        )

    @classmethod
    def parse(cls, text: str, where: str) -> Manifest:
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise CheckpointMismatchError(f"{where} is not a stalwart manifest")
            if raw.get("version") != FORMAT_VERSION:
                raise CheckpointMismatchError(
                    f"{where} has format version {raw.get('version')}; this stalwart reads {FORMAT_VERSION}"
                )
            shards = [(str(s["file"]), int(s["bytes"]), int(s["crc32"])) for s in raw["shards"]]
            m = cls(int(raw["step"]), int(raw["world_size"]), str(raw["token"]), shards, float(raw["created"]))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            if isinstance(exc, CheckpointMismatchError):
                raise
            raise CheckpointCorruptError(f"{where} is malformed: {exc}") from exc
        if len(m.shards) != m.world_size or any("/" in f or f.startswith(".") for f, _, _ in m.shards):
            raise CheckpointCorruptError(f"{where} lists shards that do not match its world size")
        return m


def prepare_root(root: Path, *, create: bool) -> None:
    """Check that `root` is ours (or empty) and writable; create it and its marker when `create` is set."""
    if root.exists() and not root.is_dir():
        raise ConfigError(f"checkpoint directory {root} is a file, not a directory")
    marker = root / ROOT_MARKER
    if root.is_dir() and not marker.exists():
        foreign = sorted(p.name for p in root.iterdir())[:3]
        if foreign:
            raise ConfigError(
                f"checkpoint directory {root} holds files stalwart did not write ({', '.join(foreign)}); "
                "use an empty directory or one stalwart created"
            )
    if not create:
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not marker.exists():
            write_durable(marker, json.dumps({"format": "stalwart-checkpoints", "version": 1}).encode())
        probe = root / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"checkpoint directory {root} is not writable: {exc.strerror or exc}") from exc


def committed_steps(root: Path) -> list[int]:
    """Steps with a manifest, newest first (whether their shards verify is checked on load)."""
    return sorted((s for s, d in _step_dirs(root) if (d / MANIFEST).exists()), reverse=True)


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), entry))
    return found


def quarantined(root: Path) -> list[tuple[int, Path]]:
    """Checkpoints moved aside after failing verification: (step, path), oldest move first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _QUARANTINED_DIR.match(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(2)), int(m.group(1)), entry))
    return [(step, path) for _, step, path in sorted(found)]


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every step directory, committed or interrupted, oldest first."""
    return sorted(_step_dirs(root))


def read_manifest(root: Path, step: int) -> Manifest:
    """Parse a step's manifest; an I/O error is raised as OSError (maybe passing), bad content as corruption."""
    path = root / step_dir_name(step) / MANIFEST
    text = path.read_text(encoding="utf-8")
    manifest = Manifest.parse(text, str(path))
    if manifest.step != step:
        raise CheckpointCorruptError(f"{path} says step {manifest.step}, its directory says {step}")
    return manifest


def quarantine(root: Path, step: int) -> Path:
    """Rename a checkpoint that failed verification out of the step namespace; returns its new path.
    Quarantined checkpoints are never removed by retention: they are evidence."""
    src = root / step_dir_name(step)
    dst = root / f"{step_dir_name(step)}.invalid-{time.time_ns()}"
    os.rename(src, dst)
    fsync_dir(root)
    return dst


def make_step_dir(root: Path, step: int) -> Path:
    """Create a step's directory durably (its entry in the root survives a power cut before the commit)."""
    path = root / step_dir_name(step)
    if not path.is_dir():
        path.mkdir(exist_ok=True)
        fsync_dir(root)
    return path


def wait_for_file(path: Path, content: str, timeout_s: float) -> bool:
    """True once `path` holds `content`; polls because a network filesystem may show a new file late."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if path.read_text(encoding="utf-8") == content:
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def remove_tree(path: Path) -> None:
    """Delete one of our step directories (never called on anything outside a marked root)."""
    for child in path.iterdir():
        if child.is_dir():
            remove_tree(child)
        else:
            child.unlink(missing_ok=True)
    path.rmdir()


def prune(root: Path, keep_last: int, current: Manifest) -> list[int]:
    """Retention after a commit: keep the newest `keep_last` committed steps, drop older interrupted saves and
    stale shards of earlier attempts at the current step. Returns the steps removed."""
    removed = []
    committed = set(committed_steps(root))
    keep = set(sorted(committed, reverse=True)[:keep_last])
    newest = max(committed) if committed else current.step
    for step, path in _step_dirs(root):
        interrupted = step not in committed and step < newest
        if (step in committed and step not in keep) or interrupted:
            remove_tree(path)
            removed.append(step)
    live = {f for f, _, _ in current.shards} | {MANIFEST}
    for entry in (root / step_dir_name(current.step)).iterdir():
        if entry.name not in live and entry.is_file():
            entry.unlink(missing_ok=True)
    return sorted(removed)
