"""Fixtures that start real `stalwart run` processes and always reap them, also when a test fails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stalwart.telemetry.events import read_events

TINY = Path(__file__).parent / "scripts" / "train_tiny.py"


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STALWART_", "TORCHELASTIC_", "PET_"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class Launch:
    """One `stalwart run` process with its event log and output."""

    def __init__(self, workdir: Path, args: list[str], env: dict[str, str], prefix: tuple[str, ...] = ()) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.event_log = workdir / "events.jsonl"
        self.output_path = workdir / "output.log"
        cmd = [*prefix, sys.executable, "-m", "stalwart", "run", "--event-log", str(self.event_log), *args]
        self._out = open(self.output_path, "wb")  # noqa: SIM115 (closed in reap)
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, env=env, cwd=workdir)

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [e for e in read_events(self.event_log) if kind is None or e["event"] == kind]

    def worker_pids(self, restart: int | None = None) -> dict[int, int]:
        return {
            e["rank"]: e["worker_pid"]
            for e in self.events("worker_spawned")
            if restart is None or e["restart"] == restart
        }

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"stalwart run did not finish in {timeout} s; output:\n{self.output()[-3000:]}")

    def wait_for(self, predicate: Any, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if self.proc.poll() is not None:
                pytest.fail(
                    f"stalwart run exited ({self.proc.returncode}) while waiting for {what}:\n{self.output()[-3000:]}"
                )
            time.sleep(0.02)
        pytest.fail(f"timed out after {timeout} s waiting for {what}:\n{self.output()[-3000:]}")

    def output(self) -> str:
        return self.output_path.read_text(errors="replace")

    def results(self) -> dict[int, dict[str, Any]]:
        out = {}
        for path in sorted((self.workdir / "out").glob("rank*.json")):
            out[int(path.stem[4:])] = json.loads(path.read_text())
        return out

    def reap(self) -> None:
        """End the launcher and every worker it started that is still alive (only our own PIDs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for e in self.events("worker_spawned"):
            if alive(e["worker_pid"]):
                os.kill(e["worker_pid"], signal.SIGKILL)
        self._out.close()


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Any]:
    started: list[Launch] = []

    def start(
        args: list[str], name: str = "job", env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()
    ) -> Launch:
        job = Launch(tmp_path / name, args, env or child_env(), prefix)
        started.append(job)
        return job

    yield start
    for job in started:
        job.reap()


def tiny_args(*extra: str, nproc: int = 2, max_restarts: int = 3) -> list[str]:
    """`stalwart run` arguments for the tiny job; it writes ckpt/ and out/ in the Launch's directory (its cwd)."""
    return [
        "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
        str(TINY), "--ckpt", "ckpt", "--out", "out", *extra,
    ]  # fmt: skip


_OPEN_CHECKPOINTERS: list[Any] = []


def open_checkpointer(root: Path | str, log: Path | None = None, **options: Any) -> Any:
    """A one-rank Checkpointer (token "t") whose persister is stopped after the test, pass or fail."""
    from datetime import timedelta

    from stalwart.checkpoint import Checkpointer
    from stalwart.job.dist import Comm, Placement
    from stalwart.telemetry.events import EventLog

    comm = Comm(Placement(rank=0, world_size=1, local_rank=0, restart_count=0), timedelta(seconds=30))
    options.setdefault("keep_last", 3)
    ck = Checkpointer(root, comm, EventLog(log), token="t", **options)
    _OPEN_CHECKPOINTERS.append(ck)
    return ck


@pytest.fixture(autouse=True)
def _close_checkpointers() -> Iterator[None]:
    yield
    while _OPEN_CHECKPOINTERS:
        _OPEN_CHECKPOINTERS.pop().close()
