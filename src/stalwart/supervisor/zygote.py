"""The zygote: a fork of the launcher that has imported torch once and forks every worker host from then on.

A worker host started as a new interpreter spends 2-4 s importing torch, torch.distributed, what torch imports at
the first optimizer step (runtime/torch_compat.FIRST_STEP_IMPORTS) and stalwart's training side before it can run a
line of the script: on every start, and on the critical path of every recovery that needs a new process. The
launcher has imported torch already, so at its start, while it still has a single Python thread, it forks once. That
child, the zygote, imports the rest and then only forks: a host forked from it starts in milliseconds, shares the
imported pages with its siblings and runs the script as a fresh interpreter would (supervisor/worker_host.py).

Why a separate process and not forks of the launcher itself: the launcher soon runs threads (the rendezvous
store, torch elastic's monitor, the spare pool), and a fork of a process with threads may inherit a lock some
other thread held. The zygote never starts a Python thread and never touches CUDA, so each fork is clean.

What the agent keeps of a forked host is a `ForkedProcess`: the pid, its stdin pipe and an exit code that the
zygote, which is the host's parent and reaps it, sends back. Lifetimes chain through the kernel's parent-death
signal: the zygote dies with the launcher, a host with the zygote; so SIGKILL of `stalwart run` still leaves
nothing running. Should the zygote die on its own, its hosts die with it (the agent sees failed workers and
restarts them) and hosts are started as new interpreters from then on.

Messages are JSON on an AF_UNIX SOCK_SEQPACKET socket pair (one message per packet); a fork request carries the
host's two pipe ends (its activation stdin, its status pipe) as SCM_RIGHTS descriptors.
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
from typing import IO, Any

from stalwart.runtime.env import ZYGOTE_ENV
from stalwart.runtime.process import Forked, die_with_parent, name_process, process_state
from stalwart.supervisor.preload import Preload, load

REPLY_TIMEOUT_S = 60.0
"""How long the launcher waits for the zygote to fork a host (its first fork waits for its imports) before it
gives up on it and starts hosts as new interpreters."""
UNREPORTED_GRACE_S = 2.0
"""How long a host that ended may go without an exit code from the zygote before it is counted as running again
(a zygote stopped by a signal must not stall the agent for ever)."""
MAX_PACKET = 65536
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def enabled() -> bool:
    """False where forking is unavailable or the user turned it off (STALWART_ZYGOTE=0)."""
    return sys.platform == "linux" and os.environ.get(ZYGOTE_ENV, "1") != "0"


class Zygote:
    """The launcher's handle on its zygote: `fork_host` returns a `ForkedProcess` or None (use a new interpreter)."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self._sock = sock
        self.pid = pid
        self._lock = threading.Lock()
        self._next_id = 0
        self._exits: dict[int, int] = {}
        self._forked: dict[int, int] = {}
        self.alive = True
        """The zygote is there: it reaps its hosts and reports their exit codes."""
        self.forking = True
        """It forks on request; False after it refused, failed or did not answer (new interpreters from then on)."""

    @classmethod
    def start(cls, preload: Preload | None = None) -> Zygote | None:
        """Fork the zygote; call it before the launcher starts any thread. None where that is not possible.
        `preload`: modules it imports for the script too (supervisor/preload.py)."""
        if not enabled() or threading.active_count() != 1:
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for stream in (sys.stdout, sys.stderr):  # what is buffered would otherwise be written twice
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()
        # What the launcher has imported (torch) stays for its life: out of the collector's sight from here on, its
        # full collections no longer walk torch's objects (about 0.2 s each, on and off for the whole run), and the
        # zygote's own collection below walks only what it imports itself instead of writing to every page it
        # shares with the launcher. Together about 1 s of CPU per `stalwart run` (2-core VM, 2026-11-29; benchmarks.md).
        gc.collect()
        gc.freeze()
        launcher = os.getpid()
        pid = os.fork()
        if pid == 0:  # the zygote: never returns
            try:
                ours.close()
                _Serve(theirs, launcher, preload or Preload()).run()
            finally:
                os._exit(0)
        theirs.close()
        return cls(ours, pid)

    # -- the launcher's side ---------------------------------------------------------------------------------------

    def fork_host(self, *, warm: bool) -> tuple[ForkedProcess, int] | None:
        """A new host forked by the zygote and the read end of its status pipe; None if the zygote cannot."""
        if not (self.alive and self.forking):
            return None
        control_r, control_w = os.pipe()
        status_r, status_w = os.pipe()
        try:
            with self._lock:
                self._next_id += 1
                ident = self._next_id
                msg = json.dumps({"op": "fork", "id": ident, "warm": warm}).encode()
                socket.send_fds(self._sock, [msg], [control_r, status_w])
                end = time.monotonic() + REPLY_TIMEOUT_S
                while ident not in self._forked:
                    if not self._receive(max(0.0, end - time.monotonic())):
                        if not self.alive:
                            raise OSError("the zygote is gone")
                        if time.monotonic() >= end:
                            raise TimeoutError("the zygote did not answer")
                pid = self._forked.pop(ident)
                if pid < 0:
                    raise ValueError("the zygote cannot fork safely")
        except (OSError, TimeoutError, ValueError):
            self.forking = False
            for fd in (control_w, status_r):  # ours; the host's ends are closed below
                with contextlib.suppress(OSError):
                    os.close(fd)
            return None
        finally:
            for fd in (control_r, status_w):  # the host's ends; the zygote received its own copies
                with contextlib.suppress(OSError):
                    os.close(fd)
        return ForkedProcess(pid, os.fdopen(control_w, "wb"), self), status_r

    def exit_code(self, pid: int) -> int | None:
        """The host's exit code (negative: the signal that ended it) once the zygote reaped it, else None."""
        with self._lock:
            while self.alive and self._receive(0.0):
                pass
            return self._exits.get(pid)

    def _receive(self, timeout: float) -> bool:
        """Read one message if one comes within `timeout`; False if none did. Call with the lock held."""
        if not self.alive or not select.select([self._sock], [], [], timeout)[0]:
            return False
        data = self._sock.recv(MAX_PACKET)
        if not data:  # the zygote is gone
            self.alive = False
            return False
        msg = json.loads(data)
        if msg.get("op") == "forked":
            pid = int(msg["pid"])
            self._forked[int(msg["id"])] = pid
            self._exits.pop(pid, None)  # a pid the kernel reused: the exit noted under it was an older host's
        elif msg.get("op") == "exit":
            self._exits[int(msg["pid"])] = int(msg["code"])
        return True

    def close(self) -> None:
        """Stop forking; hosts still running end with the zygote (their parent-death signal)."""
        self.alive = self.forking = False
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(ChildProcessError, OSError):
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)


