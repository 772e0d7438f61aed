"""A persister forked ahead of need by a worker host, so that a job's persister costs a fork instead of a new
interpreter.

A persister started as `python -m stalwart.checkpoint.save.persister` (background.py) spends about 0.15-0.2 s of
CPU importing what it uses, once per rank and per restart, while the job's first steps want the same cores: in
the test suite, 800 of them were a tenth of all its CPU (2-core VM, 2026-11-29). A worker host (supervisor/
worker_host.py) has imported all of that already, and before it runs the script it is a single thread, the one
moment a fork of it is safe. So it forks one child there (`prefork`), which waits on a pipe; the job's first
persister takes it (`claim`) by sending the environment and working directory the job has then, and the child
becomes that persister. It keeps the properties of the one started as an interpreter: a process of its own (no
GIL shared with training), the lowest CPU priority, dead with its worker (a parent-death signal, and its stdin
closing), and none of the worker's file descriptors (all closed in the child: it must not hold a connection that
tells a peer its worker is alive, issue 42). Anything the child does not need of the host's memory is shared
copy-on-write and never written, so it costs pages only for what the persister itself allocates.

Only the first persister of a host is forked: a later one (after a persister died, or in a survivor's next run)
is started as an interpreter, since by then the host runs the script's threads and a fork would copy their locks
in whatever state they are.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import sys
import traceback
from typing import IO, Any

from stalwart.checkpoint.save import persister
from stalwart.runtime.process import Forked, die_with_parent, name_process, single_threaded

NAME = b"stalwart-persist"
"""The forked child's short name (`ps -o comm`, top), which otherwise would be its host's."""


class ForkedPersister(Forked):
    """A forked persister as background.py uses a `subprocess.Popen`: its pipes besides `Forked`'s."""

    def __init__(self, pid: int, stdin: IO[str], stdout: IO[str]) -> None:
        super().__init__(pid)
        self.stdin = stdin
        self.stdout = stdout


_ahead: ForkedPersister | None = None
_forker = 0  # the pid of the process that forked `_ahead`: a fork of that process (a DataLoader worker) has no claim


def prefork() -> bool:
    """Fork a persister that waits to be claimed, if this process runs a single thread (runtime/process.py);
    returns whether one was forked."""
    global _ahead, _forker
    if _ahead is not None or not single_threaded():
        return False
    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.dup2(requests_r, 0)
            os.dup2(replies_w, 1)
            code = _child()
        except BaseException:
            with contextlib.suppress(BaseException):
                traceback.print_exc()
        finally:
            os._exit(code)
    os.close(requests_r)
    os.close(replies_w)
    stdin = os.fdopen(requests_w, "w", encoding="utf-8", buffering=1)
    stdout = os.fdopen(replies_r, "r", encoding="utf-8")
    for stream in (stdin, stdout):
        os.set_inheritable(stream.fileno(), False)
    _ahead, _forker = ForkedPersister(pid, stdin, stdout), os.getpid()
    return True


def claim(log: dict[str, Any]) -> ForkedPersister | None:
    """The persister forked ahead, now running for a job whose event log is `log` (its path and common fields)
    with this process's environment and working directory; None if there is none to take (this process forked
    none, it was taken, or it has ended)."""
    global _ahead
    ahead, _ahead = _ahead, None
    if ahead is None or _forker != os.getpid():
        return None
    if ahead.poll() is not None:
        _close(ahead)
        return None
    start = {"log": log, "env": dict(os.environ), "cwd": os.getcwd()}
    try:
        ahead.stdin.write(json.dumps(start) + "\n")
        ahead.stdin.flush()
    except (OSError, ValueError):
        ahead.kill()
        ahead.wait()
        _close(ahead)
        return None
    return ahead


def _close(ahead: ForkedPersister) -> None:
    for stream in (ahead.stdin, ahead.stdout):
        with contextlib.suppress(OSError, ValueError):
            stream.close()


def _child() -> int:
    """In the forked child: become a process of its own, wait for the claim, then serve as the persister."""
    # Nothing of the host's is ever collected here: its objects stay as the fork left them (one wrapping a file
    # descriptor closed below must never close the number again once a file of the persister's reuses it).
    gc.freeze()
    os.closerange(3, _fd_limit())
    name_process(NAME)
    die_with_parent()
    persister.yield_cpu()
    for signum in signal.valid_signals():  # a new interpreter's handlers, not the host's
        with contextlib.suppress(OSError, ValueError, TypeError):
            handler = signal.getsignal(signum)
            if callable(handler) and handler is not signal.default_int_handler:
                signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 (the process's own stream)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    line = sys.stdin.readline()
    if not line:  # never claimed: the host ended
        return 0
    start = json.loads(line)
    os.environ.clear()
    os.environ.update(start["env"])
    os.chdir(start["cwd"])
    persister.serve(start["log"])
    sys.stdout.flush()
    return 0


def _fd_limit() -> int:
    try:
        return int(os.sysconf("SC_OPEN_MAX"))
    except (OSError, ValueError):
        return 1 << 16
