"""The pre-flight node check: before a node takes work, measure what a bad node gets wrong.

Why: a GPU whose memory returns wrong bits, or one far slower than its peers (throttled, a PCIe link trained at a
lower width), takes a synchronous job down or slows every step of it from the first step on. Found before the
node joins, it costs seconds instead of a failed or crawling run, and the node goes on the exclusion list
(supervisor/exclusion.py) with the reason.

What it measures, on every device of the node (every visible GPU, else the CPU once):
- matmul throughput: square matmuls (bfloat16 on a GPU, float32 on the CPU) for `seconds`, in TFLOPS. A device
  under `relative` (0.8) times the median of the node's devices fails, and so does one under `min_tflops` when
  that is given (with one device there is nothing to compare it with);
- a memory pattern test: `memory_mb` of the device's memory written with all zeros, all ones, 0x55..., 0xAA...
  and each 32-bit word's own index, and read back: any mismatch fails (the memory is to be repaired);
- collective bandwidth: an all-reduce of `collective_mb` among one process per device (NCCL between GPUs, gloo
  on the CPU, over loopback), as bus bandwidth (2(n-1)/n x bytes per second, NCCL-tests' convention), against
  `min_busbw_gbps` when given. Between nodes it is not measured yet.
It runs in its own process (`python -m stalwart.detect.preflight`, or `stalwart preflight`), so the agent never
holds a CUDA context. A fault for tests enters at one seam, `after_write` (runtime/seams.MEMORY_WRITE): with
STALWART_NODE_FAULTS=bad_memory, chaos/node_faults.py flips one bit of the pattern buffer after each write, as a
bad memory cell would.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stalwart.detect.preflight_limits import Limits, add_limit_arguments, limits_from
from stalwart.runtime import seams
from stalwart.runtime.process import start_module

PATTERNS: tuple[int | str, ...] = (0x00000000, 0xFFFFFFFF, 0x55555555, 0xAAAAAAAA, "index")
PEER_TIMEOUT_S = 120.0


@dataclass(slots=True)
class DeviceResult:
    device: str
    name: str
    tflops: float
    memory_bytes: int
    memory_errors: int
    memory_gb_s: float


@dataclass(slots=True)
class Report:
    devices: list[DeviceResult] = field(default_factory=list)
    collective_ranks: int = 0
    collective_bytes: int = 0
    busbw_gbps: float | None = None
    failures: list[str] = field(default_factory=list)
    action: str = ""
    """What a failure calls for, in the GPU playbook's words (detect/gpu.py): replace_hardware for bad memory,
    drain_node for a slow device or link."""
    seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def devices() -> list[torch.device]:
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device: torch.device, seconds: float) -> float:
    """Sustained square-matmul throughput of `device` over about `seconds`."""
    size = 8192 if device.type == "cuda" else 512
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    torch.matmul(a, b, out=out)  # warm-up: kernels chosen, clocks up
    _sync(device)
    n, started = 0, time.perf_counter()
    while True:
        for _ in range(4):
            torch.matmul(a, b, out=out)
        n += 4
        _sync(device)
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            return 2 * size**3 * n / elapsed / 1e12


AfterWrite = Callable[[torch.Tensor], None]
"""Called with the pattern buffer after each pattern is written (the memory test's seam)."""


def memory_test(device: torch.device, nbytes: int, after_write: AfterWrite | None = None) -> tuple[int, float]:
    """(words that read back wrong, GB/s written and read) over `nbytes` of `device`'s memory; `after_write`
    by default what is installed at runtime/seams.MEMORY_WRITE, in production nothing."""
    after_write = after_write or seams.installed(seams.MEMORY_WRITE) or (lambda buf: None)
    words = max(1, nbytes // 4)
    buf = torch.empty(words, dtype=torch.int32, device=device)
    errors = 0
    started = time.perf_counter()
    for pattern in PATTERNS:
        expected: torch.Tensor | int
        if pattern == "index":
            index = torch.arange(words, dtype=torch.int32, device=device)
            buf.copy_(index)
            expected = index
        else:
            assert isinstance(pattern, int)
            expected = pattern - (1 << 32) if pattern >= 1 << 31 else pattern  # as a signed 32-bit word
            buf.fill_(expected)
        after_write(buf)
        errors += int((buf != expected).sum())
    _sync(device)
    seconds = time.perf_counter() - started
    return errors, 2 * len(PATTERNS) * words * 4 / seconds / 1e9


def _all_reduce_rank(rank: int, world: int, store_path: str, nbytes: int, rounds: int) -> float:
    """One rank of the collective test; returns its bus bandwidth in GB/s."""
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=PEER_TIMEOUT_S)
    )
    try:
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        t = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        dist.all_reduce(t)  # warm-up: connections made
        _sync(device)
        started = time.perf_counter()
        for _ in range(rounds):
            dist.all_reduce(t)
        _sync(device)
        elapsed = time.perf_counter() - started
        return 2 * (world - 1) / world * t.numel() * 4 * rounds / elapsed / 1e9
    finally:
        dist.destroy_process_group()


