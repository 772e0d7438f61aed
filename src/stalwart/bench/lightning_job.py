"""The job of `stalwart bench trainer --trainer lightning`: an MLP in the Lightning Trainer's own loop, on 2 CPU
ranks.

`--system plain`: `lightning.Trainer` as its users run it under torchrun: a checkpoint every 20 steps
(`ModelCheckpoint(every_n_train_steps=20, save_last=True)`), a restart resumes from it (`fit(ckpt_path="last")`).
`--system stalwart`: the same Trainer with stalwart's `StalwartCallback` and its defaults, Lightning's own
checkpoints off. Each step sleeps `--step-s` (a stand-in for the compute a GPU would do), after `--setup-s` of
set-up. Rank 1 of the first start SIGKILLs itself as step `--kill-at` + 1 begins, the time of the kill written
first. Every step end goes to `<out>/steps-<pid>.txt` (global step, wall time); each rank's parameters' sha256 to
`<out>/rank<R>.json` at the end.
"""

from __future__ import annotations

import json
import os
from typing import Any

import lightning.pytorch as pl
import torch

from stalwart.bench.common import TrainerStepClock, params_sha256, trainer_job_args

SAVE_STEPS = 20


class _LightningRegressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(256, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _LightningTiming(pl.Callback):
    def __init__(self, clock: TrainerStepClock) -> None:
        self.clock = clock

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.clock.begins(trainer.global_step)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.clock.ended(trainer.global_step)


def main() -> None:
    args = trainer_job_args(("plain", "stalwart"))
    callbacks: list[Any] = []
    ckpt_dir = args.out / "lightning-checkpoints"
    if args.system == "stalwart":
        from stalwart.integrations.lightning import StalwartCallback

        callbacks.append(StalwartCallback(str(args.out / "stalwart-checkpoints")))
    else:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=SAVE_STEPS, save_last=True))
    callbacks.append(_LightningTiming(TrainerStepClock(args.out, args.step_s, args.kill_at)))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy="ddp",
        max_steps=args.steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=args.system == "plain",
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    g = torch.Generator().manual_seed(7)
    data = torch.utils.data.TensorDataset(torch.randn(8192, 32, generator=g), torch.randn(8192, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
    module = _LightningRegressor()
    resume = "last" if args.system == "plain" and (ckpt_dir / "last.ckpt").exists() else None
    trainer.fit(module, loader, ckpt_path=resume)
    result = {"sha256": params_sha256(module)}
    (args.out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
