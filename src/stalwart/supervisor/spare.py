"""A hot spare: a worker process started ahead of need, with torch imported, waiting to become a rank.

`python -m stalwart.supervisor.spare` is started by the agent (supervisor/spares.py). At the lowest CPU
priority, so that it slows no training, it imports torch and stalwart's training-side modules, builds and steps
a throwaway optimizer (torch 2.13 imports torch._dynamo on the first optimizer step, about 1.3 s here), writes
"ready" on the file descriptor named in STALWART_SPARE_FD, and blocks on stdin. The activation is one JSON line:
the worker's argv (torchrun's `python -u script ...` or `python -u -m module ...`) and environment. The spare
then becomes that worker in place: same pid, the agent's stdout and stderr, the script run as `__main__`. An
uncaught exception goes through `sys.excepthook`, as in a plain interpreter, so stalwart's one-line error
handling and exit codes apply unchanged.

The spare dies with the agent (parent-death signal), and exits quietly if stdin closes before an activation.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import runpy
import signal
import sys
import threading
from typing import Any

SPARE_FD_ENV = "STALWART_SPARE_FD"
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _warm_up() -> None:
    """Import what a training script imports first, and pay torch's lazy first-use costs now."""
    import torch
    import torch.distributed
    import torch.nn.parallel

    import stalwart
    import stalwart.job.job  # noqa: F401

    param = torch.nn.Parameter(torch.zeros(2))
    optim = torch.optim.AdamW([param], lr=0.1)
    param.grad = torch.ones(2)
    optim.step()


def _become(msg: dict[str, Any]) -> None:
    """Turn this process into the worker described by `msg` and run it; never returns."""
    os.environ.clear()
    os.environ.update(msg["env"])
    argv: list[str] = list(msg["argv"])
    if "OMP_NUM_THREADS" in os.environ and os.environ["OMP_NUM_THREADS"].isdigit():
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if argv and argv[0] == "-u":  # torchrun's unbuffered flag
        argv = argv[1:]
        sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]
        sys.stderr.reconfigure(write_through=True)  # type: ignore[union-attr]
    try:
        if argv[:1] == ["-m"]:
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit:
        raise
    except BaseException:
        sys.excepthook(*sys.exc_info())
        sys.exit(1)
    sys.exit(0)


def _warm_up_politely() -> None:
    """Warm up on a thread at the lowest CPU priority (nice 19 applies to that thread only), so a spare being
    prepared takes CPU from nobody; the main thread, which later runs the worker, keeps normal priority.
    Lowering a thread's priority needs no privilege; raising it back would, hence the thread."""
    failure: list[BaseException] = []

    def run() -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            _warm_up()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name="spare-warm-up")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


def main() -> None:
    _die_with_parent()
    _warm_up_politely()
    fd = int(os.environ.pop(SPARE_FD_ENV, "-1"))
    if fd >= 0:
        os.write(fd, b"ready\n")
        os.close(fd)
    line = sys.stdin.readline()
    if not line:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the worker's stdin is not the agent's pipe
    os.close(devnull)
    _become(json.loads(line))


if __name__ == "__main__":
    main()
