"""One rank of `stalwart bench reshard` (bench/reshard.py starts them with torchrun's variables).

`--phase save`: a module of TENSORS parameters, sharded Shard(0) over a 1-D mesh of every rank (what FSDP2 makes),
each rank's shards filled from its own generator (no rank ever holds a whole tensor), saved once by stalwart.Job.
`--phase load`: the same module at this world size, its shards empty, resumed from that checkpoint with
allow_world_size_change: the seconds of `job.resume()`, which reshards, go to `--out` as JSON.
`--phase floor`: this rank reads its share of the checkpoint's data files once, with plain reads, and reports
the seconds: the floor of any load of those bytes.
With `--memory DIR` the memory tier lives in DIR (a directory in /dev/shm, as `stalwart run` gives it): the save
also leaves every rank's full snapshot there, the load reshards from those (tier "memory") and the floor reads the
snapshots' tensor bytes in DIR instead of the checkpoint's files.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import stalwart
from stalwart.checkpoint.format.sharded import shard_extent
from stalwart.checkpoint.tiers.slot import HEADER_BYTES, SlotHeader
from stalwart.runtime.env import EVENT_LOG_ENV, SNAPSHOT_DIR_ENV
from stalwart.telemetry.events import read_events

TENSORS = 8
WIDTH = 1024
"""Columns of every parameter: its rows make up the size."""


def _module(rows: int, mesh: Any, world: int, rank: int, fill: bool) -> torch.nn.Module:
    from stalwart.runtime.torch_compat import DTensor, Shard  # torch 2.4 has them in a private module

    module = torch.nn.Module()
    generator = torch.Generator().manual_seed(rank)
    for i in range(TENSORS):
        size, _ = shard_extent([rows, WIDTH], [world], [rank], ["S0"])
        local = torch.randn(size, generator=generator) if fill else torch.empty(size)
        dtensor = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size([rows, WIDTH]), stride=(WIDTH, 1)
        )
        module.register_parameter(f"w{i}", torch.nn.Parameter(dtensor, requires_grad=False))
    return module


def _regions(ckpt: Path, memory: Path | None) -> list[tuple[Path, int, int]]:
    """(file, offset, length) of the saved tensor bytes: the checkpoint's data files, or the memory snapshots'
    tensor data in `memory`'s slot files."""
    if memory is None:
        return [(f, 0, f.stat().st_size) for f in sorted(ckpt.glob("step_*/rank*.data"))]
    found = []
    for f in sorted(memory.glob("local*.slot[01]")):
        with open(f, "rb") as handle:
            header = SlotHeader.unpack(handle.read(HEADER_BYTES))
        if header is not None and header.valid == 1:
            found.append((f, header.data_offset, header.data_len))
    return found


def _floor(ckpt: Path, memory: Path | None, rank: int, world: int) -> dict[str, float]:
    """Read bytes [rank/world, (rank+1)/world) of the saved tensor bytes, concatenated, once."""
    regions = _regions(ckpt, memory)
    total = sum(length for _, _, length in regions)
    start, end = total * rank // world, total * (rank + 1) // world
    dist.barrier()
    began, at, read = time.perf_counter(), 0, 0
    for f, offset, size in regions:
        low, high = max(start, at), min(end, at + size)
        if low < high:
            with open(f, "rb", buffering=0) as handle:
                handle.seek(offset + low - at)
                left = high - low
                while left:
                    chunk = handle.read(min(left, 64 << 20))
                    left -= len(chunk)
                    read += len(chunk)
        at += size
    return {"seconds": time.perf_counter() - began, "bytes": read}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--phase", choices=("save", "load", "floor"), required=True)
    p.add_argument("--ckpt", type=Path, required=True)
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--memory", type=Path, help="the memory tier's directory (default: none, durable only)")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.memory is not None:
        os.environ[SNAPSHOT_DIR_ENV] = str(args.memory)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / f"events-rank{rank}.jsonl"  # where the load's world_resized event says which tier it read
    os.environ[EVENT_LOG_ENV] = str(log)
    if args.phase == "floor":
        dist.init_process_group("gloo")
        result: dict[str, Any] = _floor(args.ckpt, args.memory, rank, world)
        dist.destroy_process_group()
    else:
        from torch.distributed.device_mesh import init_device_mesh

        job = stalwart.Job(
            args.ckpt,
            checkpoint_every=1,
            when_busy="wait",
            allow_world_size_change=True,
            snapshot_every=1 if args.memory is not None else 0,
        )
        mesh = init_device_mesh("cpu", (world,))
        module = _module(args.rows, mesh, world, rank, fill=args.phase == "save")
        job.track(model=module)
        if args.phase == "save":
            for _ in job.steps(max_steps=1):
                pass
            result = {"seconds": 0.0, "bytes": 0}
        else:
            job.comm.barrier()
            began = time.perf_counter()
            step = job.resume()
            seconds = time.perf_counter() - began
            resized = [e for e in read_events(log) if e["event"] == "world_resized"] or [{}]
            local = sum(p.to_local().numel() * 4 for p in module.parameters())  # type: ignore[attr-defined]
            result = {"seconds": seconds, "bytes": local, "step": step, "tier": resized[0].get("tier")}
        job.close()
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
