"""A torchtitan (0.3) training run on CPU ranks: torchtitan's own components (its optimizer and LR scheduler
containers, its `ParallelAwareDataloader`, its checkpoint managers built from their configs with the arguments its
Trainer passes) and a Trainer whose loop is torchtitan's `Trainer.train` and `Trainer.train_step` call for call
(load; step += 1, zero_grad, draw, forward, backward, torchtitan's grad clipping, `maybe_wait_for_staging`, the
optimizer and LR scheduler steps; the loss all-reduced over torchtitan's loss mesh, its check that the loss is
finite, the metrics logged; save), over a small model sharded with FSDP2 on the mesh torchtitan's `ParallelDims`
builds, as torchtitan shards by default. Its CPU shims: `ParallelDims`'s device type (torchtitan's is CUDA wherever
no accelerator is found) and torch's fake process group registered (torchtitan's mesh gives its disabled
dimensions one; its GPU runs register it through their imports).

Why not torchtitan's Trainer itself: it needs a GPU (its device is CUDA wherever no accelerator is found, and its
models import triton), or on CPU packages the suite does not install and more shims (scripts/torchtitan_check.sh
runs it so by hand). The dataset records the indices it serves.
`--plain`: torchtitan's own CheckpointManager, disabled (the baseline a run with failures must end identical to).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.dataloader import DataloaderExhaustedError, ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.distributed import parallel_dims
from torchtitan.distributed import utils as dist_utils


class Items(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Fixed inputs and targets as torchtitan's loaders yield them (an input dict, the labels); each served index
    is appended to `log` (a file per process)."""

    def __init__(self, n: int, log: Path | None) -> None:
        g = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)
        self.log = log

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        if self.log is not None:
            self.log.mkdir(exist_ok=True)
            with open(self.log / f"pid{os.getpid()}.txt", "a") as f:
                f.write(f"{i}\n")
        return {"input": self.x[i]}, self.y[i]


class Trainer(Stateful):
    """torchtitan's Trainer, its loop as written (trainer.py `train`, `train_step`, `batch_generator`)."""

    def __init__(self, args: argparse.Namespace) -> None:
        world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        if world > 1:
            dist.init_process_group("gloo")  # torchtitan makes its own group (dist_utils.init_distributed)
        self.config = SimpleNamespace(
            training=SimpleNamespace(steps=args.steps, max_norm=1.0),
            validator=SimpleNamespace(enable=args.validate_every > 0),
        )
        self.validator = _Validator(args.validate_every, args.step_log)
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
        )
        self.world, self.loss_mesh = world, None
        if world > 1:
            importlib.import_module("torch.testing._internal.distributed.fake_pg")  # registers the "fake" backend

            parallel_dims.device_type = "cpu"
            dims = parallel_dims.ParallelDims(
                dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, world_size=world, spmd_backend="spmd_types"
            )
            dims.build_mesh()
            fully_shard(model, mesh=dims.get_mesh("dp_shard"))
            self.loss_mesh = dims.get_optional_mesh("loss")
        self.metrics_log = args.step_log
        self.model_parts = [model]
        self.optimizers = default_adamw(lr=1e-2, weight_decay=0.0).build(model_parts=self.model_parts)
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.5).build(
            optimizers=self.optimizers, training_steps=args.steps
        )
        self.step = 0
        self.ntokens_seen = 0
        dataset = Items(160, args.served_log)
        sampler = torch.utils.data.DistributedSampler(dataset, world, rank, shuffle=True, seed=0, drop_last=True)
        self.dataloader: Any = ParallelAwareDataloader(
            dataset, dp_rank=rank, dp_world_size=world, batch_size=2, sampler=sampler
        )
        if args.plain:
            config: Any = CheckpointManager.Config(enable=False)
        else:
            from stalwart.integrations.torchtitan import StalwartCheckpointManager

            config = StalwartCheckpointManager.Config(folder=args.ckpt, interval=args.every, load_step=args.load_step)
        self.checkpointer = config.build(
            dataloader=self.dataloader,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self},
            sd_adapter=None,
            base_folder=".",
        )
        self.hooks = _Hooks(args, model, self.optimizers)

    def batch_generator(self, data_iterable: Any) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        data_iterator = iter(data_iterable)
        while True:
            try:
                batch = next(data_iterator)
            except StopIteration as ex:
                raise DataloaderExhaustedError() from ex
            yield batch

    def train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
        self.optimizers.zero_grad()
        input_dict, labels = next(data_iterator)
        self.hooks.now = self.step
        self.hooks.begin()
        self.ntokens_seen += labels.numel()
        loss = torch.nn.functional.mse_loss(self.model_parts[0](input_dict["input"]), labels)
        loss.backward()
        dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()], self.config.training.max_norm, foreach=True
        )
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        # torchtitan's metrics at every step (log_freq 1): the loss summed over the loss mesh, checked finite (a
        # survivor's absorbed collectives may leave garbage in it), logged.
        global_avg_loss = dist_utils.dist_sum(loss.detach() / self.world, self.loss_mesh)
        if not math.isfinite(global_avg_loss):
            raise RuntimeError(f"Loss is not finite (global_avg_loss={global_avg_loss}) at step {self.step}.")
        if self.metrics_log is not None:
            self.metrics_log.mkdir(exist_ok=True)
            with open(self.metrics_log / f"loss{os.getpid()}.txt", "a") as f:
                f.write(f"{self.step} {global_avg_loss!r}\n")

    def train(self) -> None:
        self.checkpointer.load(step=-1)
        data_iterator = self.batch_generator(self.dataloader)
        while self.step < self.config.training.steps:
            self.step += 1
            try:
                self.train_step(data_iterator)
            except DataloaderExhaustedError:
                break
            self.checkpointer.save(self.step, last_step=self.step == self.config.training.steps)
            if self.config.validator.enable and self.validator.should_validate(self.step):
                self.validator.validate(self.model_parts, self.step)
            self.hooks.ended(self.step)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


