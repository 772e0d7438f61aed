"""`stalwart run`: torchrun's flags and worker environment, on torch.distributed.elastic, with safer defaults.

What differs from torchrun, and why:
- The rendezvous backend defaults to c10d; on one node without --rdzv-endpoint it behaves like --standalone
  (a free port on localhost), so nothing collides on a fixed port. torchrun's static flags (--master-addr,
  --master-port, --node-rank, --rdzv-backend static, or their PET_* variables) select the static backend for
  several nodes; on one node they become a c10d rendezvous on that address and port, because static rendezvous
  shares the agent's store with restarted workers (the hang below).
- Workers get a fresh TCPStore for each restart (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1). With the shared agent
  store, torch 2.13's restarted workers read gloo addresses left by the dead round and hang or fail in
  connectFullMesh; measured here (stalwart/bench/restart_reliability.py, docs/benchmarks.md), stock torchrun recovered
  from one SIGKILL in 6 of 10 runs, stalwart run in 10 of 10.
- Bad input (missing script, --nproc-per-node 0, unknown flags) ends in one line and exit 2 before anything
  starts; a worker's own bad-input exit (EXIT_USER_ERROR) stops the job instead of restarting it.
- Starts, failures and restarts go to a JSONL event log (--event-log), shared with the workers.
- --max-restarts defaults to 3 (torchrun: 0), unless PET_MAX_RESTARTS is set.
- With --nnodes MIN:MAX (MIN < MAX) workers are told the world size may change, and resume accordingly.
- Survivors of a worker's failure keep their processes and re-form the group with its replacement (L1,
  recovery/reform.py); `--no-reform` restarts every worker of the node instead, as torchrun does.
- Workers heartbeat to the agent through shared memory; one that stops beating inside the training loop for
  longer than --hang-timeout (calibrated from step times by default) is killed as hung and the group restarted,
  instead of its peers waiting out a collective timeout of many minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stalwart.detect.heartbeat import BOARD_PREFIX, Board
from stalwart.errors import EXIT_USER_ERROR, ConfigError
from stalwart.runtime.env import (
    AGENT_PID_ENV,
    ELASTIC_ENV,
    EVENT_LOG_ENV,
    FAILOVER_ENV,
    GLOO_IFNAME_ENV,
    HANG_TIMEOUT_ENV,
    HEARTBEAT_ENV,
    IN_LOOP_ENV,
    LAUNCH_TIME_ENV,
    MIRRORS_ENV,
    NCCL_ERRORS_ENV,
    QUIET_ENV,
    REFORM_ENV,
    SHARE_STORE_ENV,
    SNAPSHOT_DIR_ENV,
    WAIT_FOR_REPLACEMENT_ENV,
)
from stalwart.runtime.process import first_line
from stalwart.runtime.torch_compat_rendezvous import static_master
from stalwart.supervisor import exclusion, preflight_gate, preload
from stalwart.supervisor.gpu_watch import GpuWatch, warm_spares_off_for_gpus
from stalwart.supervisor.host_pool import SparePool
from stalwart.supervisor.leftovers import (
    SNAPSHOTS_PREFIX,
    _log_dir,
    _remove_stale_log_dirs,
    _remove_stale_shared_memory,
)
from stalwart.supervisor.preempt_notice import NoticeWatch
from stalwart.supervisor.rendezvous import DEFAULT_PORT, KEEP_ALIVE, rendezvous_handler
from stalwart.supervisor.run_args import in_hosts, parse_nnodes, reforms
from stalwart.supervisor.spare_host import SpareHost
from stalwart.supervisor.zygote import Zygote
from stalwart.telemetry.events import EventLog
from stalwart.telemetry.metrics import MetricsServer

LOOPBACK = "127.0.0.1"
MONITOR_TICK_S = 1e-6
"""torch elastic's sleep between two looks at the workers (it must be positive); the agent's own wait, woken by a
worker's end, takes torchrun's --monitor-interval as its timeout (supervisor/exit_watch.py)."""


def _supported(target: Any, **kwargs: Any) -> dict[str, Any]:
    """Keep the keyword arguments `target` accepts: WorkerSpec and the agent grew fields across torch 2.4+."""
    import inspect

    params = inspect.signature(target).parameters
    return {k: v for k, v in kwargs.items() if k in params}


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
"""What stops the launcher cleanly (workers stopped, shared memory removed, `launcher_exit`), exit 128 + N."""


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """Turn STOP_SIGNALS into torch elastic's SignalException for the whole of `launch`.

    torch installs the same handler only in `PContext.start()`, which never runs when workers live in host
    processes; without it SIGTERM killed the launcher outright: no `finally`, no event, /dev/shm left behind.
    A repeated signal while stopping is ignored, so the cleanup it started can finish.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    stopping = False

    def handler(signum: int, frame: Any) -> None:
        nonlocal stopping
        if stopping:
            return
        if signum == signal.SIGTERM and _PREEMPTION.request():
            return  # the workers save and exit; a second SIGTERM, or the grace period's end, stops them
        stopping = True
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _round_store(config: Any) -> str | None:
    """ "host:port" of the c10d rendezvous store on several nodes, which every node's workers reach too: survivors
    of a failure meet there to train on shrunk (supervisor/round_kept.py). None on one node (files on the node
    serve) and for other rendezvous backends (the survivors then wait for their replacements)."""
    store_type = str(dict(config.rdzv_configs or {}).get("store_type", "tcp")).strip().lower()
    if config.max_nodes < 2 or config.rdzv_backend != "c10d" or not config.rdzv_endpoint or store_type != "tcp":
        return None
    host, port = _host_port(config.rdzv_endpoint)
    return f"[{host}]:{port or DEFAULT_PORT}" if ":" in host else f"{host}:{port or DEFAULT_PORT}"


