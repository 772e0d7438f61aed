"""A dead worker that the failed round's result did not name (a survivor's "peer lost" came first) is reported as
failed once the next round started (supervisor/late_failures.py); survivors are not. The race itself, end to end:
tests/test_resume.py's kills, where rank 0's SIGKILL was once reported only through rank 1's "peer lost"."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from stalwart.supervisor import late_failures
from stalwart.telemetry.events import EventLog, read_events


class _Reaped:
    """The zygote's side that the report reads: the exit code of each host it reaped (None: not reaped)."""

    def __init__(self, codes: dict[int, int]) -> None:
        self.codes = codes

    def exit_code(self, pid: int) -> int | None:
        return self.codes.get(pid)


def test_replaced_workers_are_reported_with_their_signal_and_survivors_are_not(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    events = EventLog(log, role="agent")
    unreported = {0: (0, 100, 0), 2: (2, 102, 0), 3: (3, 103, 0)}  # rank -> (local rank, pid, restart)
    zygote = cast(Any, _Reaped({100: -9, 102: 1}))
    late_failures.report(events, zygote, unreported, kept={103})
    failed = [e for e in read_events(log) if e["event"] == "worker_failed"]
    assert [(e["rank"], e["worker_pid"], e["exitcode"], e["signal"], e["late"]) for e in failed] == [
        (0, 100, -9, "SIGKILL", True),
        (2, 102, 1, None, True),
    ]
    assert all(e["restart"] == 0 for e in failed), "the round that failed, not the new one"


def test_without_a_zygote_the_exit_code_is_unknown(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    late_failures.report(EventLog(log, role="agent"), None, {1: (1, 200, 2)}, kept=set())
    (failed,) = [e for e in read_events(log) if e["event"] == "worker_failed"]
    assert (failed["rank"], failed["exitcode"], failed["signal"], failed["restart"]) == (1, None, None, 2)
