"""A script that makes its own process group, as most existing scripts do, survives what stalwart's idiom survives.

tests/scripts/train_own_group.py calls `torch.distributed.init_process_group` itself (torch's environment
rendezvous, an `init_method` URL, or a TCPStore of its own), before or after `stalwart.Job()`, and draws its own
batches. Under `stalwart run` its call makes the re-formable group (recovery/script_group.py), so a survivor stays
in its loop: with `--wait-for-replacement` the run ends bitwise identical to one without the failure; in the
default mode the survivor trains on, shrunk, with its own data while the replacement starts (recovery/shrink.py),
and the ranks end as replicas of one another. Before, the default mode lost the run at the first kill (the Job
swapped the script's group for its own on the port the script's store held: "Address already in use").
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import Launch, alive, child_env

SCRIPT = Path(__file__).parent / "scripts" / "train_own_group.py"
STEPS = "40"


def _args(*extra: str) -> list[str]:
    return ["--nproc-per-node", "2", "--max-restarts", "3", str(SCRIPT), "--ckpt", "ckpt", "--out", "out",
            "--steps", STEPS, *extra]  # fmt: skip


def _env(mode: str, faults: str = "") -> dict[str, str]:
    """`mode`: "default" (survivors train on shrunk with their own data while the replacement starts) or "wait"
    (--wait-for-replacement)."""
    return child_env(STALWART_WAIT_FOR_REPLACEMENT="1" if mode == "wait" else "0", STALWART_FAULTS=faults)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The parameters' sha256 of a fault-free run (every way of making the group trains the same)."""
    job = Launch(tmp_path_factory.mktemp("own-group-reference"), _args(), _env("wait"))
    try:
        assert job.wait(120) == 0, job.output()[-3000:]
        results = job.results()
    finally:
        job.reap()
    assert {r["step"] for r in results.values()} == {int(STEPS)} and len({r["sha256"] for r in results.values()}) == 1
    return str(results[0]["sha256"])


def _ends_identical(job: Any, reference: str, *, timeout: float = 150) -> None:
    assert job.wait(timeout) == 0, job.output()[-3000:]
    results = job.results()
    assert sorted(results) == [0, 1]
    assert all(r["step"] == int(STEPS) and r["sha256"] == reference for r in results.values()), results


def _ends_as_replicas(job: Any, *, timeout: float = 150) -> None:
    """The default mode: every rank reaches the last step with the same parameters, after a stretch trained shrunk
    with the survivors' own data (their global batch smaller, so not the fault-free run's parameters)."""
    assert job.wait(timeout) == 0, job.output()[-3000:]
    results = job.results()
    assert sorted(results) == [0, 1] and {r["step"] for r in results.values()} == {int(STEPS)}, results
    assert len({r["sha256"] for r in results.values()}) == 1, f"the ranks are replicas: {results}"
    shrunk = job.events("shrunk")
    assert shrunk and all(e["own_data"] and e["world_size"] == 1 for e in shrunk), shrunk


def _ends(job: Any, mode: str, reference: str) -> None:
    if mode == "wait":
        _ends_identical(job, reference)
    else:
        _ends_as_replicas(job)


def _stayed_in_loop(job: Any, kills: int = 1) -> None:
    """Every recovery re-formed inside the survivors' loop: no survivor ran the script again."""
    assert len(job.events("reformed_in_loop")) >= kills, job.output()[-3000:]
    assert "address already in use" not in job.output().lower()


@pytest.mark.parametrize(
    ("group", "order", "mode"),
    [
        ("env", "before", "default"),
        ("url", "after", "default"),
        ("store", "after", "default"),
        ("store", "before", "wait"),
        ("env", "after", "wait"),
        ("url", "before", "wait"),
    ],
)
def test_a_kill_is_survived_in_the_loop_whatever_way_the_script_made_its_group(
    launch: Any, reference: str, group: str, order: str, mode: str
) -> None:
    """Bitwise identical with --wait-for-replacement; replicas after a shrunk stretch in the default mode."""
    job = launch(_args("--group", group, "--order", order), env=_env(mode, "kill@rank=1,step=20"))
    _ends(job, mode, reference)
    _stayed_in_loop(job)


@pytest.mark.parametrize("mode", ["default", "wait"])
def test_two_kills(launch: Any, reference: str, mode: str) -> None:
    """Two kills, rank 0 (the store's server) the second: exit 0, and bitwise identical where the survivors wait.
    In the default mode the second kill meets rank 0 training alone while the replacement starts, or the job grown
    back (whichever came first: the replacement's start against 15 steps of a few ms); either way the run ends at
    its last step with the ranks as replicas."""
    faults = "kill@rank=1,step=12;kill@rank=0,step=27,restart=1"
    job = launch(_args("--group", "store", "--order", "before"), env=_env(mode, faults))
    _ends(job, mode, reference)
    assert [(e["rank"], e["step"]) for e in job.events("fault_injected")] == [(1, 12), (0, 27)]
    if mode == "wait":
        _stayed_in_loop(job, kills=2)
    assert "address already in use" not in job.output().lower()


def test_a_stopped_rank_is_replaced_and_the_run_ends_identical(launch: Any, reference: str) -> None:
    job = launch(_args("--group", "env", "--order", "after"), env=_env("wait", "hang@rank=1,step=20,how=sigstop"))
    _ends_identical(job, reference, timeout=200)
    _stayed_in_loop(job)


def test_a_killed_launcher_leaves_no_worker(launch: Any) -> None:
    job = launch(_args("--group", "url", "--order", "before", "--steps", "100000", "--step-sleep", "0.05"),
                 env=_env("default"))  # fmt: skip
    job.wait_for(lambda: len(job.events("step_done")) >= 2, 90, "training to start")
    workers = list(job.worker_pids().values())
    assert len(workers) == 2
    job.proc.send_signal(signal.SIGKILL)
    job.proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in workers), "a worker outlived its SIGKILLed launcher"
