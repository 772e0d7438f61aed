"""Faults inside a checkpoint's persist, entering at the persister's seams (checkpoint/save/save_hooks.py): its
storage and two instants.

The persister runs in its own process and receives the faults a save should meet in its request (`faults`:
from STALWART_FAULTS through FaultInjector.save_faults). chaos/install.py installs `SaveFaults.of` as the factory
of its SaveHooks: it kills the training process at an instant (kill_in_save) and writes through the storage
`flaky()` returns (storage_error).
"""

from __future__ import annotations

import copy
import errno
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stalwart.telemetry.events import EventLog

SHARD_HALF_WRITTEN = "shard_half_written"
BEFORE_COMMIT = "before_commit"


@dataclass(slots=True)
class SaveFaults:
    """The kill_in_save fault of one save: the training process dies at `phase` (or nothing happens)."""

    phase: str | None
    step: int
    trainer_pid: int
    events: EventLog
    faults: dict[str, Any] | None = None

    @classmethod
    def of(cls, faults: dict[str, Any] | None, step: int, trainer_pid: int, events: EventLog) -> SaveFaults:
        """From a persist request's `faults` field (FaultInjector.save_faults)."""
        return cls((faults or {}).get("kill_phase"), step, trainer_pid, events, faults)

    def storage(self, storage: Any) -> Any:
        """The storage this save writes through: failing as the request's storage_error says, if it does."""
        return flaky(storage, self.faults)

    @property
    def on_half_written(self) -> Callable[[], None] | None:
        """Called once half of the rank's data is written; None when no fault waits there."""
        return (lambda: self._kill(SHARD_HALF_WRITTEN)) if self.phase == SHARD_HALF_WRITTEN else None

    def before_commit(self) -> None:
        """Called on the committing rank after every shard is durable, before the manifest is written."""
        if self.phase == BEFORE_COMMIT:
            self._kill(BEFORE_COMMIT)

    def _kill(self, phase: str) -> None:
        """The training process dies at this instant of its save (and this process with it)."""
        self.events.emit("fault_injected", fault="kill_in_save", step=self.step, phase=phase)
        os.kill(self.trainer_pid, signal.SIGKILL)
        if self.trainer_pid != os.getpid():
            os._exit(1)


def flaky(storage: Any, chaos: dict[str, Any] | None) -> Any:
    """`storage`, or a copy of it (same class) whose first `times` data writes of this save fail with `errno`
    (e.g. ENOSPC), as a full or failing disk would (storage_error fault)."""
    spec = (chaos or {}).get("storage_error")
    if not spec or int(spec.get("times", 0)) <= 0:
        return storage
    left = [int(spec["times"])]
    code = getattr(errno, str(spec["errno"]))
    wrapped = copy.copy(storage)

    def failing(name: str) -> Callable[..., Any]:
        real = getattr(storage, name)

        def call(rel: str, *args: Any, **kwargs: Any) -> Any:
            if left[0] > 0 and rel.endswith(".data"):  # the rank's data file, not its meta or the manifest
                left[0] -= 1
                raise OSError(code, os.strerror(code))
            return real(rel, *args, **kwargs)

        return call

    for name in ("write", "write_image"):
        if hasattr(storage, name):
            setattr(wrapped, name, failing(name))
    return wrapped
