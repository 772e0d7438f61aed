"""stalwart for the Hugging Face Trainer (transformers 5.x): the Trainer's own loop driven through the Job's step
protocol, so that a kill costs the survivors one step redone in place instead of a restart of every worker.

    from stalwart.integrations.hf import StalwartCallback, Trainer

    trainer = Trainer(model=model, args=args, train_dataset=dataset,
                      callbacks=[StalwartCallback("ckpt", checkpoint_every=100)])
    trainer.train()

Why a subclass as well as a callback: a callback sees a step begin and end, but cannot put the Trainer's data
loader at a restored step, nor run a failed step again. The subclass overrides `train`, `get_batch_samples` and
`training_step`, and the private `_run_epoch`, `_load_rng_state`, `_maybe_log_save_evaluate` and
`_finalize_training` (checked at import with the private helpers it calls: a transformers that moved them gets one
clear error, not a wrong resume). `StalwartCallback` given to a plain `transformers.Trainer` says so in one line and
stops at the Trainer's init.

What it does, in the Trainer's order:
- At the Trainer's init the Job is made (before the Trainer wraps its model: a replacement's group keeps the
  wrapper's collectives to itself until the survivors' state arrived).
- `on_train_begin` (the model, optimizer and LR scheduler made and prepared): the Job tracks them, the Trainer's
  progress (`TrainerState`: global step, epoch, log history, best metric; hf_state.py) and the loss each rank sums
  towards the next log line, and its first step's begin resumes from the newest state that verifies (node memory,
  a peer, or storage); every generator comes back with it.
- The data position is the Trainer's own: its sampler is a pure function of the seed and the epoch, so the
  restored global step says where it is. The epochs before it are not run; in its epoch the Trainer skips the
  batches by index (accelerate's `skip_first_batches`: no item of a map-style dataset before the restored step is
  read).
- `on_step_begin`: the protocol's begin (each step's micro-batches and generators kept back to the job's redo
  horizon). `on_step_end`: a step whose update was dropped (a peer died in it) runs again here, after the job
  recovered (re-formed in the loop, or training on shrunk while the replacement sets up), with the same
  micro-batches: forward and backward, clipping, the optimizer and LR scheduler steps, as the Trainer makes them.
  Then the Trainer logs, saves and evaluates (under `job.busy()` when it saves or evaluates), and only then comes
  the Job's end of the step (`_maybe_log_save_evaluate`): snapshot, checks, checkpoint, so that a restore puts
  back what the log line changed.
- The loop's end (`_finalize_training`, before a best model is loaded): the run's last state is durable (the step
  protocol's last checkpoint, or a save when the Trainer stopped early). The Job stays open until the process
  exits, so its group serves the Trainer's collectives after training.

The Trainer's own `save_strategy` may stay on: its checkpoints are its own. `train(resume_from_checkpoint=...)`
is ignored, with one line: the run resumes from stalwart's checkpoints. Refused with one line at the Trainer's init
(hf_state.check_engine, check_dataset): DeepSpeed, FSDP1 and an iterable dataset; FSDP2 is let through, said to be
untested (Accelerate enables FSDP only on a GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
from typing import Any

from stalwart.errors import ConfigError
from stalwart.job.job import Job
from stalwart.job.rng import capture_rng, restore_rng
from stalwart.job.step_loop import Step, StepLoop
from stalwart.runtime.process import say

try:
    import torch
    import transformers
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "stalwart.integrations.hf needs transformers: pip install 'transformers>=5' (tested with 5.23)"
    ) from exc

TESTED = "5.23"
"""The transformers release the tests run (pyproject's dev extras pin it)."""

_RESUMED = "<stalwart>"
"""What the Trainer's epoch sees as `resume_from_checkpoint` when stalwart resumed: its batch skip runs, and its RNG
re-sync after that skip restores stalwart's generators (`Trainer._load_rng_state`)."""

_RUN_EPOCH_ARGS = (
    "epoch",
    "num_update_steps_per_epoch",
    "resume_from_checkpoint",
    "epochs_trained",
    "steps_trained_in_current_epoch",
)
_PRIVATE = (
    "_run_epoch",
    "_load_rng_state",
    "_maybe_log_save_evaluate",
    "_finalize_training",
    "_get_num_items_in_batch",
    "_clip_grad_norm",
)
"""The Trainer's private methods the subclass overrides or calls."""

_SCHEDULERS_STEPPED_WITH_METRICS = ("ReduceLROnPlateau", "GreedyLR")
"""LR schedulers the Trainer steps with the evaluation's metrics, not after each optimizer step."""


def _check_contract() -> None:
    """The private methods the subclass overrides must take what it passes: else one clear error at import."""
    run_epoch = getattr(transformers.Trainer, "_run_epoch", None)
    params = set(inspect.signature(run_epoch).parameters) if run_epoch is not None else set()
    missing = [name for name in _RUN_EPOCH_ARGS if name not in params]
    absent = [name for name in _PRIVATE if not hasattr(transformers.Trainer, name)]
    if missing or absent:
        raise ImportError(
            f"stalwart.integrations.hf supports transformers 5.x (tested with {TESTED}); transformers "
            f"{transformers.__version__}'s Trainer lacks {', '.join([*absent, *(f'_run_epoch({m})' for m in missing)])}"
        )


_check_contract()

from stalwart.integrations.hf_state import (  # noqa: E402  (after the check)
    LoggedLoss,
    TrainerProgress,
    check_dataset,
    check_engine,
    match_accelerate,
)


class StalwartCallback(transformers.TrainerCallback):
    """The Job's options (`checkpoint_dir` and those of `stalwart.Job`), or a Job of your own (`job=`), for
    `stalwart.integrations.hf.Trainer`; see the module docstring."""

    def __init__(
        self, checkpoint_dir: str | os.PathLike[str] | None = None, *, job: Job | None = None, **job_options: Any
    ) -> None:
        if (checkpoint_dir is None) == (job is None):
            raise ConfigError("StalwartCallback takes a checkpoint directory or a job=, one of them")
        self._dir, self._options = checkpoint_dir, job_options
        self.job = job
        self.trainer: Trainer | None = None
        """Set by stalwart's Trainer, which the callback drives."""
        self._loop: StepLoop | None = None
        self._next: Step | None = None  # begun at the previous step's end, handed out at the next step's begin
        self._ending = False  # a step ended in the Trainer's loop: the Job's end follows its log line
        self._logged: LoggedLoss | None = None
        self._formation: int | None = None  # the job's formation at the last begin: a new one (re)formed the group
        self.rng: dict[str, Any] | None = None
        """Every generator as the restore left it (None: a fresh start), for the Trainer's re-sync after its skip."""
        self.resumed_step: int | None = None

    def make_job(self) -> Job:
        """The Job, made before the Trainer wraps its model: a replacement's group then keeps the wrapper's
        collectives to itself until the survivors' state arrived, as for `stalwart.Job()` made first."""
        if self.job is None:
            assert self._dir is not None
            self.job = Job(self._dir, **self._options)
        return self.job

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._ours()

    def _ours(self) -> Trainer:
        if self.trainer is None:
            raise ConfigError(
                "StalwartCallback needs stalwart.integrations.hf.Trainer in place of transformers.Trainer: a callback "
                "alone cannot put the Trainer's data at a restored step or run a failed step again"
            )
        return self.trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._ours()
        job = self.make_job()
        objects: dict[str, Any] = {"model": trainer.model, "optimizer": trainer.optimizer}
        self._logged = LoggedLoss(trainer)
        objects["progress"], objects["logged_loss"] = TrainerProgress(trainer), self._logged
        if trainer.lr_scheduler is not None:
            objects["lr_scheduler"] = trainer.lr_scheduler
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None:
            objects["grad_scaler"] = scaler
        job.track(**objects)
        self._loop = job.loop(None, max_steps=state.max_steps)
        self._next = self._begin()  # the first: the job resumes (and re-forms if a peer is lost meanwhile)
        if job.resumed_from is not None and job.step > 0:
            self.resumed_step, self.rng = job.step, capture_rng()

    def _begin(self) -> Step | None:
        """The protocol's begin, with Accelerate told the world size the step runs at (training on shrunk), and the
        logged loss settled after a restore."""
        assert self._loop is not None and self._logged is not None
        step = self._loop.begin()
        match_accelerate()
        now = self._loop.formation()
        new_formation, self._formation = now != self._formation, now
        if step is not None:
            self._logged.settle(new_formation)
        return step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = self._next
        if step is None:  # the Job's run is over (it reached max_steps): the Trainer's must be too
            control.should_training_stop = True
            return
        assert self._loop is not None
        self._ours().stalwart_step_began(step, self._loop.horizon())

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._logged is not None:
            self._logged.capture()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The step ended in the Trainer's loop. A step whose update was dropped (a peer failed in it) is run
        again here first, after the job recovered, so that the Trainer logs, saves and evaluates complete steps
        only; the Job's end of the step follows the Trainer's log line (`step_end`)."""
        loop = self._loop
        if loop is None or self._next is None or loop.step is None:
            return
        if loop.update_dropped():
            self._run_again_up_to(state, state.global_step - 1)
        self._ending = True

    def step_end(self) -> None:
        """The Job's end of the step the Trainer ended, after its log line, save and evaluation (so that a restore
        puts back what they changed): snapshot, checks, checkpoint, then the next step's begin. A failure met at
        the step's end (after its update) or a numeric rollback makes the job go back: the steps since are run
        again here."""
        if not self._ending:
            return
        self._ending = False
        loop, trainer = self._loop, self._ours()
        assert loop is not None
        state = trainer.state
        loop.end()
        self._next = self._begin()
        if self._next is not None and self._next.number < state.global_step:
            self._run_again_up_to(state, state.global_step - 1, begun=True)

    def _run_again_up_to(self, state: Any, last: int, *, begun: bool = False) -> None:
        """Recover (unless `begun`: the job already did) and run the steps the Trainer ran again, from the one the
        job went back to, up to `last`: each but `last` ended by the Job here, `last` left begun for the
        caller's end. The Trainer's global step and epoch as its loop left them."""
        loop, trainer = self._loop, self._ours()
        assert loop is not None
        epoch = state.epoch
        if not begun:
            loop.end()  # recovers: re-forms (or trains on shrunk), restores, and begins the step to redo
            self._next = self._begin()
        while self._next is not None and self._next.number <= last:
            step = self._next
            trainer.stalwart_run_again(step)
            if step.number == last and not begun:
                break  # the failed step itself: its end follows the Trainer's log line
            loop.end()
            self._next = self._begin()
        if self._next is not None and self._next.number > state.global_step:
            state.global_step = self._next.number  # a rollback skipped a batch: the Trainer's count follows
        state.epoch = epoch

    def finish(self) -> None:
        """The Trainer's loop is over (before it loads a best model at the end): the step protocol is left, and a
        run the Trainer stopped before max_steps (an early stop) has its last state made durable all the same. The
        Job stays open until the process exits: its group serves the Trainer's collectives after training (an
        evaluation)."""
        job, loop = self.job, self._loop
        if job is None or loop is None:
            return
        stopped_early = loop.step is not None
        loop.close()
        self._loop = None
        if stopped_early and job.step != job.parts.last_saved:
            job.save(wait=True)


class Trainer(transformers.Trainer):
    """`transformers.Trainer`, driven through stalwart's step protocol by its `StalwartCallback` (one is added,
    with its checkpoints in `<output_dir>/stalwart`, when none is given); see the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for cb in kwargs.get("callbacks") or ():
            if isinstance(cb, StalwartCallback):
                cb.trainer = self  # before the Trainer's on_init_end, where a callback on a plain Trainer stops
        super().__init__(*args, **kwargs)
        ours = [cb for cb in self.callback_handler.callbacks if isinstance(cb, StalwartCallback)]
        if not ours:
            ours = [StalwartCallback(os.path.join(self.args.output_dir or ".", "stalwart"))]
        if len(ours) > 1:
            raise ConfigError("one StalwartCallback per Trainer")
        # First: the other callbacks see a step's end once the step is complete (run again after a failure).
        handler = self.callback_handler.callbacks
        handler[:] = [ours[0], *(cb for cb in handler if cb is not ours[0])]
        self.stalwart = ours[0]
        self.stalwart.trainer = self
        self.stalwart.make_job()
        # What it cannot protect, refused with one line (the Job made: its hook says a ConfigError so, exit 78).
        check_dataset(self.train_dataset)
        untested = check_engine(self)  # DeepSpeed and FSDP1 refused; FSDP2 said untested
        if untested is not None and self.args.process_index == 0:
            say(untested)
        self._fetched: list[Any] | None = None
        self._kept: dict[int, _Kept] = {}  # the steps' since the job's redo horizon, by number

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint:
            say("stalwart: train(resume_from_checkpoint=...) is ignored: the run resumes from stalwart's checkpoints")
        return super().train(None, *args, **kwargs)

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's epoch, from stalwart's restored step: the epochs before it are not run, and in its epoch
        the Trainer skips the batches before it by index."""
        resumed = self.stalwart.resumed_step
        if resumed is not None and resumed >= self.state.max_steps:
            self.control.should_training_stop = True  # resumed at the run's end: nothing is left to train
            return None
        if resumed is not None and not args:
            done_epochs, in_epoch = divmod(resumed, kwargs["num_update_steps_per_epoch"])
            if kwargs["epoch"] < done_epochs:
                return None
            if kwargs["epoch"] == done_epochs:
                skipped = in_epoch * self.args.gradient_accumulation_steps
                kwargs.update(
                    resume_from_checkpoint=_RESUMED, epochs_trained=done_epochs, steps_trained_in_current_epoch=skipped
                )
        return super()._run_epoch(*args, **kwargs)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint != _RESUMED:
            return super()._load_rng_state(checkpoint)
        if self.stalwart.rng is not None:
            restore_rng(self.stalwart.rng)
        return None

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's log line, save and evaluation of the step that ended, then the Job's end of it. An
        evaluation or a save is a long stretch inside the step: the hang detector allows the grace period."""
        job = self.stalwart.job
        long = (
            job is not None
            and job.state.value == "running"
            and (self.control.should_evaluate or self.control.should_save)
        )
        with job.busy() if long and job is not None else contextlib.nullcontext():
            done = super()._maybe_log_save_evaluate(*args, **kwargs)
        self.stalwart.step_end()
        return done

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        self.stalwart.finish()
        return super()._finalize_training(*args, **kwargs)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list[Any], Any]:
        """The step's micro-batches, kept: a failed step runs again with them."""
        window, items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._fetched = window
        return window, items

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        job = self.stalwart.job
        if job is not None and self.accelerator.gradient_state.sync_gradients:
            job.report(loss=loss)  # the step's last micro-batch: one report a step
        return loss

    # -- what the callback calls ------------------------------------------------------------------------------

    def stalwart_step_began(self, step: Step, horizon: int) -> None:
        """A step begins: keep what running it again takes (its micro-batches and every generator: the Trainer may
        have drawn from them since the last snapshot, at an epoch's start), for the steps since the oldest one a
        recovery may go back to."""
        if self.state.global_step != step.number:
            raise ConfigError(
                f"the Trainer is at step {self.state.global_step} where stalwart's job is at {step.number}: "
                "a callback or subclass moved state.global_step"
            )
        if self._fetched is None:
            raise ConfigError("stalwart: the Trainer began a step without get_batch_samples(): its loop has changed")
        self._kept[step.number] = _Kept(self._fetched, capture_rng())
        self._fetched = None
        for old in [n for n in self._kept if n < horizon]:
            del self._kept[old]

    def stalwart_run_again(self, step: Step) -> None:
        """Run `step` again after the job recovered (its state is that before the step): the same micro-batches
        and generators, forward and backward, then the update, as the Trainer's loop makes it."""
        kept = self._kept.get(step.number)
        if kept is None:
            raise ConfigError(
                f"stalwart: the job went back to step {step.number}, before the steps whose micro-batches the "
                "Trainer kept"
            )
        model = self.model_wrapped
        restore_rng(kept.rng)
        items = self._get_num_items_in_batch(kept.window, self.args.device)  # a collective: on the new group
        self.current_gradient_accumulation_steps = len(kept.window)
        model.zero_grad()
        for i, inputs in enumerate(kept.window):
            last = i == len(kept.window) - 1
            self.accelerator.gradient_state._set_sync_gradients(last)
            sync = contextlib.nullcontext if last else functools.partial(self.accelerator.no_sync, model=model)
            with sync():
                loss = self.training_step(model, inputs, items)
            if self.args.logging_nan_inf_filter and not torch.isfinite(loss).all():
                self._tr_loss += self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
            else:
                self._tr_loss += loss
            self._track_num_input_tokens(inputs)
        if self.args.max_grad_norm > 0:
            self._clip_grad_norm(model)
        self.stalwart.on_pre_optimizer_step(self.args, self.state, self.control)
        assert self.optimizer is not None
        self.optimizer.step()
        scheduler = self.lr_scheduler
        by_metrics = type(scheduler).__name__ in _SCHEDULERS_STEPPED_WITH_METRICS
        if scheduler is not None and not by_metrics and not self.accelerator.optimizer_step_was_skipped:
            scheduler.step()
        model.zero_grad()
        self.state.global_step = step.number + 1


@dataclasses.dataclass(frozen=True, slots=True)
class _Kept:
    """What running a step again takes: its micro-batches and every generator at its begin."""

    window: list[Any]
    rng: dict[str, Any]
