"""stalwart's reads of tensor values on the training thread, in one place: counted, and batched across a step.

Why: on a GPU every read of a device value on the host (`.item()`, `.tolist()`, `float(t)`) waits for the device
to finish everything queued before it: a synchronisation that idles the CPU's launch-ahead. The numeric guard must
read the gradients' norm at each optimizer step before the update is applied (detect/numeric.py); everything else
stalwart reads (a reported loss for the spike check, the metrics of a logged step) can wait, so it rides along
with that read, one step later, instead of costing a synchronisation of its own. So with the defaults a step costs
one read, and with the guard and the loss-spike check off it costs none.

What waits is read at the latest at the end of the next step (`step_ended`): a value never waits longer than a
step, and a step in which the guard read nothing (no optimizer step, a skipped batch) makes that one read itself.
tests/test_numeric.py holds the defaults to one read per step by counting torch's own reading methods.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class _Waiting:
    values: list[torch.Tensor]
    then: Callable[[list[float]], None]
    queued_at: int  # the step end that queued it


class HostReads:
    """Reads of tensor values to the host: `read` now, or `later`, with the next read."""

    def __init__(self) -> None:
        self._waiting: list[_Waiting] = []
        self._step_ends = 0

    def later(self, values: list[torch.Tensor], then: Callable[[list[float]], None]) -> None:
        """Read `values` (1-D, one element each, not requiring grad) with the next read, and call `then` with them
        as floats."""
        self._waiting.append(_Waiting(values, then, self._step_ends))

    def read(self, values: list[torch.Tensor]) -> list[float]:
        """`values` (1-D tensors) as floats, in order, read together with everything waiting: one read per device.
        Few tensor operations on purpose: each costs microseconds of dispatch on the training thread."""
        waiting, self._waiting = self._waiting, []
        if not waiting and len(values) == 1:  # the guard's norms alone, the usual step
            return values[0].tolist()
        parts = values + [v for w in waiting for v in w.values]
        floats = self._read(parts)
        mine = sum(v.numel() for v in values)
        out, rest = floats[:mine], floats[mine:]
        for w in waiting:
            taken, rest = rest[: len(w.values)], rest[len(w.values) :]
            w.then(taken)
        return out

    def read_items(self, values: dict[str, Any]) -> dict[str, Any]:
        """`values` with each tensor in it read as its `.item()` would give it (an int or bool stays one), all in
        one read with whatever waits."""
        tensors = {k: v.detach() for k, v in values.items() if isinstance(v, torch.Tensor)}
        # float64: an int64 or a bool comes back exactly (a float32 would round ints past 2**24)
        floats = self.read([v.reshape(1).to(torch.float64) for v in tensors.values()]) if tensors else []
        read = {k: _as_item(tensors[k], f) for k, f in zip(tensors, floats, strict=True)}
        return {k: read.get(k, v) for k, v in values.items()}

    def flush(self) -> None:
        """Read what waits now (the end of the steps, before a rollback or a load replaces what it belongs to)."""
        if self._waiting:
            self.read([])

    def step_ended(self) -> None:
        """At each step's end, after the step queued its own values: what an earlier step queued and no read of
        this step took is read now, so that nothing waits more than one step."""
        if any(w.queued_at < self._step_ends for w in self._waiting):
            self.flush()
        self._step_ends += 1

    def _read(self, parts: list[torch.Tensor]) -> list[float]:
        if not parts:
            return []
        by_device: dict[torch.device, list[int]] = {}
        for i, part in enumerate(parts):
            by_device.setdefault(part.device, []).append(i)
        floats: list[float] = [0.0] * sum(p.numel() for p in parts)
        starts = [0]
        for part in parts[:-1]:
            starts.append(starts[-1] + part.numel())
        for indices in by_device.values():
            # One copy to the host for the device's values. The parts are floating point (norms, a loss, metrics
            # made float64 by read_items): cat promotes them to the widest, which holds each value exactly.
            values = torch.cat([parts[i] for i in indices]).tolist()
            at = 0
            for i in indices:
                n = parts[i].numel()
                floats[starts[i] : starts[i] + n] = values[at : at + n]
                at += n
        return floats


def _as_item(tensor: torch.Tensor, value: float) -> Any:
    """`value` read from `tensor` as its `.item()` would give it (an int or bool stays one)."""
    if tensor.dtype == torch.bool:
        return bool(value)
    return value if tensor.is_floating_point() else int(value)
