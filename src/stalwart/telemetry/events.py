"""The event log: one JSON object per line, written by the launcher and by every worker.

Each event carries wall-clock (`time`, seconds since the epoch) and monotonic (`mono`, CLOCK_MONOTONIC, which
is shared by all processes of one host) timestamps, so intervals such as kill-to-next-step can be measured
across processes. Lines are appended with one `write()` on an O_APPEND descriptor, which keeps lines from
different processes whole on a local filesystem.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stalwart.runtime.env import EVENT_LOG_ENV as EVENT_LOG_ENV


class EventLog:
    """Appends events to a JSONL file; a log without a path drops them (a job run without a launcher)."""

    def __init__(self, path: str | os.PathLike[str] | None, **common: Any) -> None:
        self.path = Path(path) if path else None
        self._common = {"host": socket.gethostname(), **common}
        self._fd: int | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    @classmethod
    def from_env(cls, **common: Any) -> EventLog:
        """The log named by STALWART_EVENT_LOG, tagged with the launcher's run id when there is one."""
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        return cls(os.environ.get(EVENT_LOG_ENV) or None, **({"run_id": run_id} if run_id else {}), **common)

    @property
    def common(self) -> dict[str, Any]:
        """The fields every event of this log carries (host, rank, run id...)."""
        return dict(self._common)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Write one event and return it. Never raises: a full disk must not stop training."""
        record = {"event": event, "time": time.time(), "mono": time.monotonic(), "pid": os.getpid()}
        record.update(self._common)
        record.update(fields)
        if self._fd is not None:
            line = (json.dumps(record, default=str) + "\n").encode()
            with contextlib.suppress(OSError):
                os.write(self._fd, line)
        return record

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_events(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield the events of a log, skipping a torn last line (a writer killed mid-write)."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        return
