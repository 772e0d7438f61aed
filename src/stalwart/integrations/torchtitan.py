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
item. Collectives on torchtitan's sub-meshes' groups cannot be absorbed; a failure there takes stalwart's
fallback, the script run again in the same process from the newest state (node memory first). torchtitan's own
Trainer makes such groups, and its finite-loss check raises on an absorbed all-reduce: tried by hand on CPU, a kill
took the fallback (docs/integrations.md); the loop and components as tests/scripts/train_torchtitan.py runs them
recover in the loop.

Refused with one line, at the Trainer's set-up (a policy stalwart's checkpoints do not carry out):
`load_step` other than -1, `initial_load_path`, `exclude_from_loading`, `create_seed_checkpoint`, `load_only`,
`last_save_in_hf`. `last_save_model_only` is ignored: the last checkpoint is the whole state.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from stalwart.errors import ConfigError
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
        self.batches = _StepBatches()
        self.recorded = None if dataloader is None else _Recorded(dataloader, self.batches)
        if self.recorded is not None:
            tracked["dataloader"] = self.recorded
        tracked.update({name: obj for name, obj in states.items() if obj is not None})
        if self.trainer is not None:
            tracked["train_state"] = _TrainState(self.trainer)
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
        try:
            self.trainer.train_step(iter(batches))
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


class BatchesGone(reform.ReformRequested):
    """A recovery took the job back further than the micro-batches kept in this process: the survivor leaves its
    loop and its host runs the script again from the newest state (the fallback), instead of stopping the job."""


class _TrainState:
    """The Trainer's own state (`step`, `ntokens_seen`), the same on every rank: written once, and a replacement
    that joins a job grown back after a stretch on shrunk takes the survivors' (its own last snapshot is older)."""

    stalwart_replicated = True

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> Any:
        return self.trainer.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.trainer.load_state_dict(state)


class _StepBatches:
    """The micro-batches each step drew from the Trainer's data loader (by the step's number: completed steps
    before it), kept back to the job's redo horizon: the steps a recovery may take the job back to are run again
    with them."""

    def __init__(self) -> None:
        self.kept: dict[int, list[Any]] = {}
        self.positions: dict[int, Any] = {}
        """The loader's state as each step ended (by completed steps): what a checkpoint taken as a step is run
        again records."""
        self.drawing = 0
        """The step the batches drawn now belong to."""
        self.replaying = False

    def record(self, batch: Any) -> None:
        """Keep `batch` for its step: its input dict copied, since torchtitan's `train_step` puts the device's
        copies of the inputs in that dict in place (the kept step would hold them on the GPU)."""
        if self.replaying:
            return
        if isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[0], dict):
            batch = ({**batch[0]}, batch[1])
        self.kept.setdefault(self.drawing, []).append(batch)

    def of(self, step: int) -> list[Any] | None:
        return self.kept.get(step)

    def forget_before(self, step: int, horizon: int) -> None:
        """`step` is drawn next (afresh), and no recovery goes back before `horizon`."""
        self.drawing = step
        for old in [s for s in self.kept if s < horizon or s >= step]:
            del self.kept[old]
        for old in [s for s in self.positions if s <= horizon or s > step]:
            del self.positions[old]


class _Recorded:
    """The Trainer's data loader as its loop iterates it and as the Job tracks it: the same batches, each kept for
    its step. Its state is the loader's, except where this process already iterates it: a survivor's restore puts
    the tracked objects back at an earlier step, whose batches it runs again from what was kept, so the data to come
    is still the live iterator's (torchdata's `load_state_dict` would drop that iterator, and the next snapshot
    would record the restored position for ever). Anything else goes to the loader itself."""

    def __init__(self, loader: Any, batches: _StepBatches) -> None:
        self._loader = loader
        self._batches = batches
        self._live = False
        self._restored = False
        self.pinned: Any = None
        """While a step is run again: the loader's state as that step first ended, which its end records."""

    def __iter__(self) -> Iterator[Any]:
        self._live = True
        if self._restored:
            # A new iterator draws its base seed from torch's generator, which the uninterrupted run did before
            # its first step and a resumed one would do again after the restore, shifting every later draw.
            rng = torch.get_rng_state()
            iterator = iter(self._loader)
            torch.set_rng_state(rng)
        else:
            iterator = iter(self._loader)
        for batch in iterator:
            self._batches.record(batch)
            yield batch

    def state_dict(self) -> Any:
        return self.pinned if self.pinned is not None else self._loader.state_dict()

    def load_state_dict(self, state: Any) -> None:
        if not self._live:
            self._loader.load_state_dict(state)
            self._restored = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


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
