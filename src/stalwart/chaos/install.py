"""Plugs the fault injectors into the product's seams (runtime/seams.py), in a process that asks for fault injection.

The package root offers `install()` to runtime/seams.py, which runs it only when asked: a fault variable set
(runtime/env.FAULT_ENVS) at `import stalwart` or by the time a seam is asked, or a save request that carries
faults; without them this module and the injectors are never imported. The workers, their persisters and the
pre-flight check inherit the variables, so the injectors reach them through the environment alone. What they
inject is decided when a seam is used, not here: a Job's steps get a FaultInjector only where STALWART_FAULTS
names faults for its rank and restart (else the product's no-op, job/step_hooks.py); a persister applies only
the faults a save's request carries (checkpoint/save/save_hooks.py); the memory test's bad cell needs
STALWART_NODE_FAULTS=bad_memory (chaos/node_faults.py); the tests' threaded stand-in for a GPU's side stream
needs STALWART_TEST_THREADED_SIDE_COPY=1 (checkpoint/save/side_copy.py).
"""

from __future__ import annotations

import os
from typing import Any

from stalwart.chaos import node_faults
from stalwart.chaos.faults import Announce, FaultInjector
from stalwart.chaos.save_faults import SaveFaults
from stalwart.runtime import seams
from stalwart.runtime.env import THREADED_SIDE_COPY_ENV


def _step_hooks(rank: int, restart: int, announce: Announce) -> FaultInjector | None:
    """A rank's injector, or None (the job's no-op) when no fault waits for it. Imports nothing of the job: this
    module may be loaded at `import stalwart`, also in the torch-free persister."""
    injector = FaultInjector.from_env(rank, restart, announce)
    return injector if injector.armed else None


def _side_copy() -> Any:
    """The memory tier's threaded stand-in for a GPU's side stream where the tests ask for it (save/side_copy.py);
    imported only then: this module may be loaded at `import stalwart`, also in the torch-free persister."""
    if os.environ.get(THREADED_SIDE_COPY_ENV) != "1":
        return None
    from stalwart.checkpoint.save.side_copy import ThreadedSideCopy

    return ThreadedSideCopy()


def install() -> None:
    """Plug every injector in; run once, by the installer stalwart/__init__.py offers to runtime/seams.py."""
    seams.install(seams.STEP_HOOKS, _step_hooks)
    seams.install(seams.SAVE_HOOKS, SaveFaults.of)
    seams.install(seams.MEMORY_WRITE, node_faults.after_memory_write)
    seams.install(seams.SIDE_COPY, _side_copy)