def _host_port(endpoint: str) -> tuple[str, int]:
    """host and port of a rendezvous endpoint ("host:port", "[v6]:port" or "host")."""
    host, _, port = (
        endpoint.rpartition(":") if endpoint.count(":") == 1 or endpoint.startswith("[") else (endpoint, "", "")
    )
    return host.strip("[]") or endpoint, int(port) if port.isdigit() else 0


class _Preemption:
    """SIGTERM while workers run (a scheduler's preemption): ask them, through the heartbeat board, for a last
    durable checkpoint and a clean exit (detect/risk.py), instead of killing them mid-step. If they have not
    exited within the grace period, or a second SIGTERM comes, the launcher stops them as before."""

    def __init__(self) -> None:
        self.board: Board | None = None
        self.grace_s = 0.0
        self.events: EventLog | None = None
        self.say: Any = None
        self.requested = False
        self._timer: threading.Timer | None = None

    def arm(self, board: Board, grace_s: float, events: EventLog, say: Any) -> None:
        self.board, self.grace_s, self.events, self.say = board, grace_s, events, say
        self.requested = False

    def request(self, why: str = "received SIGTERM") -> bool:
        """Handle a SIGTERM (or a preemption notice); False when it must stop the launcher at once (not armed, or
        already asked)."""
        if self.board is None or self.grace_s <= 0 or self.requested:
            return False
        self.requested = True
        self.board.request_preemption()
        if self.events is not None:
            self.events.emit("preemption_requested", grace_s=self.grace_s, why=why)
        if self.say is not None:
            self.say(f"{why}: asking the workers for a last checkpoint (grace {self.grace_s:g} s)")
        self._timer = threading.Timer(self.grace_s, os.kill, (os.getpid(), signal.SIGTERM))
        self._timer.daemon = True
        self._timer.start()
        return True

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.board = self._timer = None


_PREEMPTION = _Preemption()


