"""The `dist.Work` objects the re-formable group (runtime/group.py) hands back: one not run, one whose failure is
recorded on the group instead of raised, and one made of several (a coalesced collective run one tensor at a time).

Each is kept alive by the group that gave it until its caller has been served (`Given`). Why: a caller in C++
(DDP's reducer, torch's functional collectives) holds only the C++ part of a Python work, and torch 2.4 keeps the
Python object alive for none of them: once the last Python reference goes, the C++ part loses the Python overrides
and runs torch's base `Work` instead (a `get_future` that raises "not implemented", a `wait` that never returns).
Later releases hold the Python object for as long as C++ holds the work; keeping it is harmless there.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist
from torch.futures import Future

from stalwart.runtime.torch_compat import is_wait_timeout

Then = Callable[[], Any] | None
"""What completes a collective once the backend's part succeeded (AbsorbingWork's `then`)."""

POLL = timedelta(milliseconds=100)
"""How long an absorbing wait blocks before it looks whether the group has failed meanwhile."""


class Keeper(Protocol):
    """What keeps a given work alive until its caller has been served: the group that gave it."""

    def served(self, work: Given) -> None: ...


class Absorber(Keeper, Protocol):
    """What a work reports a failure to: the group (ReformableGroup)."""

    @property
    def failed(self) -> BaseException | None: ...

    def absorb(self, exc: BaseException) -> None: ...

    def work_failed(self, exc: BaseException) -> None: ...

    def give(self, work: Given) -> dist.Work: ...


class Given(dist.Work):
    """A work of this module, kept by the group that gave it (`kept_by`) until its caller has been served: it
    waited, or it took the future and the future completed (see the module docstring for why)."""

    _keeper: Keeper | None = None

    def kept_by(self, keeper: Keeper) -> None:
        """`keeper` holds this work until `served` tells it the caller has what it came for."""
        self._keeper = keeper

    def release(self) -> None:
        """The group has failed: complete now if not done (nothing to do for a work done when made)."""

    def served(self) -> None:
        """The caller has what it came for: the keeper may let go (the caller holds the work if it needs more)."""
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.served(self)


class DoneWork(Given):
    """A collective that was not run (the group has failed): done at once, its tensors left as they are."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self._future: Future[Any] = Future()
        self._future.set_result(result)

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.served()
        return True

    def get_future(self) -> Future[Any]:
        self.served()
        return self._future

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


class AbsorbingWork(Given):
    """A collective of the real backend whose failure is recorded on the group instead of raised. Given out by the
    group when made, which completes it if the group fails first (`release`): a C++ waiter (DDP's reducer) is woken.
    """

    def __init__(self, group: Absorber, work: dist.Work, result: Any, then: Then = None) -> None:
        """`then`: what completes the collective once the backend's part succeeded (a reduce-scatter run as an
        all-reduce copies its part out, runtime/group.py); run once, before the caller is served, and never for
        a work released first (its caller has moved on)."""
        super().__init__()
        self._group, self._work, self._result = group, work, result
        self._then = then
        self._then_lock = threading.RLock()  # re-entrant: the re-form request's handler may release mid-`then`
        self._future: Future[Any] = Future()
        self._future_taken = False
        with contextlib.suppress(RuntimeError):  # gloo's reduce-scatter has none: completed by wait(), get_future
            work.get_future().add_done_callback(self._settle)
        group.give(self)  # kept until served; a group that failed already releases it at once

    def release(self) -> None:
        """The group has failed: complete the future now, its tensors as they are, without waiting for the backend
        (which may wait for a peer that left until the collective timeout). The step's update is dropped."""
        with self._then_lock:
            self._then = None
        self._complete()

    def _succeeded(self) -> None:
        """The backend's part is done and did not fail: `then`, once (from the backend's thread or the waiter's)."""
        with self._then_lock:
            then, self._then = self._then, None
            if then is not None:
                then()

    def _settle(self, inner: Future[Any]) -> None:
        try:
            inner.value()
        except Exception as exc:
            self._group.work_failed(exc)
        else:
            self._succeeded()
        self._complete()

    def _complete(self) -> None:
        if not self._future.done():  # once, by whichever of wait() and the callback is first
            with contextlib.suppress(RuntimeError):
                self._future.set_result(self._result)
        if self._future_taken:  # a caller that took the future (DDP's reducer) has what it waits for
            self.served()

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            done = self._work.wait(timeout) if timeout is not None else self._wait_unless_failed()
        except Exception as exc:
            self._group.work_failed(exc)
        else:
            if done:
                self._succeeded()
        self._complete()
        self.served()
        return True

    def _wait_unless_failed(self) -> bool:
        """Wait in slices of POLL, and give up once the group has failed. Why: a peer on this node that met the
        failure first leaves the collective, and gloo's wait for its part would block until the collective timeout
        (it is alive: nothing errors); the agent's request to re-form, a signal whose handler marks the group failed
        (recovery/in_loop/), runs only between bytecodes, never inside that wait. Given up, the collective's
        tensors stay as they are and the step's update is dropped, as for any absorbed failure. True: the
        collective is done; False: given up."""
        while True:
            try:
                self._work.wait(POLL)
                return True
            except RuntimeError as exc:
                if not is_wait_timeout(exc):
                    raise
            if self._group.failed is not None:
                return False

    def get_future(self) -> Future[Any]:
        self._future_taken = True
        if not self._future.done():
            try:
                self._work.get_future()
            except RuntimeError:  # no future of its own: the caller gets a completed one, after the wait
                self.wait()
        if self._future.done():
            self.served()
        return self._future

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def is_success(self) -> bool:
        return self._group.failed is None


class AllOf(Given):
    """Several works as one: done when all are (a coalesced collective run as one collective per tensor)."""

    def __init__(self, works: list[dist.Work], result: Any) -> None:
        super().__init__()
        self._works, self._result = works, result
        self._future: Future[Any] = Future()

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout)
        if not self._future.done():
            with contextlib.suppress(RuntimeError):
                self._future.set_result(self._result)
        self.served()
        return True

    def get_future(self) -> Future[Any]:
        self.wait()
        return self._future

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def is_success(self) -> bool:
        return all(work.is_success() for work in self._works)
