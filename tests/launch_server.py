"""A launch server for the tests: one process per test process that has imported `stalwart run`'s launcher (torch)
and the training side once, and forks each `stalwart run` the tests start (conftest.Launch).

Why: a `stalwart run` started as a new interpreter spends about 4.6 s of CPU importing torch (the launcher) and the
training side (its zygote) before it does anything (torch 2.13.0 on the 2-core VM, 2026-11-28), and the suite
starts a few hundred of them on two cores. A fork of this server starts with both imported, as the launcher's own
zygote does for its workers (supervisor/zygote.py), and then runs exactly what `python -m stalwart run ...` runs:
the same `main`, its own environment, working directory, output file and session, and the interpreter's normal
exit (atexit handlers, thread joins). What differs from a new interpreter: the imported modules come from the
server's start (no module of stalwart reads the environment when imported), and the Python RNGs are seeded anew.
The real entry point (`python -m stalwart run`) keeps its own tests: everything started through `spawn` or
`subprocess` (the leftovers, the demo, Slurm, the import tests) and every launch with a prefix (network namespaces).

The tests' other `python -m stalwart <command>` calls (conftest.stalwart) are forked the same way: a command's
result does not depend on how its interpreter started, and the ones whose subject is the start itself (the import
tests, the leftovers, `stalwart run` under Slurm, the demo) keep new interpreters.

Protocol over the server's stdin and stdout, one JSON object per line: a request {"argv", "env", "cwd", "out", "err"}
is answered {"pid"}; each child's end is sent as {"exit": pid, "code": returncode as Popen gives it}. The server
ends when its stdin closes (the test process is gone) or when the test process dies (a parent-death signal); its
children, the launchers, then get SIGTERM from their own parent-death signal, as `spawn` arms it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1


class ServedProcess:
    """The part of `subprocess.Popen`'s interface the tests use, for a launcher forked by the server."""

    def __init__(self, server: LaunchServer, pid: int, args: list[str]) -> None:
        self._server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        code = self._server.wait_exit(self.pid, deadline)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.returncode = code
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never a signal to a PID that may have been reused
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class LaunchServer:
    """The test process's side: starts the server, sends requests, collects the children's exit codes."""

    def __init__(self, env: dict[str, str]) -> None:
        from stalwart.runtime.process import spawn

        self._proc = spawn(
            [sys.executable, "-u", __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            death_signal=signal.SIGKILL,
        )
        self._lock = threading.Condition()
        self._starting = threading.Lock()
        self._pids: list[int] = []
        self._codes: dict[int, int] = {}
        self._gone = False
        threading.Thread(target=self._read, name="launch-server-reader", daemon=True).start()

    def start(
        self, argv: list[str], env: dict[str, str], cwd: Path, out: Path, err: Path | None = None
    ) -> ServedProcess:
        """Fork `stalwart <argv>` with `env`, in `cwd`, its stdout to `out` and its stderr to `err` (or `out`),
        each created or truncated."""
        files = {"out": str(out), "err": str(err or out)}
        request = json.dumps({"argv": argv, "env": env, "cwd": str(cwd), **files}) + "\n"
        with self._starting, self._lock:  # one request at a time: the answers come in the requests' order
            assert self._proc.stdin is not None
            self._proc.stdin.write(request.encode())
            self._proc.stdin.flush()
            while not self._pids and not self._gone:
                self._lock.wait(1.0)
            if self._gone:
                raise RuntimeError("the tests' launch server ended")
            pid = self._pids.pop(0)
        return ServedProcess(self, pid, ["stalwart", *argv])

    def exit_code(self, pid: int) -> int | None:
        with self._lock:
            return self._codes.get(pid)

    def wait_exit(self, pid: int, deadline: float | None) -> int | None:
        with self._lock:
            while pid not in self._codes and not self._gone:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._lock.wait(left)
            return self._codes.get(pid, -signal.SIGKILL)

    def close(self) -> None:
        """End the server (its stdin closes) and reap it; launchers still running get SIGTERM from their own
        parent-death signal."""
        with contextlib.suppress(OSError):
            assert self._proc.stdin is not None
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def alive(self) -> bool:
        return not self._gone and self._proc.poll() is None

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            message = json.loads(line)
            with self._lock:
                if "pid" in message:
                    self._pids.append(message["pid"])
                else:
                    self._codes[message["exit"]] = message["code"]
                self._lock.notify_all()
        self._proc.stdout.close()
        with self._lock:
            self._gone = True
            self._lock.notify_all()


def _serve() -> dict[str, Any] | None:
    """The server's loop: fork on each request, report each child's end. Returns the request in a child (which
    then runs `stalwart` as its main program), None when the test process is gone."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    pending = b""
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([0], [], [], 0.02)
        if readable:
            data = os.read(0, 1 << 16)
            if not data:
                return None
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    return request
                children.add(pid)
                os.write(1, (json.dumps({"pid": pid}) + "\n").encode())
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                os.write(1, (json.dumps({"exit": pid, "code": code}) + "\n").encode())


def _become(request: dict[str, Any], server: int) -> list[str]:
    """In a forked child: take the request's environment, directory, output and session, as `spawn` would give a
    new `python -m stalwart` process; returns its arguments."""
    import random

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != server:
        os._exit(1)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = (
        out
        if request["err"] == request["out"]
        else os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    )
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in {out, err, null}:
        os.close(fd)
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    import stalwart

    sys.argv = [str(Path(stalwart.__file__).with_name("__main__.py")), *request["argv"]]  # as `python -m` sets it
    sys.path[0] = request["cwd"]
    return list(request["argv"])


if __name__ == "__main__":
    # Imported once here; every fork has them. What `stalwart run` imports, and its zygote after it.
    from stalwart.cli import main
    from stalwart.supervisor import cli as _run_cli  # noqa: F401
    from stalwart.supervisor.worker_host import import_training_side

    import_training_side()
    # Out of the collector's sight, as the launcher freezes what it imported before it forks its zygote: otherwise
    # each fork's first full collection walks torch's objects and writes to every page it shares with the server.
    import gc

    gc.collect()
    gc.freeze()
    server = os.getpid()
    request = _serve()
    if request is None:
        sys.exit(0)
    sys.exit(main(_become(request, server)))
