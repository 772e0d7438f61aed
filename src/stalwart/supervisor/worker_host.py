"""A worker host: the process a worker runs in under `stalwart run`, which outlives one run of the script.

A host is normally forked from the zygote (supervisor/zygote.py, then `run_forked`), which imported the
training side once; without a zygote, `python -m stalwart.supervisor.worker_host` is started by the agent
(supervisor/host_pool.py). Either way it starts in one of two ways:
- as a hot spare (STALWART_HOST_WARM=1): at the lowest CPU priority, so that it slows no training, it imports
  torch and stalwart's training-side modules, builds and steps a throwaway optimizer (torch imports more at the
  first optimizer step: runtime/torch_compat.FIRST_STEP_IMPORTS) and reports READY on its status pipe
  (host_protocol.py);
- cold, for a worker that must start now and has no spare: it goes straight to its activation.

An activation is one JSON line on stdin: the worker's argv (torchrun's `python -u script ...` or
`python -u -m module ...`) and environment. The host becomes that worker in place: the agent's stdout and
stderr, the script run as `__main__`. An uncaught exception goes through `sys.excepthook`, as in a plain
interpreter, so stalwart's one-line error handling and exit codes apply unchanged.

With STALWART_REFORM=1 (recovery/reform.py) a run that ends because a peer failed does not end the process:
the host abandons the run's Jobs and process groups, reports REARMED on its status pipe and waits for the
next activation, which the agent sends after the next round of the rendezvous. Any other ending, or the agent
closing the pipe, ends the process as before.

The host dies with the agent (parent-death signal), and exits quietly if stdin closes before an activation.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import sys
import threading
from typing import IO, Any

from stalwart.recovery import reform, script_group, warm_spare
from stalwart.recovery.in_loop import survivor
from stalwart.runtime.env import HOST_STATUS_FD_ENV as STATUS_FD_ENV
from stalwart.runtime.env import HOST_WARM_ENV as WARM_ENV
from stalwart.runtime.process import die_with_parent, run_as_main, say
from stalwart.supervisor import preload, stack_dump
from stalwart.supervisor.host_protocol import Activation, HostStatus


def import_training_side() -> None:
    """Import what a training script imports first (the zygote does this once for every host it forks)."""
    import importlib

    import torch
    import torch.distributed
    import torch.nn.parallel  # noqa: F401

    import stalwart
    import stalwart.job.job  # noqa: F401
    from stalwart.runtime.torch_compat import FIRST_STEP_IMPORTS

    for name in FIRST_STEP_IMPORTS:  # a large part of the first optimizer step otherwise
        importlib.import_module(name)
    from stalwart.runtime.torch_compat_process import skip_operator_deregistration_at_exit

    skip_operator_deregistration_at_exit()  # in every process forked from here: its exit is cheaper


def _warm_up() -> None:
    """Import what a training script imports first, and pay torch's lazy first-use costs now."""
    import torch

    import_training_side()
    param = torch.nn.Parameter(torch.zeros(2))
    optim = torch.optim.AdamW([param], lr=0.1)
    param.grad = torch.ones(2)
    optim.step()


def _warm_up_politely() -> None:
    """Warm up on a thread at the lowest CPU priority (nice 19 applies to that thread only), so a spare being
    prepared takes CPU from nobody; the main thread, which later runs the worker, keeps normal priority.
    Lowering a thread's priority needs no privilege; raising it back would, hence the thread."""
    failure: list[BaseException] = []

    def run() -> None:
        tid = threading.get_native_id()
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        try:
            _warm_up()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name="spare-warm-up")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


def _apply(activation: Activation) -> list[str]:
    """Take the activation's environment; returns the argv without torchrun's interpreter flags."""
    os.environ.clear()
    os.environ.update(activation.env)
    preload.settle()  # what the zygote's imports read of an environment without a rank
    argv = list(activation.argv)
    if "OMP_NUM_THREADS" in os.environ and os.environ["OMP_NUM_THREADS"].isdigit():
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if argv and argv[0] == "-u":  # torchrun's unbuffered flag
        argv = argv[1:]
        sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]
        sys.stderr.reconfigure(write_through=True)  # type: ignore[union-attr]
    return argv


def _run_script(argv: list[str]) -> None:
    if argv[:1] == ["-m"]:
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


class _Baseline:
    """What a run of the script may change in the process and the next run must not inherit: the working
    directory, sys.excepthook (torch and stalwart wrap it), the standard streams, sys.path, the signal
    handlers and torch's grad mode. Module globals of imported modules are not reset (nothing is imported again,
    by design).

    Grad mode: the request to re-form arrives as an exception raised between any two bytecodes, and one raised
    inside `torch.no_grad().__enter__` after it turned grad mode off skips the `__exit__` that would turn it back
    on. The next run then computed a loss without a graph ("element 0 of tensors does not require grad", an FSDP2
    survivor in the suite at 23b36fe, once in a full run). A fresh interpreter starts with it on."""

    def __init__(self) -> None:
        self.cwd = os.getcwd()
        self.excepthook = sys.excepthook
        self.streams = (sys.stdout, sys.stderr)
        self.path = list(sys.path)
        self.handlers: dict[int, Any] = {}
        for signum in signal.valid_signals():
            with contextlib.suppress(OSError, ValueError):
                self.handlers[signum] = signal.getsignal(signum)

    def restore(self) -> None:
        with contextlib.suppress(OSError):
            os.chdir(self.cwd)
        sys.excepthook = self.excepthook
        sys.stdout, sys.stderr = self.streams
        sys.path[:] = self.path
        for signum, handler in self.handlers.items():
            if signum == reform.REFORM_SIGNAL or handler is None:
                continue
            with contextlib.suppress(OSError, ValueError, TypeError):
                signal.signal(signum, handler)
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_grad_enabled(True)


