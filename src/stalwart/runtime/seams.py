"""Seams: where fault injection (chaos/) plugs into the product without the product importing it.

A product module that can be disturbed from outside names its seam here and asks `installed(name)` for what is
plugged in: nothing in production, so the product path calls its own no-op. `chaos/install.py` installs its
injectors at `import stalwart` when a fault variable is set (STALWART_FAULTS, STALWART_NODE_FAULTS), so they
reach every process that imports stalwart (the workers, their persisters, the pre-flight check) through the
environment alone; a test can pass its own through the same protocol objects (`Job(hooks=...)`,
`preflight.check(after_write=...)`). Each seam's protocol lives beside the product code that calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

STEP_HOOKS = "step_hooks"
"""job/step_hooks.py: (rank, restart, announce) -> StepHooks, the faults fired at a job's steps."""
SAVE_HOOKS = "save_hooks"
"""checkpoint/save/save_hooks.py: (faults of the request, step, trainer pid, events) -> SaveHooks, in the persister."""
SIDE_COPY = "side_copy"
"""checkpoint/tiers/memory.py: () -> SideCopy | None, the copier of a job's memory tier (None: the real one)."""
MEMORY_WRITE = "memory_write"
"""detect/preflight.py: (buffer) -> None, called after each pattern of the memory test is written."""

_installed: dict[str, Callable[..., Any]] = {}


def install(name: str, factory: Callable[..., Any]) -> None:
    """Plug `factory` into the seam `name` for the rest of this process."""
    _installed[name] = factory


def installed(name: str) -> Callable[..., Any] | None:
    """What is plugged into the seam `name`, or None (the product's no-op applies)."""
    return _installed.get(name)
