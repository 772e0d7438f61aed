"""docs/integrations.md's recipe for a loop written with Hugging Face Accelerate, as the tests run it: the Job first
(under `stalwart run` it makes the process group, which Accelerate's state then takes as it is), the model and
optimizer through `accelerator.prepare`, the data through a ResumableLoader (not prepared: stalwart slices it),
the loop through `job.steps()`. Writes each rank's parameters' sha256 to --out/rank<R>.json."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch
from accelerate import Accelerator

import stalwart


class Samples(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    job = stalwart.Job("ckpt", checkpoint_every=10)  # first: it makes the process group under `stalwart run`
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optim = accelerator.prepare(model, optim)
    loader = stalwart.ResumableLoader(Samples(256), global_batch_size=8, seed=3)
    job.track(model=model, optim=optim, data=loader)
    for _step, x in job.steps(loader, max_steps=args.steps):
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optim.zero_grad()
        accelerator.backward(loss)
        optim.step()
        job.report(loss=loss.detach())
    job.close()
    digest = hashlib.sha256()
    for name, t in accelerator.unwrap_model(model).state_dict().items():
        digest.update(name.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{job.rank}.json").write_text(json.dumps({"step": job.step, "sha256": digest.hexdigest()}))


if __name__ == "__main__":
    main()
