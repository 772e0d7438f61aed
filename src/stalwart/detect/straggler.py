"""Straggler detection: which rank's own work per step is persistently slower than the other ranks'.

Why: in synchronous training every collective waits for the slowest rank, so one degraded GPU, a throttled CPU
or a noisy neighbour slows the whole job (by up to 40% in published fleet studies), and the step time cannot say
which rank it is: every rank's step takes the slow rank's time. What differs is each rank's own work: the time
from the start of its step until its backward pass has produced its last local gradient, before it waits for
the others in the gradient all-reduce.

How: a post-accumulate-grad hook on the first parameter of each tracked module (backward reaches the first
layers last) timestamps the end of the rank's local backward; its compute time for the step is that minus the
step's start (data loading included: a slow loader makes a straggler too). Every WINDOW steps the ranks gather
the median of their window (one small all-gather of integers, started then and read at the end of the next
window, so that no rank waits for it), and each rank scores every rank:

- relative score: the rank's median over the median of the other ranks' medians (NVRx's relative score; against
  the others, so that with two ranks a slow one is not hidden in a median it is half of);
- individual score: the rank's median over its own baseline (the median of its first BASELINE windows), which a
  slowdown of the whole job raises on every rank.

A rank whose relative score is at least `threshold` (1.1: 10% slower than the others) in PERSIST windows in a
row is flagged: rank 0 writes a `straggler_detected` event (`straggler`: the slow rank) and prints one line. A
flagged rank whose score stays below the threshold for PERSIST windows is cleared (`straggler_cleared`). Every
rank computes the same verdicts from the same gathered numbers (`flagged`), for policies that act on them.

The same stamps give each rank's communication ratio: the time from its last local gradient to its optimizer
step (waiting for the gradient all-reduce) over the time from the step's start to its optimizer step. A window
median over max(2x, +0.10) the rank's own baseline in PERSIST windows in a row is a `comm_ratio_high` event from
that rank (a slower network, a congested link; a straggler raises it on the others, and is named by its own
event), `comm_ratio_normal` when it is back. It is local: no collective.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from stalwart.telemetry.events import EventLog

STRAGGLER_POLICIES = ("report", "evict")
"""JobConfig.straggler_policy: what a flagged straggler gets (the job acts; this module only judges)."""
WINDOW = 10
"""Steps per window: the ranks compare their medians once per window (one all-gather)."""
PERSIST = 3
"""Windows in a row at or over the threshold before a rank is flagged (and under it before it is cleared)."""
WARMUP = 5
"""Steps after a start that are not measured (allocation, first-step compilation)."""
BASELINE = 3
"""Windows whose median is a rank's own baseline for its individual score."""
HOOKED_PARAMETERS = 1
"""Parameters hooked per module: the first, whose gradient backward produces last. Each hook costs a Python
call per step taken from the autograd engine (its cost: docs/benchmarks.md)."""
NO_SAMPLE = -1
MIN_EXCESS_S = 0.002
"""A straggler's median must also exceed the others' by this much: on a busy host, scheduling alone moves a few
milliseconds of work by 20% (clean runs of short steps on shared cores were flagged without it,
docs/benchmarks.md), while a slow GPU or node costs far more than 2 ms a step on any step worth watching."""


@dataclass
class _RankHistory:
    over: int = 0  # windows in a row at or over the threshold
    under: int = 0  # windows in a row under it, while flagged
    flagged: bool = False
    baseline: list[float] = field(default_factory=list)


