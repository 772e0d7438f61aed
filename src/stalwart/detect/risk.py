"""Risk signals from the node agent reaching the training loop: a warning sign becomes a checkpoint now.

Why: thermal throttling, correctable ECC errors that keep rising and rows pending remapping often come before a
GPU fails. A durable checkpoint taken when they appear shortens the work a failure then costs, at the price of
one extra save.

How: the agent's GPU watch raises a counter on its heartbeat board (detect/heartbeat.py) with each warning (and
writes a `gpu_risk` event saying which). Every rank reads its node's counter at each step's end (one load from
mapped memory). The ranks must save at the same step, and a warning on one node is seen by that node's ranks
only, at slightly different steps: so every `every` steps they all-gather whether their counter rose, and act
on the gather of the window before (started a window earlier, so no rank waits for it). Every rank then sees
the same answer at the same step. Detection to checkpoint: one to two windows (10-20 steps) after the agent's
poll, which itself runs every 5 s.

A preemption travels the same way: the launcher that gets SIGTERM sets a flag on its board, and at the window
end where every rank has seen some rank's flag the job takes a last durable checkpoint and exits cleanly, so the
next launch resumes from that step (JobConfig and `stalwart run --preempt-grace-s`).
"""

from __future__ import annotations

from collections.abc import Callable

WINDOW = 10
"""Steps between two exchanges of the ranks' risk flags."""


class RiskWatch:
    """Agrees across ranks on new warnings from the agents, and on a preemption (module docstring)."""

    def __init__(
        self,
        read: Callable[[], int],
        gather_later: Callable[[list[int]], Callable[[], list[list[int]]]],
        world_size: int,
        every: int = WINDOW,
        preempted: Callable[[], bool] = lambda: False,
    ) -> None:
        self._read = read
        self._preempted = preempted
        self.preempt = False
        """Set at the window's end at which every rank agrees that some agent asked for a last checkpoint and a
        clean exit (SIGTERM to a launcher: a preemption)."""
        self._gather_later = gather_later
        self._world_size = world_size
        self.every = every
        self._seen = read()  # what was raised before this worker started is not news
        self._pending: Callable[[], list[list[int]]] | None = None

    def step_done(self, step: int) -> list[int] | None:
        """After `step` completed steps (every rank, the same steps): the ranks whose node raised a warning, when
        this is the step every rank agrees to act on; None otherwise."""
        if step % self.every:
            return None
        now = self._read()
        risen, self._seen = int(now != self._seen), now
        preempt = int(self._preempted())
        if self._world_size < 2:
            self.preempt = bool(preempt)
            return [0] if risen else None
        pending, self._pending = self._pending, self._gather_later([risen, preempt])
        if pending is None:
            return None
        flags = pending()
        self.preempt = any(f[1] for f in flags)
        ranks = [r for r, f in enumerate(flags) if f[0]]
        return ranks or None
