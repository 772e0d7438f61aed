"""The hooks stalwart puts on the tracked optimizers' step, besides the guard's and the commit point's: the fence
that lets a checkpoint's copy run under the next step, and re-forming's deferral.

On a GPU, checkpoints and full memory snapshots copy the tracked optimizers' tensors under the next step
(checkpoint/save/overlap.py): the fence makes that step's optimizer step wait for the copy. Under the tests'
threaded stand-in for a side stream (checkpoint/save/side_copy.py), memory snapshots do so on a CPU too.

Under in-place re-forming, from a tracked optimizer's step on, the agent's request to re-form (a peer died) waits
for the step's snapshot (survivor.defer_requests; allowed again at the step's end). A survivor that got that far
has passed the step's all-reduce, so its peers computed the step too; interrupted, it would redo a step that
every rank may hold. The agent sees a death within milliseconds (supervisor/exit_watch.py), often while a
survivor is still in that step's optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch

from stalwart.checkpoint.manager import Checkpointer
from stalwart.checkpoint.save.overlap import UpdateFence
from stalwart.job.snapshots import Snapshots
from stalwart.recovery.in_loop import survivor


def _defer_reform(optimizer: Any, args: Any, kwargs: Any) -> None:
    survivor.defer_requests()


class OptimizerHooks:
    """The fence (None where nothing overlaps) and the deferral hooks of one job."""

    def __init__(self, checkpointer: Checkpointer, snapshots: Snapshots) -> None:
        self._checkpointer = checkpointer
        self._snapshots = snapshots
        self.fence: UpdateFence | None = None
        self._deferral: list[Any] = []

    def start(self, optimizers: list[torch.optim.Optimizer], *, overlap: bool) -> None:
        """After the guard's hooks (they decide first whether the update happens)."""
        memory = self._snapshots.memory
        host = memory is not None and memory.side.on_host
        if self.fence is None and overlap and (torch.cuda.is_available() or host) and optimizers:
            self.fence = UpdateFence(optimizers, host=host)
            self._checkpointer.overlap = self.fence
            self._snapshots.fence = self.fence
            if memory is not None:
                memory.overlap = self.fence
        if self._snapshots.reform and not self._deferral:
            self._deferral = [o.register_step_pre_hook(_defer_reform) for o in optimizers]

    def wait(self) -> None:
        """Until the copies left running have ended: before the tensors they read are written outside an
        optimizer step (a load, a bit flip), and at every step's end (a step without an optimizer step must not
        outrun a checkpoint's copy)."""
        if self.fence is not None:
            self.fence.fence()

    def close(self) -> None:
        for handle in self._deferral:
            handle.remove()
        self._deferral = []
        if self.fence is not None:
            self._checkpointer.overlap = None
            self._snapshots.fence = None
            if self._snapshots.memory is not None:
                self._snapshots.memory.overlap = None
            self.fence.close()
            self.fence = None
