"""Overlapping a durable checkpoint's device-to-host copy with the next step (the GPU path).

A checkpoint of step s needs the state as it is at the end of step s. On a GPU, most of that state (the
parameters and the optimizer's moments) changes only inside the optimizer's step(), so its copy to host memory
can run on a side stream under the forward and backward of step s+1: the training loop is held only for
enqueueing the copies, and the compute stream waits for them just before the next optimizer step, when the copy
(about 55 GB/s over PCIe 5: 0.09 s for 4.8 GB, measured on an H100) has long finished.

Which tensors are safe to copy that way is decided per save by storage: a tensor whose storage is a tracked
optimizer's parameter or state is "stable" (only that optimizer's step writes it). Anything else on the GPU (a
BatchNorm buffer the forward updates, a tensor built by state_dict() that is freed at once) is copied before
save() returns, as without overlap. The guarantee therefore rests on one rule, stated in docs/checkpoints.md:
between two steps, a tracked optimizer's parameters and state change only in its step(); a loop that writes them
elsewhere before the optimizer step (a parameter edited in place in the forward) sets
JobConfig(checkpoint_overlap=False). As a second line, the Job fences at the end of every step, so a step with no
optimizer step cannot outrun the copy either.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import Any

import torch

from stalwart.checkpoint.format.sharded import is_dtensor


def storage_key(t: torch.Tensor) -> int:
    """The address of a tensor's storage: views of one parameter (a state_dict's, FSDP's) share it."""
    return int(t.untyped_storage().data_ptr())


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its wrapper has no storage of its own); any other tensor itself."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


class UpdateFence:
    """Holds the overlapped copies' completion events (a checkpoint's and a memory snapshot's may be running at
    once) and makes the compute stream wait for them before any tracked optimizer updates its tensors (a step
    pre-hook on each).

    With `host` (tests only, side_copy.ThreadedSideCopy): CPU tensors count as stable too, and the fence waits
    on the host for copies that a thread runs."""

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer], *, host: bool = False) -> None:
        self._optimizers = list(optimizers)
        self._host = host
        self._pending: list[tuple[Any, torch.device | None]] = []
        self._stalls: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # the compute stream's waits, timed
        self._host_stall_s = 0.0
        self._handles = [opt.register_step_pre_hook(self._before_update) for opt in self._optimizers]

    def stable(self) -> set[int]:
        """Storage addresses that only an optimizer's step() writes: its parameters and its state tensors (a
        sharded one's local shard, which is what a checkpoint copies)."""
        keys: set[int] = set()
        for opt in self._optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.is_cuda or self._host:
                        keys.add(storage_key(_local(p)))
            for state in opt.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and (value.is_cuda or self._host):
                        keys.add(storage_key(_local(value)))
        return keys

    def defer(self, done: Any, device: torch.device | None) -> None:
        """A copy whose completion is `done` (a torch.cuda.Event on `device`, or with device None an event the
        host waits for) reads stable tensors: no update may start before it."""
        self._pending.append((done, device))

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def fence(self) -> None:
        """Order the compute stream after the pending copies (no host wait for a GPU's: the GPU waits, and only
        if a copy is still running)."""
        pending, self._pending = self._pending, []
        for done, device in pending:
            if device is None:
                started = time.perf_counter()
                done.synchronize()
                self._host_stall_s += time.perf_counter() - started
            else:
                stream = torch.cuda.current_stream(device)
                before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                before.record(stream)
                stream.wait_event(done)
                after.record(stream)
                self._stalls = [*self._stalls[-63:], (before, after)]  # read at snapshots' publishes, if any

    def take_stall_s(self) -> float:
        """How long training waited for the copies at the fences since the last call, as far as that is known
        yet (a GPU wait is timed by two events around it on the compute stream, read once they have passed;
        zero when the copy had ended before the optimizer step came). This is what an overlapped copy costs
        beyond enqueueing it."""
        total, self._host_stall_s = self._host_stall_s, 0.0
        waiting = []
        for before, after in self._stalls:
            if after.query():
                total += before.elapsed_time(after) / 1e3
            else:
                waiting.append((before, after))
        self._stalls = waiting[-64:]
        return total

    def _before_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.fence()

    def close(self) -> None:
        """Remove the hooks, ordering the compute stream after copies still pending (no host wait for a GPU's:
        closing after a hung collective must not hang; staging itself outlives a copy into it, see
        Staging.close)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if any(device is not None for _, device in self._pending):
            with contextlib.suppress(Exception):
                self.fence()
        self._pending = []
