"""What the agent (host_pool.py) and a worker host (worker_host.py) say to each other, typed.

Two pipes per host. The agent writes one `Activation` per line on the host's stdin: become this worker. The host
writes `HostStatus` lines on a status pipe (its descriptor in STALWART_HOST_FD): READY once a hot spare has
warmed up, REARMED when its worker left a failed group and waits for the next activation, PARKED when a warm
spare's run of the script reached its training loop and waits to be given a rank (recovery/warm_spare.py).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass


class HostStatus(enum.Enum):
    READY = "ready"
    """A hot spare imported torch and stepped an optimizer: activating it costs no Python start-up."""
    REARMED = "rearmed"
    """The worker's run ended because a peer failed; the process waits to be activated again (L1)."""
    PARKED = "parked"
    """A warm spare ran the script's set-up and waits at `job.steps()` for a rank's activation."""

    def encode(self) -> bytes:
        return self.value.encode() + b"\n"

    @classmethod
    def decode(cls, line: bytes) -> HostStatus | None:
        """The status a line says; None for a line this version does not know."""
        try:
            return cls(line.decode().strip())
        except (UnicodeDecodeError, ValueError):
            return None


@dataclass(frozen=True, slots=True)
class Activation:
    """Become the worker: torchrun's worker argv (`-u script ...` or `-u -m module ...`) and environment."""

    argv: list[str]
    env: dict[str, str]

    def encode(self) -> bytes:
        return (json.dumps({"argv": self.argv, "env": self.env}) + "\n").encode()

    @classmethod
    def decode(cls, line: str) -> Activation:
        msg = json.loads(line)
        return cls(argv=[str(a) for a in msg["argv"]], env={str(k): str(v) for k, v in msg["env"].items()})
