"""What stalwart.integrations.lightning tracks of the Lightning Trainer besides its module, optimizer and schedulers
(its loops' counters and the callbacks' states), and the two changes it makes to the Trainer's objects: the
strategy's optimizer step with its closure first, and a restored epoch's samplers skipping by index. Apart from
lightning.py so that each stays one screenful of responsibility."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch

from stalwart.errors import ConfigError
from stalwart.job.rng import capture_rng, restore_rng


class LightningProgress:
    """The Trainer's progress: its fit loop's state (epoch, batch and optimizer-step counters) and every callback's
    state, as Lightning saves them in its own checkpoints. The same on every rank, so replicated: it changes after
    the optimizer step (the counters do) without turning light snapshots off.

    It is saved at a batch's end (the Job's end of the step runs in `on_train_batch_end`), where Lightning's
    `ModelCheckpoint` saves too, and a resume restores it as Lightning restores its own checkpoint: the Trainer
    goes on from the next batch. Once training runs (`running`), a restore of it is the Job's going back to the
    failed step, whose counters the integration puts back itself: it is then not applied."""

    stalwart_replicated = True

    def __init__(self, trainer: pl.Trainer) -> None:
        self._trainer = trainer
        self.running = False
        self.as_of: dict[str, Any] | None = None
        """While a step older than the loop's is run again and ends: its own state, kept as it ended the first
        time (`now()`), which its snapshot or checkpoint must hold, not the loop's later counters."""

    def state_dict(self) -> dict[str, Any]:
        if self.as_of is not None:
            return self.as_of
        from lightning.pytorch.trainer import call

        return {
            "fit_loop": self._trainer.fit_loop.state_dict(),
            "callbacks": call._call_callbacks_state_dict(self._trainer),
        }

    def now(self) -> dict[str, Any]:
        """The state as it is, kept apart from the Trainer's objects (the loop's counters are fresh dicts; the
        callbacks' states may be their own objects: copied). About 0.1 ms."""
        state = self.state_dict()
        return {"fit_loop": state["fit_loop"], "callbacks": copy.deepcopy(state["callbacks"])}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if self.running:
            return
        connector = self._trainer._checkpoint_connector
        connector._loaded_checkpoint = {
            "loops": {"fit_loop": saved["fit_loop"]},
            "callbacks": saved["callbacks"],
            "pytorch-lightning_version": pl.__version__,
        }
        try:
            connector.restore_loops()
            connector.restore_callbacks()
        finally:
            connector._loaded_checkpoint = {}

    @property
    def batches_drawn_in_epoch(self) -> int:
        """The batches of the current epoch the restored run had drawn: its loaders skip them."""
        return int(self._trainer.fit_loop.epoch_loop.batch_progress.current.ready)

    @property
    def epoch_ended(self) -> bool:
        """The restored step was its epoch's last: Lightning's restart goes on with the next epoch, from its start."""
        return bool(self._trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


@dataclass
class KeptStep:
    """A step as the Trainer's loop ran it, for running it again: the optimizer-step counters as it began, its
    micro-batches (batch, index, every generator as each began), whether it was its epoch's last batch (it
    stepped the epoch-interval LR schedulers too), the Trainer's progress as it ended, and what followed it."""

    counters: dict[str, Any]
    micro: list[tuple[Any, int, dict[str, Any]]] = field(default_factory=list)
    epoch_end: bool = False
    progress: dict[str, Any] | None = None
    """The Trainer's progress as the step ended (LightningProgress.now): what its end saves when it is run again."""
    synced: str | None = None
    """What the Trainer did after the step besides training that makes collectives (a validation, a checkpoint
    save of its own): a replacement running that step in its loop makes them, a survivor running it again does not."""


class EpochStart:
    """Every generator as the current epoch's batch sampler began (`sampler_starts`, from the sampler's iteration):
    a sampler not seeded by Lightning (a shuffling DataLoader in one process, where no DistributedSampler is added)
    draws its order from the global generator then. Per rank; it changes only at an epoch's start. After a resume
    (`replay`) the restored epoch's sampler starts from them again, so its order is the uninterrupted run's."""

    def __init__(self) -> None:
        self.rng: dict[str, Any] | None = None
        self._step_rng: dict[str, Any] | None = None  # a resume's: the restored step's generators

    def resume(self, step_rng: dict[str, Any]) -> None:
        """The next sampler start is the restored epoch's: its generators then, and `step_rng` once it drew."""
        self._step_rng = step_rng

    def sampler_starts(self) -> None:
        if self._step_rng is not None and self.rng is not None:
            restore_rng(self.rng)
        else:
            self.rng = capture_rng()

    def sampler_drew(self) -> None:
        """The sampler has drawn its order and skipped the batches drawn before: a resume's step generators again,
        before the first batch's items are read (a random transform in the main process draws from them)."""
        if self._step_rng is not None:
            restore_rng(self._step_rng)
            self._step_rng = None

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.rng = saved["rng"]


def closure_first(strategy: Any) -> None:
    """The strategy's optimizer step runs the Trainer's closure (zero_grad, forward, backward) and then the
    optimizer's step with a closure that returns its result. Lightning passes the closure into `optimizer.step`,
    which calls it after the optimizer's step pre-hooks: stalwart's (the numeric guard, the update dropped after a
    peer's failure, the snapshot's commit point) would judge gradients not yet computed. Lightning's own hooks
    around the step (`on_before_optimizer_step`, gradient clipping) still run inside the step, after the closure,
    as before. Once per strategy object."""
    if getattr(strategy, "_stalwart_closure_first", False):
        return
    original: Callable[..., Any] = strategy.optimizer_step

    def optimizer_step(optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        result = closure()
        return original(optimizer, lambda: result, model, **kwargs)

    strategy.optimizer_step = optimizer_step
    strategy._stalwart_closure_first = True


def local_broadcasts_while_joining() -> None:
    """Lightning's strategies broadcast Python objects (`Strategy.broadcast`: rank 0's log directory, before any
    callback is set up). A replacement's collectives run locally until the survivors' state arrived
    (runtime/group.py `join`), and a local broadcast leaves the size a receiving rank allocates by unset: the
    object is this rank's own instead while the group joins, as if rank 0 had sent the same. Once per class."""
    from lightning.pytorch.strategies import ParallelStrategy

    from stalwart.runtime import group

    if getattr(ParallelStrategy, "_stalwart_local_broadcasts", False):
        return
    for cls in {ParallelStrategy, *_subclasses(ParallelStrategy)}:
        original = cls.__dict__.get("broadcast")
        if original is None:
            continue

        def broadcast(self: Any, obj: Any, src: int = 0, _original: Any = original) -> Any:
            now = group.current()
            if now is not None and now.joining:
                return obj
            return _original(self, obj, src)

        setattr(cls, "broadcast", broadcast)  # noqa: B010 (a class's method replaced)
    ParallelStrategy._stalwart_local_broadcasts = True  # type: ignore[attr-defined]


def _subclasses(cls: type) -> set[type]:
    found: set[type] = set()
    sub: type
    for sub in cls.__subclasses__():
        found |= {sub, *_subclasses(sub)}
    return found


def track_loaders(trainer: pl.Trainer, epoch_start: EpochStart, skip: int, *, again: bool) -> None:
    """The train loaders' batch samplers tell `epoch_start` when each epoch's iteration begins, and skip the first
    `skip` batches of the next one by index: a sampler draws indices only (a function of its seed and the epoch,
    or of the generators `epoch_start` puts back), so nothing of the dataset before the restored step is read.
    `again`: the fit loop made the epoch's iterators already (`FitLoop.setup_data`, before `on_train_start`):
    they are made again, the generators as they were before (the discarded iterator's draws undone)."""
    fit_loop = trainer.fit_loop
    combined, fetcher = fit_loop._combined_loader, getattr(fit_loop, "_data_fetcher", None)
    if combined is None or fetcher is None:
        raise ConfigError(
            f"lightning {pl.__version__}'s fit loop has no train loaders made by on_train_start (tested "
            "with 2.6.6): the integration cannot resume the data at the restored step"
        )
    for loader in combined.flattened:
        if not isinstance(loader, torch.utils.data.DataLoader) or loader.batch_sampler is None:
            raise ConfigError(
                "the Lightning integration resumes a train loader with a batch sampler only (a DataLoader "
                f"with batch_size), not {type(loader).__name__}"
            )
        if isinstance(loader.dataset, torch.utils.data.IterableDataset):
            raise ConfigError(
                "an IterableDataset's position is not a function of the step: the Lightning integration "
                "cannot resume it at the restored step yet"
            )
        sampler = loader.batch_sampler
        sampler.__class__ = _tracking(type(sampler))
        sampler._stalwart_skip = skip  # type: ignore[attr-defined]
        sampler._stalwart_epoch_start = epoch_start  # type: ignore[attr-defined]
    if again:  # the sampler's epoch first (Lightning sets it later, but worker processes draw indices at once)
        from lightning.fabric.utilities.data import _set_sampler_epoch

        for loader in combined.flattened:
            _set_sampler_epoch(loader, fit_loop.epoch_progress.current.processed)  # type: ignore[attr-defined]
        rng = capture_rng()
        iter(fetcher)
        restore_rng(rng)


_TRACKING: dict[type, type] = {}


def _tracking(cls: type) -> type:
    """A subclass of the batch sampler's class whose iteration first tells its EpochStart, then skips
    `_stalwart_skip` batches (once)."""
    if getattr(cls, "_stalwart_tracking", False):
        return cls
    if cls not in _TRACKING:

        def __iter__(self: Any) -> Iterator[Any]:
            skip, self._stalwart_skip = self._stalwart_skip, 0
            epoch_start = self._stalwart_epoch_start
            epoch_start.sampler_starts()
            batches = itertools.islice(cls.__iter__(self), skip, None)  # type: ignore[attr-defined]
            first = next(batches, None)  # the order drawn (a sampler draws at its first index), the skip done
            epoch_start.sampler_drew()
            if first is None:
                return
            yield first
            yield from batches

        def __len__(self: Any) -> int:
            return cls.__len__(self)  # type: ignore[attr-defined]

        namespace = {"__iter__": __iter__, "__len__": __len__, "_stalwart_tracking": True}
        _TRACKING[cls] = type(cls.__name__, (cls,), namespace)
    return _TRACKING[cls]
