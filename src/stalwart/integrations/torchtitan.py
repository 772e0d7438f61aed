"""stalwart for torchtitan (0.3): a checkpoint manager on torchtitan's `BaseCheckpointManager` that drives its
Trainer's loop through the Job's step protocol, so that its checkpoints are stalwart's (asynchronous, verified,
node memory and peer copies), a restart resumes from the fastest tier that holds the state, and a rank lost in a
step costs the survivors that step, run again inside torchtitan's loop.

The one change: launch torchtitan's entry point through stalwart's, with the same arguments,

    stalwart run --nproc-per-node 8 -m stalwart.integrations.torchtitan --module llama3 --config llama3_8b

which puts `StalwartCheckpointManager.Config` in place of the config's checkpoint manager, carrying over its
folder, interval and `keep_latest_k` (and turning checkpoints on: a run without them has nothing to recover from).
A config function can name it itself instead: `checkpoint=StalwartCheckpointManager.Config(interval=100)`.

Why a checkpoint manager: it is the one component torchtitan's Trainer calls at each step's boundary (`load`
before the loop, `maybe_wait_for_staging` before the optimizer step, `save` after every step), and it is given the
objects that make up the state (the model parts, the optimizers and LR schedulers, the data loader and the
Trainer's own `step` and `ntokens_seen`). The manager makes a `stalwart.Job` (it joins the group torchtitan made)
and tracks them; `load` is the protocol's first begin (the resume), each `save` its end and the next begin.

A step whose update was dropped (a peer died inside it, its collectives absorbed) is run again inside `save`,
after the job recovered: `Trainer.train_step` with the same micro-batches, which the manager keeps by wrapping
the Trainer's data loader at `load` (before the Trainer's loop draws from it). The data loader's position is
stalwart's to restore: torchtitan's `StatefulDataLoader` resumes where the state says, without reading an earlier
item. What `train_step` raises after a peer's failure was absorbed in it (torchtitan's check that its all-reduced
loss is finite, on what an absorbed collective left) goes to the protocol's `failed()`, which recovers from it as
that failure's consequence. torchtitan's data-parallel meshes over every rank are the job's group; collectives on a
sub-mesh of fewer ranks (tensor, pipeline, context parallel, HSDP) cannot be absorbed, and a failure there takes
stalwart's fallback, the script run again in the same process from the newest state (node memory first).
torchtitan's own Trainer, by hand on CPU (scripts/torchtitan_check.sh), recovers in its loop and ends bitwise.

Refused with one line, at the Trainer's set-up (a policy stalwart's checkpoints do not carry out):
`load_step` other than -1, `initial_load_path`, `exclude_from_loading`, `create_seed_checkpoint`, `load_only`,
`last_save_in_hf`. `last_save_model_only` is ignored: the last checkpoint is the whole state.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Any

from stalwart.errors import ConfigError
from stalwart.integrations.torchtitan_state import Recorded, StepBatches, TrainState
from stalwart.job import lifecycle
from stalwart.job.job import Job
from stalwart.job.step_loop import Step, StepLoop
from stalwart.recovery import reform

try:
    import torch
    from torchtitan.components.checkpointer.base import BaseCheckpointManager
    from torchtitan.components.dataloader import DataloaderExhaustedError
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "stalwart.integrations.torchtitan needs torchtitan: pip install torchtitan==0.3.0 (tested with 0.3.0)"
    ) from exc

TESTED = "0.3.0"
"""The torchtitan release the tests run (scripts/setup.sh installs it)."""

DEFAULT_FOLDER = "stalwart_checkpoint"
"""Under the Trainer's dump folder: not torchtitan's `checkpoint`, whose DCP layout is another."""

_UNSUPPORTED: tuple[tuple[str, Any, str], ...] = (
    ("load_step", -1, "stalwart resumes from the newest state that verifies"),
    ("initial_load_path", None, "load the initial weights in a first run with torchtitan's own CheckpointManager"),
    ("exclude_from_loading", [], "stalwart restores the whole state or none of it"),
    ("create_seed_checkpoint", False, "make seed checkpoints with torchtitan's own CheckpointManager"),
    ("load_only", False, "stalwart's checkpoints are how it recovers"),
    ("last_save_in_hf", False, "export to safetensors with torchtitan's own CheckpointManager"),
)


class StalwartCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager, stalwart's way; see the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """torchtitan's checkpoint policy, read by stalwart: `folder` (relative to the dump folder unless absolute
        or an fsspec URL) is the Job's checkpoint directory, `interval` its durable `checkpoint_every`,
        `keep_latest_k` its `keep_last` (0: keep all). Node-memory snapshots, peer copies and the detectors take
        stalwart's defaults and `stalwart run`'s flags."""

        enable: bool = True
        folder: str = DEFAULT_FOLDER
        initial_load_model_only: bool = False  # torchtitan's default warns where no initial_load_path is set

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        self.save_future = None
        if not self.enable:
            return
        lifecycle.install_worker_safety_nets()  # bad input is one line and no restart, also before the Job exists
        refuse_unsupported(config)
        self.trainer = states.get("train_state")
        self.dataloader = dataloader
        self.job = Job(
            checkpoint_folder(base_folder, config.folder),
            checkpoint_every=config.interval,
            keep_last=config.keep_latest_k or 1_000_000,
        )
        parts = (
            {"model": model_parts[0]}
            if len(model_parts) == 1
            else {f"model_part{i}": m for i, m in enumerate(model_parts)}
        )
        tracked = {**parts, "optimizer": optimizers, "lr_scheduler": lr_schedulers}
        self.batches = StepBatches()
        self.recorded = None if dataloader is None else Recorded(dataloader, self.batches)
        if self.recorded is not None:
            tracked["dataloader"] = self.recorded
        tracked.update({name: obj for name, obj in states.items() if obj is not None})
        if self.trainer is not None:
            tracked["train_state"] = TrainState(self.trainer)
        self.job.track(**tracked)
        self.loop: StepLoop | None = None
        self.current: Step | None = None
        self._recovered = False  # the step's train_step raised and the job recovered (_guarded)

    def _load(self, step: int = -1) -> bool:
        """The Trainer's loop is about to start: the protocol's first begin, which resumes the job (node memory, a
        peer or storage; a replacement joins the survivors here). True when a state was restored."""
        if step != -1:
            raise ConfigError(f"checkpoint.load_step={step}: {_UNSUPPORTED[0][2]}")
        if self.loop is not None:
            raise ConfigError("StalwartCheckpointManager.load() called twice: the Trainer's loop starts once")
        max_steps = _training_steps(self.trainer)
        self.loop = self.job.loop(None, max_steps=max_steps)
        trainer = self.trainer
        if (
            self.recorded is not None
            and trainer is not None
            and getattr(trainer, "dataloader", None) is self.dataloader
        ):
            trainer.dataloader = self.recorded
        validator = getattr(trainer, "validator", None)
        if validator is not None and hasattr(validator, "validate"):
            validator.validate = self._busy(validator.validate)
        if trainer is not None and hasattr(trainer, "train_step"):
            trainer.train_step = self._guarded(trainer.train_step)
        self.current = self.loop.begin()
        _without_a_late_barrier(self.job)  # known once the job resumed: a replacement joins there
        _wait_with_torchtitans_trainer(self.job, self.trainer)
        _check_step(self.trainer, self.job.step)
        if self.job.resumed_from is not None:
            self._validate(self.job.step)  # as the run that took the state did, after it took it
        self.batches.forget_before(self.job.step, self.job.step)
        return self.job.resumed_from is not None

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """A step ended (`curr_step` steps done): the protocol's end (snapshot, checks, checkpoint), then the next
        begin; a step to redo is run here, in a loop while a failure is met again."""
        loop = self._running()
        if self.current is None or curr_step != self.current.number + 1:
            expected = "none" if self.current is None else self.current.number + 1
            raise ConfigError(f"torchtitan saved step {curr_step} where stalwart expected step {expected}")
        if self.recorded is not None:
            self.batches.positions[curr_step] = self.recorded.state_dict()
        self._end(loop)
        self.current = loop.begin()
        if self.current is not None and self.current.number < curr_step:
            self._validate(self.current.number)  # the state restored was taken before that step's validation
        # Back behind the steps drawn (a recovery restored an earlier step): each is run again with its batches,
        # up to the step the Trainer's loop draws next. The loader's state at each of their ends is the one kept
        # when the step first ended: the live loader is already past them.
        while self.current is not None and self.current.number < curr_step:
            done = self.current.number + 1
            self._redo(self.current)
            if self.recorded is not None:
                self.recorded.pinned = self.batches.positions.get(done)
            try:
                self._end(loop)
            finally:
                if self.recorded is not None:
                    self.recorded.pinned = None
            self.current = loop.begin()
            completed = self.current is None or self.current.number >= done  # not failed again
            if completed and done < curr_step:  # the Trainer validates after this save returns, at curr_step
                self._validate(done)
        self.batches.forget_before(curr_step, loop.horizon())
        return True

    def _guarded(self, train_step: Any) -> Any:
        """The Trainer's `train_step`, whose exception goes to the step protocol's `failed()`: raised after a peer's
        failure was absorbed in the step, it is that failure's consequence (torchtitan checks that its all-reduced
        loss is finite, and an absorbed collective leaves garbage in it), and the job recovers there, the step then
        run again at the save that follows; any other is raised again, as without stalwart. The loop's own signal
        that the data ran out is the loop's."""

        def guarded_train_step(*args: Any, **kwargs: Any) -> Any:
            try:
                return train_step(*args, **kwargs)
            except DataloaderExhaustedError:
                raise
            except Exception as exc:
                at = getattr(self.trainer, "step", None)
                self._running().failed(exc)  # raises exc again unless the job recovered
                self._recovered = True
                if at is not None:  # the loop's count, which its save() passes: the restore put back an earlier one
                    self.trainer.step = at  # type: ignore[union-attr]

        return guarded_train_step

    def _end(self, loop: StepLoop) -> None:
        """The step's end, unless its `train_step` raised and the job already recovered from it (`_guarded`)."""
        if self._recovered:
            self._recovered = False
            return
        loop.end()

    def _validate(self, step: int) -> None:
        """torchtitan's validation after a step run again or resumed at, where its loop made it: the state a
        resume restores was taken at the step's end, before its validation (whose validation loader's iterator
        draws from torch's generator), and a replacement validates at the steps the survivors run again (their
        collectives must meet)."""
        trainer = self.trainer
        enabled = getattr(getattr(getattr(trainer, "config", None), "validator", None), "enable", False)
        validator = getattr(trainer, "validator", None)
        if enabled and validator is not None and validator.should_validate(step):
            validator.validate(trainer.model_parts, step)  # type: ignore[union-attr]

    def _busy(self, validate: Any) -> Any:
        """A validation runs between two steps, after the next one began: under `job.busy()`, so it is not taken
        for a hang by the next step's calibrated timeout."""

        def busy_validate(*args: Any, **kwargs: Any) -> Any:
            with self.job.busy():
                return validate(*args, **kwargs)

        return busy_validate

    def _redo(self, step: Step) -> None:
        """Run step `step.number + 1` again with the micro-batches it drew, the tracked objects holding the state
        before it (the Trainer's `step` among them)."""
        batches = self.batches.of(step.number)
        if self.trainer is None or not hasattr(self.trainer, "train_step") or batches is None:
            raise BatchesGone(
                f"step {step.number + 1} must run again but its batches or the Trainer's train_step are not at hand"
            )
        self.trainer.step = step.number + 1
        self.batches.replaying = True
        # Through the Trainer's batch generator, as its loop draws: torchtitan's counts what it yields for the step's
        # metrics (its log divides by the loading times it kept).
        generator = getattr(self.trainer, "batch_generator", None)
        iterator = generator(batches) if callable(generator) else iter(batches)
        try:
            self.trainer.train_step(iterator)
        finally:
            self.batches.replaying = False

    def _running(self) -> StepLoop:
        if self.loop is None:
            raise ConfigError("StalwartCheckpointManager.save() before load(): the Trainer loads before its loop")
        return self.loop

    def _maybe_wait_for_staging(self) -> None:
        """Nothing: a snapshot is taken at the step's end, before the next step changes the parameters."""

    def _wait_for_saving(self) -> None:
        self.save_future = None

    def _close(self) -> None:
        """The loop's end: the last state durable, the Job closed. A loop that ended early (torchtitan's breaks
        mid-step, without a save, when its data ran out) gets its last completed step saved here, unless the close
        comes from an exception in flight (train.py closes the Trainer in its `except`)."""
        if self.loop is not None:
            ended_early = self.current is not None and sys.exc_info()[0] is None
            if ended_early and self.job.step != self.job.parts.last_saved:
                self.job.save(wait=True)
            self.loop.close()
        self.job.close()


