"""The agent's side of worker hosts (worker_host.py is the process itself): the pool of hot spares,
the process context that runs workers in hosts,
and what keeps a re-formed survivor in its process.

A restart normally spawns fresh interpreters that import torch again (seconds before a worker can do anything;
docs/benchmarks.md). Under `stalwart run` workers run in host processes instead, so that:
- a host is forked from the zygote (zygote.py), which imported torch once, in milliseconds; without one it is
  a new interpreter;
- with `--spares N` the agent keeps N hosts that are ready before they are needed (`SparePool`);
- with re-forming on (the default, recovery/reform.py), a survivor of a peer's failure keeps its process: it
  re-arms and the next round activates it again.

torch elastic's own `_start_workers` runs unchanged, computing every worker's environment, but the call that
would spawn processes activates hosts instead (`running_in`) and returns a `HostContext`: the same
pids/wait/close interface as torch elastic's process contexts, so monitoring, failure reports, restarts and
shutdown work as for spawned workers.

The pool is refilled `REFILL_DELAY_S` after it was used (and after the first start), so that the spares'
start-up (their imports, when there is no zygote) does not compete for CPU with workers that are recovering.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from stalwart.errors import EXIT_PEER_LOST, EXIT_USER_ERROR
from stalwart.recovery.reform import REFORM_SIGNAL
from stalwart.runtime.env import (
    HOST_STATUS_FD_ENV,
    HOST_WARM_ENV,
    KEPT_RANKS_ENV,
    SHRUNK_STORE_ENV,
    WARM_SPARE_ENV,
)
from stalwart.runtime.process import say, stopped
from stalwart.supervisor import stack_dump
from stalwart.supervisor.host_protocol import Activation, HostStatus
from stalwart.supervisor.zygote import ForkedProcess, Zygote
from stalwart.telemetry.events import EventLog

REFILL_DELAY_S = 5.0
WARM_FAILURES_MAX = 3
"""Warm spares that died in the script's set-up, one after another, before spares stay hot (SparePool)."""
REARM_TIMEOUT_S = 10.0
"""How long survivors get to leave their failed group before they are killed and replaced. A survivor blocked
in a collective leaves when it fails, at once once the peer's sockets are closed; this bounds a stuck one."""
USER_ERROR_GRACE_S = 5.0
"""How long the other workers may go on after one exited for bad input (EXIT_USER_ERROR) before they are
stopped: they usually met the same input and are ending too, and one of them may be the rank that says why."""


