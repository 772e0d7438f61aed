"""A user's Lightning Trainer script (lightning 2.6) with stalwart's callback: a small MLP with dropout and an LR
schedule, a map-style dataset that records the indices it serves, DDP on CPU ranks under `stalwart run` (or one
process). `--plain`: the Trainer alone, the baseline a run with failures must end identical to."""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import recipe_common
import torch


class Items(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Fixed inputs and targets; each served index is appended to `log` (a file per process)."""

    def __init__(self, n: int, log: Path | None) -> None:
        g = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)
        self.log = log

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.log is not None:
            self.log.mkdir(exist_ok=True)
            with open(self.log / f"pid{os.getpid()}.txt", "a") as f:
                f.write(f"{i}\n")
        return self.x[i], self.y[i]


class Regressor(pl.LightningModule):
    """An LR schedule by step and one by epoch. `manual`: Lightning's manual optimization (the module steps its
    optimizer and its step LR schedule itself); `two_optimizers`: with manual optimization, one optimizer for each
    linear layer."""

    def __init__(
        self, manual: bool = False, two_optimizers: bool = False, fsdp2: bool = False, frequency: int = 1
    ) -> None:
        super().__init__()
        self.frequency = frequency
        self.net = recipe_common.model()
        self.automatic_optimization = not manual
        self.two = two_optimizers
        self.fsdp2 = fsdp2

    def configure_model(self) -> None:
        """Under ModelParallelStrategy (FSDP2): each linear layer and the whole net sharded over the data-parallel
        mesh, as Lightning's FSDP2 examples do."""
        if not self.fsdp2:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        if not self.automatic_optimization:
            optimizers: Any = self.optimizers()
            optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
            for optimizer in optimizers:
                optimizer.zero_grad()
            self.manual_backward(loss)
            for optimizer in optimizers:
                optimizer.step()
            schedulers: Any = self.lr_schedulers()
            for scheduler in schedulers if isinstance(schedulers, list) else [schedulers]:
                scheduler.step()
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)  # a collective

    def configure_optimizers(self) -> Any:
        if self.two:
            first, last = self.net[0], self.net[3]
            return [torch.optim.AdamW(first.parameters(), lr=1e-2), torch.optim.AdamW(last.parameters(), lr=1e-2)]
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        steps = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
        if not self.automatic_optimization:  # training_step steps it
            return {"optimizer": opt, "lr_scheduler": {"scheduler": steps, "interval": "step"}}
        epochs = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8)  # stepped by the loop at an epoch's end
        by_step = {"scheduler": steps, "interval": "step", "frequency": self.frequency}
        return [opt], [by_step, {"scheduler": epochs, "interval": "epoch"}]


class DieAt(pl.Callback):
    """Rank 1 of the first round SIGKILLs itself at step STEP, in PHASE: begin (before the forward), backward (a
    gradient hook, DDP's all-reduce of another bucket in flight at a step's last micro-batch) or optimizer (inside
    the optimizer step, its gradients all-reduced); at the step's micro-batch MICRO (0, the first, by default; with
    gradient accumulation)."""

    def __init__(self, step: int, phase: str, micro: int) -> None:
        self.step, self.phase, self.micro = step, phase, micro
        self.now, self.now_micro = -1, 0
        self.armed = os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        # Once the strategy has set the model up. FSDP2 (configure_model) gives the sharded parameters their
        # gradients itself, after its reduce-scatter: there, the first layer's backward as it begins.
        if self.armed and self.phase == "backward":
            if module.fsdp2:
                module.net[0].register_full_backward_pre_hook(lambda *_: self._die())
            else:
                module.net[0].weight.register_hook(lambda g: self._die())

    def _die(self) -> None:
        if self.armed and self.now == self.step and self.now_micro == self.micro:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.now_micro = self.now_micro + 1 if trainer.global_step == self.now else 0
        self.now = trainer.global_step
        if self.phase == "begin":
            self._die()

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.phase == "optimizer":
            self._die()