def _wait_with_torchtitans_trainer(job: Job, trainer: Any) -> None:
    """torchtitan's own Trainer: the survivors wait for the replacement instead of training on shrunk. Why: by hand on
    CPU (scripts/torchtitan_check.sh's model, 2026-12-02), its survivor trained on shrunk, but at the grow the
    replacement's first step hung until the hang timeout (300 s), and the job went back to an older step; waiting took
    8.8 s and ended bitwise. The stacks at the hang: the survivor loading the grown state called the model's
    `state_dict()`, whose save hook (`FusedQKVLinear._split_qkv_on_save`) redistributes a DTensor, a collective the
    replacement, already waiting at the grow's barrier on stalwart's own group, never made. The loop as written with
    torchtitan's components (tests/test_torchtitan.py) has no such hook and grows back."""
    in_loop = getattr(getattr(job, "parts", None), "in_loop", None)
    try:
        from torchtitan.trainer import Trainer
    except ImportError:  # torchtitan's Trainer imports more than its components (tensorboard, datasets)
        return
    if in_loop is not None and isinstance(trainer, Trainer):
        in_loop.shrink_refused = (
            "torchtitan's Trainer has not yet been seen to grow back after training on shrunk (its grow hung on CPU)"
        )


def _without_a_late_barrier(job: Job) -> None:
    """A replacement that joined survivors in their loop sets torchtitan's training timeouts without its barrier.

    Why: torchtitan's loop calls `set_pg_timeouts` after the first step of each process, and it begins with a
    barrier over every rank so that no rank runs under the shorter timeout while another still sets up. A
    replacement's first step is long after the survivors' (they made their barrier then, and stay in their loop):
    its barrier would meet their next collective and both would wait for ever. Its peers are past their set-up, so
    the barrier has nothing to wait for; the timeouts are set as torchtitan sets them."""
    in_loop = getattr(getattr(job, "parts", None), "in_loop", None)
    if in_loop is None or not in_loop.joined_late:
        return
    from torchtitan.distributed import utils as dist_utils

    set_pg_timeouts = dist_utils.set_pg_timeouts

    def set_pg_timeouts_joined_late(*args: Any, **kwargs: Any) -> Any:
        barrier = torch.distributed.barrier
        torch.distributed.barrier = lambda *a, **k: None
        try:
            return set_pg_timeouts(*args, **kwargs)
        finally:
            torch.distributed.barrier = barrier
            dist_utils.set_pg_timeouts = set_pg_timeouts  # once: a later re-forming is all ranks' or none's

    dist_utils.set_pg_timeouts = set_pg_timeouts_joined_late


