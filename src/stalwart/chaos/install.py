"""Plugs the fault injectors into the product's seams (runtime/seams.py), in every process that imports stalwart.

`import stalwart` calls `install()`, so the injectors reach the workers, their persisters and the pre-flight
check through the environment alone. What they inject is decided when a seam is used, not here: a Job's steps
get a FaultInjector only where STALWART_FAULTS names faults for its rank and restart (else the product's
no-op, job/step_hooks.py); a persister applies only the faults a save's request carries (checkpoint/save/save_hooks.py);
the memory test's bad cell needs STALWART_NODE_FAULTS=bad_memory (chaos/node_faults.py); the tests' threaded
stand-in for a GPU's side stream needs STALWART_TEST_THREADED_SIDE_COPY=1 (checkpoint/save/side_copy.py).
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
    runs at `import stalwart`, also in the torch-free persister."""
    injector = FaultInjector.from_env(rank, restart, announce)
    return injector if injector.armed else None


def _side_copy() -> Any:
    """The memory tier's threaded stand-in for a GPU's side stream where the tests ask for it (save/side_copy.py);
    imported only then: this module is loaded at `import stalwart`, also in the torch-free persister."""
    if os.environ.get(THREADED_SIDE_COPY_ENV) != "1":
        return None
    from stalwart.checkpoint.save.side_copy import ThreadedSideCopy

    return ThreadedSideCopy()


def install() -> None:
    seams.install(seams.STEP_HOOKS, _step_hooks)
    seams.install(seams.SAVE_HOOKS, SaveFaults.of)
    seams.install(seams.MEMORY_WRITE, node_faults.after_memory_write)
    seams.install(seams.SIDE_COPY, _side_copy)
