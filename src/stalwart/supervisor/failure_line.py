"""The one line the agent prints when workers fail: the causes first, and the others stopped or re-forming as their
consequence, so that the line names the root cause (supervisor/agent.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from stalwart.errors import EXIT_EVICTED, EXIT_PEER_LOST
from stalwart.runtime.process import process_state
from stalwart.supervisor.late_failures import signal_name


def what_happened(failures: Mapping[int, Any], hung: Mapping[int, str], reform: bool) -> str:
    """`failures` by rank (torch elastic's ProcessFailure: pid, exitcode); `hung`: why the agent killed a rank it
    found hung; `reform`: survivors re-form in place. E.g. "rank 1 (pid 42) killed by SIGKILL (1 other worker
    re-forming in place as a consequence)"."""
    causes, consequences = [], []
    for rank, failure in sorted(failures.items()):
        sig = signal_name(failure.exitcode)
        if sig == "SIGTERM":  # the agent stops the survivors of a failure with SIGTERM
            consequences.append(f"rank {rank} (pid {failure.pid}) stopped")
        elif failure.exitcode == EXIT_PEER_LOST:
            kept = ", re-forms in place" if reform and _alive(failure.pid) else ""
            consequences.append(f"rank {rank} (pid {failure.pid}) lost a peer{kept}")
        elif rank in hung:
            causes.append(f"rank {rank} (pid {failure.pid}) {hung[rank]}, killed")
        elif failure.exitcode == EXIT_EVICTED:
            causes.append(f"rank {rank} (pid {failure.pid}) left as a straggler")
        else:
            how = f"killed by {sig}" if sig else f"exited with status {failure.exitcode}"
            causes.append(f"rank {rank} (pid {failure.pid}) {how}")
    if causes and consequences:
        n = len(consequences)
        how = "re-forming in place" if all(c.endswith("in place") for c in consequences) else "stopped"
        return ", ".join(causes) + f" ({n} other worker{'s' if n > 1 else ''} {how} as a consequence)"
    return ", ".join(causes or consequences) or "workers unhealthy"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return process_state(pid) != "Z"