class _Collective:
    """The collective test's other ranks, started before this process touches a device: forked from it where it
    is one thread (torch imported: a new interpreter spent 3-4 s of CPU importing it on the 2-core VM,
    2026-11-30), and a fork must not inherit a CUDA context, hence before the device tests; else new interpreters.
    They meet this process (rank 0) through a file store, wait while the device tests run, and are ended on leaving
    the `with` block if they have not ended by then. Their error output is passed on to this process's."""

    def __init__(self, world: int, nbytes: int, rounds: int = 5) -> None:
        self.world, self.nbytes, self.rounds = world, nbytes, rounds
        self._tmp = tempfile.TemporaryDirectory(prefix="stalwart-preflight-")
        self._store = str(Path(self._tmp.name) / "store")
        self._peers: list[tuple[Any, Path]] = []
        self._ran = False

    def __enter__(self) -> _Collective:
        for r in range(1, self.world):
            err = Path(self._tmp.name) / f"peer-{r}.err"
            args = ["--peer", str(r), str(self.world), self._store, str(self.nbytes), str(self.rounds)]
            proc = start_module("stalwart.detect.preflight", args, env=dict(os.environ), out=Path(os.devnull), err=err)
            self._peers.append((proc, err))
        return self

    def busbw(self) -> float:
        """Bus bandwidth of the all-reduce among `world` processes of this node (this one is rank 0), in GB/s."""
        self._ran = True
        return _all_reduce_rank(0, self.world, self._store, self.nbytes, self.rounds)

    def __exit__(self, *exc: object) -> None:
        try:
            for proc, err in self._peers:
                try:
                    proc.wait(timeout=PEER_TIMEOUT_S if self._ran and exc[0] is None else 0)
                except subprocess.TimeoutExpired:  # this rank never came, or failed: they would wait for it
                    proc.kill()
                    proc.wait()
                with contextlib.suppress(OSError):
                    sys.stderr.write(err.read_text(errors="replace"))
        finally:
            self._tmp.cleanup()


def check(limits: Limits, ranks: int, *, after_write: AfterWrite | None = None) -> Report:
    """Run every measurement on this node and judge it; `ranks`: processes for the collective test;
    `after_write`: the memory test's seam (see memory_test)."""
    started = time.monotonic()
    report = Report()
    with contextlib.ExitStack() as stack:
        collective = stack.enter_context(_Collective(ranks, limits.collective_mb << 20)) if ranks > 1 else None
        for device in devices():
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            tflops = matmul_tflops(device, limits.seconds)
            mb = limits.memory_mb if limits.memory_mb is not None else 1024 if device.type == "cuda" else 64
            errors, speed = memory_test(device, mb << 20, after_write)
            report.devices.append(DeviceResult(str(device), name, round(tflops, 4), mb << 20, errors, round(speed, 2)))
        if collective is not None:
            report.collective_ranks = ranks
            report.collective_bytes = collective.nbytes
            report.busbw_gbps = round(collective.busbw(), 3)
    judge(report, limits)
    report.seconds = round(time.monotonic() - started, 2)
    return report


def judge(report: Report, limits: Limits) -> None:
    """Fill `failures` and `action` from the measurements."""
    failures, action = [], ""
    median = statistics.median(d.tflops for d in report.devices) if report.devices else 0.0
    for d in report.devices:
        if d.memory_errors:
            failures.append(f"{d.device} ({d.name}): {d.memory_errors} memory words read back wrong")
            action = "replace_hardware"
        if len(report.devices) > 1 and d.tflops < limits.relative * median:
            failures.append(
                f"{d.device}: {d.tflops:.3g} TFLOPS, under {limits.relative:g}x the node's median ({median:.3g})"
            )
        if limits.min_tflops is not None and d.tflops < limits.min_tflops:
            failures.append(f"{d.device}: {d.tflops:.3g} TFLOPS, under the floor of {limits.min_tflops:g}")
    if (
        limits.min_busbw_gbps is not None
        and report.busbw_gbps is not None
        and report.busbw_gbps < limits.min_busbw_gbps
    ):
        failures.append(
            f"all-reduce among {report.collective_ranks} ranks: {report.busbw_gbps:.3g} GB/s bus bandwidth, "
            f"under the floor of {limits.min_busbw_gbps:g}"
        )
    report.failures = failures
    report.action = action or ("drain_node" if failures else "")


def _main(argv: list[str]) -> int:
    if argv[:1] == ["--peer"]:
        rank, world, nbytes, rounds = (int(v) for v in (argv[1], argv[2], argv[4], argv[5]))
        _all_reduce_rank(rank, world, argv[3], nbytes, rounds)
        return 0
    p = argparse.ArgumentParser(prog="python -m stalwart.detect.preflight")
    p.add_argument("--ranks", type=int, default=1, help="processes for the collective test (1: none)")
    add_limit_arguments(p)
    args = p.parse_args(argv)
    print(check(limits_from(args), args.ranks).to_json(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
