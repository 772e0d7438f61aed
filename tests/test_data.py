"""ResumableLoader: order independent of world size, exact resume, no draws from the global RNG."""

from __future__ import annotations

import itertools

import pytest
import torch

from stalwart.data import ResumableLoader
from stalwart.errors import ConfigError


def _take(loader: ResumableLoader, n: int) -> list[list[int]]:
    return [batch.tolist() for batch in itertools.islice(iter(loader), n)]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_global_order_is_independent_of_world_size(world_size: int) -> None:
    data = torch.arange(30)
    reference = _take(ResumableLoader(data, global_batch_size=6, seed=5, rank=0, world_size=1), 12)
    ranks = [
        _take(ResumableLoader(data, global_batch_size=6, seed=5, rank=r, world_size=world_size), 12)
        for r in range(world_size)
    ]
    rebuilt = [sum((ranks[r][s] for r in range(world_size)), []) for s in range(12)]
    assert rebuilt == reference


def test_a_loader_rebound_to_another_world_size_goes_on_with_its_new_slice() -> None:
    """What a survivor's loader does when the job re-formed in its loop at another world size (job/endings.py):
    the next global batches are cut among the new world, from the same global position."""
    data = torch.arange(48)
    reference = _take(ResumableLoader(data, global_batch_size=12, seed=2, rank=0, world_size=1), 6)
    loaders = [ResumableLoader(data, global_batch_size=12, seed=2, rank=r, world_size=4) for r in range(4)]
    taken = [_take(ld, 2) for ld in loaders]  # 2 steps at 4 ranks
    head = [sum((t[s] for t in taken), []) for s in range(2)]
    survivors = loaders[:2]  # 4 -> 2 ranks; the survivors' positions are the job's
    for rank, loader in enumerate(survivors):
        loader.rebind(rank, 2)
    taken = [_take(ld, 4) for ld in survivors]
    tail = [sum((t[s] for t in taken), []) for s in range(4)]
    assert head + tail == reference, "every sample once, in the global order"
    with pytest.raises(ConfigError, match="does not divide among 5 ranks"):
        survivors[0].rebind(0, 5)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_continues_at_the_next_unseen_batch(num_workers: int) -> None:
    data = torch.arange(40)
    straight = _take(ResumableLoader(data, global_batch_size=4, seed=1, num_workers=num_workers), 15)
    first = ResumableLoader(data, global_batch_size=4, seed=1, num_workers=num_workers)
    head = _take(first, 7)  # 7 batches handed out, whatever the workers prefetched
    resumed = ResumableLoader(data, global_batch_size=4, seed=1, num_workers=num_workers)
    resumed.load_state_dict(first.state_dict())
    assert head + _take(resumed, 8) == straight


