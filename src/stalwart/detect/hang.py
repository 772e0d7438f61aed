"""How long a worker may go without a heartbeat: calibrated from its own step times, or set by hand.

The timeout for a step is `MULTIPLE` times a high percentile of the recent step times, clamped to
[FLOOR_S, CEILING_S]. Until WARMUP_STEPS steps have been timed after a (re)start, and while resuming or saving
a checkpoint it waits on, the worker gets GRACE_S instead: the first steps compile and fill caches, and a waited
save runs as long as the store needs. A fixed timeout (`stalwart run --hang-timeout S`, or JobConfig.hang_timeout_s)
replaces the calibration but not the grace.

With 60 ms steps the timeout is the 2 s floor, so a hang is caught within about 2.2 s (the floor, at most one
step since the last beat, and the agent's 0.1 s monitor interval): inside the max(3 s, 5x median step) budget.
For long steps, 3x the 99th percentile plus at most one step stays inside 5x the median when steps are steady.
"""

from __future__ import annotations

import math
import os
from collections import deque

from stalwart.errors import ConfigError
from stalwart.runtime.env import HANG_TIMEOUT_ENV as HANG_TIMEOUT_ENV

FLOOR_S = 2.0
CEILING_S = 1800.0
MULTIPLE = 3.0
PERCENTILE = 0.99
WINDOW = 200
WARMUP_STEPS = 3
GRACE_S = 300.0


class HangTimer:
    """Step times in, the current step timeout out."""

    def __init__(self, fixed_s: float | None = None) -> None:
        self.fixed_s = fixed_s
        self._times: deque[float] = deque(maxlen=WINDOW)

    def observe(self, step_s: float) -> None:
        self._times.append(step_s)

    def restart(self) -> None:
        """After a resume: the first steps are slow again (caches, compilation), so grace applies anew."""
        self._times.clear()

    @property
    def warming_up(self) -> bool:
        return len(self._times) < WARMUP_STEPS

    def step_timeout(self) -> float:
        if self.warming_up:
            return max(GRACE_S, self.fixed_s or 0.0)
        if self.fixed_s is not None:
            return self.fixed_s
        ordered = sorted(self._times)
        high = ordered[min(len(ordered) - 1, math.ceil(PERCENTILE * len(ordered)) - 1)]
        return min(CEILING_S, max(FLOOR_S, MULTIPLE * high))

    def grace(self) -> float:
        return max(GRACE_S, self.fixed_s or 0.0)


def hang_timer(fixed_s: float | None) -> HangTimer:
    """The job's timer: `fixed_s` (the hang_timeout_s option), else STALWART_HANG_TIMEOUT (`stalwart run
    --hang-timeout`); ConfigError naming the variable if it is malformed."""
    if fixed_s is None:
        try:
            fixed_s = parse_timeout(os.environ.get(HANG_TIMEOUT_ENV))
        except ValueError as exc:
            raise ConfigError(f"{HANG_TIMEOUT_ENV}: {exc}") from exc
    return HangTimer(fixed_s)


def parse_timeout(text: str | None) -> float | None:
    """None for "auto" or unset; seconds otherwise. Raises ValueError with a readable message."""
    if text is None or text.strip().lower() in ("", "auto"):
        return None
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"the hang timeout must be 'auto' or a positive number of seconds, got {text!r}")
    return value
