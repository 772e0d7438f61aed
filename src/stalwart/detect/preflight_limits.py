"""The pre-flight check's limits and their flags, apart from the check (detect/preflight.py): `stalwart preflight`
builds its parser and answers a bad flag without importing torch (seconds of start-up)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limits:
    relative: float = 0.8
    min_tflops: float | None = None
    min_busbw_gbps: float | None = None
    memory_mb: int | None = None
    """None: 1024 MB of a GPU's memory, 64 MB of host memory."""
    collective_mb: int = 64
    seconds: float = 1.0
    """Matmul time per device."""


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--min-tflops", type=float, default=None, help="fail a device under this matmul throughput")
    p.add_argument("--min-busbw-gbps", type=float, default=None, help="fail under this all-reduce bus bandwidth")
    p.add_argument("--relative", type=float, default=0.8, help="fail a device under this x the node's median")
    p.add_argument("--memory-mb", type=int, default=None, help="memory tested per device (GPU 1024, CPU 64)")
    p.add_argument("--collective-mb", type=int, default=64)
    p.add_argument("--seconds", type=float, default=1.0, help="matmul time per device")


def limits_from(args: argparse.Namespace) -> Limits:
    return Limits(args.relative, args.min_tflops, args.min_busbw_gbps, args.memory_mb, args.collective_mb, args.seconds)
