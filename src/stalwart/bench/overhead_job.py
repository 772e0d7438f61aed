"""The job `stalwart bench overhead` times: an MLP of about --params parameters, AdamW, on one rank or several.

`--mode plain` is the loop without stalwart (started with plain `python`, or torchrun for several ranks: then
DDP over gloo); `--mode stalwart` is the same loop under `stalwart.Job` (started with `stalwart run`),
configured by `--config` (JobConfig keywords as JSON). Rank 0 writes the result. The
time of a step is from the start of one loop body to the start of the next, so whatever stalwart does between
two steps (snapshot, checkpoint, heartbeat) is inside it; the body's own time is recorded too, so the time
stalwart takes on the training thread is measured in the same process at the same moment, free of the drift
between separate runs. On CUDA each body ends with a synchronize, in both
modes, so a step's time is the device's. Writes `--result` (JSON): the step times after --warmup steps and, in
plain mode, the floor: one copy of the whole state into preallocated (pinned, on CUDA) host memory.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from stalwart.runtime.process import die_with_parent

DEPTH = 4


def build(params: int, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    """DEPTH square layers whose weights and biases add up to about `params`; returns the width too."""
    width = max(8, int(math.sqrt(params / DEPTH)))
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i in range(DEPTH):
        layers.append(torch.nn.Linear(width, width))
        if i < DEPTH - 1:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), width


def state_tensors(model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p.detach() for p in model.parameters()]
    tensors += [t for st in optim.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim()]
    return tensors


def memcpy_s(tensors: list[torch.Tensor], repeats: int = 3) -> float:
    """The physical floor of a snapshot: one copy of every tensor into host memory allocated beforehand."""
    cuda = any(t.is_cuda for t in tensors)
    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors]
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for d, t in zip(dst, tensors, strict=True):
            d.copy_(t, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("plain", "stalwart"), required=True)
    p.add_argument("--result", type=Path, required=True)
    p.add_argument("--params", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--config", default="{}", help="JobConfig keywords (JSON), with --mode stalwart")
    p.add_argument("--ckpt", type=Path, help="checkpoint_dir, with --mode stalwart")
    args = p.parse_args()
    die_with_parent()
    job: Any = None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.mode == "stalwart":
        import stalwart

        job = stalwart.Job(args.ckpt, **json.loads(args.config))
    elif world > 1:  # under torchrun
        torch.distributed.init_process_group("gloo")
    rank = int(os.environ.get("RANK", "0"))
    model, optim, width = build(args.params, args.device)
    # Several ranks: DDP, tracked as such, so stalwart's defaults see replicated state (light snapshots).
    trained = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    if job is not None:
        job.track(model=trained, optim=optim)
        steps = job.steps(max_steps=args.steps)
    else:
        steps = ((step, None) for step in range(args.steps))
    cuda = args.device.startswith("cuda")
    starts: list[float] = []
    bodies: list[float] = []
    optimizer: list[float] = []
    for step, _ in steps:
        starts.append(time.perf_counter())
        g = torch.Generator().manual_seed(step * 1009 + rank)
        x = torch.randn(args.batch, width, generator=g).to(args.device)
        loss = (trained(x) - x).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        before = time.perf_counter()
        optim.step()  # under light snapshots this holds stalwart's commit point (a capture and a barrier)
        optimizer.append(time.perf_counter() - before)
        if cuda:
            torch.cuda.synchronize()
        bodies.append(time.perf_counter() - starts[-1])
    # Between body starts only: the last step's end includes the run's final, waited-for checkpoint.
    times = [b - a for a, b in itertools.pairwise(starts)][args.warmup :]
    tensors = state_tensors(model, optim)
    result: dict[str, Any] = {
        "step_times": times,
        "body_times": bodies[args.warmup : len(times) + args.warmup],
        "optimizer_times": optimizer[args.warmup : len(times) + args.warmup],
        "params": sum(t.numel() for t in model.parameters()),
        "threads": torch.get_num_threads(),
        "state_bytes": sum(t.numel() * t.element_size() for t in tensors),
    }
    if job is None:
        result["memcpy_s"] = memcpy_s(tensors)
        if world > 1:
            torch.distributed.destroy_process_group()
    else:
        result["detector_s"] = job.detector_seconds / max(1, len(starts))  # per step, all steps
        result["detector_breakdown_s"] = {k: v / max(1, len(starts)) for k, v in job.detector_breakdown.items()}
        job.close()
    if rank == 0:
        args.result.write_text(json.dumps(result))
    if job is None and world > 1:
        # Plain DDP under torchrun: at interpreter exit torch's gloo threads now and then abort the process
        # ("terminate called without an active exception", now and then in the 2-rank test), which
        # fails a run whose result is written. The work is done and the group destroyed: leave without teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
