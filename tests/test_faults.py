from __future__ import annotations

import pytest

from stalwart.chaos import Fault, parse_faults
from stalwart.errors import ConfigError


def test_parse_fault_plan() -> None:
    faults = parse_faults("kill@rank=1,step=37; kill_in_save@rank=0,step=40,phase=before_commit,restart=2")
    assert faults == [
        Fault(kind="kill", rank=1, step=37),
        Fault(kind="kill_in_save", rank=0, step=40, restart=2, phase="before_commit"),
    ]


def test_nan_and_slow_faults() -> None:
    import torch

    from stalwart.chaos import FaultInjector

    nan, slow = parse_faults("nan@rank=0,step=3;slow@rank=0,step=5,ms=2.5")
    assert (nan.kind, slow.kind, slow.ms) == ("nan", "slow", 2.5)
    announced = []
    injector = FaultInjector([nan, slow], rank=0, restart=0, announce=lambda kind, details: announced.append(kind))
    batch = (torch.arange(3), {"x": torch.ones(2), "tags": ["a"]})
    assert injector.batch(2, batch) is batch
    ids, poisoned = injector.batch(3, batch)
    assert torch.equal(ids, torch.arange(3)) and torch.isnan(poisoned["x"]).all() and poisoned["tags"] == ["a"]
    assert torch.equal(batch[1]["x"], torch.ones(2)), "the loader's own tensors are left alone"
    injector.slow(4)
    injector.slow(5)
    injector.slow(6)
    assert announced == ["nan", "slow"], "each announced once"


@pytest.mark.parametrize(
    "spec",
    ["explode@rank=1,step=2", "kill@rank=1", "kill@rank=1,step=2,when=now", "kill@x", "slow@rank=0,step=1,ms=-1"],
)
def test_bad_fault_plans_are_config_errors(spec: str) -> None:
    with pytest.raises(ConfigError):
        parse_faults(spec)
