"""How often a memory snapshot is taken: as often as a cost budget allows, measured online (`snapshot_every="auto"`).

Why: a memory snapshot copies this rank's whole state: a large share of a step on CPU cores, and on a GPU up to
many times the step itself (docs/benchmarks.md). Taken every step, it is the dominant
cost of fault tolerance. With a budget b (JobConfig.snapshot_budget, default 1%), a snapshot that costs c
seconds is taken every k = ceil(c / (b * t)) steps of t seconds, so it costs at most about b of the training
time; a failure then redoes up to k - 1 more steps than with a snapshot every step. That is the trade-off,
and it is chosen from measurements, not guessed: the interval is recomputed at every snapshot.

Every rank must snapshot at the same steps (a restart looks for a step that every rank holds), so the inputs are
agreed: at each snapshot the ranks gather their step time and snapshot cost (one small collective per snapshot,
none per step) and all compute the same next interval from the largest of each. The first WARMUP snapshots
are taken every step: they allocate the double-buffered slots, so their cost is not yet the steady one.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

WARMUP = 3
"""Snapshots taken every step after a start, before the interval follows the budget."""
STEP_WINDOW = 32
"""Step times kept for the median that the interval is computed from."""
MAX_INTERVAL = 10_000
HYSTERESIS = 1.25
"""The interval in force is kept while it is within this factor of the one the latest costs ask for: step and
copy times jitter by 10-20% on a shared machine, and an interval that flips between 7 and 9 says nothing. The
cost may then exceed the budget by up to this factor until the next snapshot."""


@dataclass(frozen=True, slots=True)
class IntervalDecision:
    """One choice of interval and what it was chosen from (every rank computes the same)."""

    step: int
    interval: int
    step_s: float
    snapshot_s: float
    budget: float


class SnapshotSchedule:
    """Which steps get a memory snapshot. `every` is a fixed interval (>= 1), or None for the budgeted one."""

    def __init__(self, every: int | None, budget: float, start: int) -> None:
        self.every = every
        self.budget = budget
        self.interval = every or 1
        self.next_step = start + 1
        self._taken = 0
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW)

    def observe_step(self, seconds: float) -> None:
        """A completed step's time, without its snapshot."""
        self._steps.append(seconds)

    def step_s(self) -> float:
        """The median of the recent step times (this rank's)."""
        return statistics.median(self._steps) if self._steps else 0.0

    def due(self, step: int) -> bool:
        """Whether the state after `step` completed steps is to be snapshotted. A fixed interval counts from
        step 0, so every rank agrees whatever step it resumed at."""
        if self.every is not None:
            return step % self.every == 0
        return step >= self.next_step

    def served(self, step: int) -> bool:
        """A durable checkpoint of `step` was taken on every rank and serves as this step's full copy: the next
        full copy is due an interval after it, not earlier. Only for the budgeted schedule after its warm-up (a
        fixed interval counts from step 0). Returns whether that moved the next full copy."""
        if self.every is not None or self._taken < WARMUP or step + self.interval <= self.next_step:
            return False
        self.next_step = step + self.interval
        return True

    def taken(
        self, step: int, snapshot_s: float, agree: Callable[[float, float], tuple[float, float]]
    ) -> IntervalDecision | None:
        """Note the snapshot of `step` and plan the next one. `agree(step_s, snapshot_s)` returns the largest of
        each over all ranks (a collective: every rank calls `taken` at the same step). Returns the decision at
        the end of the warm-up and whenever the interval changes after it."""
        self._taken += 1
        if self.every is not None:
            return None
        step_s, snapshot_s = agree(self.step_s(), snapshot_s)
        interval = 1 if self._taken < WARMUP else interval_for(snapshot_s, step_s, self.budget)
        if self._taken > WARMUP and interval / HYSTERESIS <= self.interval <= interval * HYSTERESIS:
            interval = self.interval  # noise in the measurements: keep the interval in force
        self.next_step = step + interval
        if self._taken != WARMUP and interval == self.interval:
            return None
        self.interval = interval
        return IntervalDecision(step, interval, step_s, snapshot_s, self.budget)


