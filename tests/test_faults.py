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


@pytest.mark.parametrize("spec", ["explode@rank=1,step=2", "kill@rank=1", "kill@rank=1,step=2,when=now", "kill@x"])
def test_bad_fault_plans_are_config_errors(spec: str) -> None:
    with pytest.raises(ConfigError):
        parse_faults(spec)
