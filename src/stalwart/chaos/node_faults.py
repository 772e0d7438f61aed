"""Faults of the node itself, for the pre-flight check (detect/preflight.py), from STALWART_NODE_FAULTS:

    STALWART_NODE_FAULTS=bad_memory    one bit of the memory test's buffer flips after each pattern is written,
                                       as a stuck or weak memory cell would show

The pre-flight check runs in its own process, so the fault comes through the environment, like STALWART_FAULTS.
"""

from __future__ import annotations

import os
from typing import Any

from stalwart.runtime.env import NODE_FAULTS_ENV

KINDS = ("bad_memory",)


def active() -> set[str]:
    return {k.strip() for k in os.environ.get(NODE_FAULTS_ENV, "").split(",") if k.strip()}


def after_memory_write(buf: Any) -> None:
    """The memory test's seam: with `bad_memory`, flip bit 3 of the buffer's middle word."""
    if "bad_memory" in active() and buf.numel():
        buf[buf.numel() // 2 : buf.numel() // 2 + 1].bitwise_xor_(1 << 3)
