"""The job of `stalwart bench trainer`: a tiny GPT-2 in the Hugging Face Trainer's own loop, on 2 CPU ranks.

`--system hf`: `transformers.Trainer` as its users run it under torchrun: a checkpoint every 20 steps
(`save_steps`), a restart resumes from the newest (`resume_from_checkpoint`). `--system stalwart`: the same with
`stalwart.integrations.hf.Trainer` and a `StalwartCallback` with its defaults. Each step sleeps `--step-s` (a
stand-in for the compute a GPU would do), after `--setup-s` of set-up. Rank 1 of the first start SIGKILLs itself
as step `--kill-at` + 1 begins, the time of the kill written first. Every step end goes to `<out>/steps-<pid>.txt`
(global step, wall time); each rank's parameters' sha256 to `<out>/rank<R>.json` at the end.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import transformers

from stalwart.bench.common import TrainerStepClock, params_sha256, trainer_job_args

SAVE_STEPS = 20


def tiny_gpt2() -> transformers.GPT2LMHeadModel:
    """The bench's model (and the tests' HF Trainer script's): a 2-layer GPT-2 of width 32 over 64 tokens, the same
    initial weights in every process."""
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _Timing(transformers.TrainerCallback):
    def __init__(self, clock: TrainerStepClock) -> None:
        self.clock = clock

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.clock.begins(state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.clock.ended(state.global_step)


def main() -> None:
    args = trainer_job_args(("hf", "stalwart"))
    model = tiny_gpt2()
    hf_dir = args.out / "hf-checkpoints"
    training = transformers.TrainingArguments(
        output_dir=str(hf_dir),
        per_device_train_batch_size=4,
        max_steps=args.steps,
        learning_rate=1e-3,
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,
        save_strategy="steps" if args.system == "hf" else "no",
        save_steps=SAVE_STEPS,
        logging_steps=10**6,
        report_to=[],
        seed=0,
        disable_tqdm=True,
    )
    callbacks: list[Any] = [_Timing(TrainerStepClock(args.out, args.step_s, args.kill_at))]
    dataset = _Tokens(4096)
    if args.system == "hf":
        from transformers.trainer_utils import get_last_checkpoint

        trainer = transformers.Trainer(model=model, args=training, train_dataset=dataset, callbacks=callbacks)
        trainer.train(resume_from_checkpoint=get_last_checkpoint(str(hf_dir)) if hf_dir.is_dir() else None)
    else:
        from stalwart.integrations.hf import StalwartCallback, Trainer

        callbacks.append(StalwartCallback(str(args.out / "stalwart-checkpoints")))
        trainer = Trainer(model=model, args=training, train_dataset=dataset, callbacks=callbacks)
        trainer.train()
    result = {"sha256": params_sha256(trainer.model)}
    (args.out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