def _serve(control: IO[str], status: int) -> None:
    """Run activations until one ends for another reason than a peer's failure; never returns."""
    from stalwart.errors import EXIT_PEER_LOST

    ran = False
    baseline = _Baseline()
    while True:
        line = control.readline()
        if not line:  # a spare never used, or a re-armed worker the agent no longer needs
            os._exit(EXIT_PEER_LOST if ran else 0)
        if ran:
            baseline.restore()
        ran = True
        argv = _apply(Activation.decode(line))
        while _run_once(argv, control, status):  # the script again in this round (reform.RunAgainInRound)
            baseline.restore()
        _report_rearmed(status)


def _run_once(argv: list[str], control: IO[str], status: int) -> bool:
    """One run of the script; exits the process unless it ended for a peer's failure. Returns whether to run it
    again at once, in the same round."""
    lost: str | None = None
    again = False
    survivor.offer_rearm((lambda parked: _rearm_in_loop(control, status, parked)) if status >= 0 else None)
    if survivor.in_loop():  # the script's own init_process_group makes the re-formable group
        script_group.adopt()
    if warm_spare.waiting():  # from the script's first line: idle priority, its reads of the rank noted
        warm_spare.set_up_started()
    try:
        with survivor.interruptible():
            _run_script(argv)
    except SystemExit:
        raise
    except BaseException as exc:
        if not (reform.enabled() and status >= 0 and reform.is_reformable(exc)):
            sys.excepthook(type(exc), exc, exc.__traceback__)
            sys.exit(1)
        lost, again = reform.reason(exc), isinstance(exc, reform.RunAgainInRound)
    if lost is None:
        sys.exit(0)
    # Outside the except block, so that the failed run's frames (model, optimizer, buckets) can be freed.
    say(f"stalwart: rank {os.environ.get('RANK', '?')}: {lost}{'' if again else '; re-forming in place'}")
    survivor.abandon()
    return again


def _rearm_in_loop(control: IO[str], status: int, parked: bool) -> None:
    """A survivor that stays in its training loop (recovery/in_loop/) re-arms from inside the script: as a run that
    ended, but the next activation's environment is taken in place and the script goes on. `parked`: a warm spare
    at its loop's start says PARKED instead (recovery/warm_spare.py), and waits alike."""
    from stalwart.errors import EXIT_PEER_LOST

    _report_rearmed(status, HostStatus.PARKED if parked else HostStatus.REARMED)
    line = control.readline()
    if not line:  # the agent no longer needs this worker (the job ends, or its round failed)
        os._exit(EXIT_PEER_LOST)
    _apply(Activation.decode(line))  # its argv is the script already running


def _report_rearmed(status: int, said: HostStatus = HostStatus.REARMED) -> None:
    """REARMED (or `said`) on the status pipe; an agent that is gone ends the worker."""
    from stalwart.errors import EXIT_PEER_LOST

    try:
        os.write(status, said.encode())
    except OSError:
        os._exit(EXIT_PEER_LOST)


def _host(control_fd: int, status: int, *, warm: bool) -> None:
    """Warm up if a spare, say READY, and serve activations from `control_fd`; never returns."""
    stack_dump.arm()  # before _serve's baseline of signal handlers, which then leaves it alone
    if warm:
        _warm_up_politely()
    if status >= 0:
        os.set_inheritable(status, False)  # the worker's own children (its persister) must not hold it
        if warm:
            os.write(status, HostStatus.READY.encode())
    os.set_inheritable(control_fd, False)
    control = os.fdopen(control_fd, "r", encoding="utf-8")
    # stdin becomes /dev/null, as for any worker.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    # The forker of the job's persisters, forked now while this process is one thread: each persister the script's
    # Jobs start is then a fork instead of a new interpreter (checkpoint/save/forked.py).
    from stalwart.checkpoint.save import forked

    forked.prefork()
    _serve(control, status)


def run_forked(control_fd: int, status: int, *, warm: bool) -> int:
    """A host forked by the zygote (zygote.py): as `main`, and returns the exit code a new interpreter would have
    had. The caller ends the process with it: the zygote's frames below this one must never run on."""
    reform.ignore_requests()
    return run_as_main(lambda: _host(control_fd, status, warm=warm))


def main() -> None:
    die_with_parent()
    reform.ignore_requests()
    warm = os.environ.pop(WARM_ENV, "") == "1"
    status = int(os.environ.pop(STATUS_FD_ENV, "-1"))
    # The agent's pipe moves off stdin.
    _host(os.dup(0), status, warm=warm)


if __name__ == "__main__":
    main()
