"""What stalwart.integrations.torchtitan keeps of torchtitan's Trainer besides the objects it is handed: the
Trainer's own counters, each step's micro-batches (back to the job's redo horizon) and the data loader's state as
each step ended, and the loader as the Trainer's loop iterates it. Apart from torchtitan.py so that each stays one
screenful of responsibility."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


class TrainState:
    """The Trainer's own state (`step`, `ntokens_seen`), the same on every rank: written once, and a replacement
    that joins a job grown back after a stretch on shrunk takes the survivors' (its own last snapshot is older)."""

    stalwart_replicated = True

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> Any:
        return self.trainer.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.trainer.load_state_dict(state)


class StepBatches:
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


class Recorded:
    """The Trainer's data loader as its loop iterates it and as the Job tracks it: the same batches, each kept for
    its step. Its state is the loader's, except where this process already iterates it: a survivor's restore puts
    the tracked objects back at an earlier step, whose batches it runs again from what was kept, so the data to come
    is still the live iterator's (torchdata's `load_state_dict` would drop that iterator, and the next snapshot
    would record the restored position for ever). Anything else goes to the loader itself."""

    def __init__(self, loader: Any, batches: StepBatches) -> None:
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
