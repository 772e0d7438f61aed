"""The recipes of docs/integrations.md for loops written with Hugging Face Accelerate and Lightning Fabric: each
script, under `stalwart run` on 2 CPU ranks with rank 1 killed mid-run, keeps its survivor in its loop and ends
with the parameters of its run without the failure, bit for bit (the tests' default: the survivor waits for the
replacement)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import child_env
from stalwart.job.state import TrackedState
from stalwart.telemetry.events import EventLog

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["accelerate", "fabric"])
def test_a_loop_written_with_the_framework_survives_a_kill_bitwise(launch: Any, recipe: str) -> None:
    args = ["--nproc-per-node", "2", "--max-restarts", "3", str(SCRIPTS / f"recipe_{recipe}.py"), "--out", "out"]
    reference = launch(args, name="reference")
    assert reference.wait(180) == 0, reference.output()[-3000:]
    job = launch(args, name="killed", env=child_env(STALWART_FAULTS="kill@rank=1,step=20"))
    assert job.wait(180) == 0, job.output()[-3000:]
    assert [e["rank"] for e in job.events("fault_injected")] == [1], "the kill happened"
    survivor = [e for e in job.events("reformed_in_loop") if e["rank"] == 0]
    assert survivor, f"rank 0 stayed in its loop:\n{job.output()[-3000:]}"
    expected = {rank: r["sha256"] for rank, r in reference.results().items()}
    assert {rank: r["sha256"] for rank, r in job.results().items()} == expected
    assert set(expected) == {0, 1} and {r["step"] for r in job.results().values()} == {40}


class _Wrapper(torch.optim.Optimizer):
    """As Accelerate's AcceleratedOptimizer: a torch Optimizer without an optimizer's own state (no step hooks),
    holding the real one and delegating to it."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:  # no super().__init__, as accelerate's
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)


def test_a_frameworks_optimizer_wrapper_is_hooked_through_the_optimizer_it_wraps() -> None:
    real = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    state = TrackedState(0, 1, EventLog(None), None)
    state.track(optim=_Wrapper(_Wrapper(real)), plain=torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1))
    inner, plain = state.optimizers()
    assert inner is real and plain is state.objects["plain"], "the real optimizer of a wrapper, the plain one as it is"
    assert isinstance(state.state(0)["objects"]["optim"], dict), "the wrapper's state_dict is what is saved"
