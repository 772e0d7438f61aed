"""The step protocol: a Job driven by a loop it does not own (issue #44).

Why: `job.steps()` protects a loop the user writes around it, but most training runs in a loop the user does not
own (the Hugging Face Trainer, the Lightning Trainer, torchtitan). Their integrations cannot write
`for step, batch in job.steps(...)`; they can call "a step begins", "the step ended" and "the step failed" from
the places the framework lets them in. `StepLoop` is that surface, and `job.steps()` is its first driver:

    loop = job.loop(loader, max_steps=N)
    while (step := loop.begin()) is not None:
        try:
            train_on(step.batch)         # forward, backward, optimizer step
        except Exception as exc:
            loop.failed(exc)             # raises it again unless the job recovers
            continue                     # the next begin() is the redo
        loop.end()
    loop.close()

What each call does is what `steps()` did at that point of its loop, in the same order, so every guarantee of
`steps()` holds for a driver that keeps this order: the resume before the first step; at a step's begin the
heartbeat, the straggler clock and the batch drawn from `loader` (None for a script's own data); at its end the
snapshot, the checks, the log line and the checkpoint. A peer's failure inside the body does not raise there
(recovery/in_loop/group_side.py: the collective is absorbed and the update dropped), so the body returns and
`end()` recovers (re-forming in the loop, training on shrunk meanwhile); a body that raised hands its exception
to `failed()`. Either way the next `begin()` is the answer a driver needs: the step to redo, `Step.redo`, with
the tracked objects holding that step's state again and `Step.batch` the batch drawn for it.

Implementation: the Job's step engine is one coroutine (job/job.py `_run`): `end()` resumes it past the step's
end, up to the next step's begin, and `failed()` throws the failure into it at the point the step was running.
So a step's end work runs at `end()`, on the calling thread, as in `steps()`; `begin()` hands out what the
engine reached. Every call must come from the thread the loop body runs on (signal handlers and the commit point
are that thread's).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from stalwart.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Step:
    """A step the driver is to run. `number`: completed steps before it (a fresh job's first is 0), as
    `job.steps()` yields. `batch`: drawn from the loop's loader, or None for the script's own data (after a
    failure: the batch drawn for the failed step, whatever the driver drew itself is its own). `redo`: the step
    (or, after a numeric rollback, an earlier one) is run again: the tracked objects hold the state before it."""

    number: int
    batch: Any
    redo: bool = False


class _Phase(enum.Enum):
    NOT_STARTED = "not started"
    IN_STEP = "in a step"  # begin() returned a step: end() or failed() is next
    BETWEEN = "between steps"  # end() or failed() reached the next step: begin() hands it out
    DONE = "done"


Engine = Generator[tuple[int, Any], None, None]


class StepLoop:
    """One run's step protocol; see the module docstring. Made by `Job.loop()`."""

    def __init__(
        self,
        engine: Callable[[], Engine],
        update_dropped: Callable[[], bool],
        horizon: Callable[[], int],
        formation: Callable[[], int],
    ) -> None:
        self._make = engine
        self._update_dropped = update_dropped
        self._horizon = horizon
        self._formation = formation
        self._closed = False
        self._engine: Engine | None = None
        self._phase = _Phase.NOT_STARTED
        self._next: Step | None = None
        self.step: Step | None = None
        """The step begun last (None before the first and after the run's last)."""

    def begin(self) -> Step | None:
        """A step begins: the one to run, or None once the run is done (`max_steps` reached, or the loader ran
        out), its last checkpoint durable. The first call resumes the job (the restore, or a replacement's late
        join)."""
        if self._phase is _Phase.IN_STEP:
            raise ConfigError("StepLoop.begin() called again before end() or failed() of the step it began")
        if self._closed:
            raise ConfigError("StepLoop.begin() called after close()")
        if self._phase is _Phase.NOT_STARTED:
            self._engine = self._make()
            self._advance(lambda engine: next(engine))
        self.step, self._next = self._next, None
        self._phase = _Phase.IN_STEP if self.step is not None else _Phase.DONE
        return self.step

    def end(self) -> None:
        """The step's body returned (its optimizer step made): the step is complete. Its end's work runs now:
        snapshot, checks, log line, checkpoint; a numeric rollback makes the next step an earlier one."""
        self._in_step("end()")
        self._advance(lambda engine: next(engine))

    def failed(self, exc: Exception) -> Step | None:
        """The step's body raised `exc`. Returns the step to redo once the job recovered (the next `begin()`
        returns it too; None if the recovery itself took the run to its end); raises `exc` again when it cannot
        recover (not a peer's failure, or no way back), as `steps()` does. An error raised after a peer's failure
        was absorbed in the step counts as that failure's (group_side.InLoop.consequence): what it raised on may be
        what an absorbed collective left."""
        self._in_step("failed()")
        self._advance(lambda engine: engine.throw(exc))
        return self._next

    def update_dropped(self) -> bool:
        """The step's update is about to be applied, or was: whether it is dropped because a peer failed during
        the step. `end()` then recovers and the step is run again; a driver that must log or save only complete
        steps (a Trainer's log line) recovers first."""
        self._in_step("update_dropped()")
        return self._update_dropped()

    def horizon(self) -> int:
        """The oldest completed step a recovery may take the job back to: a driver that runs steps again itself
        keeps what it needs for each step after it (its micro-batches)."""
        return self._horizon()

    def formation(self) -> int:
        """Changes each time the job (re)forms its group: at its start, and at each re-forming in the loop (after a
        peer's failure, training on shrunk, the grow back). Every rank of the new group sees it change at the same
        step's begin: a driver with state of its own to agree on (a Trainer's running loss sums) does it there."""
        return self._formation()

    def close(self) -> None:
        """Leave the loop (also early: a `break` out of `steps()`). Nothing is saved that the run had not saved;
        a re-forming request that was waiting is dropped with the loop."""
        self._phase, self.step, self._next, self._closed = _Phase.DONE, None, None, True
        if self._engine is not None:
            self._engine.close()

    def __enter__(self) -> StepLoop:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _in_step(self, call: str) -> None:
        if self._phase is not _Phase.IN_STEP:
            raise ConfigError(f"StepLoop.{call} called {self._phase.value}: begin() returns the step it ends")

    def _advance(self, resume: Callable[[Engine], tuple[int, Any]]) -> None:
        """Run the engine up to its next step's begin; `_next` is that step, or None when the run is done. A step
        that is no later than the one begun last is a redo: the engine recovered from a failure (or rolled back
        from a numeric one) and the tracked objects hold that step's state."""
        assert self._engine is not None
        self._phase = _Phase.BETWEEN
        try:
            number, batch = resume(self._engine)
        except StopIteration:
            self._next = None
            return
        except BaseException:
            self._phase = _Phase.DONE  # the engine raised: it is closed
            with contextlib.suppress(Exception):
                self._engine.close()
            raise
        self._next = Step(number, batch, redo=self.step is not None and number <= self.step.number)
