"""The small deterministic job `stalwart chaos --suite` runs when no script is given: a DDP MLP with AdamW, a
dropout (so the RNG matters), a StepLR schedule and a ResumableLoader, checkpointing to `--ckpt` every
`--every` steps. Deterministic algorithms, so a run with failures must end bitwise where a run without ends.

    python -m stalwart chaos --suite quick            # uses this job
    stalwart run --nproc-per-node 2 -m stalwart.chaos.tiny_job --ckpt ckpt --steps 60
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn.parallel import DistributedDataParallel

import stalwart


class _Samples(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 8, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m stalwart.chaos.tiny_job")
    p.add_argument("--ckpt", default="ckpt")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.02, help="seconds per step, a stand-in for compute")
    p.add_argument("--divergence-every", type=int, default=10)
    p.add_argument("--loss-spike", default="rollback")
    p.add_argument("--light-budget", type=float, default=0.02, help="light_snapshot_budget (stalwart.Job's)")
    args = p.parse_args()
    torch.use_deterministic_algorithms(True)
    job = stalwart.Job(args.ckpt, checkpoint_every=args.every, log_every=1, when_busy="wait",
                       divergence_every=args.divergence_every, loss_spike=args.loss_spike,
                       light_snapshot_budget=args.light_budget)  # fmt: skip
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    ddp = DistributedDataParallel(model)  # at one rank too: its state keeps the same keys when the world shrinks to one
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=20, gamma=0.5)
    loader = stalwart.ResumableLoader(_Samples(240), global_batch_size=8, seed=3)
    job.track(model=ddp, optim=optim, sched=sched, data=loader)
    for _, x in job.steps(loader, max_steps=args.steps):
        loss = (ddp(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        job.report(loss=loss.detach())
        time.sleep(args.step_sleep)
    job.close()


if __name__ == "__main__":
    main()