class StepLog(pl.Callback):
    """The Trainer's own callbacks: each batch end's global step, appended to --step-log (a file per process), and
    --step-sleep seconds of sleep."""

    def __init__(self, path: Path | None, sleep_s: float) -> None:
        self.path, self.sleep_s = path, sleep_s

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.path is not None:
            self.path.mkdir(exist_ok=True)
            with open(self.path / f"pid{os.getpid()}.txt", "a") as f:
                f.write(f"{trainer.global_step}\n")
        time.sleep(self.sleep_s)


def _strategy(name: str, ranks: int) -> Any:
    """`model_parallel`: Lightning's FSDP2 strategy, data-parallel over every rank (no tensor parallelism). `fsdp`:
    its FSDP1 strategy, which it refuses by name on CPU (its check looks at the exact class): a subclass, which FSDP1
    itself refuses on CPU as it wraps the model (the callback's refusal comes first)."""
    if name == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=ranks, tensor_parallel_size=1)
    if name == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        return type("CPUFSDPStrategy", (FSDPStrategy,), {})()
    return name


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ckpt", default="ckpt")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5, help="stalwart's checkpoint_every")
    p.add_argument("--plain", action="store_true", help="the Lightning Trainer alone (the baseline)")
    p.add_argument("--ga", type=int, default=1, help="accumulate_grad_batches")
    p.add_argument("--manual", action="store_true", help="manual optimization")
    p.add_argument("--two-optimizers", action="store_true", help="with --manual: two optimizers")
    p.add_argument(
        "--strategy",
        default="ddp",
        choices=["ddp", "fsdp", "model_parallel"],
        help="fsdp: FSDP1 (refused); model_parallel: FSDP2",
    )
    p.add_argument("--snapshot-every", type=int, help="stalwart's snapshot_every (node memory's cadence)")
    p.add_argument("--validate-every", type=int, default=0, help="a validation (2 batches) every this many batches")
    p.add_argument("--sched-frequency", type=int, default=1, help="the step LR schedule's frequency")
    p.add_argument("--step-log", type=Path)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--served-log", type=Path)
    p.add_argument("--setup-log", type=Path)
    p.add_argument("--die-at", default="", help="STEP:PHASE[:MICRO], see DieAt")
    args = p.parse_args()
    if args.setup_log is not None:
        with open(args.setup_log, "a") as f:
            f.write(f"{os.getpid()}\n")
    pl.seed_everything(0, verbose=False)
    module = Regressor(
        args.manual, args.two_optimizers, fsdp2=args.strategy == "model_parallel", frequency=args.sched_frequency
    )
    callbacks: list[Any] = []
    if args.die_at:
        step, phase, *micro = args.die_at.split(":")
        callbacks.append(DieAt(int(step), phase, int(micro[0]) if micro else 0))
    if args.step_log is not None or args.step_sleep:
        callbacks.append(StepLog(args.step_log, args.step_sleep))
    if not args.plain:
        from stalwart.integrations.lightning import StalwartCallback

        options = {} if args.snapshot_every is None else {"snapshot_every": args.snapshot_every}
        callbacks.append(StalwartCallback(args.ckpt, checkpoint_every=args.every, **options))
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=ranks,
        strategy=_strategy(args.strategy, ranks) if ranks > 1 else "auto",
        max_steps=args.steps,
        accumulate_grad_batches=args.ga,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **(
            {"val_check_interval": args.validate_every, "check_val_every_n_epoch": None, "limit_val_batches": 2}
            if args.validate_every
            else {}
        ),
    )
    loader = torch.utils.data.DataLoader(Items(96, args.served_log), batch_size=4, shuffle=True)
    validation = torch.utils.data.DataLoader(Items(16, None), batch_size=4) if args.validate_every else None
    trainer.fit(module, loader, validation)
    rank = int(os.environ.get("RANK", "0"))
    recipe_common.write_digest(args.out, rank, trainer.global_step, module)


if __name__ == "__main__":
    main()
