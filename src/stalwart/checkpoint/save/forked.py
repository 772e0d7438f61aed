"""Persisters forked from a small server of this process's, the forker, so that each one costs a fork instead of a
new interpreter.

A persister started as `python -m stalwart.checkpoint.save.persister` (background.py) spends about 0.2 s of CPU
importing what it uses, once per job, per rank and per restart, while the job's first steps want the same cores: in
the test suite, 313 of them were 70 s of its 1,240 s of CPU (2-core VM, 2026-11-30). So each process that starts
persisters keeps one forker: a single-threaded process that has imported the persister and forks one per request.

- A worker host (supervisor/worker_host.py) has imported all of that already, and before it runs the script it is a
  single thread, the one moment a fork of it is safe: it forks its forker there (`prefork`).
- Any other process (a script run without `stalwart run`, or a survivor's host after its forker died) starts one as
  an interpreter at its first persister (`python -m stalwart.checkpoint.save.forked`) and keeps it for the next.

A persister keeps the properties of the one started as an interpreter: a process of its own (no GIL shared with
training), the lowest CPU priority, the job's environment and working directory (sent with each request), and
none of the worker's file descriptors (its pipes are passed over the forker's socket; everything else is closed in
the forker: it must not hold a connection that tells a peer its worker is alive, issue 42). It is dead with its
worker: its stdin closes, and the forker, which learns of the worker's end as its socket's end (or, forked ahead,
from a parent-death signal), kills it. Anything a fork does not need of the host's memory is shared
copy-on-write and never written, so it costs pages only for what the persister itself allocates.

Protocol on the forker's socket (SOCK_SEQPACKET, one JSON object per packet): this process sends {"id", "log",
"env", "cwd"} with three passed descriptors: the persister's stdin and stdout, and this process's stderr of the
moment (a Popen's child would inherit it); the forker answers {"started": pid} (or {"error": text}) with the
request's "id" and, when a persister ends, {"exit": pid, "code": exit code as Popen gives it}.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO, Any

from stalwart.checkpoint.save import persister
from stalwart.runtime.process import (
    Forked,
    close_descriptors,
    die_with_parent,
    end_fork,
    name_process,
    process_state,
    python_signal_handlers,
    single_threaded,
)

NAME = b"stalwart-persist"
"""A persister's short name (`ps -o comm`, top), which otherwise would be its host's."""
FORKER_NAME = b"stalwart-forker"
PACKET = 1 << 20
"""The largest packet read: a request carries the job's environment."""
START_TIMEOUT_S = 30.0
"""How long a request waits for the forker's answer before the persister is started as an interpreter instead."""


class ForkedPersister(Forked):
    """A persister forked by this process's forker, as background.py uses a `subprocess.Popen`: its pipes, and its
    exit code as the forker reports it (it is the forker's child, not this process's)."""

    def __init__(self, pid: int, stdin: IO[str], stdout: IO[str], forker: Forker) -> None:
        super().__init__(pid, stdin, stdout)
        self._forker = forker

    def poll(self) -> int | None:
        with self._lock:  # the code is told once: two threads waiting on one persister must both see it
            if self.returncode is None:
                self.returncode = self._forker.exit_code(self.pid)
            return self.returncode


