"""ResumableLoader: a DataLoader whose position is part of the training state.

The position counts batches handed to the training loop, not batches fetched: DataLoader worker processes
prefetch ahead, and those prefetched batches are simply fetched again after a resume. The DataLoader gets its own
seeded generator, so creating an iterator never draws from torch's global RNG (which would break bitwise resume).

Randomness inside `Dataset.__getitem__` (augmentation) resumes exactly too. In worker processes, the RNGs (torch,
python, numpy) are seeded from (seed, epoch, batch) before each batch, so a batch's draws do not depend on which
worker fetches it or how many batches that worker fetched before the resume. Without workers, fetching draws from
the main process's RNGs, which the checkpoint restores.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

try:
    import numpy as np
except ImportError:  # numpy is optional
    np = None  # type: ignore[assignment]

from stalwart.data import order
from stalwart.errors import ConfigError
from stalwart.runtime.dist import Placement
from stalwart.runtime.process import die_with_parent


class _LocalBatches(Sampler[list[tuple[int, int]]]):
    """Endless stream of this rank's index lists, starting at a global position: per global batch, one list for
    each of the ranks this process stands for (its own, and a missing rank's while the job runs shrunk)."""

    def __init__(self, loader: ResumableLoader, epoch: int, batch: int, ranks: tuple[int, ...]) -> None:
        self._loader = loader
        self._start = (epoch, batch)
        self._ranks = ranks

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        ld = self._loader
        epoch, batch = self._start
        size = ld.global_batch_size
        while ld.max_epochs is None or epoch < ld.max_epochs:
            perm = order.epoch_permutation(ld.num_samples, ld.seed, epoch, shuffle=ld.shuffle)
            # Fixed global batch: `batch` counts global batches; scaled with the world: samples of the epoch.
            at = batch if ld.batch_size_per_rank is None else batch // size
            start = 0 if ld.batch_size_per_rank is None else batch % size  # 0 unless resumed at another size
            for b in range(at, ld.batches_per_epoch):
                first = start + b * size
                if first + size > ld.num_samples:
                    break
                g = perm[first : first + size]
                seed = order.batch_seed(ld.seed, epoch, b if ld.batch_size_per_rank is None else first)
                for rank in self._ranks:
                    yield [(seed, i) for i in order.local_slice(g, rank, ld.world_size).tolist()]
            epoch, batch = epoch + 1, 0


class _SeededFetch(Dataset[Any]):
    """Wraps the user's dataset: keys are (batch seed, index); inside a worker the RNGs are reseeded per batch."""

    def __init__(self, dataset: Dataset[Any] | Sequence[Any]) -> None:
        self.dataset = dataset
        self._seeded: int | None = None

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        self._reseed(key[0])
        return self.dataset[key[1]]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any]:
        """Batched fetch: the user's own __getitems__ when it has one (e.g. Hugging Face datasets)."""
        if not keys:
            return []
        self._reseed(keys[0][0])
        batched = getattr(self.dataset, "__getitems__", None)
        if batched is not None:
            return list(batched([index for _, index in keys]))
        return [self.dataset[index] for _, index in keys]

    def _reseed(self, seed: int) -> None:
        if seed != self._seeded and get_worker_info() is not None:
            self._seeded = seed
            torch.manual_seed(seed)
            random.seed(seed)
            if np is not None:
                np.random.seed(seed)


def _die_with_rank(worker_id: int) -> None:
    """In each DataLoader worker process: end with the rank that started it. A worker inherits the rank's
    connections (its process group's sockets) and would hold them open after the rank died, until torch's own
    watchdog in the worker notices, about 5 s later; meanwhile the rank's peers, blocked in a collective with it,
    see no connection error. Under `stalwart run` the agent also ends a dead worker's process group."""
    die_with_parent(signal.SIGKILL)


