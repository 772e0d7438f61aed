"""Process helpers every layer uses: dying with the parent, starting children that die with us, one-line errors.

Why a parent-death signal and not cleanup code: a parent killed with SIGKILL runs no `finally`, no atexit and no
signal handler, so only the kernel can end its children. Linux's PR_SET_PDEATHSIG delivers a chosen signal to
a child when the thread that started it exits; every process stalwart starts (launchers under the demo and the
benchmarks, workers, spares, persisters) arms it, so a stalwart command killed by any signal leaves nothing
running.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import random
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, NoReturn

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def die_with_parent(sig: int = signal.SIGKILL, *, parent: int | None = None) -> bool:
    """Have the kernel send `sig` to this process when its parent dies.

    `parent` is the pid the parent had when this process was started (default: the current parent). If the
    parent already died before the signal was armed, this process exits at once. Returns False where the
    signal cannot be armed (not Linux).
    """
    expected = os.getppid() if parent is None else parent
    if sys.platform != "linux":
        return False
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return False
    if os.getppid() != expected:  # the parent died before the signal was armed
        os._exit(1)
    return True


def name_process(name: bytes) -> None:
    """Set this process's short name (/proc/self/comm, 15 bytes), which top and `ps -o comm` show: a process
    forked without exec (the zygote, a forker of persisters) is told apart from the one it was forked from."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)


def _arm_in_child(sig: int, parent: int) -> Callable[[], None]:
    def arm() -> None:  # runs in the child between fork and exec: no locks, no allocation-heavy work
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return arm