class ForkedProcess(Forked):
    """The part of `subprocess.Popen` the agent uses, for a host whose parent is the zygote: its exit code comes
    from the zygote, which reaps it."""

    POLL_S = 0.005

    def __init__(self, pid: int, stdin: IO[bytes], zygote: Zygote) -> None:
        super().__init__(pid)
        self.stdin: IO[bytes] | None = stdin
        self._zygote = zygote
        self._gone_since: float | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            code = self._zygote.exit_code(self.pid)
            if code is None and not self._zygote.alive and not _exists(self.pid):
                code = -signal.SIGKILL  # it died with the zygote, which can no longer say how
            self.returncode = code
        return self.returncode

    def ended_unreported(self) -> bool:
        """It has ended but the zygote has not yet said how (for at most UNREPORTED_GRACE_S): whoever reads exit
        codes to decide what failed first should look again shortly rather than take it for running."""
        if self.poll() is not None or _exists(self.pid):
            return False
        now = time.monotonic()
        if self._gone_since is None:
            self._gone_since = now
        return now - self._gone_since < UNREPORTED_GRACE_S


def cuda_driver_loaded(maps: str | None = None) -> bool:
    """True if this process has the CUDA driver library mapped (something called into CUDA, even only to count
    devices): a forked child could then not use the GPU. `maps` is /proc/self/maps' text, read when None."""
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            return False
    return any(line.rsplit("/", 1)[-1].startswith("libcuda.so") for line in maps.splitlines())