class ResumableLoader:
    """Iterates this rank's batches forever (or for `max_epochs`); `state_dict()` is the global position.

    Use it like a DataLoader; register it with `job.track(data=loader)` so its position is checkpointed.
    """

    def __init__(
        self,
        dataset: Dataset[Any] | Sequence[Any],
        *,
        global_batch_size: int | None = None,
        batch_size_per_rank: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        max_epochs: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        pin_memory: bool = False,
    ) -> None:
        placement = Placement.from_env()
        self.rank = placement.rank if rank is None else rank
        self.world_size = placement.world_size if world_size is None else world_size
        self.dataset = dataset
        self.num_samples = len(dataset)  # type: ignore[arg-type]
        if (global_batch_size is None) == (batch_size_per_rank is None):
            raise ConfigError(
                "give the ResumableLoader either global_batch_size (kept when the world size changes) "
                "or batch_size_per_rank (the global batch scales with the world), not both"
            )
        self.batch_size_per_rank = batch_size_per_rank
        """None: the global batch is fixed (the default); else each rank's batch, the global one that times the
        world size (a change of world size then scales the learning rate, JobConfig.lr_scaling)."""
        self._fixed = global_batch_size
        order.check_sizes(self.num_samples, self.global_batch_size, self.world_size)
        if num_workers < 0:
            raise ConfigError(f"num_workers must be >= 0, got {num_workers}")
        self.seed = seed
        self.shuffle = shuffle
        self.max_epochs = max_epochs
        self._num_workers = num_workers
        self._collate_fn = collate_fn
        self._pin_memory = pin_memory
        self.epoch = 0
        self.batch = 0  # next global batch within the epoch
        self._ranks: tuple[int, ...] = (self.rank,)

    @property
    def global_batch_size(self) -> int:
        """Samples of one step over all ranks: fixed, or `batch_size_per_rank` times the world size."""
        per_rank = self.batch_size_per_rank
        return per_rank * self.world_size if per_rank is not None else int(self._fixed or 0)

    @property
    def batches_per_epoch(self) -> int:
        return order.batches_per_epoch(self.num_samples, self.global_batch_size)

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.world_size

    @property
    def shares(self) -> tuple[int, ...]:
        """The ranks whose slice of each global batch this process trains on: its own, and while the job runs
        shrunk (recovery/shrink.py) a missing rank's too."""
        return self._ranks

    def take_shares(self, ranks: tuple[int, ...] | None) -> None:
        """From the next iterator on, yield each global batch's slices of `ranks` in turn, one item each, and move
        the position once all of them were handed out (None: this rank's alone). The position stays global, so a
        missing rank's samples are neither lost nor seen twice."""
        ranks = (self.rank,) if ranks is None else tuple(ranks)
        if not ranks or any(not 0 <= r < self.world_size for r in ranks):
            raise ConfigError(f"shares {ranks} are not ranks of {self.world_size}")
        self._ranks = ranks

    def check_world(self, world_size: int) -> None:
        """ConfigError unless each global batch divides among `world_size` ranks (as `rebind` to it needs)."""
        per_rank = self.batch_size_per_rank
        order.check_sizes(self.num_samples, per_rank * world_size if per_rank else self.global_batch_size, world_size)

    def rebind(self, rank: int, world_size: int) -> None:
        """This process's place after the job re-formed at another world size in its loop (recovery/in_loop/driver.py):
        its slice of each global batch from the next iterator on (a global batch that scales with the world grows or
        shrinks with it). The position is global, so no sample is lost or seen twice; ConfigError if the global batch
        does not divide among the new world."""
        self.check_world(world_size)
        self.rank, self.world_size, self._ranks = rank, world_size, (rank,)
        self._next_epoch_if_full()

    def _next_epoch_if_full(self) -> None:
        """A global batch that scales with the world: at a new size, the rest of the epoch may hold no whole one."""
        if self.batch_size_per_rank is not None and self.batch + self.global_batch_size > self.num_samples:
            self.epoch, self.batch = self.epoch + 1, 0

    def __iter__(self) -> Iterator[Any]:
        start = (self.epoch, self.batch)
        ranks = self._ranks
        g = torch.Generator()
        g.manual_seed(self.seed)  # seeds worker processes; never touches the global generator
        dl = DataLoader(
            _SeededFetch(self.dataset),
            batch_sampler=_LocalBatches(self, *start, ranks),
            num_workers=self._num_workers,
            collate_fn=self._collate_fn,
            generator=g,
            pin_memory=self._pin_memory,
            worker_init_fn=_die_with_rank if self._num_workers else None,
        )
        for n, item in enumerate(dl, 1):
            if (self.epoch, self.batch) != start:
                # load_state_dict moved the position under us: this iterator is stale.
                return
            if n % len(ranks):  # more shares of this global batch to come: the position moves after the last
                yield item
                continue
            self._advance()
            start = (self.epoch, self.batch)
            yield item

    def _advance(self) -> None:
        """One global batch handed out: the next position (an epoch ends where a whole global batch no longer fits)."""
        if self.batch_size_per_rank is None:
            self.batch += 1
            if self.batch == self.batches_per_epoch:
                self.epoch, self.batch = self.epoch + 1, 0
            return
        self.batch += self.global_batch_size
        self._next_epoch_if_full()

    def state_dict(self) -> dict[str, int]:
        """The global position: `batch` counts global batches of the epoch, or its samples when the global batch
        scales with the world (then `batch_size_per_rank` replaces `global_batch_size`)."""
        size = (
            ("batch_size_per_rank", self.batch_size_per_rank)
            if self.batch_size_per_rank is not None
            else ("global_batch_size", self.global_batch_size)
        )
        return {
            "epoch": self.epoch,
            "batch": self.batch,
            "seed": self.seed,
            "num_samples": self.num_samples,
            size[0]: int(size[1]),
            "shuffle": int(self.shuffle),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        mode = "batch_size_per_rank" if self.batch_size_per_rank is not None else "global_batch_size"
        if mode not in state:
            other = "global_batch_size" if mode == "batch_size_per_rank" else "batch_size_per_rank"
            raise ConfigError(
                f"the checkpoint's data order was saved with {other} and this loader has {mode}; resuming would "
                "repeat or skip samples, so keep the loader's settings"
            )
        for key, mine in (
            ("seed", self.seed),
            ("num_samples", self.num_samples),
            (mode, self.batch_size_per_rank if self.batch_size_per_rank is not None else self.global_batch_size),
            ("shuffle", int(self.shuffle)),
        ):
            if state[key] != mine:
                raise ConfigError(
                    f"the checkpoint's data order has {key}={state[key]} but this loader has {mine}; "
                    "resuming would repeat or skip samples, so keep the loader's settings"
                )
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
        self._next_epoch_if_full()
