"""Heartbeats from workers to their node agent through a small shared-memory board, not the training collectives.

The agent creates one board per node (a file in /dev/shm) with a slot per local rank and tells the workers its
path in STALWART_HEARTBEAT. A worker writes its slot at every step boundary: its pid, the step, the phase, the
time of the beat and the deadline by which it promises to beat again. A beat is a few stores into mapped memory
(about a microsecond), costs no system call and reaches the agent even while the worker's collectives are stuck.

The agent reads the slots every monitor interval. A watched slot whose deadline has passed belongs to a worker
that stopped making progress: stopped by a signal, deadlocked, asleep in C code, or blocked in a collective
behind such a peer. Times are CLOCK_MONOTONIC nanoseconds, which every process on a host shares.

A slot is written seqlock-style (sequence odd while writing, even when done), so the agent never acts on a torn
slot: it reads again, or skips the slot until the next interval.

The board's last slot goes the other way: the agent's risk counter, which it raises when its GPU watch sees a
warning sign (throttling, rising ECC errors, rows pending remapping: supervisor/gpu_watch.py), and its
preemption flag, set when the launcher gets SIGTERM. Workers read them at each step's end (a load from mapped
memory) and agree on a risk checkpoint, or a last checkpoint and a clean exit (detect/risk.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalwart.runtime.env import HEARTBEAT_ENV as HEARTBEAT_ENV

BOARD_PREFIX = "stalwart-heartbeat-"
"""A board's file name: the prefix, the launcher's pid and a random suffix (its memory tier shares the suffix)."""
"""Path of the agent's heartbeat board; unset when a worker is not started by `stalwart run`."""

SLOT = struct.Struct("<qqqqqq")  # seq, pid, step, phase, beat_ns, deadline_ns
SLOT_BYTES = 64
WORD = struct.Struct("<q")
RISK_AT, PREEMPT_AT = 0, 8
"""The agent's slot (the board's last), one int64 word each at these offsets in it: the risk counter, and the
preemption flag (1: asked)."""

PHASE_NONE, PHASE_RESUME, PHASE_STEP, PHASE_SAVE, PHASE_DONE = range(5)
PHASES = {PHASE_NONE: "none", PHASE_RESUME: "resume", PHASE_STEP: "step", PHASE_SAVE: "save", PHASE_DONE: "done"}


@dataclass(frozen=True, slots=True)
class Beat:
    """One slot as the agent reads it. `deadline_ns` 0: not watched (outside the training loop)."""

    pid: int
    step: int
    phase: int
    beat_ns: int
    deadline_ns: int

    @property
    def phase_name(self) -> str:
        return PHASES.get(self.phase, str(self.phase))


