"""Sample order as a pure function of (seed, epoch, position), independent of the world size.

An epoch is a permutation of the dataset's indices drawn from a generator seeded by (seed, epoch) alone. The
epoch is cut into global batches of `global_batch_size`; rank r of w takes the r-th contiguous slice of each. A
position is therefore global (epoch, batch), and resuming at any world size continues at the next unseen sample.
"""

from __future__ import annotations

import torch

from stalwart.errors import ConfigError

_EPOCH_MIX = 0x9E3779B97F4A7C15  # golden-ratio increment: neighbouring epochs get unrelated streams


def epoch_permutation(num_samples: int, seed: int, epoch: int, *, shuffle: bool = True) -> torch.Tensor:
    if not shuffle:
        return torch.arange(num_samples)
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + epoch * _EPOCH_MIX) % (2**63))
    return torch.randperm(num_samples, generator=g)


def batch_seed(seed: int, epoch: int, batch: int) -> int:
    """Seed of the RNGs a DataLoader worker uses while fetching one global batch (see loader.py)."""
    return (seed * 1_000_003 + epoch * _EPOCH_MIX + batch * 0xBF58476D1CE4E5B9) % (2**32)


def batches_per_epoch(num_samples: int, global_batch_size: int) -> int:
    """Whole global batches per epoch; the last `num_samples % global_batch_size` indices of each epoch's
    permutation are not used that epoch (a new permutation each epoch spreads which ones)."""
    return num_samples // global_batch_size


def local_slice(global_batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per_rank = len(global_batch) // world_size
    return global_batch[rank * per_rank : (rank + 1) * per_rank]


def check_sizes(num_samples: int, global_batch_size: int, world_size: int) -> None:
    if global_batch_size <= 0:
        raise ConfigError(f"global_batch_size must be positive, got {global_batch_size}")
    if global_batch_size % world_size:
        raise ConfigError(
            f"global_batch_size={global_batch_size} does not divide among {world_size} ranks; "
            "choose a multiple of the world size"
        )
    if num_samples < global_batch_size:
        raise ConfigError(f"the dataset has {num_samples} samples, fewer than one global batch of {global_batch_size}")
