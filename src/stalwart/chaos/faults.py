"""Faults injected by (rank, step, restart) from one environment variable, so any script can be tested.

    STALWART_FAULTS="kill@rank=1,step=37;kill@rank=0,step=80,restart=1;kill_in_save@rank=1,step=40"

Kinds:
  kill          the rank sends itself a signal (default SIGKILL) just before starting `step`
  kill_in_optimizer  the rank is killed in the optimizer step of the step after `step` completed steps (after
                the step's collectives), at `phase`: 'before_snapshot' (default: before its light memory
                snapshot and the commit barrier) or 'after_barrier' (every rank has committed the step, this
                one's parameters are unchanged); fires only under light snapshots (job/step_commit.py)
  kill_in_save  the rank is killed while saving the checkpoint of `step`, at `phase`:
                'shard_half_written' (default: half its shard is on disk) or 'before_commit'
                (every shard is durable, the manifest is not yet written; fires on rank 0, the committer)
  kill_in_join  the rank is killed in a replacement of it (a warm spare, a late joiner) that joined the survivors'
                group at `step` or later, before they hand it their state (recovery/in_loop/late_join.grow)
  storage_error the first `times` (default 1) attempts to write the rank's checkpoint of `step` fail with
                `errno` (default EIO; e.g. ENOSPC): the persister must retry with backoff, training goes on
  slow          from `step` on, the rank sleeps `ms` milliseconds (default 10) at the start of every step, inside
                the time the straggler detector measures (a rank that is slower than the others)
  flip          one bit of the first replicated tensor (a parameter) flips on the rank just before `step`: silent
                corruption of one replica, which the divergence check must find and repair
  nan           the floating-point tensors of the rank's batch for `step` (the one `job.steps(loader)` yields after
                `step` completed steps) are filled with NaN: the numeric guard must keep it out of the parameters
  spike         the floating-point tensors of the rank's batch for `step` are multiplied by `factor` (default 100):
                a finite outlier batch whose loss spikes (the loss-spike check's fault; see JobConfig.loss_spike)
  hang          the rank stops making progress just before starting `step`, `how`: 'sigstop' (default: it
                stops itself with SIGSTOP), 'sleep' (a sleep inside C code, libc's sleep) or 'deadlock' (it
                takes a lock it already holds); the agent must detect it and kill it
`restart` (default 0) is the launcher's TORCHELASTIC_RESTART_COUNT at which the fault fires, so a fault
fires once and the restarted job runs on; within a process too, a fault fires once (a step replayed after a
rollback, recovery/rollback.py, does not meet it again).
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stalwart.errors import ConfigError
from stalwart.runtime.env import FAULTS_ENV as FAULTS_ENV

_KINDS = (
    "kill",
    "kill_in_save",
    "kill_in_optimizer",
    "kill_in_join",
    "storage_error",
    "hang",
    "nan",
    "spike",
    "slow",
    "flip",
)
_HOWS = ("sigstop", "sleep", "deadlock")
_PHASES = ("shard_half_written", "before_commit")
_OPTIMIZER_PHASES = ("before_snapshot", "after_barrier")


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    rank: int
    step: int
    restart: int = 0
    phase: str = "shard_half_written"
    signal: str = "SIGKILL"
    errno: str = "EIO"
    times: int = 1
    how: str = "sigstop"
    ms: float = 10.0
    factor: float = 100.0


def parse_faults(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        kind, _, params = item.partition("@")
        if kind not in _KINDS:
            raise ConfigError(f"{FAULTS_ENV}: unknown fault kind {kind!r} (known: {', '.join(_KINDS)})")
        fields: dict[str, str] = {}
        for pair in filter(None, params.split(",")):
            key, eq, value = pair.partition("=")
            if not eq:
                raise ConfigError(f"{FAULTS_ENV}: expected key=value in {item!r}")
            fields[key.strip()] = value.strip()
        try:
            fault = Fault(
                kind=kind,
                rank=int(fields.pop("rank")),
                step=int(fields.pop("step")),
                restart=int(fields.pop("restart", "0")),
                phase=fields.pop("phase", "before_snapshot" if kind == "kill_in_optimizer" else "shard_half_written"),
                signal=fields.pop("signal", "SIGKILL"),
                errno=fields.pop("errno", "EIO"),
                times=int(fields.pop("times", "1")),
                how=fields.pop("how", "sigstop"),
                ms=float(fields.pop("ms", "10")),
                factor=float(fields.pop("factor", "100")),
            )
        except (KeyError, ValueError) as exc:
            raise ConfigError(f"{FAULTS_ENV}: {item!r} needs integer rank= and step= ({exc})") from exc
        if fields:
            raise ConfigError(f"{FAULTS_ENV}: unknown keys {sorted(fields)} in {item!r}")
        phases = _OPTIMIZER_PHASES if kind == "kill_in_optimizer" else _PHASES
        if fault.phase not in phases or not hasattr(signal, fault.signal) or not hasattr(errno, fault.errno):
            raise ConfigError(f"{FAULTS_ENV}: bad phase or signal in {item!r}")
        if not 0 <= fault.ms < float("inf"):
            raise ConfigError(f"{FAULTS_ENV}: ms= must be a non-negative number of milliseconds in {item!r}")
        if fault.how not in _HOWS:
            raise ConfigError(f"{FAULTS_ENV}: how= must be one of {', '.join(_HOWS)} in {item!r}")
        faults.append(fault)
    return faults


Announce = Callable[[str, dict[str, Any]], None]
"""(fault kind, details): job/hooks.Announce, called just before a fault fires."""


class FaultInjector:
    """Fires this rank's faults at the matching step/phase; before dying it calls `announce`. The job's StepHooks
    (job/step_hooks.py), installed through runtime/seams.py by chaos/install.py."""

    def __init__(self, faults: list[Fault], rank: int, restart: int, announce: Announce | None = None) -> None:
        self._faults = [f for f in faults if f.rank == rank and f.restart == restart]
        self._tell = announce or (lambda kind, details: None)
        self._fired: set[int] = set()  # indices into _faults: a step replayed after a rollback meets no fault again

    def _first_time(self, fault: Fault) -> bool:
        index = next(i for i, f in enumerate(self._faults) if f is fault)
        if index in self._fired:
            return False
        self._fired.add(index)
        return True

    @classmethod
    def from_env(cls, rank: int, restart: int, announce: Announce | None = None) -> FaultInjector:
        return cls(parse_faults(os.environ.get(FAULTS_ENV, "")), rank, restart, announce)

    @property
    def armed(self) -> bool:
        """Whether any fault waits for this rank and restart."""
        return bool(self._faults)

    def _announce(self, fault: Fault) -> None:
        details: dict[str, Any] = {}
        if fault.kind == "hang":
            details["how"] = fault.how
        elif fault.kind in ("kill_in_save", "kill_in_optimizer"):
            details["phase"] = fault.phase
        self._tell(fault.kind, details)

    def before_step(self, step: int) -> None:
        """Before the step after `step` completed steps: a `kill` or a `hang` that says so."""
        for f in self._faults:
            if f.kind == "kill" and f.step == step:
                self._fire(f)
            elif f.kind == "hang" and f.step == step:
                self._hang(f)

    def step_started(self, step: int, tensors: Callable[[], list[Any]]) -> None:
        """Inside the measured time of the step after `step` completed steps: `slow`, then `flip`."""
        self.slow(step)
        self.flip(step, tensors)

    def slow(self, step: int) -> None:
        """At the start of the step after `step` completed steps: sleep if a `slow` fault covers it."""
        for f in self._faults:
            if f.kind == "slow" and step >= f.step:
                if step == f.step:
                    self._announce(f)
                time.sleep(f.ms / 1000)

    def flip(self, step: int, tensors: Callable[[], list[Any]]) -> None:
        """Before the step after `step` completed steps: flip a bit of `tensors()[0]` if a `flip` fault says so."""
        for f in self._faults:
            if f.kind == "flip" and f.step == step and self._first_time(f):
                found = tensors()
                if found:
                    self._announce(f)
                    _flip_a_bit(found[0])

    def batch(self, step: int, batch: Any) -> Any:
        """The batch of the step after `step` completed steps, poisoned with NaN (a `nan` fault) or scaled up (a
        `spike` fault) if one says so."""
        for f in self._faults:
            if f.kind in ("nan", "spike") and f.step == step and self._first_time(f):
                self._announce(f)
                return _poisoned(batch, None if f.kind == "nan" else f.factor)
        return batch

    def in_optimizer(self, step: int, phase: str) -> None:
        """Called at the commit point of the step after `step` completed steps (job/step_commit.py)."""
        for f in self._faults:
            if f.kind == "kill_in_optimizer" and f.step == step and f.phase == phase:
                self._fire(f)

    def joined(self, step: int) -> None:
        """In a replacement that joined the survivors' group at `step`, before their state is handed to it."""
        for f in self._faults:
            if f.kind == "kill_in_join" and step >= f.step and self._first_time(f):
                self._fire(f)

    def save_faults(self, step: int) -> dict[str, object] | None:
        """The faults the persist of `step` is to meet, as its request carries them to the persister
        (chaos/save_faults.py): `kill_phase` (kill_in_save) and `storage_error` ({errno, times})."""
        chaos: dict[str, object] = {}
        for f in self._faults:
            if f.step != step:
                continue
            if f.kind == "kill_in_save":
                chaos["kill_phase"] = f.phase
            elif f.kind == "storage_error":
                chaos["storage_error"] = {"errno": f.errno, "times": f.times}
        return chaos or None

    def _fire(self, fault: Fault) -> None:
        self._announce(fault)
        os.kill(os.getpid(), getattr(signal, fault.signal))

    def _hang(self, fault: Fault) -> None:
        """Never returns by itself: only a signal from outside (the agent's SIGKILL) ends it."""
        self._announce(fault)
        if fault.how == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.how == "sleep":
            libc = ctypes.CDLL(None)
            while True:
                libc.sleep(3600)
        else:
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()


def _poisoned(value: Any, factor: float | None = None) -> Any:
    """`value` with every floating-point tensor in it (through tuples, lists and dicts) a NaN-filled copy, or with
    a `factor`, a copy scaled by it. torch is imported here, not at the top: this module is also loaded by the
    torch-free persister process."""
    import torch

    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            return value
        return torch.full_like(value, float("nan")) if factor is None else value * factor
    if isinstance(value, dict):
        return type(value)((k, _poisoned(v, factor)) for k, v in value.items())
    if isinstance(value, list | tuple):
        items = [_poisoned(v, factor) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _flip_a_bit(tensor: Any) -> None:
    """Flip bit 20 of the tensor's first 32-bit word (or bit 4 of its first byte), in place."""
    import torch

    with torch.no_grad():
        raw = tensor.detach().reshape(-1).view(torch.uint8)
        if raw.numel() >= 4:
            words = raw[:4].view(torch.int32)
            words.bitwise_xor_(1 << 20)
        else:
            raw[:1].bitwise_xor_(1 << 4)
