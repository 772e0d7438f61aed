"""docs/integrations.md's recipe for a loop written with Hugging Face Accelerate, as the tests run it: the Job first
(under `stalwart run` it makes the process group, which Accelerate's state then takes as it is), the model and
optimizer through `accelerator.prepare`, the data through a ResumableLoader (not prepared: stalwart slices it),
the loop through `job.steps()`. Writes each rank's parameters' sha256 to --out/rank<R>.json."""

from __future__ import annotations

import argparse
from pathlib import Path

import recipe_common
import torch
from accelerate import Accelerator

import stalwart


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    job = stalwart.Job("ckpt", checkpoint_every=10)  # first: it makes the process group under `stalwart run`
    accelerator = Accelerator(cpu=True)
    model = recipe_common.model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optim = accelerator.prepare(model, optim)
    loader = stalwart.ResumableLoader(recipe_common.Samples(256), global_batch_size=8, seed=3)
    job.track(model=model, optim=optim, data=loader)
    for _step, x in job.steps(loader, max_steps=args.steps):
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optim.zero_grad()
        accelerator.backward(loss)
        optim.step()
        job.report(loss=loss.detach())
    job.close()
    recipe_common.write_digest(args.out, job.rank, job.step, accelerator.unwrap_model(model))


if __name__ == "__main__":
    main()
