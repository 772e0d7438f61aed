"""A launch server: one process that has imported `stalwart run`'s launcher and the training side once, and forks
each `stalwart run` asked of it.

Why: a `stalwart run` started as a new interpreter spends 4-6 s of CPU importing torch (the launcher) and the
training side (its zygote) before it does anything (torch 2.13.0 on the 2-core VM, 2026-11-29). A tool that
starts many of them one after another, `stalwart chaos` (a reference run, a faulted run, a relaunch after each
node fault; the quick suite about twenty), pays that each time, on the machine its jobs train on. A fork of this
server starts with both imported, as the launcher's own zygote does for its workers (supervisor/zygote.py), and
then runs exactly what `python -m stalwart run ...` runs: the same `main`, its own environment, working
directory, output file and, when asked, its own session, and the interpreter's normal exit (atexit handlers,
thread joins). What differs from a new interpreter: the imported modules come from the server's start (no module
of stalwart reads the environment when imported; fault injection is plugged in when a seam is first asked, by
then from the child's environment), and the Python RNGs are seeded anew.

The tests use the same server for every `stalwart` command they start (tests/launch_server.py): a command's
result does not depend on how its interpreter started.

Protocol over the server's stdin and stdout, one JSON object per line: a request {"argv", "env", "cwd", "out",
"err", "append", "session"} (and "netns", a network namespace to enter, for a host of `stalwart chaos`'s
two-node scenarios or the tests') is answered {"pid"}; each child's end is sent as {"exit": pid, "code": returncode as
Popen gives it}. The server ends when its stdin closes (its client is gone) or when its client dies (a
parent-death signal); its children, the launchers, then get SIGTERM from their own parent-death signal.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from stalwart.runtime.process import (
    Forked,
    close_descriptors,
    die_with_parent,
    end_fork,
    python_signal_handlers,
    run_as_main,
    single_threaded,
    spawn,
)

MODULE = "stalwart.supervisor.launch_server"


class ServedProcess:
    """The part of `subprocess.Popen`'s interface its users need, for a process the server forked."""

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
    """The client's side: starts the server (`command`, by default this module's), sends requests, collects the
    children's exit codes."""

    def __init__(self, env: dict[str, str], command: list[str] | None = None) -> None:
        self._proc: subprocess.Popen[bytes] | Forked = (command is None and _fork_server(env)) or spawn(
            command or [sys.executable, "-u", "-m", MODULE],
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
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: Path,
        out: Path,
        err: Path | None = None,
        *,
        append: bool = False,
        session: bool = False,
        netns: str | None = None,
    ) -> ServedProcess:
        """Fork `stalwart <argv>` with `env`, in `cwd`, its stdout to `out` and its stderr to `err` (or `out`),
        each created, and truncated unless `append`; in a new session if `session` (as Popen's
        start_new_session); in the named network namespace if `netns` (as under `ip netns exec NAME`). Raises
        RuntimeError if the server has ended."""
        files = {"out": str(out), "err": str(err or out)}
        request = {"argv": argv, "env": env, "cwd": str(cwd), **files, "append": append, "session": session}
        if netns is not None:
            request["netns"] = netns
        with self._starting, self._lock:  # one request at a time: the answers come in the requests' order
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write((json.dumps(request) + "\n").encode())
                self._proc.stdin.flush()
            except OSError as exc:
                raise RuntimeError("the launch server ended") from exc
            while not self._pids and not self._gone:
                self._lock.wait(1.0)
            if self._gone:
                raise RuntimeError("the launch server ended")
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


def _fork_server(env: dict[str, str]) -> Forked | None:
    """The server as a fork of this process where it runs one thread, else None (then: a new interpreter). A tool
    that starts one (`stalwart chaos`, `stalwart demo`) has imported much of what the server imports; a new
    interpreter spent 5-7 s of CPU importing it again (2-core VM, 2026-11-30: the test suite started 7). The fork
    starts as the interpreter would: the pipes as its stdin and stdout, no other descriptor of this process's,
    `env` as its environment, Python's signal handlers and no atexit handler of this process's."""
    if not single_threaded():
        return None
    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    for stream in (sys.stdout, sys.stderr):  # nothing of ours written twice
        with contextlib.suppress(Exception):
            stream.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the server: never returns
        end_fork(lambda: _serve_forked(requests_r, replies_w, parent, env))
    os.close(requests_r)
    os.close(replies_w)
    return Forked(pid, os.fdopen(requests_w, "wb"), os.fdopen(replies_r, "rb"))


