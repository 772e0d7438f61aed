"""Durable checkpoints: per-rank shards, fsync'd, committed by a manifest written last."""

from stalwart.checkpoint.manager import Checkpointer, Restored

__all__ = ["Checkpointer", "Restored"]
