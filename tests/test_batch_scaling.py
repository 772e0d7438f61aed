"""The learning rate at a change of world size (job/batch_scaling.py): scaled by the chosen rule when the global
batch scales with the world, left alone when it is fixed."""

from __future__ import annotations

import math

import pytest
import torch

from stalwart.data import ResumableLoader
from stalwart.errors import ConfigError
from stalwart.job.batch_scaling import scale_learning_rates
from stalwart.job.config import JobConfig


def _parts(per_rank: bool) -> tuple[ResumableLoader, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    model = torch.nn.Linear(2, 1)
    optim = torch.optim.SGD([{"params": [model.weight], "lr": 0.4}, {"params": [model.bias], "lr": 0.2}])
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 0.5**step)  # computes from its base rates
    size = {"batch_size_per_rank": 3} if per_rank else {"global_batch_size": 12}
    return ResumableLoader(torch.arange(48), rank=0, world_size=4, **size), optim, sched


@pytest.mark.parametrize(("rule", "factor"), [("linear", 0.5), ("sqrt", math.sqrt(0.5)), ("none", 1.0)])
def test_a_global_batch_that_scales_with_the_world_scales_the_learning_rates(rule: str, factor: float) -> None:
    loader, optim, sched = _parts(per_rank=True)
    assert scale_learning_rates([loader, optim, sched], 4, 2, rule) == pytest.approx(factor)
    assert [g["lr"] for g in optim.param_groups] == pytest.approx([0.4 * factor, 0.2 * factor])
    optim.step()
    sched.step()  # the scheduler's next rate keeps the scaling: it is computed from the scaled base rates
    assert [g["lr"] for g in optim.param_groups] == pytest.approx([0.2 * factor, 0.1 * factor])


def test_a_fixed_global_batch_changes_no_learning_rate() -> None:
    loader, optim, sched = _parts(per_rank=False)
    assert scale_learning_rates([loader, optim, sched], 4, 2, "linear") == 1.0
    assert [g["lr"] for g in optim.param_groups] == [0.4, 0.2] and sched.base_lrs == [0.4, 0.2]


def test_an_unknown_rule_is_one_line() -> None:
    with pytest.raises(ConfigError, match="lr_scaling must be one of linear, sqrt, none"):
        JobConfig.of("ckpt", lr_scaling="cubic")