class Forker:
    """This process's handle on its forker: its socket, the process, and the answers read from it."""

    def __init__(self, sock: int, proc: Forked) -> None:
        self._sock = sock  # a descriptor, not a socket object: one left open at exit is no ResourceWarning
        self.proc = proc
        self.owner = os.getpid()
        self._requests = threading.Lock()  # one request at a time
        self._io = threading.Lock()  # one reader of the socket at a time
        self._started: list[dict[str, Any]] = []
        self._exits: dict[int, int] = {}
        self._gone = False
        self._asked = 0  # the id of the newest request: an answer to an older one (it timed out) is passed over

    def alive(self) -> bool:
        return not self._gone and self.proc.poll() is None

    def start(self, log: dict[str, Any]) -> ForkedPersister | None:
        """A new persister for a job whose event log is `log` (its path and common fields), with this process's
        environment and working directory; None if the forker cannot start one (then: an interpreter)."""
        with self._requests:
            if not self.alive():
                return None
            requests_r, requests_w = os.pipe()
            replies_r, replies_w = os.pipe()
            stdin = os.fdopen(requests_w, "w", encoding="utf-8", buffering=1)
            stdout = os.fdopen(replies_r, "r", encoding="utf-8")
            self._asked += 1
            request = {"id": self._asked, "log": log, "env": dict(os.environ), "cwd": os.getcwd()}
            try:
                with _socket(self._sock) as sock:
                    socket.send_fds(sock, [json.dumps(request).encode()], [requests_r, replies_w, 2])
            except OSError:
                self._gone = True
            finally:
                os.close(requests_r)
                os.close(replies_w)
            answer = self._answer() if not self._gone else None
            if answer is None or "started" not in answer:
                for stream in (stdin, stdout):
                    with contextlib.suppress(OSError):
                        stream.close()
                return None
            return ForkedPersister(int(answer["started"]), stdin, stdout, self)

    def exit_code(self, pid: int) -> int | None:
        """The persister `pid`'s exit code once the forker reported it (or -SIGKILL once the forker is gone: its
        persisters die with it), else None."""
        with self._io:
            while self._read(0.0):
                pass
            if pid in self._exits:
                return self._exits.pop(pid)
            if process_state(pid) not in ("?", "Z"):
                return None
            if self._gone or self.proc.poll() is not None:  # its persisters die with it
                return -signal.SIGKILL
            if process_state(pid) == "?":  # reaped: its notice is on its way
                self._read(0.5)
                return self._exits.pop(pid, None)
            return None

    def _answer(self) -> dict[str, Any] | None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            with self._io:
                while self._started:
                    answer = self._started.pop(0)
                    if answer.get("id") == self._asked:
                        return answer
                if not self._read(0.1) and (self._gone or self.proc.poll() is not None):
                    return None
        return None

    def _read(self, timeout: float) -> bool:
        """Read one packet if one comes within `timeout` and file it; whether one was read."""
        if self._gone:
            return False
        waiting = select.poll()  # not select.select: this process's descriptors may number over 1,024
        waiting.register(self._sock, select.POLLIN)
        try:
            if not waiting.poll(int(timeout * 1000)):
                return False
            with _socket(self._sock) as sock:
                data = sock.recv(PACKET)
        except OSError:
            data = b""
        if not data:
            self._gone = True
            return False
        msg = json.loads(data)
        if "exit" in msg:
            self._exits[int(msg["exit"])] = int(msg["code"])
        else:
            self._started.append(msg)
        return True


_forker: Forker | None = None
SOCKET_FD = 3
"""The forker's socket in a forker started as an interpreter."""
_making = threading.Lock()


def prefork() -> bool:
    """Fork this process's forker now, if this process runs a single thread (runtime/process.py) and has none;
    returns whether one was forked."""
    global _forker
    if _current() is not None or not single_threaded():
        return False
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:  # the child: never returns
        ours.close()
        end_fork(lambda: _forker_main(theirs, ahead=True))
    theirs.close()
    _forker = Forker(ours.detach(), Forked(pid))
    return True


def claim(log: dict[str, Any]) -> ForkedPersister | None:
    """A persister for a job whose event log is `log`, forked by this process's forker (started as an interpreter
    first if this process has none); None if none can be forked (then the caller starts an interpreter)."""
    forker = _current() or _start_forker()
    return forker.start(log) if forker is not None else None


def _current() -> Forker | None:
    """This process's forker if it has one that runs (a process forked from this one, a DataLoader worker, has
    its parent's socket but not its forker)."""
    forker = _forker
    if forker is None or forker.owner != os.getpid() or not forker.alive():
        return None
    return forker


