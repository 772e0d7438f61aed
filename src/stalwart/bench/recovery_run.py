"""One launch of the recovery bench's job under one system (torchrun, torchft or `stalwart run`), watched through
its event log: starting it, its workers' pids, the steps it completed, stopping it (bench/recovery.py drives it)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.bench.common import Progress as Progress
from stalwart.bench.common import free_port
from stalwart.errors import BenchError
from stalwart.runtime.process import spawn
from stalwart.telemetry.events import EventLog

FULL_EVERY_STEP = ["--snapshot-every", "1", "--replicated-snapshot-every", "1"]
"""The stalwart_full runs' job options: a full memory snapshot every step (the defaults before the budget)."""


NPROC = 2

WIDTH = 1152
"""The job's model: 3 linear layers of WIDTH x WIDTH (4.0M parameters at 1152), `--width` of the bench."""


RESTART_CHECKPOINT_EVERY = 20
"""The durable checkpoint cadence of the job under torchrun, whose recovery reloads it: at most 19 steps
lost per kill. stalwart's runs keep JobConfig's default (every 100 steps): its recovery comes from live peers and
node memory, and what a user who changes nothing gets is what the bench measures (docs/benchmarks.md says so)."""


@dataclass(frozen=True)
class JobShape:
    """What the bench's job is like: the same for every system of one bench run."""

    setup_s: float = 0.0
    """Seconds the job's script spends before its loop (`--setup-s`: dataset indexing, building the model)."""
    width: int = WIDTH
    own_data: bool = False
    """Each rank draws its own batches in its loop (`--own-data`) instead of through a ResumableLoader."""
    warm_spares: bool = False
    """stalwart's spares run the script's set-up before they are needed (`stalwart run --warm-spares`)."""
    wait_for_replacement: bool = False
    """stalwart's survivors wait for the replacement (`stalwart run --wait-for-replacement`): every kill then
    includes the hand-over of the survivor's live state."""
    nodes: int = 1
    """The job's NPROC ranks on this many nodes (`--nodes`): with 2, two launchers on loopback of one rank each,
    meeting through the c10d rendezvous as two machines would (torchft is not measured so)."""
    fsdp: bool = False
    """The job's model sharded with FSDP2 instead of replicated with DDP (`--fsdp`; torchft is not measured so)."""

    def job_args(self) -> list[str]:
        """The recovery job's options for this shape (torchft's driver takes the first two)."""
        setup = ["--setup-s", str(self.setup_s)] if self.setup_s else []
        own = ["--own-data"] if self.own_data else []
        return [*setup, "--width", str(self.width), *own, *(["--fsdp"] if self.fsdp else [])]


DEFAULT_SHAPE = JobShape()


