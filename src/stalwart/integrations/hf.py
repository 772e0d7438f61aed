"""stalwart for the Hugging Face Trainer (transformers 5.x): the Trainer's own loop driven through the Job's step
protocol, so that a kill costs the survivors one step redone in place instead of a restart of every worker.

    from stalwart.integrations.hf import StalwartCallback, Trainer

    trainer = Trainer(model=model, args=args, train_dataset=dataset,
                      callbacks=[StalwartCallback("ckpt", checkpoint_every=100)])
    trainer.train()

Why a subclass as well as a callback: a callback sees a step begin and end, but cannot put the Trainer's data
loader at a restored step, nor run a failed step again. The subclass overrides four of the Trainer's methods
(`train`, `get_batch_samples`, `training_step`, and the private `_run_epoch` and `_load_rng_state`, whose
signatures are checked at import: a transformers that moved them gets one clear error, not a wrong resume).
`StalwartCallback` given to a plain `transformers.Trainer` says so in one line and stops.

What it does, in the Trainer's order:
- `on_train_begin` (the model, optimizer and LR scheduler made and prepared): the Job (made here unless given) tracks
  them and the Trainer's progress (`TrainerState`: global step, epoch, log history, best metric), and resumes from
  the newest checkpoint that verifies (node memory, a peer, or storage); every generator comes back with it.
- The data position is the Trainer's own: its sampler is a pure function of the seed and the epoch, so the
  restored global step says where it is. The epochs before it are not run; in its epoch the Trainer skips the
  batches by index (accelerate's `skip_first_batches`: no item before the restored step is read).
- `on_step_begin`/`on_step_end`: the protocol's begin and end; a step's end takes stalwart's snapshot, checks and
  checkpoint. A peer's death inside a step is absorbed (the step's update dropped), `end()` recovers (re-forms in
  the loop, or trains on shrunk while the replacement sets up), and the step is run again here with the same
  micro-batches (`get_batch_samples` keeps them): forward and backward, clipping, the optimizer step, the LR
  scheduler step, as the Trainer makes them.
- `on_train_end`: the run's last state is durable (the step protocol's last checkpoint, or a save when the Trainer
  stopped early), and the Job is closed.

The Trainer's own `save_strategy` may stay on: its checkpoints are its own. `train(resume_from_checkpoint=...)`
is ignored, with one line: the run resumes from stalwart's checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
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


def _check_contract() -> None:
    """The private methods the subclass overrides must take what it passes: else one clear error at import."""
    run_epoch = getattr(transformers.Trainer, "_run_epoch", None)
    params = set(inspect.signature(run_epoch).parameters) if run_epoch is not None else set()
    missing = [name for name in _RUN_EPOCH_ARGS if name not in params]
    if missing or not hasattr(transformers.Trainer, "_load_rng_state"):
        raise ImportError(
            f"stalwart.integrations.hf supports transformers 5.x (tested with {TESTED}); transformers "
            f"{transformers.__version__}'s Trainer has no _run_epoch({', '.join(missing)}) or _load_rng_state"
        )


_check_contract()


class _Progress:
    """The Trainer's progress (its `TrainerState`, and what it has logged of the loss), tracked by the Job so that a
    restore puts it back. The same on every rank (the Trainer gathers what it sums), so replicated: it may change
    after the optimizer step (the global step does) without turning light snapshots off. It also carries the loss
    this rank summed since the last log line, which a replacement that grows back into the job after the survivors
    trained on shrunk takes as its own (its predecessor's is older than the last log line)."""

    stalwart_replicated = True
    FIELDS = (
        "global_step",
        "epoch",
        "total_flos",
        "log_history",
        "best_metric",
        "best_global_step",
        "best_model_checkpoint",
        "num_input_tokens_seen",
    )

    def __init__(self, trainer: transformers.Trainer) -> None:
        self._trainer = trainer
        self.since_logged: torch.Tensor | None = None

    def state_dict(self) -> dict[str, Any]:
        t = self._trainer
        fields = {name: getattr(t.state, name, None) for name in self.FIELDS}
        fields["logged_total"] = getattr(t, "_total_loss_scalar", 0.0)
        fields["logged_at"] = getattr(t, "_globalstep_last_logged", 0)
        return {"json": json.dumps(fields), "since_logged": _since_logged(t)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        t = self._trainer
        fields = json.loads(saved["json"])
        t._total_loss_scalar = fields.pop("logged_total")
        t._globalstep_last_logged = fields.pop("logged_at")
        for name, value in fields.items():
            if hasattr(t.state, name):
                setattr(t.state, name, value)
        self.since_logged = saved["since_logged"]


class _LoggedLoss:
    """The loss this rank summed towards the Trainer's next log line: a replacement or a restart logs the same loss
    as a run without the failure."""

    def __init__(self, trainer: transformers.Trainer) -> None:
        self._trainer = trainer
        self.loaded_at: int | None = None

    def state_dict(self) -> dict[str, Any]:
        t = self._trainer
        return {"since_logged": _since_logged(t), "logged_at": getattr(t, "_globalstep_last_logged", 0)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        _set_since_logged(self._trainer, saved["since_logged"])
        self.loaded_at = saved["logged_at"]


def _since_logged(trainer: transformers.Trainer) -> torch.Tensor | None:
    since = getattr(trainer, "_tr_loss", None)
    return since.detach().clone() if since is not None else None


def _set_since_logged(trainer: transformers.Trainer, value: torch.Tensor | None) -> None:
    if value is not None and hasattr(trainer, "_tr_loss"):
        trainer._tr_loss = value.to(trainer._tr_loss.device)


def _settle_logged(trainer: transformers.Trainer, progress: _Progress, logged: _LoggedLoss) -> None:
    """After a restore: this rank's own sum if it is of the Trainer's current log window, else (a replacement
    that grew back into the job, its predecessor's snapshot older than the last log line) the one of the rank
    the progress came from."""
    if logged.loaded_at is not None and logged.loaded_at != getattr(trainer, "_globalstep_last_logged", 0):
        _set_since_logged(trainer, progress.since_logged)


def _match_accelerate() -> None:
    """Accelerate sizes its gathers and scales its losses by the world it started in (`num_processes` of its
    `PartialState` and `AcceleratorState`, the Trainer's `args.world_size`); while the survivors train on shrunk
    their group is smaller, and back at full size after the grow. Its shared states follow the job's group."""
    if not torch.distributed.is_initialized():
        return
    from accelerate.state import AcceleratorState, PartialState

    size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    for shared in (PartialState._shared_state, AcceleratorState._shared_state):
        if "num_processes" in shared and (shared["num_processes"], shared.get("process_index")) != (size, rank):
            shared["num_processes"], shared["process_index"] = size, rank


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
        progress, logged = _Progress(trainer), _LoggedLoss(trainer)
        objects["progress"], objects["logged_loss"] = progress, logged
        if trainer.lr_scheduler is not None:
            objects["lr_scheduler"] = trainer.lr_scheduler
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None:
            objects["grad_scaler"] = scaler
        job.track(**objects)
        job.resume()
        _settle_logged(trainer, progress, logged)
        if job.resumed_from is not None and job.step > 0:
            self.resumed_step, self.rng = job.step, capture_rng()
        self._loop = job.loop(None, max_steps=state.max_steps)
        self._next = self._begin()

    def _begin(self) -> Step | None:
        """The protocol's begin, with Accelerate told the world size the step runs at (training on shrunk)."""
        assert self._loop is not None
        step = self._loop.begin()
        _match_accelerate()
        return step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = self._next
        if step is None:  # the Job's run is over (it reached max_steps): the Trainer's must be too
            control.should_training_stop = True
            return
        assert self.trainer is not None and self._loop is not None
        self.trainer.stalwart_step_began(step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The step's end (the Job's: snapshot, checks, checkpoint), then the next step's begin. After a peer's
        failure the job recovered inside `end()` and its next steps are ones the Trainer already ran: each runs
        again here, from the state before it, up to the step the Trainer is at."""
        loop, trainer = self._loop, self.trainer
        assert loop is not None and trainer is not None
        ran = state.global_step  # the steps the Trainer has run
        epoch = state.epoch
        loop.end()
        step = self._begin()
        while step is not None and step.number < ran:
            trainer.stalwart_run_again(step)
            loop.end()
            step = self._begin()
        state.epoch = epoch
        self._next = step

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        job, loop = self.job, self._loop
        if job is None:
            return
        stopped_early = loop is not None and loop.step is not None
        if loop is not None:
            loop.close()
        if stopped_early and job.step != job.parts.last_saved:
            job.save(wait=True)  # the Trainer stopped before max_steps: its last state is durable all the same
        job.close()


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
        self._fetched: tuple[list[Any], Any] | None = None
        self._kept: dict[int, _Kept] = {}  # the last steps', by number: what running one again takes

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint:
            say("stalwart: train(resume_from_checkpoint=...) is ignored: the run resumes from stalwart's checkpoints")
        return super().train(None, *args, **kwargs)

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's epoch, from stalwart's restored step: the epochs before it are not run, and in its epoch
        the Trainer skips the batches before it by index."""
        resumed = self.stalwart.resumed_step
        if resumed is not None and resumed >= self.state.max_steps:
            return None  # resumed at the run's end: nothing is left to train
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

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list[Any], Any]:
        """The step's micro-batches, kept: a failed step runs again with them."""
        window, items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._fetched = (window, items)
        return window, items

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        job = self.stalwart.job
        if job is not None:
            job.report(loss=loss)
        return loss

    # -- what the callback calls ------------------------------------------------------------------------------

    def stalwart_step_began(self, step: Step) -> None:
        """A step begins: keep what running it again takes (its micro-batches, the loss the Trainer summed so far,
        every generator: the Trainer may have drawn from them since the last snapshot, at an epoch's start)."""
        if self.state.global_step != step.number:
            raise ConfigError(
                f"the Trainer is at step {self.state.global_step} where stalwart's job is at {step.number}: "
                "a callback or subclass moved state.global_step"
            )
        if self._fetched is None:
            raise ConfigError("stalwart: the Trainer began a step without get_batch_samples(): its loop has changed")
        loss = self._tr_loss.detach().clone() if hasattr(self, "_tr_loss") else None
        self._kept[step.number] = _Kept(self._fetched[0], loss, capture_rng())
        for old in [n for n in self._kept if n < step.number - _KEPT_STEPS]:
            del self._kept[old]

    def stalwart_run_again(self, step: Step) -> None:
        """Run `step` again after the job recovered (its state is that before the step): the same micro-batches
        and generators, forward and backward, then the update, as the Trainer's loop makes it."""
        kept = self._kept.get(step.number)
        if kept is None:
            raise ConfigError(
                f"stalwart: the job went back to step {step.number}, further than the {_KEPT_STEPS} steps whose "
                "micro-batches the Trainer keeps"
            )
        model = self.model_wrapped
        if kept.loss is not None and self._globalstep_last_logged <= step.number:
            self._tr_loss = kept.loss.clone()  # a step run again counts once in the logged loss
        restore_rng(kept.rng)
        items = self._get_num_items_in_batch(kept.window, self.args.device)  # a collective: on the new group
        model.zero_grad()
        for i, inputs in enumerate(kept.window):
            last = i == len(kept.window) - 1
            self.accelerator.gradient_state._set_sync_gradients(last)
            sync = contextlib.nullcontext if last else functools.partial(self.accelerator.no_sync, model=model)
            with sync():
                loss = self.training_step(model, inputs, items)
            self._tr_loss += loss
        if self.args.max_grad_norm > 0:
            self._clip_grad_norm(model)
        assert self.optimizer is not None
        self.optimizer.step()
        scheduler = self.lr_scheduler
        plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)  # stepped with the metrics
        if scheduler is not None and not plateau and not self.accelerator.optimizer_step_was_skipped:
            scheduler.step()
        model.zero_grad()
        self.state.global_step = step.number + 1


_KEPT_STEPS = 4
"""How many steps back the Trainer keeps its micro-batches: a recovery goes back to the newest snapshot every rank
holds, the step before the failed one unless a snapshot was skipped."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Kept:
    """What running a step again takes: its micro-batches, the Trainer's summed loss and every generator at its
    begin."""

    window: list[Any]
    loss: torch.Tensor | None
    rng: dict[str, Any]
