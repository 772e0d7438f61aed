"""A reduce-scatter on gloo run as what gloo runs for one: an all-reduce of a copy of the input, this rank's part
copied out once it is done; bitwise the same (tests/test_group.py). The re-formable group (runtime/group.py) runs
its CPU reduce-scatters so while it absorbs failures.

Why: gloo's own reduce-scatter work (`reduce_scatter` and `_reduce_scatter_base`, torch 2.13.0) does that copy
inside `wait()`, which waits for the all-reduce ignoring the timeout it is given, and has no future. A survivor in
FSDP2's reduce-scatter, whose peer on this node met the failure first and left the collective alive, waited there
until the collective timeout: the absorbing wait's slices (runtime/works.py) never ended, and its agent replaced
it after 10 s. Gloo's all-reduce ends a sliced wait on time and completes a future.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class Staged:
    """The all-reduce to run (`buffer` with `options`) and what completes the reduce-scatter after it (`then`)."""

    buffer: torch.Tensor
    options: dist.AllreduceOptions
    then: Callable[[], Any]


def applies(absorbing: bool, outputs: list[torch.Tensor]) -> bool:
    """Whether a reduce-scatter into `outputs` runs staged: one CPU tensor while failures are absorbed (else
    gloo's own, whose waits raise as any group's do)."""
    return absorbing and len(outputs) == 1 and outputs[0].device.type == "cpu"


def stage(output: torch.Tensor, parts: list[torch.Tensor], offset: int, opts: Any) -> Staged:
    """The all-reduce of a reduce-scatter of `parts` (concatenated) whose result for this rank starts at element
    `offset`; `opts`: its ReduceScatterOptions (the reduction and timeout carry over)."""
    buffer = torch.cat([part.reshape(-1) for part in parts])
    mine = buffer[offset : offset + output.numel()].view(output.shape)
    options = dist.AllreduceOptions()
    options.reduceOp = opts.reduceOp
    options.timeout = opts.timeout
    return Staged(buffer, options, lambda: output.copy_(mine))
