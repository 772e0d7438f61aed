"""The layout of a checkpoint root, its manifest, and the operations on it that must stay correct on every store.

    <root>/stalwart-checkpoints.json                  marks the root as ours; nothing else is ever written
    <root>/step_00000120/rank00000.<tok>.data         rank 0's tensor bytes (raw, or zstd for a delta)
    <root>/step_00000120/rank00000.<tok>.meta.json    rank 0's skeleton and tensor table, written after its data
    <root>/step_00000120/manifest.json                written last by rank 0: its presence is the commit

The manifest lists every rank's meta file (with its xxh3) and every tensor: the file and byte range holding it,
its codec, dtype, shape and the xxh3 of its raw bytes. A delta checkpoint's unchanged tensors point into the
data files of its base (a full checkpoint), which retention keeps while any kept checkpoint refers to it.

A step directory without a manifest is an interrupted save and is never loaded; one that fails verification is
moved to `step_XXXXXXXX.invalid-<ns>` and kept. A save repeated at the same step (after a restart) writes under
a new token, so the previous manifest keeps pointing at whole files until the new one replaces it.

This module imports no torch: the persister process uses it.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from dataclasses import dataclass
from typing import Any

import xxhash

from stalwart.checkpoint.storage import Storage
from stalwart.errors import CheckpointCorruptError, CheckpointMismatchError, ConfigError

FORMAT = "stalwart-checkpoint"
FORMAT_VERSION = 2
ROOT_MARKER = "stalwart-checkpoints.json"
MANIFEST = "manifest.json"
CODECS = ("raw", "zstd")
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_QUARANTINED_DIR = re.compile(r"^step_(\d{8,})\.invalid-(\d+)$")
_DATA_FILE = re.compile(r"^step_\d{8,}/rank\d{5,}\.[A-Za-z0-9_-]+\.data$")
_META_FILE = re.compile(r"^rank\d{5,}\.[A-Za-z0-9_-]+\.meta\.json$")


def xxh3(data: memoryview | bytes) -> str:
    """The checksum of every tensor and meta file in a manifest."""
    return xxhash.xxh3_64_hexdigest(data)


BLOCK_BYTES = 8 << 20
"""A large sharded tensor also carries the xxh3 of each block of this many bytes (`TensorEntry.blocks`), so that a
rank resharding at another world size reads and checks only the blocks of a saved shard that overlap its new one
(load/shards.py): without them, a 4-rank FSDP2 checkpoint loaded on 3 ranks read 1.5x its bytes. 8 MiB: a few
hundred digests per GB of shards in the manifest, at most two blocks read beyond an overlap."""


def block_digests(tid: str, raw: memoryview | bytes) -> tuple[tuple[str, ...], int]:
    """The per-block checksums and block size a tensor's entry carries (`blocks`, `block_bytes`): for sharded
    tensors (`D/...`) over one block, else ((), 0)."""
    if not tid.startswith("D/") or len(raw) <= BLOCK_BYTES:
        return (), 0
    return blocks_of(raw, BLOCK_BYTES), BLOCK_BYTES


def blocks_of(raw: memoryview | bytes, size: int) -> tuple[str, ...]:
    view = memoryview(raw)
    return tuple(xxh3(view[i : i + size]) for i in range(0, len(view), size))


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def data_name(rank: int, token: str) -> str:
    return f"rank{rank:05d}.{token}.data"


_DATA_NAME = re.compile(r"^rank(\d{5,})\.[A-Za-z0-9_-]+\.data$")


def recycle_slot(rank: int) -> str:
    """Where retention leaves a retired data file of `rank` for its next full save (local storage only)."""
    return f"rank{rank:05d}.data"


def meta_name(rank: int, token: str) -> str:
    return f"rank{rank:05d}.{token}.meta.json"


def failed_name(rank: int, token: str) -> str:
    """Left by a rank whose persist gave up, so rank 0 stops waiting for it."""
    return f"rank{rank:05d}.{token}.failed"


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor's bytes are: `file` is relative to the root, so a delta can point into its base."""

    file: str
    offset: int
    stored_bytes: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    xxh3: str
    codec: str = "raw"
    blocks: tuple[str, ...] = ()
    """The xxh3 of each `block_bytes` of a raw sharded tensor over one block (`block_digests`), else empty."""
    block_bytes: int = 0
    """The block size of `blocks` (BLOCK_BYTES when written; kept, so that another size later reads the same)."""

    def to_json(self) -> dict[str, Any]:
        out = {
            "file": self.file,
            "offset": self.offset,
            "stored_bytes": self.stored_bytes,
            "nbytes": self.nbytes,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "xxh3": self.xxh3,
            "codec": self.codec,
        }
        if self.blocks:
            out["block_bytes"] = self.block_bytes
            out["blocks"] = list(self.blocks)
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> TensorEntry:
        entry = cls(
            str(raw["file"]),
            int(raw["offset"]),
            int(raw["stored_bytes"]),
            int(raw["nbytes"]),
            str(raw["dtype"]),
            tuple(int(d) for d in raw["shape"]),
            str(raw["xxh3"]),
            str(raw.get("codec", "raw")),
            tuple(str(b) for b in raw.get("blocks", ())),
            int(raw.get("block_bytes", 0)),
        )
        if not _DATA_FILE.match(entry.file) or entry.codec not in CODECS or min(entry.offset, entry.nbytes) < 0:
            raise ValueError(f"bad tensor entry {raw!r}")
        if entry.blocks and (
            entry.codec != "raw" or entry.block_bytes <= 0 or len(entry.blocks) != -(-entry.nbytes // entry.block_bytes)
        ):
            raise ValueError(f"bad tensor entry {raw!r}: its blocks do not cover its bytes")
        return entry


@dataclass(frozen=True, slots=True)
class RankEntry:
    meta: str
    bytes: int
    xxh3: str


@dataclass(frozen=True, slots=True)
class Manifest:
    """What a committed checkpoint holds."""

    step: int
    world_size: int
    token: str
    ranks: list[RankEntry]
    tensors: dict[str, TensorEntry]
    created: float
    base: int | None = None
    """The full checkpoint this delta refers to; None for a full checkpoint."""
    written_bytes: int = 0
    """Bytes this checkpoint added to storage (a delta adds only changed tensors, compressed)."""

    @property
    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def referenced_steps(self) -> set[int]:
        return {int(t.file[5 : t.file.index("/")]) for t in self.tensors.values()}

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "step": self.step,
                "world_size": self.world_size,
                "token": self.token,
                "created": self.created,
                "base": self.base,
                "written_bytes": self.written_bytes,
                "ranks": [{"meta": r.meta, "bytes": r.bytes, "xxh3": r.xxh3} for r in self.ranks],
                "tensors": {tid: t.to_json() for tid, t in self.tensors.items()},
            },
            indent=1,
        )

    @classmethod
    def parse(cls, text: str, where: str) -> Manifest:
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict) or raw.get("format") != FORMAT:
                raise CheckpointMismatchError(f"{where} is not a stalwart manifest")
            if raw.get("version") != FORMAT_VERSION:
                raise CheckpointMismatchError(
                    f"{where} has format version {raw.get('version')}; this stalwart reads {FORMAT_VERSION}"
                )
            ranks = [RankEntry(str(r["meta"]), int(r["bytes"]), str(r["xxh3"])) for r in raw["ranks"]]
            tensors = {str(k): TensorEntry.from_json(v) for k, v in raw["tensors"].items()}
            base = raw.get("base")
            m = cls(
                int(raw["step"]),
                int(raw["world_size"]),
                str(raw["token"]),
                ranks,
                tensors,
                float(raw["created"]),
                None if base is None else int(base),
                int(raw.get("written_bytes", 0)),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            if isinstance(exc, CheckpointMismatchError):  # a ValueError too, but no proof of damage
                raise
            raise CheckpointCorruptError(f"{where} is malformed: {exc}") from exc
        if len(m.ranks) != m.world_size or m.world_size < 1 or any(not _META_FILE.match(r.meta) for r in m.ranks):
            raise CheckpointCorruptError(f"{where} lists shards that do not match its world size")
        return m


def prepare_root(storage: Storage, *, create: bool) -> None:
    """Check that the root is ours (or empty) and writable; create it and its marker when `create` is set."""
    where = storage.display()
    local = storage.local_path()
    if local is not None and local.exists() and not local.is_dir():
        raise ConfigError(f"checkpoint directory {where} is a file, not a directory")
    names = storage.listdir()
    if names and ROOT_MARKER not in names:
        foreign = ", ".join(names[:3])
        raise ConfigError(
            f"checkpoint directory {where} holds files stalwart did not write ({foreign}); "
            "use an empty directory or one stalwart created"
        )
    if not create:
        return
    storage.makedirs("")
    if ROOT_MARKER not in names:
        storage.write_bytes(ROOT_MARKER, json.dumps({"format": "stalwart-checkpoints", "version": 1}).encode())


def committed_steps(storage: Storage) -> list[int]:
    """Steps with a manifest, newest first (whether their shards verify is checked on load)."""
    return sorted((s for s, d in step_dirs(storage) if MANIFEST in storage.listdir(d)), reverse=True)


def step_dirs(storage: Storage) -> list[tuple[int, str]]:
    """Every step directory, committed or interrupted, oldest first."""
    found = []
    for name in storage.listdir():
        m = _STEP_DIR.match(name)
        if m:
            found.append((int(m.group(1)), name))
    return sorted(found)


def quarantined(storage: Storage) -> list[tuple[int, str]]:
    """Checkpoints moved aside after failing verification: (step, name), oldest move first."""
    found = []
    for name in storage.listdir():
        m = _QUARANTINED_DIR.match(name)
        if m:
            found.append((int(m.group(2)), int(m.group(1)), name))
    return [(step, name) for _, step, name in sorted(found)]


def read_manifest(storage: Storage, step: int) -> Manifest:
    """Parse a step's manifest; an I/O error is raised as OSError (maybe passing), bad content as corruption."""
    rel = f"{step_dir_name(step)}/{MANIFEST}"
    try:
        text = storage.read(rel).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointCorruptError(f"{storage.display(rel)} is not text") from exc
    manifest = Manifest.parse(text, storage.display(rel))
    if manifest.step != step:
        raise CheckpointCorruptError(f"{storage.display(rel)} says step {manifest.step}, its directory says {step}")
    return manifest


def quarantine(storage: Storage, step: int) -> str:
    """Move a checkpoint that failed verification out of the step namespace; returns its new name.
    Quarantined checkpoints are never removed by retention: they are evidence."""
    dst = f"{step_dir_name(step)}.invalid-{time.time_ns()}"
    storage.move_tree(step_dir_name(step), dst)
    return dst


def prune(storage: Storage, keep_last: int, current: Manifest) -> list[int]:
    """Retention after a commit: keep the newest `keep_last` committed steps and the full checkpoints their
    deltas refer to, drop older interrupted saves and stale files of earlier attempts at the current step.
    Returns the steps removed."""
    committed = committed_steps(storage)
    keep = set(committed[:keep_last])
    for step in list(keep):
        manifest = current if step == current.step else _manifest_or_none(storage, step)
        if manifest is None:  # unreadable now: keep what it may refer to rather than guess
            keep.update(committed)
            break
        keep.update(manifest.referenced_steps())
    newest = committed[0] if committed else current.step
    removed = []
    for step, name in step_dirs(storage):
        interrupted = step not in committed and step < newest and step not in keep  # a base a copy brought along
        if (step in committed and step not in keep) or interrupted:
            for file in storage.listdir(name):  # a data file becomes the next one of its rank, if it may
                m = _DATA_NAME.match(file)
                if m and step in committed:
                    with contextlib.suppress(OSError):
                        storage.recycle(f"{name}/{file}", recycle_slot(int(m.group(1))))
            storage.remove_tree(name)
            removed.append(step)
    own = step_dir_name(current.step)
    live = {r.meta for r in current.ranks} | {t.file.split("/", 1)[1] for t in current.tensors.values()} | {MANIFEST}
    for name in storage.listdir(own):
        if name not in live and not name.startswith("."):
            storage.remove(f"{own}/{name}")
    return sorted(removed)


def _manifest_or_none(storage: Storage, step: int) -> Manifest | None:
    try:
        return read_manifest(storage, step)
    except (OSError, CheckpointCorruptError, CheckpointMismatchError):
        return None