def _serve_forked(requests: int, replies: int, parent: int, env: dict[str, str]) -> int:
    """In the forked server: become what `python -u -m stalwart.supervisor.launch_server` is, then serve."""
    os.dup2(requests, 0)
    os.dup2(replies, 1)
    close_descriptors()
    die_with_parent(signal.SIGKILL, parent=parent)
    python_signal_handlers()
    os.environ.clear()
    os.environ.update(env)
    atexit._clear()
    # As `python -u`: text streams over the descriptors, written through (the server's own writes to its stdout go
    # through os.write; a launcher it forks writes to the output it was given).
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 (the process's own stream)
    for name, fd in (("stdout", 1), ("stderr", 2)):
        setattr(sys, name, open(fd, "w", encoding="utf-8", buffering=1, closefd=False))  # noqa: SIM115
        getattr(sys, name).reconfigure(write_through=True)
    from stalwart.supervisor import cli  # noqa: F401 - imported once, before the forks

    return main(_run_only)


def started(current: LaunchServer | None, env: dict[str, str], command: list[str] | None = None) -> LaunchServer:
    """`current` while it runs, else a new server (`LaunchServer(env, command)`) closed at this process's exit."""
    if current is not None and current.alive():
        return current
    server = LaunchServer(env, command)
    atexit.register(server.close)
    return server


def prepare() -> int:
    """In the server, before `serve`: what is imported stays for the process's life, out of the collector's
    sight (as the launcher freezes what it imported before it forks its zygote), so that a fork's first full
    collection neither walks torch's objects nor writes to every page it shares with the server. Its pid."""
    gc.collect()
    gc.freeze()
    return os.getpid()


def serve() -> dict[str, Any] | None:
    """The server's loop: fork on each request, report each child's end. Returns the request in a child (which
    then runs `stalwart` as its main program, after `become`), None when the client is gone."""
    die_with_parent(signal.SIGKILL)
    pending = b""
    children: set[int] = set()
    # Woken by a request or a child's end (SIGCHLD through a wake-up pipe), not every 20 ms: polling took 0.4% of a
    # core idle (2-core VM, 2026-11-30), more with each child it looked at, for the server's life; the tests run
    # four. The timeout is a safety net.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        readable, _, _ = select.select([0, wake_r], [], [], 1.0)
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        if 0 in readable:
            data = os.read(0, 1 << 16)
            if not data:
                return None
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:  # the child's signals as a new interpreter's
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.close(wake_r)
                    os.close(wake_w)
                    return dict(request)
                children.add(pid)
                os.write(1, (json.dumps({"pid": pid}) + "\n").encode())
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                os.write(1, (json.dumps({"exit": pid, "code": code}) + "\n").encode())


def become(request: dict[str, Any], server: int) -> list[str]:
    """In a forked child: take the request's environment, directory, output and session, as `spawn` would give a
    new `python -m stalwart` process; returns its arguments."""
    import random

    die_with_parent(signal.SIGTERM, parent=server)
    if request.get("session"):
        os.setsid()
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    mode = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request.get("append") else os.O_TRUNC)
    out = os.open(request["out"], mode, 0o644)
    err = out if request["err"] == request["out"] else os.open(request["err"], mode, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in {out, err, null}:
        os.close(fd)
    if request.get("netns"):
        _enter_netns(request["netns"])
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    import stalwart

    sys.argv = [str(Path(stalwart.__file__).with_name("__main__.py")), *request["argv"]]  # as `python -m` sets it
    sys.path[0] = request["cwd"]
    return list(request["argv"])


NETNS_EXEC = ("ip", "netns", "exec")
"""The prefix that runs a command in a named network namespace (iproute2's), as chaos/netns.py's hosts do."""


def split_netns(cmd: Sequence[str]) -> tuple[str | None, list[str]]:
    """`ip netns exec NAME COMMAND...` -> (NAME, COMMAND); any other command -> (None, the command): a launch
    under that prefix is forked into the namespace (`start(netns=NAME)`) instead of run by `ip`."""
    if tuple(cmd[:3]) == NETNS_EXEC and len(cmd) > 4:
        return cmd[3], list(cmd[4:])
    return None, list(cmd)


def _enter_netns(name: str) -> None:
    """Move this process into the network namespace `ip netns add NAME` made (setns(2), as `ip netns exec` does;
    its other step, a private /sys, matters to no part of stalwart: interfaces are looked up by netlink)."""
    import ctypes

    for directory in ("/run/netns", "/var/run/netns"):
        with contextlib.suppress(FileNotFoundError):
            fd = os.open(f"{directory}/{name}", os.O_RDONLY | os.O_CLOEXEC)
            break
    else:
        raise OSError(f"no network namespace {name!r} (ip netns add {name})")
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"cannot enter network namespace {name!r}")
    finally:
        os.close(fd)


_CLONE_NEWNET = 0x40000000


def main(run: Callable[[list[str]], int]) -> int:
    """The server's program: import, serve; in each forked child, `run` the request's arguments. The server's exit
    status. Call it from a program's top level only (`sys.exit(main(...))`). A child ends here, as the interpreter
    ends a program (non-daemon threads joined, atexit run, the standard streams flushed) but without the
    interpreter's finalization, as a forked worker ends (runtime/process.run_as_main): in a fork of this server
    it walked every module torch left, writing to pages the fork shares with the server, 0.5 s of CPU a command
    against 0.02 s (2-core VM, 2026-11-30), paid by each launcher and CLI command the server forks."""
    from stalwart.supervisor.worker_host import import_training_side

    import_training_side()
    _import_the_launchers_side()
    server = prepare()
    request = serve()
    if request is None:
        return 0
    argv = become(request, server)
    os._exit(run_as_main(lambda: sys.exit(run(argv))))


def _import_the_launchers_side() -> None:
    """What `stalwart run` imports only once it runs (so that a bad flag is answered without torch): imported here
    once, not in each fork (0.07 s of CPU each, 2-core VM, 2026-11-30)."""
    import multiprocessing.synchronize  # noqa: F401 - torch elastic's process contexts

    import torch.distributed.elastic.agent.server.api
    import torch.distributed.run  # noqa: F401

    from stalwart.supervisor import agent, launcher  # noqa: F401


def _run_only(argv: list[str]) -> int:
    """`stalwart run` only (the commands above the supervisor are not this layer's to import)."""
    from stalwart.supervisor import cli

    if argv[:1] != ["run"]:
        sys.stderr.write(f"stalwart: error: this launch server runs `stalwart run` only, not {argv[:1]}\n")
        return 2
    return cli.main(argv[1:])


if __name__ == "__main__":
    from stalwart.supervisor import cli as _cli  # noqa: F401 - imported once, before the forks

    sys.exit(main(_run_only))
