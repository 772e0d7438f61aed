"""A Hugging Face Trainer script as its users write one (a tiny GPT-2 from a config, a map-style dataset, the
Trainer's own loop), with stalwart's one change: `stalwart.integrations.hf.Trainer` and a `StalwartCallback`
(docs/integrations.md). `--plain` runs the same script on `transformers.Trainer` alone, the baseline.

The dataset records which indices it served (--served-log, a file per process), the script's set-up which
processes ran it (--setup-log); each rank writes its parameters' sha256 to --out/rank<R>.json."""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path
from typing import Any

import recipe_common
import torch
import transformers

from stalwart.bench.trainer_job import tiny_gpt2


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Random token sequences, the same in every process; each served index is appended to `log`."""

    def __init__(self, n: int, length: int, vocab: int, log: Path | None) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(7))
        self.log = log

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.log is not None:
            self.log.mkdir(exist_ok=True)
            with open(self.log / f"pid{os.getpid()}.txt", "a") as f:
                f.write(f"{i}\n")
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """`--iterable`: the same items as an IterableDataset, in their order, round after round (as a stream that does
    not end); each served index is appended to `log`."""

    def __init__(self, items: Tokens) -> None:
        self.items = items

    def __iter__(self) -> Any:
        while True:
            for i in range(len(self.items)):
                yield self.items[i]


class DieAt(transformers.TrainerCallback):
    """Rank 1 of the first round SIGKILLs itself at step STEP, in PHASE: begin (before the forward), backward (a
    gradient hook, DDP's all-reduce of another bucket in flight) or optimizer (before the update)."""

    def __init__(self, step: int, phase: str, model: torch.nn.Module) -> None:
        self.step, self.phase = step, phase
        self.armed = os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if self.armed and phase == "backward":
            model.transformer.h[0].mlp.c_fc.weight.register_hook(lambda g: self._die(self.now))
        self.now = -1

    def _die(self, step: int) -> None:
        if self.armed and step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.now = state.global_step
        if self.phase == "begin":
            self._die(state.global_step)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.phase == "optimizer":
            self._die(state.global_step)


class StepLog(transformers.TrainerCallback):
    """The Trainer's own callbacks: each step end's global step, appended to --step-log (a file per process), and
    --step-sleep seconds of sleep (a step long enough for a test to stop the run at a given step)."""

    def __init__(self, log: Path | None, sleep_s: float) -> None:
        self.log, self.sleep_s = log, sleep_s

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.log is not None:
            self.log.mkdir(exist_ok=True)
            with open(self.log / f"pid{os.getpid()}.txt", "a") as f:
                f.write(f"{state.global_step}\n")
        time.sleep(self.sleep_s)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ckpt", default="ckpt")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=10, help="stalwart's checkpoint_every")
    p.add_argument("--ga", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--plain", action="store_true", help="transformers.Trainer alone (the baseline)")
    p.add_argument("--plain-with-callback", action="store_true", help="transformers.Trainer with a StalwartCallback")
    p.add_argument("--iterable", action="store_true", help="the dataset as an IterableDataset")
    p.add_argument("--step-log", type=Path)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--served-log", type=Path)
    p.add_argument("--setup-log", type=Path)
    p.add_argument("--die-at", default="", help="STEP:PHASE, see DieAt")
    p.add_argument("--divergence-every", type=int, default=100, help="stalwart's replica divergence check")
    args = p.parse_args()
    if args.setup_log is not None:
        with open(args.setup_log, "a") as f:
            f.write(f"{os.getpid()}\n")
    model = tiny_gpt2()  # `stalwart bench trainer`'s
    training = transformers.TrainingArguments(
        output_dir="hf-out",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=args.ga,
        max_steps=args.steps,
        learning_rate=1e-3,
        use_cpu=True,
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,  # one process: no group
        ddp_find_unused_parameters=False,
        save_strategy="no",
        logging_steps=5,
        report_to=[],
        seed=0,
        disable_tqdm=True,
    )
    callbacks: list[Any] = []
    if args.die_at:
        step, phase = args.die_at.split(":")
        callbacks.append(DieAt(int(step), phase, model))
    if args.step_log is not None or args.step_sleep:
        callbacks.append(StepLog(args.step_log, args.step_sleep))
    dataset: Any = Tokens(256, 16, 64, args.served_log)
    if args.iterable:
        dataset = Stream(dataset)
    if args.plain_with_callback:
        from stalwart.integrations.hf import StalwartCallback

        callbacks.append(StalwartCallback(args.ckpt))
        trainer = transformers.Trainer(model=model, args=training, train_dataset=dataset, callbacks=callbacks)
    elif args.plain:
        trainer = transformers.Trainer(model=model, args=training, train_dataset=dataset, callbacks=callbacks)
    else:
        from stalwart.integrations.hf import StalwartCallback, Trainer

        callbacks.append(
            StalwartCallback(args.ckpt, checkpoint_every=args.every, divergence_every=args.divergence_every)
        )
        trainer = Trainer(model=model, args=training, train_dataset=dataset, callbacks=callbacks)
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    recipe_common.write_digest(args.out, rank, trainer.state.global_step, trainer.model)


if __name__ == "__main__":
    main()
