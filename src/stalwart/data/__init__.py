"""Resumable, deterministic data: sample order is a pure function of (seed, epoch, position)."""

from stalwart.data.loader import ResumableLoader
from stalwart.data.order import epoch_permutation

__all__ = ["ResumableLoader", "epoch_permutation"]
