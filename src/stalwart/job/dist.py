"""Where this process stands in the job, and the few collectives stalwart itself needs.

The same script runs as a single process, under `stalwart run` and under plain `torchrun`: everything is read
from torchrun's environment variables. stalwart's own coordination (checkpoint commit, resume agreement) uses a
separate gloo group so it works next to NCCL training and never interleaves with the user's collectives.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from stalwart.errors import ConfigError

RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"


@dataclass(frozen=True, slots=True)
class Placement:
    """This process's coordinates, as torchrun's environment variables give them."""

    rank: int
    world_size: int
    local_rank: int
    restart_count: int

    @classmethod
    def from_env(cls) -> Placement:
        try:
            rank = int(os.environ.get("RANK", "0"))
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            restart_count = int(os.environ.get(RESTART_COUNT_ENV, "0"))
        except ValueError as exc:
            raise ConfigError(f"malformed launcher environment variable: {exc}") from exc
        if not 0 <= rank < world_size:
            raise ConfigError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
        return cls(rank=rank, world_size=world_size, local_rank=local_rank, restart_count=restart_count)


class Comm:
    """Barrier, gather and broadcast of small integers over stalwart's own gloo group."""

    def __init__(self, placement: Placement, timeout: timedelta) -> None:
        self.rank = placement.rank
        self.world_size = placement.world_size
        self._group: dist.ProcessGroup | None = None
        if self.world_size > 1:
            # A second group costs one store round-trip at start; it keeps checkpoint traffic off NCCL.
            self._group = dist.new_group(backend="gloo", timeout=timeout)

    def close(self) -> None:
        """Destroy stalwart's group; a gloo group left alive at interpreter exit can abort the process."""
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._group = None

    def forget(self) -> None:
        """Drop the group without destroying it: after a peer's failure it is aborted with every other group."""
        self._group = None

    def barrier(self) -> None:
        if self._group is not None:
            dist.barrier(group=self._group)

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's list of int64 values, indexed by rank (lists must have equal length)."""
        if self._group is None:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self._group)
        return [t.tolist() for t in out]

    def broadcast_ints(self, values: list[int]) -> list[int]:
        """Rank 0's list of int64 values (any length), on every rank."""
        if self._group is None:
            return list(values)
        n = self.broadcast_int(len(values))
        t = torch.tensor(values if self.rank == 0 else [0] * n, dtype=torch.int64)
        dist.broadcast(t, src=0, group=self._group)
        return [int(v) for v in t.tolist()]

    def broadcast_tensor(self, tensor: torch.Tensor, src: int) -> None:
        """Rank `src`'s contents of `tensor` (same shape and dtype everywhere), in place on every rank."""
        if self._group is not None:
            dist.broadcast(tensor, src=src, group=self._group)

    def broadcast_int(self, value: int) -> int:
        """Rank 0's value, on every rank."""
        if self._group is None:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(t, src=0, group=self._group)
        return int(t.item())


def init_process_group(placement: Placement, timeout: timedelta) -> bool:
    """Join the default process group when launched with several ranks; returns whether this call did it.

    The backend is NCCL when CUDA is available and gloo otherwise; a group the user created first is kept.
    """
    if placement.world_size == 1 or dist.is_initialized():
        return False
    if torch.cuda.is_available():
        torch.cuda.set_device(placement.local_rank % torch.cuda.device_count())
        backend = "cuda:nccl,cpu:gloo"
    else:
        backend = "gloo"
    dist.init_process_group(backend=backend, timeout=timeout)
    return True
