"""The per-node agent: torch.distributed.elastic's LocalElasticAgent plus stalwart's event log and rules.

torch elastic does the rendezvous, rank assignment, worker start/monitor/stop and restart counting. On top:
- every start, failure (rank, exit code, signal name) and restart is written to the event log and printed as
  one line;
- a worker that exits with EXIT_USER_ERROR (bad input) stops the job instead of using up the restarts;
- survivors that exit with EXIT_PEER_LOST or are stopped with SIGTERM are reported as consequences, so the
  one-line summary names the root cause;
- workers run in host processes (host_pool.py): with a pool of hot spares, a replacement starts in a process that
  already imported torch; with re-forming (L1, recovery/reform.py), the survivors of a failure keep their
  processes and the next round of the rendezvous activates them again, so only the failed worker is replaced;
- workers that stop beating on the heartbeat board (detect/heartbeat.py) past their deadline are killed as
  hung, which turns a hang into the failure the restart path already handles;
- the node's GPUs are watched (supervisor/gpu_watch.py): an XID the playbook answers with a process restart
  kills the worker on that GPU; one that asks for a reset, a drain or a repair excludes the node and stops its
  workers without a restart.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from stalwart.detect.heartbeat import Beat, Board
from stalwart.errors import EXIT_USER_ERROR
from stalwart.runtime.process import process_state, stopped
from stalwart.supervisor import exclusion, failure_line, late_failures, peer_check, round_kept
from stalwart.supervisor.exclusion import Exclusion
from stalwart.supervisor.exit_watch import ExitWatch
from stalwart.supervisor.gpu_watch import GpuWatch, is_restart
from stalwart.supervisor.host_pool import REARM_TIMEOUT_S, Host, HostContext, SparePool, running_in
from stalwart.supervisor.late_failures import signal_name
from stalwart.supervisor.peer_check import PeerCheck
from stalwart.supervisor.spare_host import SpareHost
from stalwart.supervisor.zygote import Zygote
from stalwart.telemetry.events import EventLog

STOP_CONFIRM_S = 0.5
"""How long a worker must stay stopped (state T) before it is killed: a SIGSTOP followed at once by SIGCONT (job
control in a terminal) is not a hang."""


class StalwartAgent(LocalElasticAgent):
    def __init__(
        self,
        *,
        events: EventLog,
        say: Callable[[str], None],
        board: Board | None = None,
        spares: SparePool | None = None,
        zygote: Zygote | None = None,
        hosts: bool = False,
        reform: bool = False,
        gpu: GpuWatch | None = None,
        peer_check: PeerCheck | None = None,
        monitor_s: float | None = None,
        round_store: str | None = None,
        spare_host: SpareHost | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._spare_host = spare_host  # publishes each round's activation; warms spares while a spare node waits
        self._round_store = round_store  # "host:port" of the rendezvous store on several nodes (round_kept.py)
        self._monitor_s = monitor_s  # None: torch elastic's own sleep alone paces the looks at the workers
        self._exits = ExitWatch()  # wakes the look as soon as a worker ends (supervisor/exit_watch.py)
        self._gpu = gpu
        self._peer_check = peer_check  # the first start's bandwidth check between nodes (supervisor/peer_check.py)
        self.excluded: Exclusion | None = None
        self._events = events
        self._say = say
        self._board = board
        self._spares = spares
        self._zygote = zygote
        self._hosts = hosts or spares is not None or reform
        self._reform = reform
        self._reforming = False
        self._kept: dict[int, Host] = {}  # local rank -> re-armed survivor, for the next round
        self._failed_at: float | None = None
        self._unreported: dict[int, tuple[int, int, int]] = {}  # see supervisor/late_failures.py
        self._pids: dict[int, int] = {}  # local rank -> pid of the current workers
        self._hung: dict[int, str] = {}  # global rank -> why it was killed as hung
        self._stopped_since: dict[int, int] = {}  # pid -> monotonic ns when it was first seen stopped
        self.user_error = False

    @property
    def restart_count(self) -> int:
        return self._worker_group.spec.max_restarts - self._remaining_restarts

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        if self._peer_check is not None:
            check, self._peer_check = self._peer_check, None  # once: at this agent's first start
            self._check_peers(worker_group, check)
        if self._board is not None:
            self._board.clear()  # beats of the previous round must not count against the new workers
        self._hung.clear()
        from_spares: set[int] = set()
        kept: set[int] = set()
        if not self._hosts:
            pids = super()._start_workers(worker_group)
        else:
            plan: dict[int, Host] = dict(self._kept)
            self._kept = {}
            kept = {host.pid for host in plan.values()}
            missing = [r for r in range(worker_group.spec.local_world_size) if r not in plan]
            spares = self._spares.take(len(missing), all_or_none=False) if self._spares is not None else []
            if self._spare_host is not None:
                self._spare_host.admitted()  # a spare node's warm spares were just taken for its ranks
            from_spares = {s.pid for s in spares}
            plan.update(zip(missing, spares, strict=False))
            round_env = self._round_env(worker_group, {r for r, host in plan.items() if host.pid in kept})
            publish = self._spare_host.publish if self._spare_host is not None else None
            with running_in(
                plan, reform=self._reform, zygote=self._zygote, env=round_env, spares=self._spares, publish=publish
            ):
                pids = super()._start_workers(worker_group)
            if self._spares is not None and len(spares) < len(missing):
                self._spares.schedule_refill()  # after the start, so spares do not slow it down
        self._pids = {int(local): int(pid) for local, pid in pids.items()}
        self._emit_spawned(worker_group, from_spares, kept)
        if self._failed_at is not None:
            rank_of = {self._pids[w.local_rank]: w.global_rank for w in worker_group.workers}
            self._events.emit(
                "group_reformed",
                restart=self.restart_count,
                kept=sorted(rank for pid, rank in rank_of.items() if pid in kept),
                replaced=sorted(rank for pid, rank in rank_of.items() if pid not in kept),
                seconds=round(time.monotonic() - self._failed_at, 4),
            )
            late_failures.report(self._events, self._zygote, self._unreported, kept)
            self._unreported = {}
            self._failed_at = None
        return pids

    def _round_env(self, worker_group: WorkerGroup, local_kept: set[int]) -> dict[str, str]:
        """What every worker of this round learns of the survivors (supervisor/round_kept.py): on several nodes from
        every node's agent, through the round's store. Every agent of a re-forming job shares, at every start, so
        that none waits for another."""
        survivors = sorted(w.global_rank for w in worker_group.workers if w.local_rank in local_kept)
        world_size = worker_group.workers[0].world_size if worker_group.workers else 0
        nodes, node, store = worker_group.group_world_size or 1, worker_group.group_rank, worker_group.store
        if nodes == 1:
            return round_kept.worker_env(survivors, world_size, None, None)
        if self._round_store is None or not self._reform or node is None or store is None:
            return {}  # survivors wait for their replacements
        shared = round_kept.share(store, node, nodes, survivors)
        if shared is None:
            self._events.emit("round_kept_unknown", restart=self.restart_count, nodes=nodes)
            return {}
        ranks, token = shared
        return round_kept.worker_env(ranks, world_size, self._round_store, token)

    def _check_peers(self, worker_group: WorkerGroup, check: PeerCheck) -> None:
        """Measure the links between nodes when the job first forms (every node at its first start); report."""
        nodes, node, store = worker_group.group_world_size, worker_group.group_rank, worker_group.store
        if nodes is None or node is None or store is None or nodes < 2:
            return
        root = store
        while hasattr(root, "underlying_store"):  # each round's store is a prefix of the run's store
            root = root.underlying_store
        with contextlib.suppress(Exception):
            if root.check([f"{peer_check.KEY}/done"]):
                return  # a node that joins a running job (a later round): the others are past their first start
        started = time.monotonic()
        inbound = peer_check.measure(store, node, nodes, check.address, check.payload_mb)
        with contextlib.suppress(Exception):
            root.set(f"{peer_check.KEY}/done", "1")  # measured or not: a node joining later does not wait for it
        if inbound is None:
            self._events.emit("peer_check_skipped", reason="a peer did not answer in time")
            return
        verdict = peer_check.judge(inbound, check.min_gbps)
        measured = {str(k): round(v, 3) for k, v in inbound.items()}
        self._events.emit(
            "peer_bandwidth",
            node=node,
            address=check.address,
            inbound_gbps=measured,
            reference_gbps=round(verdict.reference_gbps, 3),
            payload_mb=check.payload_mb,
            seconds=round(time.monotonic() - started, 3),
        )
        for src, dst in verdict.slow_links:
            self._events.emit(
                "peer_link_slow",
                node=node,
                link=[src, dst],
                gbps=round(inbound[dst], 3),
                reference_gbps=round(verdict.reference_gbps, 3),
                suspects=verdict.suspects,
            )
        if verdict.slow_links and node == 0:
            links = ", ".join(f"node {a} -> node {b} {inbound[b]:.2f} GB/s" for a, b in verdict.slow_links)
            who = f"; likely node {', '.join(map(str, verdict.suspects))}" if verdict.suspects else ""
            healthy = f"healthy links {verdict.reference_gbps:.2f} GB/s"
            self._say(f"pre-flight between nodes: slow links ({links}; {healthy}){who}")

    def _emit_spawned(self, worker_group: WorkerGroup, from_spares: set[int], kept: set[int]) -> None:
        context = getattr(self, "_pcontext", None)
        forked = context.forked() if isinstance(context, HostContext) else set()
        for worker in worker_group.workers:
            pid = self._pids[worker.local_rank]
            self._events.emit(
                "worker_spawned",
                rank=worker.global_rank,
                local_rank=worker.local_rank,
                worker_pid=pid,
                world_size=worker.world_size,
                restart=self.restart_count,
                master=f"{worker_group.master_addr}:{worker_group.master_port}",
                spare=pid in from_spares,
                kept=pid in kept,
                forked=pid in forked,
            )

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self._reforming = self._reform  # survivors stay only for a new round, not when the job is ending
        try:
            super()._restart_workers(worker_group)
        except BaseException:
            self._release_kept()  # the round failed (e.g. the rendezvous): no one will activate them
            raise
        finally:
            self._reforming = False

    def _release_kept(self) -> None:
        for host in self._kept.values():
            host.kill()
        self._kept = {}

    def _shutdown(self, *args: Any, **kwargs: Any) -> None:
        if not self._reforming:  # torch elastic's _stop_workers shuts down too, right after survivors were kept
            self._release_kept()
            self._exits.close()
        super()._shutdown(*args, **kwargs)

    def _stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        # torch 2.4 passes is_restart=; later versions pass nothing more: whatever comes goes on to torch's own.
        self._kill_stopped(worker_group)  # it would neither re-arm nor act on SIGTERM: never wait for it
        ctx = self._pcontext
        if self._reforming and isinstance(ctx, HostContext):
            started = time.monotonic()
            self._kept = ctx.keep_rearmed()
            self._events.emit(
                "survivors_rearmed",
                local_ranks=sorted(self._kept),
                seconds=round(time.monotonic() - started, 4),
                restart=self.restart_count,
                stuck=sorted(ctx.stuck),
            )
            if ctx.stuck:
                ranks = ", ".join(str(r) for r in sorted(ctx.stuck))
                self._say(
                    f"local rank{'s' if len(ctx.stuck) > 1 else ''} {ranks} did not leave the failed group in "
                    f"{REARM_TIMEOUT_S:.0f} s; replaced (where: the threads' stacks, in the output above)"
                )
        super()._stop_workers(worker_group, *args, **kwargs)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self._monitor_s is not None:
            self._exits.wait(self._pids.values(), self._monitor_s, self._zygote)
        if self._gpu is not None and self.excluded is None:
            for index, action, reason in self._gpu.due_actions():
                self._act_on_gpu(worker_group, index, action, reason)
            for index, reason in self._gpu.warnings():
                raised = self._board.raise_risk() if self._board is not None else 0
                self._events.emit("gpu_risk", gpu=index, reason=reason, counter=raised)
        self._check_stopped(worker_group)
        if self._board is not None:
            self._check_hangs(worker_group, self._board)
        if self._spares is not None:
            self._spares.maintain()
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._failed_at = time.monotonic()
            self._report_failure(result)
            self._unreported = {
                w.global_rank: (w.local_rank, self._pids[w.local_rank], self.restart_count)
                for w in worker_group.workers
                if w.global_rank not in result.failures and w.local_rank in self._pids
            }
        return result

    def _act_on_gpu(self, worker_group: WorkerGroup, index: int, action: str, reason: str) -> None:
        """The playbook's action for GPU `index` (supervisor/gpu_watch.py)."""
        if self.excluded is not None:
            return
        if is_restart(action):
            for worker in worker_group.workers:
                pid = self._pids.get(worker.local_rank)
                if worker.local_rank != index or pid is None or worker.global_rank in self._hung:
                    continue
                self._events.emit(
                    "gpu_action",
                    gpu=index,
                    action=action,
                    reason=reason,
                    rank=worker.global_rank,
                    worker_pid=pid,
                    restart=self.restart_count,
                )
                self._hung[worker.global_rank] = f"on GPU {index} after {reason}"
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return
        self.excluded = exclusion.exclude(f"GPU {index}: {reason}", action)
        self._events.emit(
            "node_excluded",
            gpu=index,
            action=action,
            reason=reason,
            host=self.excluded.host,
            file=str(exclusion.exclusion_file()),
        )
        self._say(
            f"GPU {index}: {reason}: {action.replace('_', ' ')}; this node ({self.excluded.host}) is excluded "
            f"from the job ({exclusion.exclusion_file()}) and its workers are stopped"
        )
        self._remaining_restarts = 0  # not on this node: the others go on without it, or the job stops here
        for worker in worker_group.workers:
            pid = self._pids.get(worker.local_rank)
            if pid is not None:
                self._hung.setdefault(worker.global_rank, "stopped: its node is excluded")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def _check_stopped(self, worker_group: WorkerGroup) -> None:
        """Kill a worker stopped by a signal once it has stayed stopped for STOP_CONFIRM_S, whatever its
        heartbeat deadline (a start's grace period is 300 s): a stopped process makes no progress, answers no
        signal but SIGKILL, and stalls every peer waiting for it in a collective. Its peers then fail or re-form
        as after any death."""
        if self._hung:
            return
        now = time.monotonic_ns()
        seen = {pid: self._stopped_since.get(pid, now) for pid in self._pids.values() if stopped(pid)}
        self._stopped_since = seen
        confirmed = {pid for pid, since in seen.items() if now - since >= STOP_CONFIRM_S * 1e9}
        victims = [w for w in worker_group.workers if self._pids.get(w.local_rank) in confirmed]
        board = self._board
        for worker in victims:
            pid = self._pids[worker.local_rank]
            beat = board.read(worker.local_rank) if board is not None else None
            beat = beat if beat is not None and beat.pid == pid else None
            self._kill_hung(worker, pid, beat, "stopped by a signal", now, (now - seen[pid]) / 1e9)

    def _kill_stopped(self, worker_group: WorkerGroup) -> None:
        """At a restart: a worker stopped by a signal is killed now, with the event that says why."""
        now = time.monotonic_ns()
        for worker in worker_group.workers:
            pid = self._pids.get(worker.local_rank)
            if pid is None or worker.global_rank in self._hung or not stopped(pid):
                continue
            beat = self._board.read(worker.local_rank) if self._board is not None else None
            beat = beat if beat is not None and beat.pid == pid else None
            since = self._stopped_since.get(pid, now)
            self._kill_hung(worker, pid, beat, "stopped by a signal", now, (now - since) / 1e9)

    def _check_hangs(self, worker_group: WorkerGroup, board: Board) -> None:
        """Kill workers that stopped beating; torch elastic then sees them fail and the usual restart follows.

        A worker past its deadline is stuck, but so is every peer waiting for it in a collective. A worker
        stopped by a signal is the cause for certain, so when one exists only it is killed (its peers fail
        when its sockets close). Otherwise every overdue worker is killed: from outside, a deadlock or a sleep
        in C code looks the same as waiting in a collective, and the whole group restarts either way."""
        if self._hung:  # acted in this round already: the killed worker's failure restarts the whole group
            return
        now = time.monotonic_ns()
        watched: list[tuple[Any, Beat]] = []
        for worker in worker_group.workers:
            beat = board.read(worker.local_rank)
            if beat is None or beat.pid != self._pids.get(worker.local_rank) or not beat.deadline_ns:
                continue
            watched.append((worker, beat))
        overdue = [(w, b) for w, b in watched if now > b.deadline_ns]
        if not overdue:
            return
        halted = [(w, b) for w, b in watched if process_state(b.pid) in ("T", "t")]
        for worker, beat in halted or overdue:
            cause = "stopped by a signal" if (worker, beat) in halted else "no progress"
            self._kill_hung(worker, beat.pid, beat, cause, now, (now - beat.beat_ns) / 1e9)

    def _kill_hung(self, worker: Any, pid: int, beat: Beat | None, cause: str, now: int, silent: float) -> None:
        if beat is not None:
            silent = (now - beat.beat_ns) / 1e9
        timeout = (beat.deadline_ns - beat.beat_ns) / 1e9 if beat is not None and beat.deadline_ns else None
        self._events.emit(
            "hang_detected",
            rank=worker.global_rank,
            local_rank=worker.local_rank,
            worker_pid=pid,
            step=beat.step if beat is not None else None,
            phase=beat.phase_name if beat is not None else None,
            silent_s=round(silent, 3),
            timeout_s=round(timeout, 3) if timeout is not None else None,
            cause=cause,
            restart=self.restart_count,
        )
        where = f"at step {beat.step} " if beat is not None else ""
        limit = f", timeout {timeout:.1f} s" if timeout is not None else ""
        self._hung[worker.global_rank] = f"hung {where}({cause}; no heartbeat for {silent:.1f} s{limit})"
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def _report_failure(self, result: RunResult) -> None:
        for rank, failure in sorted(result.failures.items()):
            self._events.emit(
                "worker_failed",
                rank=rank,
                local_rank=failure.local_rank,
                worker_pid=failure.pid,
                exitcode=failure.exitcode,
                signal=signal_name(failure.exitcode),
                hung=rank in self._hung,
                restart=self.restart_count,
                **(self._board.progress(failure.local_rank, failure.pid) if self._board is not None else {}),
            )
            if failure.exitcode == EXIT_USER_ERROR:
                self.user_error = True
        what = failure_line.what_happened(result.failures, self._hung, self._reform)
        if self.excluded is not None:  # its workers were stopped on purpose; _act_on_gpu said why
            self._events.emit("job_stopped", reason="node_excluded")
            self._say("workers stopped; not restarting on an excluded node")
        elif self.user_error:
            self._remaining_restarts = 0
            self._events.emit("job_stopped", reason="user_error")
            self._say(f"{what}: a worker reported bad input; not restarting")
        elif self._remaining_restarts > 0:
            self._events.emit(
                "restarting",
                restart=self.restart_count + 1,
                remaining=self._remaining_restarts - 1,
                reform=self._reform,
            )
            verb = "re-forming the group" if self._reform else "restarting workers"
            self._say(f"{what}; {verb} ({self.restart_count + 1}/{self._worker_group.spec.max_restarts})")
        else:
            self._events.emit("job_stopped", reason="max_restarts")
            self._say(f"{what}; no restarts left (--max-restarts {self._worker_group.spec.max_restarts})")
