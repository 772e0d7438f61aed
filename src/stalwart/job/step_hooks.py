"""The seam at which a job's steps can be disturbed from outside (fault injection, chaos/faults.py).

The Job calls a `StepHooks` at fixed instants of each step; in production it is `NoStepHooks`, which does
nothing, so the training loop holds no fault branches. `Job(hooks=...)` takes one, else the one installed at
runtime/seams.STEP_HOOKS (chaos/ installs its injector there when STALWART_FAULTS is set).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from stalwart.runtime import seams

Announce = Callable[[str, dict[str, Any]], None]
"""(fault kind, details): what a hook calls just before it fires, so the job's event log records the fault."""


class StepHooks(Protocol):
    def before_step(self, step: int) -> None:
        """Before the step after `step` completed steps, outside its measured time (a kill, a hang)."""

    def step_started(self, step: int, tensors: Callable[[], list[torch.Tensor]]) -> None:
        """Inside the step's measured time, before its batch is drawn; `tensors()` are the replicated ones."""

    def batch(self, step: int, batch: Any) -> Any:
        """The batch the loop body gets."""

    def in_optimizer(self, step: int, phase: str) -> None:
        """At the commit point of light snapshots (job/step_commit.py): 'before_snapshot' or 'after_barrier'."""

    def save_faults(self, step: int) -> dict[str, object] | None:
        """What the persist of `step` is to meet, carried to the persister (checkpoint/save/save_hooks.py)."""

    def joined(self, step: int) -> None:
        """In a replacement (a warm spare, a late joiner) that joined the survivors' group at `step`, before they hand
        it their state (recovery/in_loop/late_join.grow): a kill there is a replacement lost while joining."""


class NoStepHooks:
    """Production: nothing happens at any instant."""

    def before_step(self, step: int) -> None:
        pass

    def step_started(self, step: int, tensors: Callable[[], list[torch.Tensor]]) -> None:
        pass

    def batch(self, step: int, batch: Any) -> Any:
        return batch

    def in_optimizer(self, step: int, phase: str) -> None:
        pass

    def save_faults(self, step: int) -> dict[str, object] | None:
        return None

    def joined(self, step: int) -> None:
        pass


def step_hooks(rank: int, restart: int, announce: Announce) -> StepHooks:
    """The hooks installed for this process (runtime/seams.py; the factory may decline with None), or none."""
    factory = seams.installed(seams.STEP_HOOKS)
    hooks: StepHooks | None = factory(rank, restart, announce) if factory is not None else None
    return hooks if hooks is not None else NoStepHooks()