def spawn(cmd: list[str], *, death_signal: int = signal.SIGTERM, **popen: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen(cmd, **popen)` whose child gets `death_signal` when this process dies.

    The default, SIGTERM, lets a launcher child (`stalwart run`, torchrun) stop its own workers and clean up;
    the workers' own parent-death signals catch the rest. Call it from a thread that lives as long as the
    child should (the kernel signals when the starting thread exits, not only the process).
    """
    if sys.platform != "linux":
        return subprocess.Popen(cmd, **popen)
    return subprocess.Popen(cmd, preexec_fn=_arm_in_child(int(death_signal), os.getpid()), **popen)


def python_signal_handlers() -> None:
    """Every signal's handler back to what a new interpreter has: in a fork that is to behave as one (a forker of
    persisters, a launch server), no handler of the process it was forked from runs."""
    for signum in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, TypeError):
            handler = signal.getsignal(signum)
            if callable(handler) and handler is not signal.default_int_handler:
                signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)


def close_descriptors(*keep: int) -> None:
    """Close every descriptor from 3 up but `keep`: in a fork that is to hold nothing of the process it was forked
    from (a connection that tells a peer a dead worker is alive, issue 42)."""
    try:
        limit = int(os.sysconf("SC_OPEN_MAX"))
    except (OSError, ValueError):
        limit = 1 << 16
    low = 3
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, limit)


def single_threaded() -> bool:
    """Whether this process runs one thread, native ones included (OpenMP's pool, gloo's, a library's): the one
    state in which a fork copies no lock that another thread holds. False where that cannot be told (not Linux)."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


class Forked:
    """A child forked from this process, handled as a `subprocess.Popen`: `pid`, `returncode`, `poll`, `wait`
    (raising subprocess.TimeoutExpired), `kill`, and the pipes to its stdin and from its stdout if it was given
    them (a forked launch server's, a forked persister's)."""

    POLL_S = 0.01
    """How often `wait` looks: no thread of this process is left blocked in waitpid."""

    def __init__(self, pid: int, stdin: IO[Any] | None = None, stdout: IO[Any] | None = None) -> None:
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        """Its exit code as Popen gives it if it has ended (reaped here), else None."""
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped by someone else: its code is lost
                    pid, status = self.pid, 0
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for it to end, looking every POLL_S."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"process {self.pid}", timeout or 0.0)
            time.sleep(self.POLL_S)
        return code

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, signal.SIGKILL)


def fork_module(
    module: str,
    args: list[str],
    *,
    env: dict[str, str],
    out: Path,
    err: Path | None = None,
    cwd: Path | None = None,
    death_signal: int = signal.SIGKILL,
) -> Forked | None:
    """`python -m MODULE ARGS...` with `env`, its stdout to `out` and its stderr to `err` (or `out`), as a fork of
    this process instead of a new interpreter: for a tool that starts workers importing what it has imported
    already (torch: 3-6 s of CPU each on the 2-core VM). None where this process runs more than one thread (a
    fork would copy their locks in whatever state they are): the caller then starts an interpreter. The child
    dies with this process (SIGKILL), starts with the atexit handlers of its own only, and exits as an
    interpreter would (its non-daemon threads joined, atexit run, streams flushed). `cwd`: where it runs (this
    process's directory by default); `death_signal`: what it gets when this process dies (SIGTERM lets a launcher
    stop its own workers). Its signal handlers are Python's defaults, not this process's."""
    if not single_threaded():
        return None
    for stream in (sys.stdout, sys.stderr):  # nothing of ours written twice
        with contextlib.suppress(Exception):
            stream.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return Forked(pid)

    def child() -> int:
        die_with_parent(death_signal, parent=parent)
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if cwd is not None:
            os.chdir(cwd)
        mode = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        fds = [os.open(os.devnull, os.O_RDONLY), os.open(out, mode, 0o644)]
        fds.append(fds[1] if err is None or err == out else os.open(err, mode, 0o644))
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        atexit._clear()
        random.seed()
        sys.argv = [module, *args]
        return _run_module(module)

    end_fork(child, flush=True)


def end_fork(body: Callable[[], int], *, flush: bool = False) -> NoReturn:
    """In a forked child: run `body`, print what escapes it, and end the process with its status (1 if it raised),
    never returning into the frames the fork copied. `flush`: the standard streams first (a child that writes
    through Python's streams; one that must not write a buffer it copied from its parent leaves them)."""
    code = 1
    try:
        code = body()
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        if flush:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(BaseException):
                    stream.flush()
        os._exit(code)


def start_module(
    module: str,
    args: list[str],
    *,
    env: dict[str, str],
    out: Path,
    err: Path | None = None,
    cwd: Path | None = None,
    death_signal: int = signal.SIGKILL,
) -> Forked | subprocess.Popen[bytes]:
    """`python -m MODULE ARGS...` as `fork_module` starts it where this process is one thread, else as a new
    interpreter with the same environment, output files, directory and death signal: for a tool whose children
    would otherwise each import torch again (the benches)."""
    forked = fork_module(module, args, env=env, out=out, err=err, cwd=cwd, death_signal=death_signal)
    if forked is not None:
        return forked
    with contextlib.ExitStack() as files:
        stdout = files.enter_context(open(out, "wb"))
        stderr: Any = subprocess.STDOUT if err is None or err == out else files.enter_context(open(err, "wb"))
        cmd = [sys.executable, "-m", module, *args]
        return spawn(cmd, stdout=stdout, stderr=stderr, env=env, cwd=cwd, death_signal=death_signal)


def _run_module(module: str) -> int:
    """Run `module` as __main__ and exit as an interpreter would; its exit status."""
    return run_as_main(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))


def run_as_main(main: Callable[[], object]) -> int:
    """Run `main` in a forked process as an interpreter runs its program: SystemExit's argument or an uncaught
    exception (printed) becomes the exit status, then the interpreter's exit (non-daemon threads joined, atexit
    run, the standard streams flushed). The caller ends the process with the status (os._exit)."""
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exit_status(exc.code)
    except BaseException as exc:  # as the interpreter reports it: through sys.excepthook (a script's own, stalwart's)
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = 1
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    return code


def exit_status(code: object) -> int:
    """sys.exit's argument as the interpreter turns it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(BaseException):
        print(code, file=sys.stderr)
    return 1


def say(line: str) -> None:
    """One line to the process's own stderr, flushed: what a worker or the agent tells the person watching. The
    real stream, since torch's init_process_group may have swapped sys.stderr for a buffer it prints later."""
    stream = sys.__stderr__ or sys.stderr
    stream.write(line + "\n")
    stream.flush()


def first_line(exc: BaseException, *, with_type: bool = False) -> str:
    """The first line of an exception's message (its type's name if it has none), for one-line reports."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    line = text.splitlines()[0]
    return f"{type(exc).__name__}: {line}" if with_type else line


def process_state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat ('R', 'S', 'D', 'T' stopped, 't' traced, 'Z'...), '?' when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def cpu_seconds(pid: int) -> float | None:
    """The CPU time (user and system, all its threads) a process has used so far, from /proc/<pid>/stat; None when
    it is gone or this is not Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def memory_mb(pid: int | None = None) -> dict[str, float] | None:
    """A process's resident memory (`rss_mb`) and the part of it no other process shares (`private_mb`: a fork's
    pages it wrote or allocated itself; the rest it shares with the process it was forked from), from
    /proc/<pid>/smaps_rollup, in MB; None where that cannot be read (not Linux, before Linux 4.14). This process by
    default."""
    fields: dict[str, float] = {}
    try:
        with open(f"/proc/{'self' if pid is None else pid}/smaps_rollup") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("Rss", "Private_Clean", "Private_Dirty"):
                    fields[name] = int(rest.split()[0]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    if "Rss" not in fields:
        return None
    return {"rss_mb": fields["Rss"], "private_mb": fields.get("Private_Clean", 0.0) + fields.get("Private_Dirty", 0.0)}


def stopped(pid: int) -> bool:
    """Stopped by a signal (SIGSTOP, SIGTSTP): it cannot act on SIGTERM, or anything else, until continued. A
    process stopped by a debugger ('t') is not counted: someone is looking at it."""
    return process_state(pid) == "T"