class BatchesGone(reform.ReformRequested):
    """A recovery took the job back further than the micro-batches kept in this process: the survivor leaves its
    loop and its host runs the script again from the newest state (the fallback), instead of stopping the job."""


def refuse_unsupported(config: Any) -> None:
    """One line for a checkpoint policy stalwart does not carry out (ConfigError: the launcher does not restart)."""
    for name, default, why in _UNSUPPORTED:
        value = getattr(config, name, default)
        if value != default and not (default == [] and not value):
            raise ConfigError(f"checkpoint.{name}={value!r} is not supported with StalwartCheckpointManager: {why}")


def checkpoint_folder(base_folder: str, folder: str) -> str:
    """Where the checkpoints go: `folder` as it is when absolute or a URL, else under the Trainer's dump folder."""
    if os.path.isabs(folder) or "://" in folder or not base_folder:
        return folder
    return os.path.join(base_folder, folder)


def _training_steps(trainer: Any) -> int:
    try:
        return int(trainer.config.training.steps)
    except AttributeError as exc:
        raise ConfigError(
            "StalwartCheckpointManager needs the Trainer as states['train_state'] (torchtitan's Trainer passes itself)"
        ) from exc


def _check_step(trainer: Any, done: int) -> None:
    """The Trainer's own step count, restored with its state, must be stalwart's."""
    have = getattr(trainer, "step", done)
    if have != done:
        raise ConfigError(f"the Trainer is at step {have} after the resume, stalwart at {done}")