@dataclass
class Run:
    """One launch of the bench job under one system, watched through its event log."""

    system: str
    workdir: Path
    steps: int
    spares: int = 2
    seconds: float | None = None
    """A bound on the job's wall time (the hang and goodput runs stop it themselves long before)."""
    stock: bool = False
    shape: JobShape = DEFAULT_SHAPE
    proc: subprocess.Popen[bytes] | None = None
    """The first node's launcher (the only one on one node)."""
    others: list[subprocess.Popen[bytes]] = field(default_factory=list)
    """The other nodes' launchers (JobShape.nodes)."""
    started: float = 0.0
    offset: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def log(self) -> Path:
        return self.workdir / "events.jsonl"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        nodes = self.shape.nodes if self.system in ("torchrun", "stalwart", "stalwart_full") else 1
        port = free_port() if nodes > 1 else 0
        for node in range(nodes):
            cmd, env = self.command(node, port)
            name = "output.log" if node == 0 else f"output-node{node}.log"
            out = open(self.workdir / name, "wb")  # noqa: SIM115 - the launcher holds it; closed here
            # Its own session (the bench signals the whole group), and SIGTERM to the launcher if the bench dies.
            proc = spawn(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            out.close()
            if node == 0:
                self.proc = proc
            else:
                self.others.append(proc)

    def command(self, node: int = 0, port: int = 0) -> tuple[list[str], dict[str, str]]:
        """The launch's command line and environment for this system and job shape; on several nodes, node
        `node`'s, the rendezvous at 127.0.0.1:`port`."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("STALWART_", "TORCHELASTIC_", "PET_"))}
        env.update(STALWART_EVENT_LOG=str(self.log), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        until = [] if self.seconds is None else ["--until", f"{time.time() + self.seconds:.0f}"]
        setup = self.shape.job_args()
        job = [
            "-m",
            "stalwart.bench.recovery_job",
            "--out",
            str(self.workdir),
            "--steps",
            str(self.steps),
            *until,
            *setup,
        ]
        if self.system == "stalwart_full":
            job += FULL_EVERY_STEP
        if self.system == "torchrun":
            job += ["--checkpoint-every", str(RESTART_CHECKPOINT_EVERY)]
        if self.system == "torchft":
            cmd = [
                sys.executable,
                "-m",
                "stalwart.bench.torchft_driver",
                "--out",
                str(self.workdir),
                "--steps",
                str(self.steps),
                *until,
                *[a for a in setup if a != "--own-data"],  # its job draws its own data
            ]
        elif self.system == "torchrun":
            if not self.stock:
                env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            # Its log directory in the run's (torch elastic's default, a new one in /tmp, outlives a SIGKILL).
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                *self._placement(port),
                "--max-restarts=100",
                "--log-dir",
                str(self.workdir / f"torchrun-logs-{node}"),
                *job,
            ]
        else:
            cmd = [
                sys.executable,
                "-m",
                "stalwart",
                "run",
                *[a for a in self._placement(port) if a != "--standalone"],  # its default on one node
                "--max-restarts",
                "100",
                "--spares",
                str(self.spares),
                *(["--warm-spares"] if self.shape.warm_spares and self.spares else []),
                *(["--wait-for-replacement"] if self.shape.wait_for_replacement else []),
                "--event-log",
                str(self.log),
                *job,
            ]
        return cmd, env

    def _placement(self, port: int) -> list[str]:
        """torchrun's (and stalwart run's, without --standalone) flags placing the job's NPROC ranks: one node, or
        JobShape.nodes launchers meeting at 127.0.0.1:`port`."""
        if self.shape.nodes == 1:
            return ["--standalone", f"--nproc-per-node={NPROC}"]
        per_node = NPROC // self.shape.nodes
        return [
            "--rdzv-backend=c10d",
            f"--nnodes={self.shape.nodes}",
            f"--nproc-per-node={per_node}",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=bench",
        ]

    def poll_events(self) -> list[dict[str, Any]]:
        try:
            with open(self.log, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n") + 1
        new = []
        for line in chunk[:end].splitlines():
            with contextlib.suppress(ValueError):
                new.append(json.loads(line))
        self.offset += end
        self.events.extend(new)
        return new

    def worker_pid(self, rank: int) -> int | None:
        """The newest pid of `rank` (from the workers' own `worker_started` events)."""
        pids = [e["pid"] for e in self.events if e["event"] == "worker_started" and e.get("rank") == rank]
        return pids[-1] if pids else None

    def last_step(self) -> int:
        return max((e["step"] for e in self.events if e["event"] == "step_done"), default=0)

    def running(self) -> bool:
        """Whether a launcher of the run still runs (the job has ended once every node's has)."""
        return any(proc.poll() is None for proc in self.launchers())

    def launchers(self) -> list[subprocess.Popen[bytes]]:
        return [*([self.proc] if self.proc is not None else []), *self.others]

    def failed(self) -> int | None:
        """The first non-zero exit status of a launcher that ended; None when none failed."""
        return next((p.returncode for p in self.launchers() if p.returncode not in (None, 0)), None)

    def stop(self) -> None:
        """End the launchers and every worker this run started (pids from its own events and /proc)."""
        if self.proc is None:
            return
        workers = [pid for proc in self.launchers() for pid in _descendants(proc.pid)]
        for proc in self.launchers():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.launchers():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.poll_events()
        known = {e["pid"] for e in self.events if e["event"] == "worker_started"}
        for pid in set(workers) | known:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, pp in parents.items() if pp == parent]
        found += children
        frontier += children
    return found


def _note_kill(run: Run, what: str, rank: int, step: int) -> float:
    """Record the fault in the run's event log (so every time is on one CLOCK_MONOTONIC) and return its time."""
    record = EventLog(run.log, role="bench").emit("fault_injected", fault=what, rank=rank, step=step)
    return float(record["mono"])


def _wait(run: Run, until: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        if not run.running():
            run.poll_events()
            if until():
                return
            raise BenchError(
                f"{run.system}: the job exited ({run.failed() or 0}) while "
                f"waiting for {what}; see {run.workdir / 'output.log'}"
            )
        if time.monotonic() > deadline:
            raise BenchError(f"{run.system}: timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.02)
        run.poll_events()


def _stepped_in_round(run: Run, restart: int) -> Callable[[], bool]:
    """Whether a worker of restart round `restart` (or later) has completed a step."""
    return lambda: any(e["event"] == "step_done" and e.get("restart", 0) >= restart for e in run.events)


def _first_step_after(events: list[dict[str, Any]], mono: float, rank: int | None = None) -> float | None:
    times = [
        e["mono"]
        for e in events
        if e["event"] == "step_done" and e["mono"] > mono and (rank is None or e.get("rank") == rank)
    ]
    return min(times) if times else None


def _median_step(events: list[dict[str, Any]]) -> float | None:
    steps = [e["step_s"] for e in events if e["event"] == "step_done" and e.get("rank") == 0 and e["step"] > 5]
    return statistics.median(steps) if steps else None


def _results(workdir: Path) -> dict[int, str]:
    out = {}
    for rank in range(NPROC):
        path = workdir / f"result-rank{rank}.json"
        if path.exists():
            out[rank] = json.loads(path.read_text())["sha256"]
    return out
