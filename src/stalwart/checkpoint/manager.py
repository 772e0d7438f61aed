"""Durable checkpoints v1: every rank writes its shard in parallel, rank 0 commits with a manifest.

Two-phase commit. Phase 1: each rank writes and fsyncs its shard. The ranks then exchange (ok, bytes, crc32).
Phase 2: only if every rank succeeded, rank 0 writes the manifest atomically; that rename is the instant the
checkpoint becomes visible, and rank 0 tells every rank whether it happened. A crash at any earlier instant
leaves the previous checkpoint the newest loadable one.

Every decision that must be the same on all ranks is taken once and shared: rank 0 lists the checkpoints,
the ranks vote on each candidate, rank 0 reports the commit. A rank that saw the directory differently (a node-
local path, a lagging network filesystem) can therefore never wait in a different collective than the others;
and at start every rank must see a file rank 0 wrote, or the job stops with a clear error.

Loading walks the committed steps newest first; every rank verifies its own shard (size and CRC) and the
newest step valid on every rank is loaded. Newer ones that failed an integrity check are moved to
`step_XXXXXXXX.invalid-<ns>` for inspection, never deleted. If checkpoints exist but none verifies, loading stops
with NoValidCheckpointError rather than silently starting again from step 0.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalwart.checkpoint import layout
from stalwart.checkpoint.serialize import checksum, dumps, loads
from stalwart.checkpoint.verify import read_verified, retrying
from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    ConfigError,
    NoValidCheckpointError,
    PeerError,
    UnsavableStateError,
)
from stalwart.job.dist import Comm
from stalwart.telemetry.events import EventLog

FaultHook = Callable[[str], None]
"""Called with a phase name ('shard_half_written', 'before_commit') so chaos can kill at that instant."""

_OK, _FAILED, _UNSAVABLE = 1, 0, -1  # a rank's vote on a save
_VALID, _CORRUPT, _UNREADABLE, _MISMATCH = 1, 0, -1, -2  # a rank's vote on a checkpoint it tried to load
SHARED_DIR_TIMEOUT_S = 10.0


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
        self._prepare_root()

    def _prepare_root(self) -> None:
        """Rank 0 alone checks and creates the root (a rank looking while rank 0 creates it would take the
        half-written marker for a foreign file), then every rank must read a probe file rank 0 wrote."""
        problem: ConfigError | None = None
        probe = self.root / f".probe-{self._token}"
        if self._comm.rank == 0:
            try:
                layout.prepare_root(self.root, create=True)
                layout.write_durable(probe, self._token.encode())
            except ConfigError as exc:
                problem = exc
            except OSError as exc:
                problem = ConfigError(f"checkpoint directory {self.root} is not writable: {exc.strerror or exc}")
        if not self._comm.broadcast_int(0 if problem else 1):
            raise problem or PeerError("rank 0 rejected the checkpoint directory; see its error")
        sees = 1 if self._comm.rank == 0 else int(layout.wait_for_file(probe, self._token, SHARED_DIR_TIMEOUT_S))
        votes = self._comm.all_gather_ints([sees])
        if self._comm.rank == 0:
            with contextlib.suppress(OSError):
                probe.unlink(missing_ok=True)
        if all(v[0] for v in votes):
            return
        if not sees:
            raise ConfigError(
                f"rank {self._comm.rank} cannot see the checkpoint directory {self.root} that rank 0 writes to; "
                "put checkpoint_dir on storage every rank shares (a shared filesystem)"
            )
        raise PeerError("another rank cannot see the checkpoint directory; see its error")

    def save(self, step: int, state: dict[str, Any]) -> bool:
        """Write this rank's shard for `step` and commit if every rank succeeded. Returns whether it committed.

        A failed write (disk full, I/O error), on any rank and for the manifest too, is logged and the save is
        skipped on every rank alike: training goes on and the previous checkpoint stays the newest. A state
        that can never be saved (unloadable types) raises UnsavableStateError on every rank.
        """
        started = time.monotonic()
        self._attempt += 1
        token = f"{self._token}-{self._attempt}"
        vote, size, crc = _OK, 0, 0
        unsavable: UnsavableStateError | None = None
        try:
            data = dumps(state)
            size, crc = len(data), checksum(data)
            step_dir = layout.make_step_dir(self.root, step)
            layout.write_durable(
                step_dir / layout.shard_name(self._comm.rank, token),
                data,
                on_half_written=lambda: self._fault("shard_half_written"),
            )
        except UnsavableStateError as exc:
            vote, unsavable = _UNSAVABLE, exc
        except OSError as exc:
            vote = _FAILED
            self._events.emit("checkpoint_write_failed", step=step, error=str(exc))
        except Exception as exc:  # torch.save failing on a state: vote, so no rank is left waiting in the gather
            vote = _UNSAVABLE
            unsavable = UnsavableStateError(f"the state of step {step} cannot be serialized: {exc}")
        gathered = self._comm.all_gather_ints([vote, size, crc])
        if any(g[0] == _UNSAVABLE for g in gathered):
            raise unsavable or PeerError("another rank's state cannot be checkpointed; see its error")
        if not all(g[0] == _OK for g in gathered):
            self._events.emit("checkpoint_skipped", step=step, reason="a rank failed to write its shard")
            return False
        self._fault("before_commit")
        committed = self._commit(step, token, gathered, started) if self._comm.rank == 0 else 0
        return bool(self._comm.broadcast_int(committed))

    def _commit(self, step: int, token: str, gathered: list[list[int]], started: float) -> int:
        step_dir = self.root / layout.step_dir_name(step)
        manifest = layout.Manifest(
            step=step,
            world_size=self._comm.world_size,
            token=token,
            shards=[(layout.shard_name(r, token), g[1], g[2]) for r, g in enumerate(gathered)],
            created=time.time(),
        )
        try:
            layout.write_durable(step_dir / layout.MANIFEST, manifest.to_json().encode())
        except OSError as exc:
            self._events.emit("checkpoint_write_failed", step=step, error=f"manifest: {exc}")
            self._events.emit("checkpoint_skipped", step=step, reason="the manifest could not be written")
            return 0
        try:
            removed = layout.prune(self.root, self._keep_last, manifest)
        except OSError as exc:  # the commit stands; old checkpoints are removed after a later save
            removed = []
            self._events.emit("checkpoint_prune_failed", step=step, error=str(exc))
        self._events.emit(
            "checkpoint_committed",
            step=step,
            bytes=sum(g[1] for g in gathered),
            seconds=time.monotonic() - started,
            path=str(step_dir),
            removed=removed,
        )
        return 1

    def load_latest(self, *, allow_world_size_change: bool = False) -> Restored | None:
        """Load the newest checkpoint that verifies on every rank; None when there is no checkpoint at all."""
        listing: list[int] = []
        if self._comm.rank == 0:
            try:
                listing = [1, *layout.committed_steps(self.root)]
            except OSError as exc:
                self._events.emit("checkpoint_list_failed", error=str(exc))
                listing = [0]
        listed, *steps = self._comm.broadcast_ints(listing)
        if not listed:  # maybe passing: not a user error, so the launcher restarts and tries again
            raise CheckpointError(f"rank 0 cannot list the checkpoint directory {self.root}")
        corrupt: list[int] = []
        first_problem: str | None = None
        unreadable_only = True
        for step in steps:
            restored, verdict, problem = self._try_load(step, allow_world_size_change)
            votes = [v[0] for v in self._comm.all_gather_ints([verdict])]
            if _MISMATCH in votes:
                if verdict == _MISMATCH:
                    raise CheckpointMismatchError(problem)
                raise PeerError("the checkpoint does not fit this job; see another rank's error")
            if all(v == _VALID for v in votes):
                assert restored is not None
                self._quarantine(corrupt)
                return restored
            if problem:
                first_problem = first_problem or problem
                self._events.emit("checkpoint_invalid", step=step, error=problem)
            if _CORRUPT in votes:
                corrupt.append(step)
                unreadable_only = False
        if not steps:
            return None
        if unreadable_only:
            raise CheckpointError(
                f"no checkpoint in {self.root} can be read now ({first_problem or 'see other ranks'})"
            )
        if first_problem is None:
            raise PeerError("no checkpoint verifies on another rank; see its error")
        raise NoValidCheckpointError(
            f"none of the {len(steps)} checkpoints in {self.root} verifies (step {steps[0]}: {first_problem}); "
            "nothing was loaded or changed. Move them aside or use another checkpoint_dir to start from step 0"
        )

    def _quarantine(self, steps: list[int]) -> None:
        """Move checkpoints that failed an integrity check aside (rank 0; every rank has finished reading them)."""
        if not steps:
            return
        if self._comm.rank == 0:
            for step in steps:
                try:
                    moved = layout.quarantine(self.root, step)
                    self._events.emit("checkpoint_quarantined", step=step, path=str(moved))
                except OSError as exc:
                    self._events.emit("checkpoint_quarantine_failed", step=step, error=str(exc))
        self._comm.barrier()  # no rank writes a new save of that step until it has been moved aside

    def _try_load(self, step: int, allow_resize: bool) -> tuple[Restored | None, int, str | None]:
        """(restored, verdict, problem). Size, CRC and format failures are _CORRUPT; an I/O error that persists
        over a few attempts is _UNREADABLE (maybe passing: reported, never quarantined); a valid checkpoint
        written at another world size, when that is not allowed, is _MISMATCH."""
        step_dir = self.root / layout.step_dir_name(step)
        try:
            manifest = retrying(lambda: layout.read_manifest(self.root, step))
        except CheckpointMismatchError as exc:
            return None, _MISMATCH, str(exc)
        except CheckpointCorruptError as exc:
            return None, _CORRUPT, str(exc)
        except FileNotFoundError:
            return None, _CORRUPT, f"{step_dir / layout.MANIFEST} disappeared"
        except OSError as exc:
            return None, _UNREADABLE, f"{step_dir / layout.MANIFEST} cannot be read: {exc.strerror or exc}"
        if manifest.world_size != self._comm.world_size and not allow_resize:
            return (
                None,
                _MISMATCH,
                (
                    f"checkpoint {step_dir} was written by {manifest.world_size} ranks and this job has "
                    f"{self._comm.world_size}; relaunch with the same world size or allow a world-size change "
                    "(docs/checkpoints.md)"
                ),
            )
        name, size, crc = manifest.shards[self._comm.rank % manifest.world_size]
        path = step_dir / name
        try:
            state = loads(read_verified(path, size, crc), str(path))
        except CheckpointCorruptError as exc:
            return None, _CORRUPT, str(exc)
        except OSError as exc:
            return None, _UNREADABLE, f"shard {path} cannot be read: {exc.strerror or exc}"
        return Restored(step, manifest.world_size, state, str(path)), _VALID, None
