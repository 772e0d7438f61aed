"""No sample is skipped or seen twice because of failures, at world sizes 1, 2 and 3.

The tiny job checkpoints the ids each rank trained on, so the final lists are the history that survived every
kill. Rebuilt into global batches they must cover each epoch exactly once and match the fault-free order.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from conftest import child_env, tiny_args
from stalwart.data.order import epoch_permutation

NUM_SAMPLES, GBS, STEPS, SEED = 60, 6, 30, 3  # 10 global batches per epoch, 3 epochs


def _global_history(results: dict[int, dict[str, Any]], world_size: int) -> list[list[int]]:
    per_rank = GBS // world_size
    seen = [results[r]["seen"] for r in range(world_size)]
    assert all(len(s) == STEPS * per_rank for s in seen), "every step trained exactly one local batch"
    return [sum((seen[r][s * per_rank : (s + 1) * per_rank] for r in range(world_size)), []) for s in range(STEPS)]


def _kills(world_size: int, count: int) -> str:
    rng = random.Random(100 + world_size)
    steps = sorted(rng.sample(range(2, STEPS - 1), count))
    return ";".join(f"kill@rank={rng.randrange(world_size)},step={s},restart={i}" for i, s in enumerate(steps))


@pytest.mark.parametrize("world_size", [1, 3])  # 2: the DataLoader workers' test below
def test_each_sample_once_per_epoch_through_kills(launch: Any, world_size: int) -> None:
    faults = _kills(world_size, count=3)
    job = launch(tiny_args("--steps", str(STEPS), nproc=world_size), env=child_env(STALWART_FAULTS=faults))
    assert job.wait(180) == 0, job.output()
    assert len(job.events("restarting")) == 3, f"three kills ({faults}) mean three restarts"
    _check_history(job.results(), world_size)


def test_exactly_once_with_dataloader_worker_processes(launch: Any) -> None:
    faults = _kills(2, count=2)
    job = launch(tiny_args("--steps", str(STEPS), "--workers", "2"), env=child_env(STALWART_FAULTS=faults))
    assert job.wait(180) == 0, job.output()
    assert len(job.events("restarting")) == 2
    _check_history(job.results(), 2)
    in_process = launch(tiny_args("--steps", str(STEPS)), name="no-workers")
    assert in_process.wait(120) == 0, in_process.output()
    assert job.results()[0]["sha256"] == in_process.results()[0]["sha256"], "worker processes change nothing"


def _check_history(results: dict[int, dict[str, Any]], world_size: int) -> None:
    history = _global_history(results, world_size)
    per_epoch = NUM_SAMPLES // GBS
    for epoch in range(STEPS // per_epoch):
        ids = [i for batch in history[epoch * per_epoch : (epoch + 1) * per_epoch] for i in batch]
        counts = Counter(ids)
        assert sorted(counts) == list(range(NUM_SAMPLES)), f"epoch {epoch} skipped samples"
        assert set(counts.values()) == {1}, f"epoch {epoch} repeated samples"
        expected = epoch_permutation(NUM_SAMPLES, SEED, epoch)[: per_epoch * GBS].tolist()
        assert ids == expected, f"epoch {epoch} is not in the seeded order"
