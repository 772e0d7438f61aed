"""Run one demo job under `stalwart run`, watch its event log, and SIGKILL a worker from outside on cue.

The kill comes from this process, like a node failure would, at a step chosen in advance; its instant is written
to the job's own event log so kill-to-next-step is measured on one clock (CLOCK_MONOTONIC).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.runtime.process import spawn
from stalwart.supervisor import launch_server, zygote
from stalwart.supervisor.launch_server import LaunchServer, ServedProcess
from stalwart.telemetry.events import EventLog, read_events


@dataclass(slots=True)
class JobRun:
    out: Path
    steps: int
    kill_at: int | None = None
    kill_rank: int = 1
    events: list[dict[str, Any]] = field(default_factory=list)
    exitcode: int | None = None
    seconds: float = 0.0

    @property
    def event_log(self) -> Path:
        return self.out / "events.jsonl"

    @property
    def log(self) -> Path:
        return self.out / "output.log"


def run_job(
    run: JobRun,
    *,
    nproc: int,
    checkpoint_every: int,
    timeout_s: float,
    on_step: Callable[[int], None],
    spares: int = 0,
) -> JobRun:
    run.out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "stalwart",
        "run",
        "--spares",
        str(spares),
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "3",
        "--event-log",
        str(run.event_log),
        # The demo shows the bitwise result: the survivor waits for the replacement (its set-up is short) instead
        # of training on shrunk, whose dropout draws would come from the survivor's generators (README).
        "--wait-for-replacement",
        "-m",
        "stalwart.demo.train",
        "--out",
        str(run.out),
        "--steps",
        str(run.steps),
        "--checkpoint-every",
        str(checkpoint_every),
    ]
    started = time.monotonic()
    proc = _start(cmd, run.log)
    try:
        _watch(run, proc, started + timeout_s, on_step)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the launcher stops its workers on SIGTERM
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    run.exitcode = proc.returncode
    run.seconds = time.monotonic() - started
    run.events = list(read_events(run.event_log))
    return run


_SERVER: LaunchServer | None = None


def _start(cmd: list[str], log: Path) -> subprocess.Popen[bytes] | ServedProcess:
    """`cmd` (`python -m stalwart run ...`), its output to `log`: forked from a launch server where forking is on
    (supervisor/launch_server.py), so that the demo's two runs pay the imports of torch and the training side once
    (the second run then starts at once), else a new interpreter. Either way the launcher gets SIGTERM if the demo
    dies, whatever killed it (directly, or through the server's end): it stops its workers and cleans up."""
    global _SERVER
    if zygote.enabled():
        _SERVER = launch_server.started(_SERVER, dict(os.environ))
        with contextlib.suppress(RuntimeError):  # the server ended: a new interpreter instead
            return _SERVER.start(cmd[3:], dict(os.environ), Path.cwd(), log)
    with open(log, "wb") as out:
        return spawn(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _watch(
    run: JobRun, proc: subprocess.Popen[bytes] | ServedProcess, deadline: float, on_step: Callable[[int], None]
) -> None:
    offset, pids, killed, best = 0, {}, False, 0
    while proc.poll() is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the demo job did not finish in time; see {run.log}")
        time.sleep(0.02)
        new, offset = _read_new(run.event_log, offset)
        for e in new:
            if e["event"] == "worker_spawned":
                pids[(e["restart"], e["rank"])] = e["worker_pid"]
            elif e["event"] == "step_done":
                best = max(best, e["step"])
                on_step(best)
                due = run.kill_at is not None and not killed and e["restart"] == 0 and e["step"] >= run.kill_at
                if due and (0, run.kill_rank) in pids:
                    EventLog(run.event_log, role="demo").emit(
                        "fault_injected", fault="SIGKILL from outside", rank=run.kill_rank, step=best
                    )
                    os.kill(pids[(0, run.kill_rank)], signal.SIGKILL)
                    killed = True


def _read_new(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    import json

    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return [], offset
    end = chunk.rfind(b"\n") + 1  # leave a half-written last line for the next read
    events = []
    for line in chunk[:end].splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events, offset + end
