"""docs/integrations.md's recipe for a loop written with Lightning Fabric, as the tests run it: the Job first (under
`stalwart run` it makes the process group, which Fabric's DDP strategy then takes as it is), the model and
optimizer through `fabric.setup`, the data through a ResumableLoader (not through `fabric.setup_dataloaders`:
stalwart slices it), the loop through `job.steps()`. Writes each rank's parameters' sha256 to --out/rank<R>.json."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import recipe_common
import torch
from lightning.fabric import Fabric

import stalwart


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    job = stalwart.Job("ckpt", checkpoint_every=10)  # first: it makes the process group under `stalwart run`
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    fabric.launch()  # under `stalwart run` (torch elastic's environment) the processes exist already
    model = recipe_common.model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optim = fabric.setup(model, optim)
    loader = stalwart.ResumableLoader(recipe_common.Samples(256), global_batch_size=8, seed=3)
    job.track(model=model, optim=optim, data=loader)
    for _step, x in job.steps(loader, max_steps=args.steps):
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optim.zero_grad()
        fabric.backward(loss)
        optim.step()
        job.report(loss=loss.detach())
    job.close()
    recipe_common.write_digest(args.out, job.rank, job.step, model.module)


if __name__ == "__main__":
    main()
