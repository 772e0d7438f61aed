"""Workers that died but were not in the failure the agent acted on, reported once the next round has started.

A survivor's "peer lost" (supervisor/host_protocol.py) can reach the agent before the zygote has reaped the worker
that died: the round fails on what the agent saw first, and torch elastic's result names only the survivors. The
agent replaces the dead worker all the same (it is not among the kept hosts), and reports it here, in the next
round, when its exit code is known: so the event log (and `stalwart report`, the metrics) names every worker that
failed, with the signal that ended it, and the recovery waits for none of this."""

from __future__ import annotations

import signal

from stalwart.supervisor.zygote import Zygote
from stalwart.telemetry.events import EventLog


def signal_name(exitcode: int) -> str | None:
    """'SIGKILL' for -9 (a death by signal, as multiprocessing reports it), else None."""
    if exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def report(
    events: EventLog, zygote: Zygote | None, unreported: dict[int, tuple[int, int, int]], kept: set[int]
) -> None:
    """`unreported`: global rank -> (local rank, pid, restart) of the workers the failed round's result did not
    name; `kept`: the pids that go on in the new round (survivors). Each other one failed: an event for it."""
    for rank, (local_rank, pid, restart) in sorted(unreported.items()):
        if pid in kept:
            continue
        code = zygote.exit_code(pid) if zygote is not None else None
        events.emit(
            "worker_failed",
            rank=rank,
            local_rank=local_rank,
            worker_pid=pid,
            exitcode=code,
            signal=signal_name(code) if code is not None else None,
            hung=False,
            restart=restart,
            late=True,
        )