class Host:
    """One host process. A warm one is `ready` once it has imported torch; a worker in one may re-arm."""

    def __init__(self, *, warm: bool, zygote: Zygote | None = None) -> None:
        forked = zygote.fork_host(warm=warm) if zygote is not None else None
        self.proc: subprocess.Popen[bytes] | ForkedProcess
        if forked is not None:
            self.proc, self._status = forked
        else:  # a new interpreter
            read, write = os.pipe()
            env = {**os.environ, HOST_STATUS_FD_ENV: str(write), HOST_WARM_ENV: "1" if warm else "0"}
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "stalwart.supervisor.worker_host"],
                stdin=subprocess.PIPE,
                env=env,
                pass_fds=(write,),
                start_new_session=True,  # as torch elastic starts workers: a signal to the group reaches children
            )
            os.close(write)
            self._status = read
        self._buffer = b""
        self.ready = not warm
        self.rearmed = False
        self.parking = False
        """A warm spare running the script's set-up (recovery/warm_spare.py); `parked` once at its loop."""
        self.parked = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ended_unreported(self) -> bool:
        """Ended, its exit code not known yet (a forked host, whose parent is the zygote: zygote.py)."""
        return isinstance(self.proc, ForkedProcess) and self.proc.ended_unreported()

    def stopped(self) -> bool:
        """Stopped by a signal (runtime/process.stopped): the host or the worker it became."""
        return stopped(self.proc.pid)

    def _read_status(self) -> None:
        while self._status >= 0 and select.select([self._status], [], [], 0)[0]:
            chunk = os.read(self._status, 256)
            if not chunk:
                os.close(self._status)
                self._status = -1
                break
            self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            status = HostStatus.decode(line)
            if status is HostStatus.READY:
                self.ready = True
            elif status is HostStatus.REARMED:
                self.rearmed = True
            elif status is HostStatus.PARKED:
                self.parked = True

    def poll_ready(self) -> bool:
        self._read_status()
        return self.ready and self.alive()

    def poll_parked(self) -> bool:
        """True once a warm spare's run of the script waits at its loop for a rank."""
        self._read_status()
        return self.parked and self.alive()

    def poll_rearmed(self) -> bool:
        """True once the worker in this host left its failed group and waits to be activated again."""
        self._read_status()
        return self.rearmed and self.alive()

    def activate(self, argv: list[str], env: dict[str, str]) -> bool:
        assert self.proc.stdin is not None
        self.rearmed = False
        try:
            self.proc.stdin.write(Activation(argv, env).encode())
            self.proc.stdin.flush()
        except (OSError, ValueError):
            return False
        return True

    def ask_to_reform(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.proc.pid, REFORM_SIGNAL)

    def end_descendants(self) -> None:
        """The host has ended: end what it started that is still running, at once. Why: a dead worker's DataLoader
        worker processes (stalwart's or the script's own) inherited its gloo connections and hold them open until
        their own watchdog notices the parent is gone, about 5 s later; meanwhile a survivor blocked in the
        collective with the dead rank sees no connection error. They share the host's process group (the host
        is its session's leader), which outlives its leader while any member runs; its persister ends with it
        anyway (checkpoint/save/persister.py)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def kill(self) -> None:
        if self._status >= 0:
            os.close(self._status)
            self._status = -1
        # The whole group, even if the host itself is gone: its children (a persister) may not be.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()


class SparePool:
    """The node's spares: hot (torch imported) or, with `warm_script`, warm: each runs the script's set-up up to its
    training loop as soon as a worker's activation is known (`remember`), and parks there (recovery/warm_spare.py).
    A spare whose set-up failed WARM_FAILURES_MAX times in a row turns warming off: the spares stay hot."""

    def __init__(
        self, target: int, events: EventLog, zygote: Zygote | None = None, *, warm_script: bool = False
    ) -> None:
        self.target = target
        self._events = events
        self.zygote = zygote
        self._idle: list[Host] = []
        self._refill_at: float | None = None
        self.warm_script = warm_script
        self._template: Activation | None = None
        self._failed_set_ups = 0
        self._told_ready: set[int] = set()  # the spares the last `spares_ready` event named

    def remember(self, argv: list[str], env: dict[str, str]) -> None:
        """A worker's activation of the round just started: what a warm spare runs the script with, marked as a
        spare's (its Job parks at the loop's start until it is given a rank)."""
        if self.warm_script:
            spare_env = {k: v for k, v in env.items() if k not in (KEPT_RANKS_ENV, SHRUNK_STORE_ENV)}
            self._template = Activation(list(argv), {**spare_env, WARM_SPARE_ENV: "1"})

    def schedule_refill(self, delay: float = REFILL_DELAY_S) -> None:
        if self.target > 0:
            self._refill_at = time.monotonic() + delay

    def maintain(self) -> None:
        """Drop dead spares and start missing ones once a refill is due (called every monitor interval)."""
        for spare in [s for s in self._idle if s.proc.poll() is not None]:
            self._idle.remove(spare)
            self._events.emit("spare_died", spare_pid=spare.pid, exitcode=spare.proc.returncode, parking=spare.parking)
            self._spare_ended(spare)
            self.schedule_refill()
        self._park_ready()
        self._tell_ready()
        if self._refill_at is None or time.monotonic() < self._refill_at:
            return
        self._refill_at = None
        started = []
        while len(self._idle) < self.target:
            spare = Host(warm=True, zygote=self.zygote)
            self._idle.append(spare)
            started.append(spare.pid)
        if started:
            self._events.emit("spares_started", spare_pids=started, target=self.target)

    def _tell_ready(self) -> None:
        """A `spares_ready` event each time the pool is full of ready spares it has not named yet (torch imported
        and warmed up; a warm spare may still be in the script's set-up): from then on a lost rank's replacement
        needs no interpreter."""
        pids = {s.pid for s in self._idle}
        if self.target <= 0 or len(pids) < self.target or pids == self._told_ready:
            return
        if all(s.poll_ready() for s in self._idle):
            self._told_ready = pids
            self._events.emit("spares_ready", spare_pids=sorted(pids), target=self.target)

    def _park_ready(self) -> None:
        """Send each ready spare not yet running the script the template activation (warm spares only)."""
        if not self.warm_script or self._template is None:
            return
        for spare in self._idle:
            if not spare.parking and spare.poll_ready():
                spare.parking = spare.activate(self._template.argv, self._template.env)
            elif spare.parking and spare.poll_parked():
                self._failed_set_ups = 0

    def _spare_ended(self, spare: Host) -> None:
        """A spare died while idle: one that died in the script's set-up counts towards turning warming off."""
        if not spare.parking or spare.parked:
            return
        self._failed_set_ups += 1
        if self._failed_set_ups >= WARM_FAILURES_MAX and self.warm_script:
            self.warm_script = False
            self._events.emit("warm_spares_off", failures=self._failed_set_ups)
            say(
                f"stalwart: {self._failed_set_ups} warm spares in a row died in the script's set-up (their output "
                "is above); spares stay hot from now on (torch imported, the set-up run when one is used)"
            )

    def take(self, n: int, *, all_or_none: bool = True) -> list[Host]:
        """Up to `n` ready spares, parked ones first, then those still in their set-up; with `all_or_none`, none
        unless `n` are ready."""
        ready = sorted((s for s in self._idle if s.poll_ready()), key=lambda s: (not s.poll_parked(), not s.parking))
        if n <= 0 or (all_or_none and len(ready) < n):
            return []
        chosen = ready[:n]
        for spare in chosen:
            self._idle.remove(spare)
        if chosen:
            self.schedule_refill()
        return chosen

    def trim(self) -> None:
        """Keep at most `target` idle spares: those beyond it end, the ones least far in their set-up first."""
        extra = len(self._idle) - self.target
        if extra <= 0:
            return
        order = sorted(self._idle, key=lambda s: (s.poll_parked(), s.parking, s.poll_ready()))
        for spare in order[:extra]:
            self._idle.remove(spare)
            spare.kill()

    def close(self) -> None:
        for spare in self._idle:
            spare.kill()
        self._idle.clear()


class HostContext:
    """Workers running in hosts, with the interface LocalElasticAgent uses of a process context.

    With `reform`, the first failure does not end the other workers: survivors that re-armed are reported as
    failed with EXIT_PEER_LOST (their run ended because of the failure) while their processes live on, and the
    agent keeps them for the next round (`keep_rearmed`)."""

    def __init__(self, workers: dict[int, Host], entrypoint: str, *, reform: bool) -> None:
        self._workers = workers
        self.entrypoint = entrypoint
        self._reform = reform
        self._bad_input_since: float | None = None
        self._ended: set[int] = set()  # ranks whose host was seen ended and its descendants ended
        self.stuck: dict[int, int] = {}
        """Local rank -> pid of the survivors the last `keep_rearmed` gave up on (their stacks are in their output)."""

    def pids(self) -> dict[int, int]:
        return {rank: host.pid for rank, host in self._workers.items()}

    def forked(self) -> set[int]:
        """Pids of the workers whose hosts the zygote forked (the others are new interpreters)."""
        return {host.pid for host in self._workers.values() if isinstance(host.proc, ForkedProcess)}

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

        codes = {rank: host.proc.poll() for rank, host in self._workers.items()}
        for rank, code in codes.items():
            if code not in (None, 0) and rank not in self._ended:  # one that finished may leave a save to end
                self._ended.add(rank)
                self._workers[rank].end_descendants()
        if any(codes[rank] is None and host.ended_unreported() for rank, host in self._workers.items()):
            # A worker that ended first must be reported with its own exit code (bad input, say), not left out
            # while a survivor that re-armed because of it is reported alone: wait for the zygote's report.
            return None
        rearmed = {rank for rank, host in self._workers.items() if self._reform and host.poll_rearmed()}
        if EXIT_USER_ERROR in codes.values() and self._peers_still_ending(codes, rearmed):
            return None
        failed = {rank for rank, code in codes.items() if code not in (None, 0)} | rearmed
        if not failed and any(code is None for code in codes.values()):
            return None
        if failed:
            if not self._reform:
                self.close()  # as torch elastic does: the first failure ends every worker of the group
                codes = {rank: host.proc.poll() for rank, host in self._workers.items()}
                failed = {rank for rank, code in codes.items() if code not in (None, 0)}
            failures = {
                rank: ProcessFailure(
                    rank, self._workers[rank].pid, EXIT_PEER_LOST if rank in rearmed else codes[rank] or 0, "<N/A>"
                )
                for rank in sorted(failed)
            }
            return RunProcsResult(failures=failures)
        return RunProcsResult(return_values=dict.fromkeys(self._workers))

    def _peers_still_ending(self, codes: dict[int, int | None], rearmed: set[int]) -> bool:
        """Whether to leave the others running a while after a worker exited for bad input.

        A user error met by every rank (training diverged on replicated gradients, a checkpoint no rank can
        read) is printed by one rank only and the others exit quietly; stopping the group at the first quiet
        exit would kill the rank about to print, and the job would end with EXIT_USER_ERROR and no reason. So
        the group ends when every other worker has ended or re-armed, or after USER_ERROR_GRACE_S (a peer
        blocked in a collective with the one that left)."""
        running = [r for r, c in codes.items() if c is None and r not in rearmed and not self._workers[r].stopped()]
        if not running:
            return False
        now = time.monotonic()
        if self._bad_input_since is None:
            self._bad_input_since = now
        return now - self._bad_input_since < USER_ERROR_GRACE_S

    def keep_rearmed(self, timeout: float = REARM_TIMEOUT_S) -> dict[int, Host]:
        """Ask every live worker to leave its group, wait up to `timeout` for each to re-arm, and take the
        re-armed hosts out of this context (close() then ends only the others). Local rank -> host."""
        asked: set[int] = set()
        end = time.monotonic() + timeout
        while True:
            # A stopped survivor cannot re-arm until it is continued: it is not waited for, and close() kills it.
            pending = [r for r, h in self._workers.items() if h.alive() and not h.poll_rearmed() and not h.stopped()]
            for rank in pending:
                if rank not in asked:
                    self._workers[rank].ask_to_reform()
                    asked.add(rank)
            if not pending or time.monotonic() >= end:
                break
            time.sleep(0.005)
        self.stuck = {r: self._workers[r].pid for r in pending if self._workers[r].alive()}
        stack_dump.request(list(self.stuck.values()))  # where each is stuck, before close() ends it
        kept = {r: h for r, h in self._workers.items() if h.poll_rearmed()}
        for rank in kept:
            del self._workers[rank]
        return kept

    def close(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        for host in self._workers.values():
            if host.alive() and host.stopped():  # it would act on death_sig only once continued: never wait
                host.kill()
        alive = [h for h in self._workers.values() if h.alive()]
        for host in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(host.pid, death_sig)
        end = time.monotonic() + timeout
        for host in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                host.proc.wait(max(0.0, end - time.monotonic()))
        for host in self._workers.values():
            host.kill()


@contextlib.contextmanager
def running_in(
    plan: dict[int, Host],
    *,
    reform: bool,
    zygote: Zygote | None = None,
    env: dict[str, str] | None = None,
    spares: SparePool | None = None,
    publish: Callable[[dict[str, str]], None] | None = None,
) -> Iterator[None]:
    """While active, torch elastic's `start_processes` activates the hosts of `plan` (local rank -> host)
    instead of spawning processes. A host that cannot be activated (it died meanwhile) is replaced by a cold one.
    `env`: what every worker of the round learns of its survivors (supervisor/round_kept.py), so survivors can
    train on shrunk while the replacements start (recovery/shrink.py).
    `spares`: told the node's last local rank's activation, which warm spares run the script's set-up with;
    `publish`: given it too (torch elastic's part of its environment), for spare nodes (supervisor/spare_host.py)."""
    import torch.distributed.elastic.agent.server.local_elastic_agent as lea

    real = lea.start_processes

    def start_in_hosts(
        *, entrypoint: str, args: dict[int, tuple[Any, ...]], envs: dict[int, dict[str, str]], **kwargs: Any
    ) -> Any:
        workers: dict[int, Host] = {}
        for rank in sorted(envs):
            worker_env = {**os.environ, **envs[rank]}
            for name in (KEPT_RANKS_ENV, SHRUNK_STORE_ENV):
                worker_env.pop(name, None)
            worker_env.update(env or {})
            argv = [str(a) for a in args[rank]]
            if spares is not None and rank == max(envs):
                spares.remember(argv, worker_env)
            if publish is not None and rank == max(envs):
                publish({k: str(v) for k, v in envs[rank].items()})
            host = plan.pop(rank, None) or Host(warm=False, zygote=zygote)
            if not host.activate(argv, worker_env):
                host.kill()
                host = Host(warm=False, zygote=zygote)
                host.activate(argv, worker_env)
            workers[rank] = host
        for host in plan.values():
            host.kill()
        return HostContext(workers, entrypoint, reform=reform)

    lea.start_processes = start_in_hosts  # type: ignore[assignment]
    try:
        yield
    finally:
        lea.start_processes = real
