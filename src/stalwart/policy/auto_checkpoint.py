"""How often a durable checkpoint is taken under `checkpoint_every="auto"`: Daly's optimum from measurements.

Why: a fixed `checkpoint_every` is a guess. Too rare, and a failure that must go back to storage redoes hours;
too frequent, and the stalls add up. The optimum depends on two numbers the job can measure, the training stall
of one checkpoint (C) and the mean time between interruptions (M): Daly's higher-order optimum
(policy/interval.py; `stalwart sim --validate` checks it). M comes from the failures this launch has seen
(restarts and re-forms, counted by the launcher) over its age, starting from a prior worth one failure
(`JobConfig.expected_mtbf_s`, 24 h by default), so that a job that keeps failing checkpoints more often, and a
quiet one less. Warning signs and preemptions still take a checkpoint at once (detect/risk.py); this policy sets
the regular rhythm.

Every rank must save at the same steps, so the inputs are agreed: right after each regular save the ranks gather
their stall, step time, failure count and age (one small collective per checkpoint, none per step), take the
largest of each, and all compute the same next step. Until the first save has measured its stall the interval
is FIRST_EVERY steps. The interval in force is kept while the new optimum is within HYSTERESIS of it (so noise
does not make every decision an event), and is at most MAX_INTERVAL_S of training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stalwart.policy.interval import daly

FIRST_EVERY = 100
"""Steps to the first checkpoint after a start, before a stall has been measured."""
MAX_INTERVAL_S = 3600.0
"""A durable checkpoint at least every hour of training, whatever the optimum says: a failure that takes the
memory and peer copies with it (every node at once) then costs at most this much work."""
HYSTERESIS = 1.25
DEFAULT_PRIOR_MTBF_S = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class Decision:
    step: int
    every: int
    """Steps between checkpoints from now on."""
    interval_s: float
    """Daly's optimum (capped), in seconds of training."""
    stall_s: float
    step_s: float
    mtbf_s: float
    failures: int
    elapsed_s: float
    previous: int


class CheckpointInterval:
    """The next regular checkpoint's step under checkpoint_every="auto" (module docstring)."""

    def __init__(self, prior_mtbf_s: float = DEFAULT_PRIOR_MTBF_S, first_every: int = FIRST_EVERY) -> None:
        if not prior_mtbf_s > 0:
            raise ValueError(f"the prior MTBF must be positive, got {prior_mtbf_s}")
        self.prior_mtbf_s = prior_mtbf_s
        self.every = first_every
        self.next_step = first_every

    def start(self, step: int) -> None:
        """After a (re)start at `step`: the first checkpoint of this process comes `every` steps later."""
        self.next_step = step + self.every

    def due(self, step: int) -> bool:
        return step >= self.next_step

    def decide(self, step: int, stall_s: float, step_s: float, failures: int, elapsed_s: float) -> Decision | None:
        """After the regular save at `step`, with inputs every rank agrees on: the next one's step. Returns the
        decision when the interval changed (an event), else None."""
        mtbf = (self.prior_mtbf_s + max(elapsed_s, 0.0)) / (1 + max(failures, 0))
        interval = min(daly(max(stall_s, 1e-6), mtbf), MAX_INTERVAL_S)
        wanted = max(1, math.ceil(interval / step_s)) if step_s > 0 else self.every
        previous = self.every
        changed = not previous / HYSTERESIS <= wanted <= previous * HYSTERESIS
        if changed:
            self.every = wanted
        self.next_step = step + self.every
        if not changed:
            return None
        return Decision(
            step,
            self.every,
            round(interval, 3),
            stall_s,
            step_s,
            round(mtbf, 1),
            failures,
            round(elapsed_s, 1),
            previous,
        )
