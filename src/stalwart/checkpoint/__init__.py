"""Checkpoints: snapshot to staging memory, persist in the background, commit by a manifest written last.

`Checkpointer` is imported on first use: the persister process imports this package without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stalwart.checkpoint.load.rank_state import Restored
    from stalwart.checkpoint.manager import Checkpointer

__all__ = ["Checkpointer", "Restored"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("stalwart.checkpoint.manager"), name)
    raise AttributeError(f"module 'stalwart.checkpoint' has no attribute {name!r}")
