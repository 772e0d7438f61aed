"""A persist request and its reply: what the training side (manager.py, background.py) asks of its persister.

It crosses a process boundary as one JSON line, so every field is a JSON value; it is built in one place
(`Checkpointer.save`) and read as attributes everywhere else. The persister process imports no torch, and
neither does this module.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_FAILOVER_S = 20.0
"""How long a save tries the checkpoint directory before it writes to the first mirror instead: longer than a
store's usual blips, short enough that a `checkpoint_every` of minutes loses no checkpoint to an outage."""


@dataclass(kw_only=True, slots=True)
class PersistRequest:
    step: int
    token: str
    """Names this attempt's files: `<run token>-<attempt>`."""
    rank: int
    world_size: int
    coordinator: bool
    """Rank 0: waits for every rank's meta file and commits the manifest."""
    keep_last: int
    url: str
    options: dict[str, Any] | None
    """fsspec storage options."""
    staging: dict[str, Any]
    """The staging memory to read the tensors from (Staging.spec(): memfd, size, the trainer's pid)."""
    base: int | None
    """The full checkpoint a delta refers to; None for a full checkpoint."""
    snapshot_mono: float
    """CLOCK_MONOTONIC when the snapshot started: the persist deadline counts from here."""
    deadline_s: float
    faults: dict[str, Any] | None = None
    """Faults for this save (checkpoint/save/save_hooks.py); None in production."""
    wait: bool = False
    """The trainer waits for this save (a run's last): retention runs before the reply."""
    mirrors: list[dict[str, Any]] = field(default_factory=list)
    """Where rank 0's persister copies the checkpoint once committed ({"url", "options"}; save/mirroring.py), and
    where a full checkpoint is written instead when the checkpoint directory does not answer (save/failover.py)."""
    failover_s: float = DEFAULT_FAILOVER_S
    """How long a full checkpoint's writes try a location before the next one (save/failover.py)."""
    durable_in: str = "one"
    """"all": rank 0 reports the save committed only once every location has it (save/mirroring.py)."""
    skeleton: str = ""
    """The state's non-tensor structure, torch.save'd and base64-encoded (filled after the stall)."""
    tensors: list[dict[str, Any]] = field(default_factory=list)
    """id, offset, nbytes, dtype, shape of each tensor in staging (filled after the stall)."""

    def to_json(self) -> str:
        return json.dumps({"op": "persist", **asdict(self)})

    @classmethod
    def from_json(cls, msg: dict[str, Any]) -> PersistRequest:
        return cls(**{k: v for k, v in msg.items() if k != "op"})


@dataclass(kw_only=True, slots=True)
class PersistReply:
    """The persister's answer to one request (one JSON line back), or the training side's own verdict when the
    persister died or the request could not be sent."""

    step: int
    ok: bool
    """This rank's shard was written."""
    committed: bool | None = None
    """Rank 0: the manifest was written (the checkpoint is visible); None on other ranks."""
    full: bool = False
    """A full checkpoint (a later delta may refer to it), not a delta."""
    written_bytes: int = 0
    seconds: float = 0.0
    location: str = ""
    """Rank 0: the mirror the checkpoint was committed in instead of the checkpoint directory (save/failover.py);
    empty when it was committed there."""

    @classmethod
    def failed(cls, step: int) -> PersistReply:
        return cls(step=step, ok=False, committed=False)

    def to_json(self) -> str:
        return json.dumps({"op": "done", **asdict(self)})

    @classmethod
    def from_json(cls, msg: dict[str, Any]) -> PersistReply | None:
        """The reply in a message from the persister; None for any other message."""
        if msg.get("op") != "done":
            return None
        return cls(**{k: v for k, v in msg.items() if k != "op"})