def launch(args: argparse.Namespace, say: Any) -> int:
    """Run the agent until the workers succeed or fail for good; returns the process exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    with _stop_on_signals():
        try:
            return _launch(args, say)
        except SignalException as exc:  # before the agent ran, or while cleaning up after it
            say(f"received {exc.sigval.name}; stopped")
            return 128 + int(exc.sigval)


def _launch(args: argparse.Namespace, say: Any) -> int:
    with contextlib.ExitStack() as cleanup:
        # First, while this process has one thread: the zygote that forks every worker host (supervisor/zygote.py).
        zygote = Zygote.start(preload.plan(args.preload, args.training_script, is_module=args.module))
        if zygote is not None:
            cleanup.callback(zygote.close)
        return _launch_with(args, say, zygote, cleanup)


def _launch_with(args: argparse.Namespace, say: Any, zygote: Zygote | None, cleanup: contextlib.ExitStack) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import config_from_args

    if "LOGLEVEL" not in os.environ:
        # torch elastic logs each failure at length; the agent reports them as one line and an event.
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)

    if args.standalone or (args.rdzv_backend == "c10d" and not args.rdzv_endpoint and str(args.nnodes) in ("1", "1:1")):
        # One node: everything listens on loopback only (the rendezvous store, rank 0's store through
        # MASTER_ADDR, gloo's connections); several nodes bind the addresses they are given.
        args.rdzv_backend, args.rdzv_endpoint = "c10d", f"{LOOPBACK}:0"
        args.rdzv_id = args.rdzv_id if args.rdzv_id != "none" else str(uuid.uuid4())
        args.local_addr = args.local_addr or LOOPBACK
        os.environ.setdefault(GLOO_IFNAME_ENV, "lo")
    if str(args.nproc_per_node).isdigit() and int(args.nproc_per_node) > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's rule, without its banner
    os.environ.setdefault(SHARE_STORE_ENV, "1")
    barred = exclusion.excluded()
    if barred is not None:
        raise ConfigError(
            f"this node ({barred.host}) is excluded since {barred.time}: {barred.reason} ({barred.action}); once it "
            f"is fixed, run `stalwart nodes clear` here (list: {exclusion.exclusion_file()})"
        )
    event_log = Path(args.event_log).absolute()
    try:
        events = EventLog(event_log, role="agent", run_id=args.rdzv_id)
    except OSError as exc:
        raise ConfigError(f"cannot write the event log {event_log}: {exc.strerror or exc}") from exc
    os.environ[EVENT_LOG_ENV] = str(event_log)
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    nproc = int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else 1
    preflight_gate.gate(args, events, nproc, say)  # before this node joins any rendezvous
    if args.metrics_port is not None:
        try:
            metrics = MetricsServer(event_log, args.metrics_port, args.metrics_addr)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {args.metrics_addr}:{args.metrics_port}: {exc.strerror or exc}"
            ) from exc
        cleanup.callback(metrics.close)
        events.emit("metrics_listening", addr=metrics.addr, port=metrics.port)
        say(f"Prometheus metrics at http://{metrics.addr}:{metrics.port}/metrics")
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    if min_nodes < max_nodes:
        os.environ[ELASTIC_ENV] = "1"  # the world size may change between restarts; the Job allows it
    else:
        os.environ.pop(ELASTIC_ENV, None)  # never inherited from an outer launcher

    os.environ[HANG_TIMEOUT_ENV] = str(args.hang_timeout)
    os.environ[REFORM_ENV] = "1" if reforms(args) else "0"
    os.environ[IN_LOOP_ENV] = "0" if args.reform_by_rerun else "1"
    os.environ[WAIT_FOR_REPLACEMENT_ENV] = "1" if args.wait_for_replacement else "0"
    if args.mirror:
        os.environ[MIRRORS_ENV] = "\n".join(args.mirror)
    if args.failover_s is not None:
        os.environ[FAILOVER_ENV] = repr(args.failover_s)
    if args.quiet:
        os.environ[QUIET_ENV] = "1"
    if reforms(args) and not args.reform_by_rerun:
        os.environ.setdefault(NCCL_ERRORS_ENV, "2")  # a failed NCCL collective raises, the process lives
    # torch elastic makes a log directory per run (attempt and rank folders, error files) and, with no
    # --log-dir, leaves it in /tmp for ever: one per run. Ours lives as long as the launcher.
    if args.log_dir is None:
        _remove_stale_log_dirs()
        args.log_dir = str(_log_dir(cleanup))
    config, cmd, cmd_args = config_from_args(args)  # several nodes must share a run id: keep torchrun's "none"
    _remove_stale_shared_memory()
    try:
        board = Board(int(config.nproc_per_node))
    except OSError as exc:
        raise ConfigError(f"cannot create the heartbeat board in /dev/shm: {exc.strerror or exc}") from exc
    os.environ[HEARTBEAT_ENV] = str(board.path)
    os.environ.setdefault(LAUNCH_TIME_ENV, repr(time.time()))  # a relaunched node keeps a scheduler's value
    snapshots = board.path.with_name(SNAPSHOTS_PREFIX + board.path.name.removeprefix(BOARD_PREFIX))
    pool = SparePool(
        args.spares, events, zygote, warm_script=args.warm_spares and not warm_spares_off_for_gpus(events, say)
    )
    try:
        snapshots.mkdir(mode=0o700)
        os.environ[SNAPSHOT_DIR_ENV] = str(snapshots)
        return _run_agent(args, config, cmd, cmd_args, events, board, pool, say)
    except SignalException as exc:  # before the agent started its workers
        events.emit("launcher_exit", reason=f"signal {exc.sigval.name}", exitcode=128 + int(exc.sigval))
        raise
    finally:
        pool.close()
        board.close()
        shutil.rmtree(snapshots, ignore_errors=True)  # the memory tier lives exactly as long as the agent


def _run_agent(
    args: argparse.Namespace,
    config: Any,
    cmd: Any,
    cmd_args: list[str],
    events: EventLog,
    board: Board,
    pool: SparePool,
    say: Any,
) -> int:
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousParameters

    from stalwart.supervisor.agent import StalwartAgent

    handled = getattr(config, "signals_to_handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    if args.preempt_grace_s > 0:  # SIGTERM stays with our handler, which asks the workers to save first
        handled = ",".join(sig for sig in handled.split(",") if sig.strip() != "SIGTERM")
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = handled
    elastic = config.min_nodes < config.max_nodes
    rdzv_configs = {**KEEP_ALIVE, **config.rdzv_configs} if elastic else config.rdzv_configs
    rdzv_parameters = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **rdzv_configs,
    )
    master_addr, master_port = None, None
    if config.rdzv_backend == "static":
        master_addr, master_port = static_master(rdzv_parameters)
    events.emit(
        "launcher_started",
        argv=sys.argv,
        run_id=config.run_id,
        nproc_per_node=config.nproc_per_node,
        nnodes=f"{config.min_nodes}:{config.max_nodes}",
        max_restarts=config.max_restarts,
    )
    # A spare node warms its spares while it waits (--warm-spares on several nodes): supervisor/spare_host.py.
    spare_host = None
    if config.max_nodes > 1 and pool.warm_script:
        spare_host = SpareHost(pool, config.nproc_per_node, [str(a) for a in cmd_args])
    try:
        rdzv_handler = rendezvous_handler(
            rdzv_parameters,
            args.replace_wait_s if elastic else None,
            on_gone=lambda node: events.emit("node_gone", node=node, why="its agent's lifeline refused a knock"),
            spare_host=spare_host,
        )
    except (RendezvousError, ValueError) as exc:  # an address this host cannot bind or reach
        raise ConfigError(f"cannot start the rendezvous at {config.rdzv_endpoint}: {first_line(exc)}") from exc
    spec = WorkerSpec(
        **_supported(
            WorkerSpec,
            role=config.role,
            local_world_size=config.nproc_per_node,
            entrypoint=cmd,
            args=tuple(cmd_args),
            rdzv_handler=rdzv_handler,
            max_restarts=config.max_restarts,
            monitor_interval=MONITOR_TICK_S,  # the agent waits config.monitor_interval itself (exit_watch.py)
            master_addr=master_addr,
            master_port=master_port,
            local_addr=config.local_addr,
            event_log_handler=getattr(config, "event_log_handler", "null"),
            numa_options=getattr(config, "numa_options", None),
            duplicate_stdout_filters=getattr(config, "duplicate_stdout_filters", None),
            duplicate_stderr_filters=getattr(config, "duplicate_stderr_filters", None),
            virtual_local_rank=getattr(config, "virtual_local_rank", False),
        )
    )
    gpu = GpuWatch.from_env(events)
    agent = StalwartAgent(
        gpu=gpu,
        events=events,
        say=say,
        board=board,
        spares=pool if pool.target else None,
        zygote=pool.zygote,
        reform=reforms(args),
        hosts=in_hosts(args),
        peer_check=preflight_gate.peer_check(args, config.max_nodes > 1, *_host_port(config.rdzv_endpoint)),
        monitor_s=float(config.monitor_interval),
        round_store=_round_store(config),
        spare_host=spare_host,
        **_supported(
            StalwartAgent.__mro__[1],
            spec=spec,
            logs_specs=config.logs_specs,
            start_method=config.start_method,
            log_line_prefix_template=config.log_line_prefix_template,
            shutdown_timeout=getattr(config, "shutdown_timeout", 30),
        ),
    )
    shutdown_rdzv = True
    _PREEMPTION.arm(board, args.preempt_grace_s, events, say)
    notice = None
    if args.preempt_notice is not None:
        notice = NoticeWatch(
            args.preempt_notice, lambda why: _PREEMPTION.request(f"preemption notice: {why}"), say
        ).start()
    try:
        result = agent.run()
    except SignalException as exc:
        shutdown_rdzv = False  # other nodes may still re-form without us
        events.emit("launcher_exit", reason=f"signal {exc.sigval.name}", exitcode=128 + int(exc.sigval))
        say(f"received {exc.sigval.name}; workers stopped")
        return 128 + int(exc.sigval)
    except RendezvousError as exc:
        # Another node ended the job (closed the rendezvous) or the rendezvous timed out: one line, no traceback.
        first = first_line(exc)
        events.emit("launcher_exit", reason=f"rendezvous: {first}", exitcode=1, restarts=agent.restart_count)
        say(f"cannot re-form the job: {type(exc).__name__}: {first}")
        return 1
    finally:
        if notice is not None:
            notice.stop()
        _PREEMPTION.disarm()
        if gpu is not None:
            gpu.close()
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()
    if result is None:  # the rendezvous was closed gracefully while this node still had work
        events.emit("launcher_exit", reason="rendezvous closed by another node", exitcode=1)
        say("the rendezvous was closed by another node; stopping")
        return 1
    if not result.is_failed() and _PREEMPTION.requested:
        status = 128 + signal.SIGTERM
        events.emit("launcher_exit", reason="preempted", exitcode=status, restarts=agent.restart_count)
        say("preempted: the workers took a last checkpoint and exited; launch again to resume from it")
        return status
    if not result.is_failed():
        events.emit("launcher_exit", reason="succeeded", exitcode=0, restarts=agent.restart_count)
        return 0
    status = EXIT_USER_ERROR if agent.user_error else 1
    if agent.excluded is not None:
        events.emit("launcher_exit", reason=f"node excluded: {agent.excluded.reason}", exitcode=status)
        return status
    events.emit("launcher_exit", reason="failed", exitcode=status, restarts=agent.restart_count)
    return status
