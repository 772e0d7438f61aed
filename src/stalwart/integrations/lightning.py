"""stalwart for the Lightning Trainer (lightning 2.6): the Trainer's own loop driven through the Job's step
protocol by one callback, so that a kill costs the survivors the failed step, run again in place, instead of a
restart of every worker and the steps since the last checkpoint.

    from stalwart.integrations.lightning import StalwartCallback

    trainer = L.Trainer(strategy="ddp", max_steps=1000, callbacks=[StalwartCallback("ckpt", checkpoint_every=100)])
    trainer.fit(model, dataloader)

What it does, in the Trainer's order (lightning_state.py holds what it tracks):
- The callback's construction makes the Job, and with it the process group (Lightning's strategy finds it made):
  before the Trainer's first collective, so that a replacement keeps the Trainer's set-up collectives to itself
  until the survivors' state arrived, as for `stalwart.Job()` made first in a script.
- `setup`: the strategy's optimizer step runs the Trainer's closure (forward, backward) before the optimizer's step
  is called, not inside it, so that what stalwart hooks before an update (the numeric guard, the update dropped
  after a peer's failure, the snapshot's commit point) sees the step's gradients, as in any loop that calls
  `optimizer.step()` after `backward()`.
- `on_fit_start` (the model wrapped, the optimizers made): the Job tracks the LightningModule, the optimizers,
  the LR schedulers and the Trainer's progress (its loops' counters and the callbacks' states), and its first
  step's begin resumes from the newest state that verifies (node memory, a peer, or storage), every generator
  with it. The loops' counters are restored as Lightning restores them from its own checkpoint saved at a batch's
  end, so the Trainer goes on from the next batch.
- `on_train_start` (the train data loaders made): after a resume, each one's sampler skips the batches of the epoch
  the restored run had drawn, by index, once: no item before the restored step is read, and the batch order is the
  uninterrupted run's (the sampler is a function of its seed and the epoch).
- `on_train_batch_start`: each micro-batch of the step (one, or `accumulate_grad_batches`) kept with every
  generator as it began, for the steps back to the job's redo horizon. `on_train_batch_end` (this callback runs
  first) of the micro-batch that stepped the optimizer: a step whose update was dropped (a peer died in it) is run
  again here, after the job recovered, with the same micro-batches and generators, before any other callback sees
  the step's end; and where the job went back further (sharded state: FSDP2's shards of the failed step are lost
  with the rank, node memory holds an older step whole), each step since, one by one; then the Job's end of the
  step: snapshot, checks, checkpoint.

Manual optimization is run again likewise (the module's `training_step`, which steps its optimizer itself). FSDP2 is
Lightning's `ModelParallelStrategy` (`fully_shard` in `configure_model`). Not covered yet, each refused with one
line: more than one optimizer, a strategy whose engine accumulates gradients itself (DeepSpeed), Lightning's FSDP1
strategy (`FSDPStrategy`), and an iterable dataset's loader (its position is not a function of the step).
Lightning's own `ModelCheckpoint` may stay on: its checkpoints are its own; `fit(ckpt_path=...)` is refused with one
line, since the run resumes from stalwart's.
"""

from __future__ import annotations

import os
from typing import Any

from stalwart.errors import ConfigError
from stalwart.job.job import Job
from stalwart.job.rng import capture_rng, restore_rng
from stalwart.job.step_loop import Step, StepLoop
from stalwart.runtime.dist import Placement

try:
    import lightning.pytorch as pl
    import torch
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("stalwart.integrations.lightning needs lightning: pip install 'lightning>=2.6'") from exc

from stalwart.integrations.lightning_state import (
    EpochStart,
    KeptStep,
    LightningProgress,
    closure_first,
    local_broadcasts_while_joining,
    track_loaders,
)

local_broadcasts_while_joining()

TESTED = "2.6.6"
"""The lightning release the tests run (pyproject's dev extras pin it)."""