def stalwart_config(checkpoint: Any) -> StalwartCheckpointManager.Config:
    """`checkpoint` (any torchtitan checkpoint manager's config) as stalwart's: the shared policy fields carried
    over, checkpoints on."""
    if isinstance(checkpoint, StalwartCheckpointManager.Config):
        return checkpoint
    shared = {f.name for f in dataclasses.fields(BaseCheckpointManager.Config)}
    values = {name: getattr(checkpoint, name) for name in shared if hasattr(checkpoint, name)}
    values.pop("initial_load_model_only", None)  # means nothing without initial_load_path, which is refused
    values["enable"] = True
    if values.get("folder") == "checkpoint":  # torchtitan's default: stalwart's own layout, its own folder
        values["folder"] = DEFAULT_FOLDER
    return StalwartCheckpointManager.Config(**values)


def main(argv: list[str] | None = None) -> None:
    """`python -m stalwart.integrations.torchtitan ARGS` (under `stalwart run`): torchtitan's `torchtitan.train`
    with the same ARGS, its config's checkpoint manager made stalwart's (`stalwart_config`)."""
    from torchtitan import train
    from torchtitan.config import ConfigManager

    parse = ConfigManager.parse_args

    def parse_args(self: Any, args: list[str] | None = None) -> Any:
        config = parse(self, args)
        config.checkpoint = stalwart_config(config.checkpoint)
        return config

    ConfigManager.parse_args = parse_args
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    train.main()


if __name__ == "__main__":
    from stalwart.integrations.torchtitan import main as _main  # the package's module, not a second copy

    _main()
