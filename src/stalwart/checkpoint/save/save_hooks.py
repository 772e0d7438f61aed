"""The seams of a persist (checkpoint/save/persister.py): its storage and two instants of a save.

The persister runs in its own process. A save's request carries the faults it is to meet (`faults`, from the
job's StepHooks.save_faults) as data; the persister asks the factory installed at runtime/seams.SAVE_HOOKS for a
`SaveHooks` of them (chaos/save_faults.py when STALWART_FAULTS is set), else uses `NoSaveHooks`: the real
storage and instants that do nothing, so the product path has no fault branches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from stalwart.checkpoint.storage import Storage
from stalwart.runtime import seams
from stalwart.telemetry.events import EventLog


class SaveHooks(Protocol):
    def storage(self, storage: Storage) -> Storage:
        """The storage this save writes through."""

    @property
    def on_half_written(self) -> Callable[[], None] | None:
        """Called once half of the rank's data is written; None when nothing waits there."""

    def before_commit(self) -> None:
        """On the committing rank, after every shard is durable, before the manifest is written."""


class NoSaveHooks:
    """Production: the real storage, and nothing at either instant."""

    def storage(self, storage: Storage) -> Storage:
        return storage

    @property
    def on_half_written(self) -> Callable[[], None] | None:
        return None

    def before_commit(self) -> None:
        pass


def save_hooks(faults: dict[str, Any] | None, step: int, trainer_pid: int, events: EventLog) -> SaveHooks:
    """The hooks of one save: the installed factory's for a request that carries faults, else none."""
    factory = seams.installed(seams.SAVE_HOOKS)
    if not faults or factory is None:
        return NoSaveHooks()
    hooks: SaveHooks = factory(faults, step, trainer_pid, events)
    return hooks
