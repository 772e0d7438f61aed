"""What rank 0 tells the person watching while training goes well: one line when its loop starts, saying what
protects the run, and one every `log_every` steps (step, the reported scalars, the pace since the last line).

The event log has all of it already; these lines are for a terminal that would otherwise stay silent for hundreds of
steps and leave a newcomer wondering whether anything protects the run. `stalwart run --quiet` (or `STALWART_QUIET=1`)
turns them off; failures, recoveries and errors are said all the same (job/job.py, supervisor/failure_line.py).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

from stalwart.data.loader import ResumableLoader
from stalwart.job.config import JobConfig
from stalwart.runtime.env import (
    EVENT_LOG_ENV,
    HEARTBEAT_ENV,
    QUIET_ENV,
    REFORM_ENV,
    WAIT_FOR_REPLACEMENT_ENV,
)
from stalwart.runtime.process import say

_started_said = False
"""The start line is said once per process: a survivor that re-forms in its loop starts no new run."""


def quiet() -> bool:
    return os.environ.get(QUIET_ENV, "") not in ("", "0")


@dataclass(slots=True)
class Progress:
    """The pace between two progress lines of this process's rank 0."""

    last_step: int | None = None
    last_at: float = 0.0

    def say_start(self, line: str, *, is_main: bool) -> None:
        """The start line (`protection`), once per process, on rank 0, unless quiet."""
        global _started_said
        if is_main and not _started_said and not quiet():
            say(line)
        _started_said = True

    def say_step(self, step: int, max_steps: int, metrics: dict[str, Any], *, is_main: bool) -> None:
        """A progress line for a logged step: `metrics` as read for its `step_done` event (job/completing.py)."""
        now = time.monotonic()
        last_step, last_at = self.last_step, self.last_at
        self.last_step, self.last_at = step, now
        if not is_main or quiet():
            return
        parts = [f"stalwart: step {step}/{max_steps}"]
        parts += [f"{name} {_scalar(value)}" for name, value in metrics.items() if _is_scalar(value)]
        if last_step is not None and step > last_step and now > last_at:
            parts.append(f"{(step - last_step) / (now - last_at):.3g} steps/s")
        say("  ".join(parts))


def _is_scalar(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _scalar(value: float) -> str:
    if isinstance(value, int) or not math.isfinite(value):
        return str(value)
    return f"{value:.5g}"


def announce(
    progress: Progress,
    config: JobConfig,
    loader: object,
    *,
    world_size: int,
    is_main: bool,
    memory_tier: bool,
    in_loop: bool,
    fresh: bool,
) -> None:
    """At the start of `job.steps()`, after the resume: rank 0's start line, and one warning if the loader handed
    out batches before the loop on a `fresh` start (a `next(iter(loader))` to look at a batch): the run starts
    after them, so their samples are not trained on in that epoch. (After a resume the loaded position replaced
    whatever a peek moved, so nothing is lost then.)"""
    ck, snap = config.checkpoint, config.snapshot
    line = protection(
        world_size=world_size,
        checkpoint_dir=str(ck.dir),
        checkpoint_every=ck.every,
        keep_last=ck.keep_last,
        memory_tier=memory_tier,
        snapshot_every=snap.every,
        snapshot_budget=snap.budget,
        in_loop=in_loop,
    )
    progress.say_start(line, is_main=is_main)
    if is_main and fresh and isinstance(loader, ResumableLoader) and (loader.epoch, loader.batch) != (0, 0):
        unit = "sample" if loader.batch_size_per_rank is not None else "batch"
        say(
            f"stalwart: warning: the loader was iterated before job.steps() (it stands at epoch {loader.epoch}, "
            f"{unit} {loader.batch}, not at the start), so the batches it handed out are not trained on in this "
            "epoch; iterate it only through job.steps(loader, ...)"
        )


def protection(
    *,
    world_size: int,
    checkpoint_dir: str,
    checkpoint_every: int | str,
    keep_last: int,
    memory_tier: bool,
    snapshot_every: int | str,
    snapshot_budget: float,
    in_loop: bool,
) -> str:
    """The start line: what protects this run, in the order a failure would meet it."""
    launched = bool(os.environ.get(HEARTBEAT_ENV))
    every = "as the failure rate calls for" if checkpoint_every == "auto" else f"every {checkpoint_every} steps"
    said = [f"checkpoints {every} to {checkpoint_dir} (last {keep_last} kept)"]
    if memory_tier:
        cadence = (
            f"as often as {snapshot_budget:.0%} of step time allows"
            if snapshot_every == "auto"
            else f"every {snapshot_every} steps"
        )
        said.append(f"snapshots in node memory {cadence}")
    if launched and in_loop:
        waits = os.environ.get(WAIT_FOR_REPLACEMENT_ENV) == "1"
        said.append("survivors of a failure stay in their loop" + (" and wait for the replacement" if waits else ""))
    elif launched and os.environ.get(REFORM_ENV) == "0":
        said.append("a failure restarts every worker (--no-reform)")
    if launched:
        said.append("hangs caught by the launcher")
    else:
        said.append("no launcher: a failure ends this process (run it under `stalwart run` to recover)")
    log = os.environ.get(EVENT_LOG_ENV)
    tail = f"; events in {log}" if log else ""
    ranks = f"{world_size} rank{'s' if world_size != 1 else ''}"
    return f"stalwart: protecting {ranks}: " + "; ".join(said) + tail
