"""Hot spares: a restart runs the workers in pre-started interpreters, and ends as a run without failures would."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import alive, child_env, fault_free_results, tiny_args

ARGS = ("--steps", "40", "--every", "50", "--num-samples", "3000", "--step-sleep", "0.06")
FAULT_STEP = 25
HOLD = ("--hold-at", "20", "--hold-file", "go")
"""The job waits at step 20 until the pool is full of ready spares (5 s after the first start, then each warms up),
however long that takes under load; the fault comes after. (240 steps run to outlast the pool's filling were a
race with its end.)"""


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return fault_free_results(tmp_path_factory.mktemp("spares-reference"), *ARGS[:6], timeout=180)


@pytest.mark.parametrize("fault", [f"kill@rank=1,step={FAULT_STEP}", f"hang@rank=0,step={FAULT_STEP}"])
def test_restart_runs_in_spares_and_ends_bitwise_identical(launch: Any, reference: Any, fault: str) -> None:
    job = launch(["--spares", "2", *tiny_args(*ARGS, *HOLD)], env=child_env(STALWART_FAULTS=fault))
    [ready] = job.wait_for(lambda: job.events("spares_ready"), 120, "the pool's spares to be ready")
    (job.workdir / "go").touch()
    assert job.wait(240) == 0, job.output()
    started = job.events("spares_started")[0]  # the first fill: what was ready before the fault
    assert sorted(ready["spare_pids"]) == sorted(started["spare_pids"]) and ready["target"] == 2, (ready, started)
    spawned = job.events("worker_spawned")
    assert [e["spare"] for e in spawned if e["restart"] == 0] == [False, False]
    victim = 1 if fault.startswith("kill") else 0
    restarted = {e["rank"]: e for e in spawned if e["restart"] == 1}
    assert restarted[victim]["spare"], "the failed rank was replaced by a spare"
    assert restarted[1 - victim]["kept"], "the survivor re-formed in its own process"
    resumed = job.events("resumed")
    assert {(e["step"], e["tier"]) for e in resumed} == {(FAULT_STEP, "memory")}, "no step lost"
    results = job.results()
    for rank in (0, 1):
        assert results[rank]["sha256"] == reference[rank]["sha256"], "parameters differ from the fault-free run"
        assert results[rank]["seen"] == reference[rank]["seen"]
    spare_pids = [pid for e in job.events("spares_started") for pid in e["spare_pids"]]
    assert len(spare_pids) >= 2
    assert not [pid for pid in spare_pids if alive(pid)], "no spare outlives the launcher"


def test_spares_with_no_python_is_refused(launch: Any) -> None:
    job = launch(["--spares", "1", "--no-python", "true"])
    assert job.wait(60) == 2
    assert "--spares" in job.output() and "Traceback" not in job.output()
