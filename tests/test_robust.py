"""Byzantine-robust aggregation (detect/robust.py): one rank sending corrupted gradients cannot steer the model."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conftest import tiny_args
from stalwart.detect.robust import aggregate, robust_aggregation
from stalwart.errors import ConfigError

HONEST = torch.tensor([[1.0, 2.0, 3.0], [1.2, 1.8, 3.1], [0.9, 2.1, 2.9], [1.1, 2.0, 3.0]])
BAD = torch.tensor([[1000.0, -1000.0, 1e6]])


@pytest.mark.parametrize("method", ["median", "trimmed_mean", "krum"])
def test_one_corrupted_rank_barely_moves_the_aggregate(method: str) -> None:
    stacked = torch.cat([HONEST, BAD])
    got = aggregate(stacked, method, trim=1, faulty=1)
    assert (got - HONEST.mean(dim=0)).abs().max() < 0.25, got
    assert (stacked.mean(dim=0) - HONEST.mean(dim=0)).abs().max() > 100, "the mean is dragged away"


def test_bad_settings_are_one_clear_error() -> None:
    with pytest.raises(ConfigError, match="one of"):
        robust_aggregation("mean")
    with pytest.raises(ConfigError, match="at least 4 ranks"):
        aggregate(HONEST[:3], "krum", faulty=1)
    with pytest.raises(ConfigError, match="leaves nothing"):
        aggregate(HONEST[:2], "trimmed_mean", trim=1)


def _loss(launch: Any, name: str, *extra: str) -> tuple[float, float]:
    """The model's loss over the whole dataset before and after training (the tiny job's own measure)."""
    job = launch(tiny_args("--steps", "60", *extra, nproc=3, max_restarts=0), name=name)
    assert job.wait(240) == 0, job.output()
    results = job.results()
    assert len({results[r]["sha256"] for r in range(3)}) == 1, "replicas stay equal"
    assert results[0]["finite"]
    return float(results[0]["loss0"]), float(results[0]["loss"])


def test_under_stalwart_run_the_median_keeps_a_byzantine_rank_from_steering_the_model(launch: Any) -> None:
    start, clean = _loss(launch, "clean")
    _, mean = _loss(launch, "mean", "--byzantine-rank", "2")
    _, median = _loss(launch, "median", "--byzantine-rank", "2", "--robust", "median")
    print(
        f"loss: at the start {start:.3f}, clean {clean:.3f}, one byzantine rank: mean {mean:.3f}, median {median:.3f}"
    )
    assert clean < start and median < start, "the median still trains"
    assert mean > start, "plain averaging is steered the wrong way"