def _start_forker() -> Forker | None:
    global _forker
    with _making:
        if (forker := _current()) is not None:
            return forker
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # posix_spawn rather than subprocess.Popen: a Popen still running when this process exits warns
        # (ResourceWarning), and the forker is meant to live as long as this process. Its socket becomes its fd 3.
        actions: list[tuple[Any, ...]] = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)]
        if theirs.fileno() == SOCKET_FD:
            os.set_inheritable(SOCKET_FD, True)
        else:
            actions.append((os.POSIX_SPAWN_DUP2, theirs.fileno(), SOCKET_FD))
        try:
            argv = [sys.executable, "-m", "stalwart.checkpoint.save.forked"]
            pid = os.posix_spawn(sys.executable, argv, dict(os.environ), file_actions=actions)
        except OSError:
            ours.close()
            return None
        finally:
            theirs.close()
        _forker = Forker(ours.detach(), Forked(pid))
        return _forker


@contextlib.contextmanager
def _socket(fd: int) -> Iterator[socket.socket]:
    """The socket object over descriptor `fd`, for one call; the descriptor stays open."""
    sock = socket.socket(fileno=fd)
    try:
        yield sock
    finally:
        sock.detach()


def _forker_main(sock: socket.socket, *, ahead: bool) -> int:
    """The forker: fork a persister for each request on `sock` until its other end closes (this process's parent
    ended), then kill the persisters still running and end."""
    if ahead:
        # Nothing of the host's is ever collected here: its objects stay as the fork left them (one wrapping a file
        # descriptor closed below must never close the number again once a file of ours reuses it).
        gc.freeze()
        die_with_parent()  # the host's main thread, which lives as long as the host
        python_signal_handlers()  # a new interpreter's handlers, not the host's
    close_descriptors(sock.fileno())
    name_process(FORKER_NAME)
    # Its own priority stays the host's: a job's start waits for its fork (its persisters yield, in _persist).
    children: dict[int, int | None] = {}  # pid: a pidfd that becomes readable when it ends (None where unsupported)
    try:
        while True:
            waits = [sock.fileno(), *(fd for fd in children.values() if fd is not None)]
            timeout = None if all(fd is not None for fd in children.values()) else 1.0
            ready, _, _ = select.select(waits, [], [], timeout)
            _reap(sock, children)
            if sock.fileno() in ready:
                try:
                    data, fds, _, _ = socket.recv_fds(sock, PACKET, 3)
                except OSError:
                    data, fds = b"", []
                if not data:
                    return 0
                _fork_persister(sock, json.loads(data), fds, children)
    finally:
        for pid in children:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _fork_persister(
    sock: socket.socket, start: dict[str, Any], fds: list[int], children: dict[int, int | None]
) -> None:
    try:
        pid = os.fork()
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"error": str(exc), "id": start.get("id")}).encode())
        return
    if pid == 0:  # the persister: never returns
        end_fork(lambda: _persist(start, fds))
    for fd in fds:
        os.close(fd)
    pidfd: int | None = None
    with contextlib.suppress(AttributeError, OSError):
        pidfd = os.pidfd_open(pid)
    children[pid] = pidfd
    sock.send(json.dumps({"started": pid, "id": start.get("id")}).encode())


def _reap(sock: socket.socket, children: dict[int, int | None]) -> None:
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if not done:
            continue
        pidfd = children.pop(pid)
        if pidfd is not None:
            os.close(pidfd)
        with contextlib.suppress(OSError):
            sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _persist(start: dict[str, Any], fds: list[int]) -> int:
    """In a forked persister: take its descriptors (`fds`: stdin, stdout, and the requester's stderr of the moment),
    the job's environment and directory, then serve."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    close_descriptors()
    die_with_parent()
    name_process(NAME)
    persister.yield_cpu()
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 (the process's own stream)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(start["env"])
    os.chdir(start["cwd"])
    persister.serve(start["log"])
    sys.stdout.flush()
    return 0


def main() -> None:
    """The forker started as a new interpreter by a process that had none (`claim`)."""
    _forker_main(socket.socket(fileno=SOCKET_FD), ahead=False)


if __name__ == "__main__":
    main()