class _Validator:
    """torchtitan's Validator's shape: every `every` steps, the model in eval mode on fixed inputs, the loss
    all-reduced, a new iterator's draw from torch's generator (as a validation loader's iterator makes); each
    validation's step appended to --step-log's `val` files."""

    def __init__(self, every: int, log: Path | None) -> None:
        self.every, self.log = every, log
        self.x = torch.randn(4, 8, generator=torch.Generator().manual_seed(11))

    def should_validate(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def validate(self, model_parts: list[torch.nn.Module], step: int) -> None:
        torch.empty((), dtype=torch.int64).random_()
        model = model_parts[0]
        model.eval()
        with torch.no_grad():
            loss = model(self.x).square().mean()
        model.train()
        if dist.is_initialized():
            dist.all_reduce(loss)
        if self.log is not None:
            self.log.mkdir(exist_ok=True)
            with open(self.log / f"val{os.getpid()}.txt", "a") as f:
                f.write(f"{step}\n")


class _Hooks:
    """The test's instruments: rank 1 of the first round SIGKILLs itself at step STEP in PHASE (begin: before the
    forward; backward: the last layer's backward; optimizer: the optimizer step's pre-hook), each step's end is
    appended to --step-log, and --step-sleep seconds pass after it."""

    def __init__(self, args: argparse.Namespace, model: torch.nn.Module, optimizers: Any) -> None:
        self.step_log, self.sleep_s, self.now = args.step_log, args.step_sleep, -1
        step, _, self.phase = args.die_at.partition(":")
        self.die_step = int(step) if step else -1
        self.armed = os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if self.armed and self.phase == "backward":  # the last layer's backward: FSDP2's reduce-scatter to come
            model[3].register_full_backward_hook(lambda *a: self._die())
        if self.armed and self.phase == "optimizer":
            optimizers.optimizers[0].register_step_pre_hook(lambda *a: self._die())

    def _die(self) -> None:
        if self.armed and self.now == self.die_step:
            os.kill(os.getpid(), signal.SIGKILL)

    def begin(self) -> None:
        if self.phase == "begin":
            self._die()

    def ended(self, step: int) -> None:
        if self.step_log is not None:
            self.step_log.mkdir(exist_ok=True)
            with open(self.step_log / f"pid{os.getpid()}.txt", "a") as f:
                f.write(f"{step}\n")
        time.sleep(self.sleep_s)


def write_digest(out: Path, rank: int, step: int, module: torch.nn.Module) -> None:
    """This rank's parameters (its FSDP2 shards, wherever they are) as one sha256."""
    digest = hashlib.sha256()
    for name, t in module.state_dict().items():
        local = t.to_local() if isinstance(t, DTensor) else t
        digest.update(name.encode() + local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"step": step, "sha256": digest.hexdigest()}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ckpt", default="ckpt")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5, help="checkpoint.interval")
    p.add_argument("--plain", action="store_true", help="torchtitan's CheckpointManager, disabled (the baseline)")
    p.add_argument("--step-log", type=Path)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--served-log", type=Path)
    p.add_argument("--setup-log", type=Path)
    p.add_argument("--die-at", default="", help="STEP:PHASE, see _Hooks")
    p.add_argument("--validate-every", type=int, default=0, help="validator freq (0: no validation)")
    p.add_argument("--load-step", type=int, default=-1, help="checkpoint.load_step (not supported by stalwart's)")
    args = p.parse_args()
    if args.setup_log is not None:
        with open(args.setup_log, "a") as f:
            f.write(f"{os.getpid()}\n")
    trainer = Trainer(args)
    trainer.train()
    trainer.checkpointer.close()
    write_digest(args.out, int(os.environ.get("RANK", "0")), trainer.step, trainer.model_parts[0])
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