class StragglerDetector:
    """Per-step compute times of this rank, compared with the other ranks' every WINDOW steps."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        events: EventLog,
        gather: Callable[[list[int]], Callable[[], list[list[int]]]],
        *,
        threshold: float = 1.1,
        announce: bool = False,
    ) -> None:
        """`gather(ints)` starts a collective and returns the function that waits for every rank's list of ints,
        by rank. `announce`: write the events and print one line when a rank is flagged (rank 0)."""
        self.rank = rank
        self.world_size = world_size
        self._events = events
        self._gather = gather
        self.threshold = threshold
        self._announce = announce
        self._samples: list[float] = []
        self._seen = 0
        self._started = 0.0
        self._last_grad = 0.0
        self._history = [_RankHistory() for _ in range(world_size)]
        self._handles: list[Any] = []
        self._pending: tuple[int, Callable[[], list[list[int]]]] | None = None  # (window's last step, its gather)
        self.flagged: set[int] = set()
        self.newly_flagged: set[int] = set()
        """Ranks flagged at the last window's judgement (the same on every rank): what risk policies act on."""
        self._optimizer_at = 0.0
        self._ratios: list[float] = []
        self._comm = _RankHistory()

    def watch(self, modules: Iterable[torch.nn.Module]) -> None:
        """Timestamp the end of each step's local backward through hooks on the modules' first parameters."""
        for module in modules:
            hooked = 0
            for p in module.parameters():
                if hooked == HOOKED_PARAMETERS:
                    break
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._grad_ready))
                    hooked += 1

    def watch_optimizers(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Timestamp each step's (first) optimizer step: the end of waiting for the gradients' all-reduce."""
        for opt in optimizers:
            self._handles.append(opt.register_step_pre_hook(self._optimizer_ready))

    def _grad_ready(self, _: torch.Tensor) -> None:
        self._last_grad = time.monotonic()

    def _optimizer_ready(self, *_: Any) -> None:
        if self._optimizer_at <= self._started:
            self._optimizer_at = time.monotonic()

    def step_started(self, now: float) -> None:
        self._started = now

    def step_done(self, step: int, *, measured: bool = True) -> None:
        """After `step` completed steps (the same call on every rank): note this step's compute time (unless not
        `measured`: a step marked busy), and at the end of a window compare the ranks (a collective)."""
        self._seen += 1
        if measured and self._seen > WARMUP and self._last_grad > self._started:
            self._samples.append(self._last_grad - self._started)
            if self._optimizer_at > self._last_grad:
                self._ratios.append((self._optimizer_at - self._last_grad) / (self._optimizer_at - self._started))
        self._last_grad = 0.0
        self.newly_flagged = set()
        if step % WINDOW == 0:
            self._judge_comm(step)
            self._compare(step)

    def _judge_comm(self, step: int) -> None:
        """This rank's communication ratio over the window, against its own first windows' (no collective)."""
        if not self._ratios:
            return
        ratio = statistics.median(self._ratios)
        self._ratios = []
        h = self._comm
        if len(h.baseline) < BASELINE:
            h.baseline.append(ratio)
            return
        baseline = statistics.median(h.baseline)
        high = ratio > max(2 * baseline, baseline + 0.10)
        h.over, h.under = (h.over + 1, 0) if high else (0, h.under + 1)
        fields = {"ratio": round(ratio, 3), "baseline": round(baseline, 3)}
        if not h.flagged and h.over >= PERSIST:
            h.flagged = True
            self._events.emit("comm_ratio_high", step=step, **fields)
        elif h.flagged and h.under >= PERSIST:
            h.flagged = False
            self._events.emit("comm_ratio_normal", step=step, **fields)

    def _compare(self, step: int) -> None:
        """Start this window's gather and judge the previous window's, which has had a window's time to arrive."""
        mine = round(statistics.median(self._samples) * 1e6) if self._samples else NO_SAMPLE
        self._samples = []
        if self.world_size < 2:
            return
        pending, self._pending = self._pending, (step, self._gather([mine]))
        if pending is None:
            return
        window_end, result = pending
        medians = [values[0] for values in result()]
        if any(m == NO_SAMPLE or m <= 0 for m in medians):
            return  # a start's warm-up, or a rank without gradients that window: nothing to compare
        for rank, median in enumerate(medians):
            others = statistics.median(m for r, m in enumerate(medians) if r != rank)
            self._judge(step, window_end, rank, median / others, median / 1e6, others / 1e6)

    def _judge(self, step: int, window_end: int, rank: int, score: float, compute_s: float, others_s: float) -> None:
        """At `step`, the window that ended at `window_end`: `rank`'s scores."""
        h = self._history[rank]
        if len(h.baseline) < BASELINE:
            h.baseline.append(compute_s)
        individual = compute_s / statistics.median(h.baseline)
        if score >= self.threshold and compute_s - others_s >= MIN_EXCESS_S:
            h.over, h.under = h.over + 1, 0
        else:
            h.over, h.under = 0, h.under + 1
        fields = {
            "window_end": window_end,
            "straggler": rank,
            "score": round(score, 3),
            "individual": round(individual, 3),
            "compute_s": compute_s,
            "others_s": others_s,
        }
        if not h.flagged and h.over >= PERSIST:
            h.flagged = True
            self.flagged.add(rank)
            self.newly_flagged.add(rank)
            if self._announce:
                self._events.emit("straggler_detected", step=step, steps=PERSIST * WINDOW, **fields)
                print(
                    f"stalwart: rank {rank} is a straggler: its own work per step took {score:.2f}x the other "
                    f"ranks' ({compute_s * 1e3:.1f} ms against {others_s * 1e3:.1f} ms, medians) in {PERSIST} "
                    f"windows of {WINDOW} steps in a row, and every step waits for it",
                    file=sys.stderr,
                    flush=True,
                )
        elif h.flagged and h.under >= PERSIST:
            h.flagged = False
            self.flagged.discard(rank)
            if self._announce:
                self._events.emit("straggler_cleared", step=step, **fields)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
