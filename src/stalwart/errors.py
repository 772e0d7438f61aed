"""The one exception tree of stalwart.

    StalwartError
     ├── ConfigError            bad flags, paths or settings: the user must change something
     │    └── PeerError              another rank found the problem and reported it (printed there, once)
     ├── NumericError           training diverged: update after update skipped for non-finite gradients
     ├── ReplicaDivergenceError  data-parallel replicas differ and no majority says which is right
 ├── BenchError             a benchmark's measurement could not be taken (a run failed or timed out)
 ├── PeerGone               a peer of a barrier outside the process groups ended or never came (re-formed)
     └── CheckpointError        a checkpoint cannot be written or used
          ├── CheckpointCorruptError   a shard is missing, truncated or fails its checksum
          │    └── NoValidCheckpointError  checkpoints exist but none verifies (never a silent fresh start)
          ├── CheckpointMismatchError  the checkpoint does not fit this job (shape, world size, format)
          └── UnsavableStateError      a state_dict holds values a checkpoint cannot carry safely

User errors (ConfigError, CheckpointMismatchError, NoValidCheckpointError, UnsavableStateError), NumericError and
ReplicaDivergenceError are not retried by `stalwart run`: a worker that dies of one exits with EXIT_USER_ERROR
and the launcher stops instead of burning its restarts on the same mistake.
"""

from __future__ import annotations

EXIT_USER_ERROR = 78
"""Exit status of a worker or command that failed on bad input (sysexits' EX_CONFIG)."""

EXIT_EVICTED = 76
"""Exit status of a worker that left on purpose as a persistent straggler (JobConfig.straggler_policy="evict"):
the launcher replaces it like a dead one and reports why."""

EXIT_PEER_LOST = 75
"""Exit status of a worker whose collective failed because a peer died (sysexits' EX_TEMPFAIL): a consequence
of another failure, which the launcher reports as such."""


class StalwartError(Exception):
    """Base of every error stalwart raises on purpose."""


class ConfigError(StalwartError, ValueError):
    """A flag, path or setting is wrong; the message says what to change."""


class PeerError(ConfigError):
    """Another rank (rank 0) found a user error and printed it; this rank exits quietly with the same status."""


class NumericError(StalwartError, RuntimeError):
    """Training diverged: the numeric guard skipped the update of several steps in a row (detect/numeric.py).
    A restart would meet the same state, so `stalwart run` stops instead of retrying. `quiet`: every rank met
    the same gradients (replicated optimizers) and rank 0 prints the line, so this rank exits without one."""

    def __init__(self, message: str, *, quiet: bool = False) -> None:
        super().__init__(message)
        self.quiet = quiet


class ReplicaDivergenceError(StalwartError, RuntimeError):
    """The data-parallel replicas' state differs and no majority can say which is right (detect/divergence.py):
    a restart from memory would carry the corruption on, so `stalwart run` stops, unless the job can roll back to
    a state from at or before `last_agreed` (recovery/rollback.py). `quiet` as NumericError's."""

    def __init__(self, message: str, *, quiet: bool = False, last_agreed: int | None = None) -> None:
        super().__init__(message)
        self.quiet = quiet
        self.last_agreed = last_agreed


class PeerGone(StalwartError, RuntimeError):
    """A peer of a barrier outside the process groups (runtime/local_barrier.py) ended or never came: the
    counterpart of a collective's connection error, and handled the same way (re-forming)."""


class BenchError(StalwartError, RuntimeError):
    """A measurement of `stalwart bench` could not be taken: a system's run crashed, timed out, or did not commit
    a checkpoint; the message is the one line the command prints."""


class CheckpointError(StalwartError):
    """A checkpoint cannot be written or used."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's shard is missing, truncated or fails its checksum."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint is valid but does not fit this job (model shape, world size, foreign format)."""


class NoValidCheckpointError(CheckpointCorruptError):
    """Committed checkpoints exist but none verifies; starting from step 0 instead would silently lose the run."""


class UnsavableStateError(CheckpointError, ValueError):
    """A tracked object's state_dict holds a value that `weights_only` loading would refuse."""


def is_user_error(exc: BaseException) -> bool:
    """True for errors that a restart cannot fix."""
    return isinstance(
        exc,
        ConfigError
        | CheckpointMismatchError
        | NoValidCheckpointError
        | UnsavableStateError
        | NumericError
        | ReplicaDivergenceError,
    )
