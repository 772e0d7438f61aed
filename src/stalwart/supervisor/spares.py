"""The agent's pool of hot spares, and the process context that runs workers in them.

A restart normally spawns fresh interpreters that import torch again (1.8-2.7 s on this machine before a
worker can do anything). With `--spares N` the agent keeps N spare processes (spare.py) that have already paid
that cost. When the workers must be (re)started and at least `local_world_size` spares are ready, torch elastic's
own `_start_workers` runs unchanged, computing every worker's environment, but the call that would spawn
processes activates spares instead and returns a `SpareContext`: the same pids/wait/close interface as torch
elastic's process contexts, so monitoring, failure reports, restarts and shutdown work as for spawned workers.

The pool is refilled `REFILL_DELAY_S` after it was used (and after the first start), so that the spares'
imports do not compete for CPU with workers that are recovering.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from stalwart.supervisor.spare import SPARE_FD_ENV
from stalwart.telemetry.events import EventLog

REFILL_DELAY_S = 5.0


class Spare:
    """One spare process; `ready` once it has imported torch and waits for its activation."""

    def __init__(self) -> None:
        read, write = os.pipe()
        env = {**os.environ, SPARE_FD_ENV: str(write)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stalwart.supervisor.spare"],
            stdin=subprocess.PIPE,
            env=env,
            pass_fds=(write,),
            start_new_session=True,  # as torch elastic starts workers: a signal to the group reaches children
        )
        os.close(write)
        self._ready_fd = read
        self.ready = False

    def poll_ready(self) -> bool:
        if not self.ready and self._ready_fd >= 0 and select.select([self._ready_fd], [], [], 0)[0]:
            self.ready = os.read(self._ready_fd, 64).startswith(b"ready")
            os.close(self._ready_fd)
            self._ready_fd = -1
        return self.ready and self.proc.poll() is None

    def activate(self, argv: list[str], env: dict[str, str]) -> bool:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"argv": argv, "env": env}) + "\n").encode())
            self.proc.stdin.close()
        except (OSError, ValueError):
            return False
        return True

    def kill(self) -> None:
        if self._ready_fd >= 0:
            os.close(self._ready_fd)
            self._ready_fd = -1
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class SparePool:
    def __init__(self, target: int, events: EventLog) -> None:
        self.target = target
        self._events = events
        self._idle: list[Spare] = []
        self._refill_at: float | None = None

    def schedule_refill(self, delay: float = REFILL_DELAY_S) -> None:
        if self.target > 0:
            self._refill_at = time.monotonic() + delay

    def maintain(self) -> None:
        """Drop dead spares and start missing ones once a refill is due (called every monitor interval)."""
        for spare in [s for s in self._idle if s.proc.poll() is not None]:
            self._idle.remove(spare)
            self._events.emit("spare_died", spare_pid=spare.proc.pid, exitcode=spare.proc.returncode)
            self.schedule_refill()
        if self._refill_at is None or time.monotonic() < self._refill_at:
            return
        self._refill_at = None
        started = []
        while len(self._idle) < self.target:
            spare = Spare()
            self._idle.append(spare)
            started.append(spare.proc.pid)
        if started:
            self._events.emit("spares_started", spare_pids=started, target=self.target)

    def take(self, n: int) -> list[Spare] | None:
        """`n` ready spares, or None (then nothing is taken)."""
        ready = [s for s in self._idle if s.poll_ready()]
        if n <= 0 or len(ready) < n:
            return None
        chosen = ready[:n]
        for spare in chosen:
            self._idle.remove(spare)
        self.schedule_refill()
        return chosen

    def close(self) -> None:
        for spare in self._idle:
            spare.kill()
        self._idle.clear()


class SpareContext:
    """Workers running in activated spares, with the interface LocalElasticAgent uses of a process context."""

    def __init__(self, workers: dict[int, Spare], entrypoint: str) -> None:
        self._workers = workers
        self.entrypoint = entrypoint

    def pids(self) -> dict[int, int]:
        return {rank: spare.proc.pid for rank, spare in self._workers.items()}

    def wait(self, timeout: float = -1, period: float = 1) -> Any:
        expiry = time.monotonic() + (timeout if timeout >= 0 else float("inf"))
        while True:
            result = self._poll()
            if result is not None or time.monotonic() >= expiry:
                return result
            time.sleep(min(period, max(0.0, expiry - time.monotonic())))

    def _poll(self) -> Any:
        from torch.distributed.elastic.multiprocessing.api import RunProcsResult
        from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

        codes = {rank: spare.proc.poll() for rank, spare in self._workers.items()}
        failed = {rank: code for rank, code in codes.items() if code not in (None, 0)}
        if not failed and any(code is None for code in codes.values()):
            return None
        if failed:
            self.close()  # as torch elastic does: the first failure ends every worker of the group
            codes = {rank: spare.proc.poll() for rank, spare in self._workers.items()}
            failures = {
                rank: ProcessFailure(rank, spare.proc.pid, codes[rank] or 0, "<N/A>")
                for rank, spare in self._workers.items()
                if codes[rank] not in (None, 0)
            }
            return RunProcsResult(failures=failures)
        return RunProcsResult(return_values=dict.fromkeys(self._workers))

    def close(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        alive = [s for s in self._workers.values() if s.proc.poll() is None]
        for spare in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(spare.proc.pid, death_sig)
        end = time.monotonic() + timeout
        for spare in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                spare.proc.wait(max(0.0, end - time.monotonic()))
        for spare in alive:
            if spare.proc.poll() is None:
                spare.kill()


@contextlib.contextmanager
def spawning_into(spares: list[Spare], on_activate: Callable[[int, Spare], None]) -> Iterator[None]:
    """While active, torch elastic's `start_processes` activates `spares` instead of spawning processes."""
    import torch.distributed.elastic.agent.server.local_elastic_agent as lea

    real = lea.start_processes

    def start_in_spares(*, entrypoint: str, args: dict[int, tuple[Any, ...]], envs: dict[int, dict[str, str]],
                        **kwargs: Any) -> Any:  # fmt: skip
        workers: dict[int, Spare] = {}
        pool = list(spares)
        for rank in sorted(envs):
            env = {**os.environ, **envs[rank]}
            argv = [str(a) for a in args[rank]]
            while pool:
                spare = pool.pop(0)
                if spare.activate(argv, env):
                    workers[rank] = spare
                    on_activate(rank, spare)
                    break
                spare.kill()
            else:  # not enough live spares after all: undo, and spawn as usual
                SpareContext(workers, entrypoint).close(signal.SIGKILL, 5)
                for spare in pool:
                    spare.kill()
                return real(entrypoint=entrypoint, args=args, envs=envs, **kwargs)
        for spare in pool:
            spare.kill()
        return SpareContext(workers, entrypoint)

    lea.start_processes = start_in_spares  # type: ignore[assignment]
    try:
        yield
    finally:
        lea.start_processes = real
