"""Durable checkpoints v1: every rank writes its shard in parallel, rank 0 commits with a manifest.

Two-phase commit. Phase 1: each rank writes and fsyncs its shard. The ranks then exchange (ok, bytes, crc32).
Phase 2: only if every rank succeeded, rank 0 writes the manifest atomically; that rename is the instant the
checkpoint becomes visible. A crash at any earlier instant leaves the previous checkpoint the newest loadable one.

Loading walks committed steps newest first; every rank verifies its own shard (size and CRC) and the ranks
agree on the newest step that verified everywhere, so a corrupt or truncated shard makes all ranks fall back
together to the next older checkpoint, with an event. The invalid checkpoint is moved to
`step_XXXXXXXX.invalid-<time>` for inspection, never deleted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalwart.checkpoint import layout
from stalwart.checkpoint.serialize import checksum, dumps, loads
from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    ConfigError,
    PeerError,
)
from stalwart.job.dist import Comm
from stalwart.telemetry.events import EventLog

FaultHook = Callable[[str], None]
"""Called with a phase name ('shard_half_written', 'before_commit') so chaos can kill at that instant."""


@dataclass(frozen=True, slots=True)
class Restored:
    """A shard that was loaded: its step, the world size that wrote it, and its contents."""

    step: int
    world_size: int
    state: dict[str, Any]
    source: str


class Checkpointer:
    """Saves and loads this rank's shard of the job's checkpoints under one root directory."""

    def __init__(
        self,
        root: str | Path,
        comm: Comm,
        events: EventLog,
        *,
        keep_last: int,
        token: str,
        fault_hook: FaultHook | None = None,
    ) -> None:
        self.root = Path(root)
        self._comm = comm
        self._events = events
        self._keep_last = keep_last
        self._token = token
        self._fault = fault_hook or (lambda phase: None)
        self._attempt = 0
        # Rank 0 alone checks and creates the root, then tells the others: a rank that looked while rank 0 was
        # creating it would take the half-written marker for a foreign file.
        problem: ConfigError | None = None
        if comm.rank == 0:
            try:
                layout.prepare_root(self.root, create=True)
            except ConfigError as exc:
                problem = exc
        if not comm.broadcast_int(0 if problem else 1):
            raise problem or PeerError("rank 0 rejected the checkpoint directory; see its error")

    def save(self, step: int, state: dict[str, Any]) -> bool:
        """Write this rank's shard for `step` and commit if every rank succeeded. Returns whether it committed.

        A failed write (disk full, I/O error) is logged and skipped: training goes on and the previous checkpoint
        stays the newest. Errors of the state itself (unloadable types) are raised: they would fail every time.
        """
        started = time.monotonic()
        data = dumps(state)
        self._attempt += 1
        token = f"{self._token}-{self._attempt}"
        name = layout.shard_name(self._comm.rank, token)
        step_dir = self.root / layout.step_dir_name(step)
        ok = 1
        try:
            step_dir.mkdir(exist_ok=True)
            layout.write_durable(step_dir / name, data, on_half_written=lambda: self._fault("shard_half_written"))
        except OSError as exc:
            ok = 0
            self._events.emit("checkpoint_write_failed", step=step, error=str(exc))
        crc = checksum(data)
        gathered = self._comm.all_gather_ints([ok, len(data), crc])
        if not all(g[0] for g in gathered):
            self._events.emit("checkpoint_skipped", step=step, reason="a rank failed to write its shard")
            return False
        self._fault("before_commit")
        if self._comm.rank == 0:
            manifest = layout.Manifest(
                step=step,
                world_size=self._comm.world_size,
                token=token,
                shards=[(layout.shard_name(r, token), g[1], g[2]) for r, g in enumerate(gathered)],
                created=time.time(),
            )
            layout.write_durable(step_dir / layout.MANIFEST, manifest.to_json().encode())
            removed = layout.prune(self.root, self._keep_last, manifest)
            self._events.emit(
                "checkpoint_committed",
                step=step,
                bytes=sum(g[1] for g in gathered),
                seconds=time.monotonic() - started,
                path=str(step_dir),
                removed=removed,
            )
        return True

    def load_latest(self, *, allow_world_size_change: bool = False) -> Restored | None:
        """Load the newest checkpoint that verifies on every rank, or None when there is none."""
        for step in layout.committed_steps(self.root):
            restored, problem = self._try_load(step, allow_world_size_change)
            votes = self._comm.all_gather_ints([0 if problem else 1])
            if all(v[0] for v in votes):
                assert restored is not None
                return restored
            if problem:
                self._events.emit("checkpoint_invalid", step=step, error=str(problem))
            if self._comm.rank == 0:
                # Every rank is done reading it (the vote above); move it aside so a later save of the same
                # step cannot overwrite the evidence, and keep it out of retention.
                moved = layout.quarantine(self.root, step)
                self._events.emit("checkpoint_quarantined", step=step, path=str(moved))
        return None

    def _try_load(self, step: int, allow_resize: bool) -> tuple[Restored | None, CheckpointError | None]:
        try:
            manifest = layout.read_manifest(self.root, step)
            if manifest.world_size != self._comm.world_size and not allow_resize:
                raise CheckpointMismatchError(
                    f"checkpoint {self.root / layout.step_dir_name(step)} was written by {manifest.world_size} "
                    f"ranks and this job has {self._comm.world_size}; relaunch with the same world size or "
                    "pass allow_world_size_change=True (docs/checkpoints.md)"
                )
            source_rank = self._comm.rank % manifest.world_size
            name, size, crc = manifest.shards[source_rank]
            path = self.root / layout.step_dir_name(step) / name
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise CheckpointCorruptError(f"shard {path} cannot be read: {exc.strerror or exc}") from exc
            if len(data) != size:
                raise CheckpointCorruptError(f"shard {path} has {len(data)} bytes, its manifest says {size}")
            if checksum(data) != crc:
                raise CheckpointCorruptError(f"shard {path} fails its CRC-32 check")
            return Restored(step, manifest.world_size, loads(data, str(path)), str(path)), None
        except CheckpointMismatchError:
            raise
        except CheckpointError as exc:
            return None, exc
