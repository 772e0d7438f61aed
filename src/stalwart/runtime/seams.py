"""Seams: where fault injection (chaos/) plugs into the product without the product importing it.

A product module that can be disturbed from outside names its seam here and asks `installed(name)` for what is
plugged in: nothing in production, so the product path calls its own no-op. The package root (stalwart/__init__.py)
`offer`s chaos/'s installer here, and it runs only where fault injection is asked for: a fault variable set
(runtime/env.FAULT_ENVS: STALWART_FAULTS, STALWART_NODE_FAULTS, STALWART_TEST_THREADED_SIDE_COPY) at `import
stalwart` or by the time a seam is asked, or a save request that carries faults. A process without them (a
production job, its persisters, `stalwart run`) imports no module of chaos/ and has nothing installed. The faults
still reach every process of a run that asks for them (the workers, their persisters, the pre-flight check)
through the environment alone: the launcher passes it on, and the chaos harness sets STALWART_FAULTS for its runs.
A test can pass its own through the same protocol objects (`Job(hooks=...)`, `preflight.check(after_write=...)`).
Each seam's protocol lives beside the product code that calls it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from stalwart.runtime.env import FAULT_ENVS

STEP_HOOKS = "step_hooks"
"""job/step_hooks.py: (rank, restart, announce) -> StepHooks, the faults fired at a job's steps."""
SAVE_HOOKS = "save_hooks"
"""checkpoint/save/save_hooks.py: (faults of the request, step, trainer pid, events) -> SaveHooks, in the persister."""
SIDE_COPY = "side_copy"
"""checkpoint/tiers/memory.py: () -> SideCopy | None, the copier of a job's memory tier (None: the real one)."""
MEMORY_WRITE = "memory_write"
"""detect/preflight.py: (buffer) -> None, called after each pattern of the memory test is written."""

_installed: dict[str, Callable[..., Any]] = {}
_offered: Callable[[], None] | None = None
"""The package root's installer of chaos/'s injectors, until it has run (stalwart/__init__.py)."""
_offered_lock = threading.Lock()


def fault_env_present(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a variable that asks for fault injection (runtime/env.FAULT_ENVS) is set, not empty, in `environ`
    (default: this process's environment)."""
    env = os.environ if environ is None else environ
    return any(env.get(name) for name in FAULT_ENVS)


def offer(installer: Callable[[], None]) -> None:
    """Keep `installer` (it imports chaos/ and `install`s its injectors) until fault injection is asked for, and run
    it now if a fault variable is already set: a worker, its persister or the pre-flight check then has its
    injectors from `import stalwart` on. Called by the package root only, so no product module imports chaos/."""
    global _offered
    _offered = installer
    if fault_env_present():
        _run_offered()


def install(name: str, factory: Callable[..., Any]) -> None:
    """Plug `factory` into the seam `name` for the rest of this process."""
    _installed[name] = factory


def installed(name: str) -> Callable[..., Any] | None:
    """What is plugged into the seam `name`, or None (the product's no-op applies).

    A fault variable set after `import stalwart` (a script's os.environ, a test's monkeypatch) still asks: the
    offered installer runs here. Before it has run, SAVE_HOOKS answers a factory that runs it at its first call:
    the persister calls that factory only for a request that carries faults (checkpoint/save/save_hooks.py), and
    those come as data, not through the persister's environment (`Job(hooks=...)`, a Checkpointer's
    `save_faults`), so such a request asks for the injectors itself. In production nothing calls it."""
    if _offered is not None and name not in _installed:
        if fault_env_present():
            _run_offered()
        elif name == SAVE_HOOKS:
            return _save_hooks_on_first_call
    return _installed.get(name)


def _save_hooks_on_first_call(*args: Any) -> Any:
    """SAVE_HOOKS before the offered installer has run: run it, then ask what it plugged in."""
    _run_offered()
    return _installed[SAVE_HOOKS](*args)


def _run_offered() -> None:
    """Run the offered installer once; a thread that asks meanwhile waits until the injectors are in."""
    global _offered
    with _offered_lock:
        if _offered is not None:
            _offered()
            _offered = None