class StalwartLightningCallback(pl.Callback):
    """The Job's options (`checkpoint_dir` and those of `stalwart.Job`), or a Job of your own (`job=`); see the
    module docstring."""

    def __init__(
        self, checkpoint_dir: str | os.PathLike[str] | None = None, *, job: Job | None = None, **job_options: Any
    ) -> None:
        if (checkpoint_dir is None) == (job is None):
            raise ConfigError("StalwartCallback takes a checkpoint directory or a job=, one of them")
        # The Job first, before the Trainer makes any collective (its strategy's set-up broadcasts the log
        # directory): it makes the process group, which the strategy then finds made, and a replacement's group
        # keeps the Trainer's collectives to itself until the survivors' state arrived.
        self.job = job if job is not None else Job(checkpoint_dir, **job_options)  # type: ignore[arg-type]
        self._loop: StepLoop | None = None
        self._next: Step | None = None  # begun at the previous step's end, handed out at the next batch's start
        # Each step's micro-batches (batch, index, every generator as it began) and the optimizer's counters as
        # its first began, back to the job's redo horizon: what running those steps again needs.
        self._kept: dict[int, KeptStep] = {}
        self._made: int | None = None  # the step the last batch made (what a validation or a save follows)
        self._progress: LightningProgress | None = None
        self._skip = 0  # batches of the restored epoch its loaders skip
        self._epoch_start = EpochStart()
        self._in_loop: Any = None  # the job's in-loop side until the first batch begins (`quiet_until_step`)
        self._busy: Any = None  # job.busy() while a validation runs

    # -- set-up ----------------------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if trainer.ckpt_path is not None:
            raise ConfigError(
                "fit(ckpt_path=...) is not taken with StalwartCallback: the run resumes from stalwart's "
                "checkpoints (drop ckpt_path)"
            )
        if trainer.strategy.handles_gradient_accumulation:
            raise ConfigError(
                f"StalwartCallback does not cover {type(trainer.strategy).__name__}, whose engine accumulates "
                "gradients itself (a failed step's micro-batches cannot be run again through it); use ddp, or "
                "ModelParallelStrategy with fully_shard (FSDP2)"
            )
        from lightning.pytorch.strategies import FSDPStrategy

        if isinstance(trainer.strategy, FSDPStrategy):
            raise ConfigError(
                f"StalwartCallback does not cover {type(trainer.strategy).__name__}: it wraps the model in FSDP1 "
                "(FullyShardedDataParallel), whose flat parameters stalwart does not snapshot or reshard; use "
                "ModelParallelStrategy with fully_shard in configure_model (FSDP2)"
            )
        # The strategy's optimizer step runs the closure first, before any other callback can step.
        callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
        callbacks[:] = [self, *(cb for cb in callbacks if cb is not self)]
        closure_first(trainer.strategy)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        job = self.job
        assert job is not None
        if len(trainer.optimizers) != 1:
            raise ConfigError(f"StalwartCallback covers one optimizer, the module has {len(trainer.optimizers)}")
        objects: dict[str, Any] = {"model": pl_module, "optimizer": trainer.optimizers[0]}
        for i, config in enumerate(trainer.lr_scheduler_configs):
            if config.frequency != 1:  # a step run again steps it by the loop's counters, not its own step's
                raise ConfigError(
                    f"StalwartCallback covers LR schedulers stepped every {config.interval} (frequency 1); "
                    f"scheduler {i} has frequency {config.frequency}"
                )
            objects[f"lr_scheduler_{i}"] = config.scheduler
        self._progress = objects["progress"] = LightningProgress(trainer)
        objects["epoch_start"] = self._epoch_start
        job.track(**objects)
        self._loop = job.loop(None, max_steps=trainer.max_steps if trainer.max_steps >= 0 else _NO_LIMIT)
        self._next = self._loop.begin()  # the first: the job resumes (and re-forms if a peer is lost meanwhile)
        # A replacement: the Trainer's collectives before its loop (a barrier, its loader's length) are not the
        # survivors', who wait in their step: they run locally until the loop begins (`on_train_start`).
        self._in_loop = job.parts.in_loop
        if self._in_loop is not None:
            self._in_loop.quiet_until_step(True)
        if job.resumed_from is not None and not self._progress.epoch_ended:
            # Inside an epoch: its loaders' order as it began, less the batches drawn; the restored step's own
            # generators once the sampler has drawn its order, before the first batch is read (EpochStart).
            self._skip = self._progress.batches_drawn_in_epoch
            self._epoch_start.resume(capture_rng())
        self._progress.running = True  # from now on a restore's counters are the loop's own (a redo)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        track_loaders(trainer, self._epoch_start, self._skip, again=True)
        self._skip = 0
        if self._in_loop is not None:  # the loop begins: a replacement's collectives run for real again, the next
            self._in_loop.quiet_until_step(False)  # being the first batch's SIGTERM broadcast, as the survivors'
            self._in_loop = None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        track_loaders(trainer, self._epoch_start, 0, again=False)  # loaders reloaded for this epoch, if any

    # -- each step -------------------------------------------------------------------------------------------

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> Any:
        step = self._next
        if step is None:  # the Job's run is over (max_steps, restored at the end): the Trainer's is too
            trainer.should_stop = True
            return -1
        if trainer.global_step != step.number:
            raise ConfigError(
                f"the Trainer is at step {trainer.global_step} where the job is at {step.number}: "
                "something moved the Trainer's progress"
            )
        kept = self._kept.get(step.number)
        if kept is None:  # the step's first micro-batch
            assert self._loop is not None
            for old in [n for n in self._kept if n < self._loop.horizon() or n > step.number]:
                del self._kept[old]
            kept = self._kept[step.number] = KeptStep(_optimizer_steps(trainer).state_dict())
        kept.micro.append((batch, batch_idx, capture_rng()))
        return None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loop = self._loop
        if loop is None or loop.step is None:
            return
        if trainer.global_step == loop.step.number:  # a micro-batch that accumulated: the step goes on
            return
        made = trainer.global_step - 1  # the step this batch made
        self._made = made
        after = _optimizer_steps(trainer).state_dict()  # the counters once `made` is done
        assert self._progress is not None
        if made in self._kept:  # an epoch's last batch steps its epoch-interval LR schedulers as well
            self._kept[made].epoch_end = trainer.fit_loop.epoch_loop._num_ready_batches_reached()
            self._kept[made].progress = self._progress.now()
        ending: KeptStep | None = None  # a step older than `made`, run again: its end saves its own progress
        while True:
            # The step's end (snapshot, checks, checkpoint), or after a peer's failure in the step (its update
            # dropped) the recovery: re-formed in the loop, or training on shrunk while the replacement sets up.
            self._progress.as_of = ending.progress if ending is not None else None
            try:
                loop.end()
            finally:
                self._progress.as_of = None
            self._next = loop.begin()
            if self._next is None or self._next.number > made:
                break
            # The job went back to this step (the failed one, or an older one whose state node memory held whole:
            # the steps since run again one by one, each ending as any step); it may fail again.
            kept = self._kept.get(self._next.number)
            if kept is None:
                raise ConfigError(
                    f"the job went back to step {self._next.number} at step {trainer.global_step} (a numeric "
                    "rollback): the Lightning integration runs again only the steps since the job's redo horizon"
                )
            if _whole_group():  # a replacement may be in it, running these steps in its own loop
                _check_nothing_synced(self._kept, self._next.number, made)
            self._run_again(trainer, kept)
            ending = kept if self._next.number < made else None
        if self._next is not None and self._next.number == made + 1:  # also where a rollback skipped `made`'s batch
            _optimizer_steps(trainer).load_state_dict(after)

    def _run_again(self, trainer: pl.Trainer, kept: KeptStep) -> None:
        """Run a step the job went back to again, with its micro-batches and generators, as the Trainer's loop
        made them: each one's SIGTERM broadcast and closure (zero_grad at the first, forward, backward; without
        DDP's gradient sync but at the last), the optimizer step at the last, then the step's LR scheduler steps
        (and the epoch's, when it was its epoch's last)."""
        epoch_loop = trainer.fit_loop.epoch_loop
        _optimizer_steps(trainer).load_state_dict(kept.counters)
        manual = not trainer.lightning_module.automatic_optimization
        last = len(kept.micro) - 1
        for i, (batch, batch_idx, rng) in enumerate(kept.micro):
            if torch.distributed.is_initialized() and trainer.world_size > 1:
                epoch_loop._broadcast_sigterm_tensor()  # as each batch of the loop begins: a replacement's does
            restore_rng(rng)
            kwargs = epoch_loop._build_kwargs({}, batch, batch_idx)  # type: ignore[arg-type]
            if manual:  # the module's training_step: its own backward and optimizer step (and accumulation)
                epoch_loop.manual_optimization.run(kwargs)
                continue
            if i < last:  # the loop's counters are the last micro-batch's: this one accumulates
                epoch_loop._should_accumulate = _accumulates  # type: ignore[method-assign]
            try:
                epoch_loop.automatic_optimization.run(trainer.optimizers[0], batch_idx, kwargs)
            finally:
                epoch_loop.__dict__.pop("_should_accumulate", None)
        epoch_loop.update_lr_schedulers("step", update_plateau_schedulers=False)  # Lightning's: none when manual
        if kept.epoch_end:  # the epoch's last batch: its schedulers stepped, as the loop does
            epoch_loop.update_lr_schedulers("epoch", update_plateau_schedulers=False)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Any) -> None:
        self._synced("a checkpoint the Trainer saved")

    def _synced(self, what: str) -> None:
        """`what` followed the last step made: a run going back before it cannot be run again by the survivors
        alone while a replacement runs those steps in its own loop (`_check_nothing_synced`)."""
        kept = self._kept.get(self._made) if self._made is not None else None
        if kept is not None and kept.synced is None:
            kept.synced = what

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A validation inside training is a long stretch between two steps: the hang detector allows its grace."""
        self._synced("a validation")
        if self._loop is not None and self.job is not None and self._busy is None:
            self._busy = self.job.busy()
            self._busy.__enter__()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._busy is not None:
            busy, self._busy = self._busy, None
            busy.__exit__(None, None, None)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """A replacement resumed at the run's end never began its loop: its collectives run for real after fit."""
        if self._in_loop is not None:
            self._in_loop.quiet_until_step(False)
            self._in_loop = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The run's last state is durable (the step protocol's last checkpoint, or a save when the Trainer stopped
        before max_steps). The Job stays open until the process exits: its group serves the Trainer after fit."""
        job, loop = self.job, self._loop
        if job is None or loop is None:
            return
        stopped_early = loop.step is not None or self._next is not None
        loop.close()
        self._loop = None
        if stopped_early and job.step != job.parts.last_saved:
            job.save(wait=True)


StalwartCallback = StalwartLightningCallback
"""The name a script imports, as from stalwart.integrations.hf (the class's own is unique in the package)."""

_NO_LIMIT = 2**62
"""max_steps for a Trainer without one (max_steps=-1: it stops at max_epochs)."""


def _optimizer_steps(trainer: pl.Trainer) -> Any:
    """The epoch loop's optimizer-step counters (the Trainer's global step is their total): automatic
    optimization's, or manual optimization's, counted as the module's `optimizer.step()` runs."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if trainer.lightning_module.automatic_optimization:
        return epoch_loop.automatic_optimization.optim_progress
    return epoch_loop.manual_optimization.optim_step_progress


def _whole_group() -> bool:
    """Whether the job's group is the whole job's (not the survivors' own, training on shrunk)."""
    whole = Placement.from_env().world_size
    return not torch.distributed.is_initialized() or torch.distributed.get_world_size() >= whole


def _check_nothing_synced(kept: dict[int, KeptStep], back: int, made: int) -> None:
    """Steps `back`..`made` are about to run again on the survivors, which make only their training's collectives;
    a replacement that joined runs them in its Trainer's loop, which also validates or saves where the first run
    did. Between `back` and `made` (after `made` both sides do it) that would pair different collectives: a hang.
    The run is restarted instead (every worker, from the restored state), with one line that says why."""
    for number in range(back, made):
        step = kept.get(number)
        if step is not None and step.synced is not None:
            raise RuntimeError(
                f"stalwart: the job went back to step {back}, before {step.synced} after step {number}, which the "
                "survivors cannot run again in step with the replacement's loop: restarting every worker"
            )


def _accumulates() -> bool:
    """The epoch loop's `_should_accumulate` for a micro-batch run again before the step's last."""
    return True
