"""A preemption notice before the SIGTERM: clouds announce a spot or preemptible VM's end through their metadata
service (GCE: `.../instance/preempted` says TRUE, about 30 s ahead; AWS: `.../spot/instance-action` stops being
404, two minutes ahead). `stalwart run --preempt-notice SOURCE` polls such a source and, at the first notice,
does what SIGTERM does: the workers take a last durable checkpoint at a step they agree on and exit, and the
launcher exits 143 ("preempted"); the next launch resumes there.

Sources:
- `http://...` or `https://...`: a notice when the URL answers 200 with a body other than empty or FALSE
  (GCE answers FALSE until it is preempted, AWS 404); sent with GCE's `Metadata-Flavor: Google` header, which
  other services ignore. A URL that cannot be reached is not a notice (and is said once).
- `file:PATH`: a notice when PATH exists (a node agent or a test writes it).

The watch is a daemon thread of the launcher; the workers pay nothing.
"""

from __future__ import annotations

import os
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from stalwart.errors import ConfigError
from stalwart.runtime.env import PREEMPT_POLL_ENV as POLL_ENV

POLL_S = 5.0
"""Seconds between two polls, unless STALWART_PREEMPT_POLL_S says otherwise (tests make it short)."""


def check_source(source: str) -> str:
    """`source` if it is one this module reads; one clear error otherwise."""
    if source.startswith(("http://", "https://")) or (source.startswith("file:") and len(source) > len("file:")):
        return source
    raise ConfigError(f"--preempt-notice must be an http(s):// URL or file:PATH, got {source!r}")


class NoticeWatch:
    """Polls a notice source until it gives notice (once) or is stopped."""

    def __init__(self, source: str, on_notice: Callable[[str], object], say: Callable[[str], None]) -> None:
        self.source = check_source(source)
        self._on_notice = on_notice
        self._say = say
        self._stop = threading.Event()
        self._poll_s = float(os.environ.get(POLL_ENV, POLL_S))
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="stalwart-preempt-notice", daemon=True)

    def start(self) -> NoticeWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            detail = self.poll()
            if detail is not None:
                self._on_notice(detail)
                return

    def poll(self) -> str | None:
        """What the source says when it gives notice; None when it does not (yet)."""
        if self.source.startswith("file:"):
            path = Path(self.source.removeprefix("file:"))
            return f"{path} exists" if path.exists() else None
        request = urllib.request.Request(self.source, headers={"Metadata-Flavor": "Google"})
        try:
            with urllib.request.urlopen(request, timeout=2.0) as answer:
                body = answer.read(4096).decode("utf-8", "replace").strip()
        except urllib.error.HTTPError:
            return None  # AWS: 404 until the instance is scheduled to stop
        except (OSError, ValueError) as exc:
            if not self._warned:
                self._warned = True
                self._say(f"preemption notice source {self.source} cannot be read ({exc}); still watching")
            return None
        if not body or body.upper() == "FALSE":
            return None
        return f"{self.source} answered {body[:200]!r}"
