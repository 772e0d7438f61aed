"""The small deterministic job `stalwart chaos --suite` runs when no script is given: a DDP MLP with AdamW, a
dropout (so the RNG matters), a StepLR schedule and a ResumableLoader, checkpointing to `--ckpt` every
`--every` steps. Deterministic algorithms, so a run with failures must end bitwise where a run without ends.

    python -m stalwart chaos --suite quick            # uses this job
    stalwart run --nproc-per-node 2 -m stalwart.chaos.tiny_job --ckpt ckpt --steps 60

`--grow-to W --grow-wait-after N` fixes when a job that lost ranks grows back (the quick suite's `shrink_and_grow`):
after N steps at fewer than W ranks, the job waits inside its next step (at most `--grow-wait-s`) until its agent
asks it to re-form, which it does when the lost host has joined again. The grow then happens at that step, however
long the host takes to start, instead of at whatever step the job reached meanwhile, or not at all when the job
ended first. (W is given, not remembered: a survivor may run its script again at the smaller size.)
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
    p.add_argument("--grow-to", type=int, default=0, help="ranks to wait to grow back to (0: never wait)")
    p.add_argument("--grow-wait-after", type=int, default=10, help="steps at fewer ranks before that wait")
    p.add_argument("--grow-wait-s", type=float, default=120.0, help="the longest such a wait lasts")
    args = p.parse_args()
    torch.use_deterministic_algorithms(True)
    job = stalwart.Job(
        args.ckpt,
        checkpoint_every=args.every,
        log_every=1,
        when_busy="wait",
        divergence_every=args.divergence_every,
        loss_spike=args.loss_spike,
        light_snapshot_budget=args.light_budget,
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    ddp = DistributedDataParallel(model)  # at one rank too: its state keeps the same keys when the world shrinks to one
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=20, gamma=0.5)
    loader = stalwart.ResumableLoader(_Samples(240), global_batch_size=8, seed=3)
    job.track(model=ddp, optim=optim, sched=sched, data=loader)
    shrunk_at = None  # the step from which the job ran at fewer than --grow-to ranks
    for step, x in job.steps(loader, max_steps=args.steps):
        shrunk_at = None if job.world_size >= args.grow_to else step if shrunk_at is None else shrunk_at
        if shrunk_at is not None and step - shrunk_at == args.grow_wait_after:
            wait_to_grow(job, args.grow_wait_s)
        loss = (ddp(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        job.report(loss=loss.detach())
        time.sleep(args.step_sleep)
    job.close()


def wait_to_grow(job: stalwart.Job, seconds: float) -> None:
    """Wait, at most `seconds`, until the agent asks this rank to re-form (its group, stalwart's re-formable one,
    records it as failed: runtime/group.py). The step's update is then dropped, the job grows back at the step's
    boundary from the steps the survivors completed, and the step is redone at the full size (recovery/in_loop/).
    The hang detector is told that this step is long (`job.busy`). The tests' script (tests/scripts/train_tiny.py)
    waits the same way."""
    group = torch.distributed.group.WORLD
    if not hasattr(group, "failed"):
        return  # not stalwart's re-formable group (not under `stalwart run`): nobody would ask
    deadline = time.monotonic() + seconds
    with job.busy(seconds + 60):
        while getattr(group, "failed", None) is None and time.monotonic() < deadline:
            time.sleep(0.05)


if __name__ == "__main__":
    main()
