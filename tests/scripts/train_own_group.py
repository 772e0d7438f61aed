"""A DDP script as people already write them: it makes its own process group and draws its own batches.

`--group` says how it makes the group (torch's environment rendezvous, an `init_method` URL, or a TCPStore it
creates itself), `--order` whether before or after `stalwart.Job()`. Its batches are a pure function of (step,
rank), drawn with its own generator: no ResumableLoader. It writes rank<r>.json (step, parameters' sha256) to
--out, as tests/scripts/train_tiny.py does, so runs with failures can be compared with runs without.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import stalwart


def make_group(how: str) -> None:
    """The script's own `init_process_group`, in one of the three ways scripts write it."""
    if how == "env":
        dist.init_process_group(backend="gloo")
    elif how == "url":
        url = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        dist.init_process_group(
            backend="gloo", init_method=url, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
        )
    elif how == "store":
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=rank == 0,
            timeout=timedelta(seconds=60),
        )  # fmt: skip
        dist.init_process_group(backend="gloo", store=store, rank=rank, world_size=world)
    else:
        raise SystemExit(f"unknown --group {how}")


def batch(step: int, rank: int) -> torch.Tensor:
    """This rank's batch of `step`: the script's own data, the same in every run."""
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + rank))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--group", default="env", choices=("env", "url", "store"))
    p.add_argument("--order", default="before", choices=("before", "after"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes over the script's data")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--setup-s", type=float, default=0.0)
    args = p.parse_args()

    torch.use_deterministic_algorithms(True)
    if args.order == "before":
        make_group(args.group)
    job = stalwart.Job(args.ckpt, checkpoint_every=args.every, log_every=1)
    if args.order == "after":
        make_group(args.group)
    rank = dist.get_rank() if dist.is_initialized() else 0
    time.sleep(args.setup_s)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    ddp = DistributedDataParallel(model) if job.world_size > 1 else model
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    job.track(model=model, optim=optim)
    job.resume()
    for step, _ in job.steps(max_steps=args.steps):
        x = batch(step, rank)
        loss = (ddp(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        job.report(loss=loss.detach())
        if args.step_sleep:
            time.sleep(args.step_sleep)

    digest = hashlib.sha256()
    for name, t in model.state_dict().items():
        digest.update(name.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"sha256": digest.hexdigest(), "step": job.step}))


if __name__ == "__main__":
    main()