def _map(path: Path, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class Board:
    """The agent's side: creates the board, reads slots, clears them before workers (re)start."""

    def __init__(self, slots: int, directory: str | None = None) -> None:
        base = Path(directory or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()))
        self.path = base / f"{BOARD_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.slots = slots
        size = (max(slots, 1) + 1) * SLOT_BYTES  # the workers' slots, then the agent's risk counter
        # The board is created locked under a temporary name and then renamed: no other launcher's stale
        # cleanup can ever find it unlocked. The lock is held (the descriptor open) for the board's lifetime.
        hidden = self.path.with_name("." + self.path.name)
        self._lock_fd: int | None = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(self._lock_fd, size)
            os.rename(hidden, self.path)
        except OSError:
            os.close(self._lock_fd)
            hidden.unlink(missing_ok=True)
            raise
        self._map: mmap.mmap | None = _map(self.path, size)

    @staticmethod
    def abandoned(path: Path) -> bool:
        """Whether the board at `path` has no living owner: its lock is free. Unlike a check of the pid in its
        name, this holds for a reused pid and for a launcher in another pid namespace sharing /dev/shm."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return True
        except OSError:
            return False  # not ours to judge (another user's)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return False  # held: its launcher is alive
        finally:
            os.close(fd)  # closing also drops the probe's lock
        return True

    def clear(self) -> None:
        """Forget every beat: a restarted worker starts unwatched until its first beat. The risk counter stays."""
        if self._map is not None:
            end = max(self.slots, 1) * SLOT_BYTES
            self._map[:end] = bytes(end)

    def request_preemption(self) -> None:
        """Ask the workers for a last checkpoint and a clean exit (the launcher got SIGTERM)."""
        if self._map is not None:
            WORD.pack_into(self._map, self._agent_slot + PREEMPT_AT, 1)

    def raise_risk(self) -> int:
        """Tell the workers of a warning sign: the counter goes up by one; returns it."""
        if self._map is None:
            return 0
        value = int(WORD.unpack_from(self._map, self._agent_slot + RISK_AT)[0]) + 1
        WORD.pack_into(self._map, self._agent_slot + RISK_AT, value)
        return value

    @property
    def _agent_slot(self) -> int:
        return max(self.slots, 1) * SLOT_BYTES

    def read(self, slot: int) -> Beat | None:
        """The slot's last complete beat, or None (never written, or being written on both tries)."""
        if self._map is None or not 0 <= slot < self.slots:
            return None
        for _ in range(2):
            seq, pid, step, phase, beat_ns, deadline_ns = SLOT.unpack_from(self._map, slot * SLOT_BYTES)
            again = SLOT.unpack_from(self._map, slot * SLOT_BYTES)[0]
            if seq == again and seq % 2 == 0:
                return Beat(pid, step, phase, beat_ns, deadline_ns) if seq else None
        return None

    def progress(self, slot: int, pid: int) -> dict[str, Any]:
        """The steps worker `pid` had completed by its last beat in the loop, and when (a beat at a step's start, or
        at the start of a checkpoint's save after a step, on the events' monotonic clock): the agent's
        `worker_failed` carries them, so that `stalwart report` counts from there where the worker's own `step_done`
        events are every `log_every` steps (telemetry/goodput.py). A worker killed during a save counted from its
        last logged step before 2026-11-30 (10 steps redone reported for 19, tests/test_goodput.py). Empty without
        such a beat of that pid."""
        beat = self.read(slot)
        if beat is None or beat.pid != pid or beat.phase not in (PHASE_STEP, PHASE_SAVE):
            return {}
        return {"last_step": beat.step, "last_step_mono": round(beat.beat_ns / 1e9, 6)}

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


class Heartbeat:
    """The worker's side: `beat()` writes this worker's slot. A no-op when there is no board."""

    def __init__(self, path: str | None, slot: int) -> None:
        self._map: mmap.mmap | None = None
        self._offset = slot * SLOT_BYTES
        self._agent_slot = -1  # the offset of the agent's slot: the board's last
        self._seq = 0
        self._pid = os.getpid()
        if path:
            with contextlib.suppress(OSError, ValueError):
                m = _map(Path(path), os.path.getsize(path))
                if self._offset + SLOT_BYTES <= len(m):
                    self._map = m
                    if self._offset + 2 * SLOT_BYTES <= len(m):
                        self._agent_slot = len(m) - SLOT_BYTES
                else:
                    m.close()

    @classmethod
    def from_env(cls, local_rank: int) -> Heartbeat:
        return cls(os.environ.get(HEARTBEAT_ENV), local_rank)

    @property
    def active(self) -> bool:
        return self._map is not None

    def risk(self) -> int:
        """The agent's risk counter (0 without a board): it rises with every warning sign the agent sees."""
        if self._map is None or self._agent_slot < 0:
            return 0
        return int(WORD.unpack_from(self._map, self._agent_slot + RISK_AT)[0])

    def preemption_requested(self) -> bool:
        """Whether the agent asked for a last checkpoint and a clean exit."""
        if self._map is None or self._agent_slot < 0:
            return False
        return bool(WORD.unpack_from(self._map, self._agent_slot + PREEMPT_AT)[0])

    def beat(self, step: int, phase: int, timeout_s: float | None) -> None:
        """Say "at `step`, in `phase`, and I will beat again within `timeout_s`" (None: do not watch me)."""
        if self._map is None:
            return
        now = time.monotonic_ns()
        deadline = 0 if timeout_s is None else now + int(timeout_s * 1e9)
        self._seq += 1
        WORD.pack_into(self._map, self._offset, 2 * self._seq - 1)  # the seq word first, odd: being written
        SLOT.pack_into(self._map, self._offset, 2 * self._seq - 1, self._pid, step, phase, now, deadline)
        WORD.pack_into(self._map, self._offset, 2 * self._seq)

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(Exception):
                self.beat(0, PHASE_DONE, None)
            self._map.close()
            self._map = None