def _exists(pid: int) -> bool:
    """Running or stopped, not a zombie nor gone (a host whose zygote died is reaped by init)."""
    return process_state(pid) not in ("Z", "?")


# -- the zygote's side -------------------------------------------------------------------------------------------


class _Serve:
    """The zygote's loop: import, then fork hosts on request and report how each one ended."""

    def __init__(self, sock: socket.socket, launcher: int, preload: Preload) -> None:
        self._sock = sock
        self._launcher = launcher
        self._preload = preload
        self._wake_r, self._wake_w = os.pipe()

    def run(self) -> None:
        die_with_parent(signal.SIGKILL, parent=self._launcher)
        for sig in STOP_SIGNALS:  # a terminal's Ctrl-C reaches the launcher's group: the launcher handles it
            signal.signal(sig, signal.SIG_IGN)
        from stalwart.recovery import reform

        reform.ignore_requests()  # until a forked worker's run installs its own handler
        os.set_blocking(self._wake_w, False)
        signal.set_wakeup_fd(self._wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select() through the wake-up pipe
        from stalwart.supervisor.worker_host import import_training_side

        import_training_side()
        single = load(self._preload)  # the script's frameworks: in no host's recovery path from now on
        # Named after the imports: torch 2.4 names the thread that imports it "pt_main_thread". The command line
        # is the launcher's; top and ps -o comm tell them apart.
        name_process(b"stalwart-zygote")
        # What is imported stays for the process's life: out of the collector's sight, a full collection in a
        # host (a re-forming survivor runs one to free its failed run) no longer walks torch's million objects
        # (230 ms), and the collector does not write to pages the hosts share with the zygote.
        gc.collect()
        gc.freeze()
        # A fork of a process that initialised CUDA cannot use the GPU; one of a process with another thread may
        # inherit a lock that thread held (a preloaded module that started one).
        safe = single and not cuda_driver_loaded()
        while True:
            waiting: list[Any] = [self._sock, self._wake_r]
            readable = select.select(waiting, [], [])[0]
            if self._wake_r in readable:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            self._reap()
            if self._sock in readable:
                msg, fds, _flags, _addr = socket.recv_fds(self._sock, MAX_PACKET, 2)
                if not msg:  # the launcher closed its end: it is stopping
                    return
                request = json.loads(msg)
                pid = self._fork(fds, warm=bool(request.get("warm"))) if safe else -1
                for fd in fds:
                    os.close(fd)
                self._send({"op": "forked", "id": request["id"], "pid": pid})

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._send({"op": "exit", "pid": pid, "code": os.waitstatus_to_exitcode(status)})

    def _send(self, msg: dict[str, Any]) -> None:
        try:
            self._sock.send(json.dumps(msg).encode())
        except OSError:
            os._exit(0)  # the launcher is gone; its parent-death signal is on its way

    def _fork(self, fds: list[int], *, warm: bool) -> int:
        control, status = fds
        zygote = os.getpid()
        pid = os.fork()
        if pid != 0:
            return pid
        code = 1
        try:
            self._become_host(zygote)
            from stalwart.supervisor.worker_host import run_forked

            code = run_forked(control, status, warm=warm)
        finally:
            os._exit(code)

    def _become_host(self, zygote: int) -> None:
        """Undo what is the zygote's own in a forked child: its session, signals, socket and random state."""
        os.setsid()  # as torch elastic starts workers: a signal to the group reaches the host's children
        name_process(os.path.basename(sys.executable).encode())  # as an interpreter started for it would be
        die_with_parent(signal.SIGKILL, parent=zygote)
        signal.set_wakeup_fd(-1)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._sock.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        # A new interpreter seeds Python's and numpy's global generators from the OS; forks would share a state.
        import random

        random.seed()
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            with contextlib.suppress(Exception):
                numpy.random.seed()
