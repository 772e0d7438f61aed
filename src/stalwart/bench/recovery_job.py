"""The job `stalwart bench recovery` runs under each launcher: 2 gloo ranks, a 4M-parameter MLP under DDP.

Sample i is drawn from a generator seeded by i and fed by a ResumableLoader (global batch: `--batch` per rank), so
a run with failures must end with exactly the parameters of a run without, and stalwart's survivors can take a
missing rank's slices of each batch while its replacement starts (recovery/shrink.py). With `--own-data` each rank
draws its batch in the loop from a generator of its own (its state tracked per rank), so stalwart's survivors train
on with their own batches meanwhile, a smaller global batch for those steps. With `--fsdp` each linear layer and the
model are sharded with FSDP2 (`fully_shard`) instead of wrapped in DDP. It checkpoints every
`--checkpoint-every` steps (durable, reloaded on restart under any launcher; JobConfig's default unless given) and
logs every step, which is what the bench reads. At the end each rank writes `result-rank<R>.json` with the sha256
of its parameters.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

import stalwart
from stalwart.bench.common import params_sha256
from stalwart.runtime.process import die_with_parent


class _SeededSamples(torch.utils.data.Dataset[torch.Tensor]):
    """`n` samples of `width` values, each made from its own seed when fetched: no memory, any order."""

    def __init__(self, n: int, width: int) -> None:
        self._n, self._width = n, width

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randn(self._width, generator=torch.Generator().manual_seed(i))


class _OwnBatches:
    """A rank's own sampler (`--own-data`): its batches from a generator seeded by its rank, its state tracked."""

    def __init__(self, rank: int, batch: int, width: int) -> None:
        self.batch, self.width = batch, width
        self.gen = torch.Generator().manual_seed(7919 * (rank + 1))

    def draw(self) -> torch.Tensor:
        return torch.randn(self.batch, self.width, generator=self.gen)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.gen.set_state(state["gen"])


def _every(text: str) -> int | str:
    return text if text == "auto" else int(text)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--checkpoint-every", type=_every, help="as JobConfig's (default: its default)")
    p.add_argument("--width", type=int, default=1152, help="3 layers of width^2: 4.0M parameters at 1152")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--snapshot-every", type=_every, default="auto", help="as JobConfig's")
    p.add_argument("--replicated-snapshot-every", type=_every, default="auto", help="as JobConfig's")
    p.add_argument(
        "--setup-s",
        type=float,
        default=0.0,
        help="seconds of set-up before the loop (a real job's dataset indexing, model building, compilation)",
    )
    p.add_argument("--own-data", action="store_true", help="each rank draws its own batches in the loop")
    p.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 instead of DDP (torch >= 2.6)")
    p.add_argument("--until", type=float, help="stop (exit 0, no result) at this time.time(): a bound on long runs")
    args = p.parse_args()
    die_with_parent()  # under torchrun too: a launcher killed with SIGKILL leaves no worker behind
    torch.use_deterministic_algorithms(True)
    # DDP keeps model and optimizer equal on every rank: written (and snapshotted) once, split between ranks.
    every = {} if args.checkpoint_every is None else {"checkpoint_every": args.checkpoint_every}
    job = stalwart.Job(
        args.out / "ckpt",
        **every,
        log_every=1,
        replicated=None if args.fsdp else ("model", "optim"),
        snapshot_every=args.snapshot_every,
        replicated_snapshot_every=args.replicated_snapshot_every,
    )
    time.sleep(args.setup_s)
    torch.manual_seed(0)
    w = args.width
    model = torch.nn.Sequential(
        torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w)
    )
    ddp: torch.nn.Module = model
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)  # the model itself, sharded in place
    elif job.world_size > 1:
        ddp = DistributedDataParallel(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    global_batch = args.batch * job.world_size
    epoch = global_batch * min(args.steps, 1000)  # long runs go round epochs: a permutation stays small
    own = _OwnBatches(job.rank, args.batch, w) if args.own_data else None
    loader = None if own else stalwart.ResumableLoader(_SeededSamples(epoch, w), global_batch_size=global_batch, seed=1)
    job.track(model=model, optim=optim, **({"sampler": own} if own else {"data": loader}))
    for _, drawn in job.steps(loader, max_steps=args.steps):
        if args.until is not None and time.time() > args.until:
            return
        x = own.draw() if own is not None else drawn
        loss = (ddp(x) - x).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        job.report(loss=loss.detach())
    result = {"sha256": params_sha256(model), "step": job.step}  # a DTensor under FSDP2: gathered (collective)
    (args.out / f"result-rank{job.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