def interval_for(snapshot_s: float, step_s: float, budget: float) -> int:
    """The smallest interval at which a snapshot of `snapshot_s` costs at most `budget` of steps of `step_s`."""
    if snapshot_s <= 0:
        return 1
    if step_s <= 0 or budget <= 0:
        return MAX_INTERVAL
    return max(1, min(MAX_INTERVAL, math.ceil(snapshot_s / (budget * step_s) - 1e-9)))


LIGHT_SAMPLES = 32
"""Light snapshots measured before their cost is judged (and the least a run keeps them)."""
FULL_FLOOR = 0.25
"""The share of the snapshot budget full copies keep beside light snapshots, whatever those cost."""


def full_copy_budget(budget: float, light_s: float | None, step_s: float) -> float:
    """The part of `budget` left to full copies next to light snapshots every step that cost `light_s` a step
    of `step_s` (None: not judged yet). Light snapshots come first: they keep the loss of the common failure
    (one rank lost, the others survive) to the interrupted step, while full copies only matter when no rank
    survives. Full copies keep at least FULL_FLOOR of the budget, so with light snapshots at their own limit
    (JobConfig.light_snapshot_budget) the memory tier takes up to that plus a quarter of `budget` on the
    training thread. A full copy's whole cost is larger than its time on the training thread (on 2 ranks sharing
    2 cores it slowed the steps by about 2.7 times its own time: memory bandwidth and caches,
    JobConfig.snapshot_budget), while a light snapshot copies a few kilobytes, so it has little of that to add
    (not measured apart: the plain runs' spread there is wider than either)."""
    if light_s is None or step_s <= 0:
        return budget * FULL_FLOOR
    return max(budget - light_s / step_s, budget * FULL_FLOOR)


class LightCost:
    """Whether light snapshots every step stay within their budget, judged from their measured cost.

    Why: a light snapshot copies little, but it waits on a barrier of every rank at the optimizer step (the
    commit point) and reads the per-rank state twice a step. On busy CPU cores that measured more than a full
    copy of the bench job's state at first (a gloo barrier); on a large model a full copy is far dearer than a
    light snapshot (docs/benchmarks.md). So neither is right everywhere, and the job measures: after
    LIGHT_SAMPLES light snapshots, if the median of the largest rank's cost is over `budget`
    (JobConfig.light_snapshot_budget, 2%) of the step time, light snapshots are turned off for the run (every
    rank decides alike, from gathered values) and full copies take the whole snapshot budget. Their budget is
    their own, not a share of the full copies' 1%: they measured close to 1% of a step on the bench jobs, and a
    line drawn at 1% kept them at one judgment and turned them off at the next as the measurements moved."""

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self._costs: deque[float] = deque(maxlen=STEP_WINDOW)
        self._seen = 0
        self._first_done = False

    def observe(self, seconds: float) -> None:
        """One step's light-snapshot cost on this rank (its capture, barrier and end-of-step check)."""
        self._costs.append(seconds)
        self._seen += 1

    def mine(self) -> float:
        return statistics.median(self._costs) if self._costs else 0.0

    def judged(self) -> bool:
        return self._seen >= LIGHT_SAMPLES

    def first_judgment(self) -> bool:
        """True once, at the step of the LIGHT_SAMPLES-th observation: where every rank judges first (and not
        only at the next full copy, which can be hundreds of steps later)."""
        if self._seen < LIGHT_SAMPLES or self._first_done:
            return False
        self._first_done = True
        return True

    def too_dear(self, light_s: float, step_s: float) -> bool:
        """With the agreed (largest) light cost and step time: over the budget."""
        return step_s > 0 and light_s > self.budget * step_s
