"""The per-node agent: torch.distributed.elastic's LocalElasticAgent plus stalwart's event log and rules.

torch elastic does the rendezvous, rank assignment, worker start/monitor/stop and restart counting. On top:
- every start, failure (rank, exit code, signal name) and restart is written to the event log and printed as
  one line;
- a worker that exits with EXIT_USER_ERROR (bad input) stops the job instead of using up the restarts;
- survivors that exit with EXIT_PEER_LOST or are stopped with SIGTERM are reported as consequences, so the
  one-line summary names the root cause.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from stalwart.errors import EXIT_PEER_LOST, EXIT_USER_ERROR
from stalwart.telemetry.events import EventLog


def signal_name(exitcode: int) -> str | None:
    """'SIGKILL' for -9 (a death by signal, as multiprocessing reports it), else None."""
    if exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


class StalwartAgent(LocalElasticAgent):
    def __init__(self, *, events: EventLog, say: Callable[[str], None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._events = events
        self._say = say
        self.user_error = False

    @property
    def restart_count(self) -> int:
        return self._worker_group.spec.max_restarts - self._remaining_restarts

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        pids = super()._start_workers(worker_group)
        for worker in worker_group.workers:
            self._events.emit(
                "worker_spawned",
                rank=worker.global_rank,
                local_rank=worker.local_rank,
                worker_pid=pids[worker.local_rank],
                world_size=worker.world_size,
                restart=self.restart_count,
                master=f"{worker_group.master_addr}:{worker_group.master_port}",
            )
        return pids

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._report_failure(result)
        return result

    def _report_failure(self, result: RunResult) -> None:
        causes, consequences = [], []
        for rank, failure in sorted(result.failures.items()):
            sig = signal_name(failure.exitcode)
            self._events.emit(
                "worker_failed",
                rank=rank,
                local_rank=failure.local_rank,
                worker_pid=failure.pid,
                exitcode=failure.exitcode,
                signal=sig,
                restart=self.restart_count,
            )
            if failure.exitcode == EXIT_USER_ERROR:
                self.user_error = True
            if sig == "SIGTERM":  # the agent stops the survivors of a failure with SIGTERM
                consequences.append(f"rank {rank} (pid {failure.pid}) stopped")
            elif failure.exitcode == EXIT_PEER_LOST:
                consequences.append(f"rank {rank} (pid {failure.pid}) lost a peer")
            else:
                how = f"killed by {sig}" if sig else f"exited with status {failure.exitcode}"
                causes.append(f"rank {rank} (pid {failure.pid}) {how}")
        if causes and consequences:
            n = len(consequences)
            what = ", ".join(causes) + f" ({n} other worker{'s' if n > 1 else ''} stopped as a consequence)"
        else:
            what = ", ".join(causes or consequences) or "workers unhealthy"
        if self.user_error:
            self._remaining_restarts = 0
            self._events.emit("job_stopped", reason="user_error")
            self._say(f"{what}: a worker reported bad input; not restarting")
        elif self._remaining_restarts > 0:
            self._events.emit("restarting", restart=self.restart_count + 1, remaining=self._remaining_restarts - 1)
            self._say(f"{what}; restarting workers ({self.restart_count + 1}/{self._worker_group.spec.max_restarts})")
        else:
            self._events.emit("job_stopped", reason="max_restarts")
            self._say(f"{what}; no restarts left (--max-restarts {self._worker_group.spec.max_restarts})")