def test_epochs_are_permutations_and_differ() -> None:
    loader = ResumableLoader(torch.arange(12), global_batch_size=4, seed=0)
    batches = _take(loader, 6)
    epoch0, epoch1 = sum(batches[:3], []), sum(batches[3:], [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(12))
    assert epoch0 != epoch1
    assert loader.state_dict()["epoch"] == 2


def test_iterating_does_not_draw_from_the_global_rng() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    _take(ResumableLoader(torch.arange(20), global_batch_size=2, seed=9, num_workers=1), 3)
    assert torch.equal(torch.rand(3), expected)


def test_settings_that_change_the_order_are_refused_on_load() -> None:
    a = ResumableLoader(torch.arange(20), global_batch_size=4, seed=1)
    b = ResumableLoader(torch.arange(20), global_batch_size=4, seed=2)
    with pytest.raises(ConfigError, match="seed=1"):
        b.load_state_dict(a.state_dict())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"global_batch_size": 5, "world_size": 2, "rank": 0}, "does not divide"),
        ({"global_batch_size": 0}, "positive"),
        ({"global_batch_size": 64}, "fewer than one global batch"),
    ],
)
def test_bad_sizes(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ResumableLoader(torch.arange(20), **kwargs)  # type: ignore[arg-type]


class _Augmented(torch.utils.data.Dataset):
    """Random augmentation inside __getitem__, as a vision pipeline would have."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return i + torch.rand(1)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_random_augmentation_resumes_identically(num_workers: int) -> None:
    def run(resume_after: int | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        loader = ResumableLoader(_Augmented(), global_batch_size=4, seed=1, num_workers=num_workers)
        if resume_after is None:
            return list(itertools.islice(iter(loader), 8))
        head = list(itertools.islice(iter(loader), resume_after))
        state, rng = loader.state_dict(), torch.get_rng_state()  # what a checkpoint holds
        torch.manual_seed(99)  # a new process
        again = ResumableLoader(_Augmented(), global_batch_size=4, seed=1, num_workers=num_workers)
        again.load_state_dict(state)
        torch.set_rng_state(rng)
        return head + list(itertools.islice(iter(again), 8 - resume_after))

    straight, resumed = run(None), run(3)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))


class _BatchedOnly(torch.utils.data.Dataset):
    """A dataset that can only be read in batches, as some columnar stores are."""

    calls = 0

    def __len__(self) -> int:
        return 12

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        type(self).calls += 1
        return [torch.tensor(i) for i in indices]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_datasets_read_in_batches_keep_their_batched_path(num_workers: int) -> None:
    _BatchedOnly.calls = 0
    loader = ResumableLoader(_BatchedOnly(), global_batch_size=4, seed=0, num_workers=num_workers)
    batches = _take(loader, 3)
    assert sorted(sum(batches, [])) == sorted(set(sum(batches, []))) and len(sum(batches, [])) == 12
    if num_workers == 0:
        assert _BatchedOnly.calls == 3, "one batched read per batch"


def test_a_global_batch_that_scales_with_the_world_goes_on_at_the_next_unseen_sample() -> None:
    """batch_size_per_rank: the global batch is that times the world size, so it changes with the world; the
    position counts samples, and every sample of an epoch is handed out once across 4 -> 2 -> 3 ranks."""
    data = torch.arange(60)
    order_ = ResumableLoader(data, batch_size_per_rank=60, seed=4, rank=0, world_size=1)
    perm = _take(order_, 1)[0]  # the epoch's permutation, whole
    loaders = [ResumableLoader(data, batch_size_per_rank=3, seed=4, rank=r, world_size=4) for r in range(4)]
    assert loaders[0].global_batch_size == 12
    taken = [_take(ld, 2) for ld in loaders]
    seen = [i for s in range(2) for t in taken for i in t[s]]  # 24 samples
    two = loaders[:2]
    for rank, loader in enumerate(two):
        loader.rebind(rank, 2)
    taken = [_take(ld, 3) for ld in two]
    seen += [i for s in range(3) for t in taken for i in t[s]]  # 3 x 6 samples
    state = two[0].state_dict()
    assert state["batch"] == 42 and "batch_size_per_rank" in state and "global_batch_size" not in state
    three = [ResumableLoader(data, batch_size_per_rank=3, seed=4, rank=r, world_size=3) for r in range(3)]
    for loader in three:
        loader.load_state_dict(state)
    taken = [_take(ld, 3) for ld in three]
    seen += [i for s in range(2) for t in taken for i in t[s]]  # 2 x 9 = 60: the epoch
    assert seen == perm, "the epoch's samples in its order, each once"
    assert three[0].state_dict()["epoch"] == 1


def test_the_batch_mode_is_one_of_two_and_checked_on_load() -> None:
    data = torch.arange(24)
    with pytest.raises(ConfigError, match="either global_batch_size"):
        ResumableLoader(data, global_batch_size=4, batch_size_per_rank=2, rank=0, world_size=2)
    with pytest.raises(ConfigError, match="either global_batch_size"):
        ResumableLoader(data, rank=0, world_size=2)
    fixed = ResumableLoader(data, global_batch_size=4, rank=0, world_size=2)
    scaled = ResumableLoader(data, batch_size_per_rank=2, rank=0, world_size=2)
    with pytest.raises(ConfigError, match="saved with global_batch_size and this loader has batch_size_per_rank"):
        scaled.load_state_dict(fixed.state_dict())
    with pytest.raises(ConfigError, match="saved with batch_size_per_rank and this loader has global_batch_size"):
        fixed.load_state_dict(scaled.state_dict())
