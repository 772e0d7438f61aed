"""Bitwise-identical resume after failures, at world size 2, against a fault-free run of the same job."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from conftest import Launch, child_env, fault_free_results, tiny_args

STEPS = 30


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return fault_free_results(tmp_path_factory.mktemp("reference"), "--steps", str(STEPS))


def _assert_same_as_reference(job: Launch, reference: dict[int, dict[str, Any]]) -> None:
    results = job.results()
    assert sorted(results) == [0, 1]
    for rank in (0, 1):
        assert results[rank]["step"] == STEPS
        assert results[rank]["sha256"] == reference[rank]["sha256"], "parameters differ from the fault-free run"
        assert results[rank]["seen"] == reference[rank]["seen"], "the sample history differs"


def test_reference_sees_torchrun_environment(reference: dict[int, dict[str, Any]]) -> None:
    for rank, result in reference.items():
        env = result["env"]
        assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0" and env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["MASTER_ADDR"] and env["MASTER_PORT"] and env["TORCHELASTIC_RUN_ID"]
    assert reference[0]["sha256"] == reference[1]["sha256"]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_at_random_step_ends_bitwise_identical(launch: Any, reference: Any, seed: int) -> None:
    rng = random.Random(seed)
    rank, step = rng.randint(0, 1), rng.randint(1, STEPS - 1)
    # Durable checkpoints only: saves that find one persisting are skipped.
    args = tiny_args("--steps", str(STEPS), "--when-busy", "skip", "--snapshot-every", "0")
    job = launch(args, env=child_env(STALWART_FAULTS=f"kill@rank={rank},step={step}"))
    assert job.wait(120) == 0, job.output()
    failed = job.events("worker_failed")
    assert any(e["rank"] == rank and e["signal"] == "SIGKILL" for e in failed)
    assert len(job.events("restarting")) == 1
    resumed = {e["step"] for e in job.events("resumed")}
    # Saves persist in the background: a kill right after a snapshot may come before its commit. The job
    # resumes from the newest checkpoint committed before the restart, at most one interval before the kill.
    # When rank 0 is the victim, its persister dies with it and may have written a manifest without logging
    # the event: then the resumed step is newer than the last logged commit, and still not after the kill.
    committed = [e["step"] for e in job.events("checkpoint_committed") if e["restart"] == 0]
    newest = max(committed, default=0)
    if not resumed:
        assert not committed, "a committed checkpoint was ignored"
    else:
        assert len(resumed) == 1, resumed
        (at,) = resumed
        assert at == newest or (rank == 0 and newest < at <= step), f"resumed {at}; logged commits {committed}"
    _assert_same_as_reference(job, reference)


@pytest.mark.parametrize(
    "faults",
    [
        "kill@rank=1,step=13",  # one rank
        "kill@rank=0,step=13;kill@rank=1,step=13",  # two ranks at once
        "kill@rank=1,step=13;kill@rank=0,step=13,restart=1",  # and again as soon as the job has recovered
        "kill_in_save@rank=1,step=12",  # inside a durable save: memory holds step 12 all the same
    ],
)
def test_memory_tier_resumes_from_the_last_completed_step(launch: Any, reference: Any, faults: str) -> None:
    job = launch(tiny_args("--steps", str(STEPS)), env=child_env(STALWART_FAULTS=faults))
    assert job.wait(180) == 0, job.output()
    resumed = job.events("resumed")
    restarts = len(job.events("restarting"))
    assert restarts == faults.count("restart=1") + 1
    assert resumed and all(e["tier"] == "memory" for e in resumed), resumed
    steps = {e["step"] for e in resumed}
    if "kill_in_save" in faults:  # the persister kills the rank while it trains on: at step 12 or later
        assert len(steps) == 1 and min(steps) >= 12, steps
    else:
        # No step every rank completed is lost. A killed rank completed the steps before its kill (between
        # steps 13 and 14); a survivor those before the step it was in when the failure reached it (`reforming`):
        # 13, or 12 when the agent's request to re-form came before the survivor's optimizer step of step 13.
        # A survivor asked to leave while it was still restoring (the second failure, right after the first
        # recovery) has no step yet (`reforming` says 0): it held the step its round was restoring.
        for restart in sorted({e["restart"] for e in resumed}):
            completed = {e["rank"]: e["step"] for e in job.events("fault_injected") if e["restart"] == restart - 1}
            restoring = {e["step"] for e in resumed if e["restart"] == restart - 1}
            for e in job.events("reforming"):
                if e["restart"] == restart - 1:
                    had_resumed = any(r["rank"] == e["rank"] and r["restart"] == restart - 1 for r in resumed)
                    completed.setdefault(e["rank"], e["step"] if had_resumed or not restoring else min(restoring))
            got = {e["step"] for e in resumed if e["restart"] == restart}
            assert got == {min(completed.values())} and got <= {12, 13}, (restart, got, completed)
    _assert_same_as_reference(job, reference)


def test_budgeted_snapshots_resume_from_the_newest_one_every_rank_holds(launch: Any, reference: Any) -> None:
    """snapshot_every="auto": snapshots every `interval` steps, chosen from measured costs, the same on every
    rank; a kill redoes at most the steps since the newest snapshot (or durable checkpoint)."""
    from stalwart.policy.snapshot import WARMUP, interval_for

    args = tiny_args("--steps", str(STEPS), "--snapshot-every", "auto", "--snapshot-budget", "0.005")
    job = launch(args, env=child_env(STALWART_FAULTS="kill@rank=1,step=13"))
    assert job.wait(180) == 0, job.output()
    decisions = [e for e in job.events("snapshot_interval") if e["restart"] == 0]
    assert decisions and decisions[0]["step"] == WARMUP, decisions
    for d in decisions:
        assert d["step_s"] > 0 and d["snapshot_s"] > 0 and d["budget"] == 0.005
        assert d["interval"] == interval_for(d["snapshot_s"], d["step_s"], d["budget"])
    largest = max(d["interval"] for d in decisions if d["step"] < 13)
    (resumed,) = {(e["step"], e["tier"]) for e in job.events("resumed")}
    assert 13 - largest <= resumed[0] <= 13, (resumed, decisions)
    _assert_same_as_reference(job, reference)


@pytest.mark.parametrize(("rank", "phase"), [(1, "shard_half_written"), (0, "before_commit")])
def test_kill_inside_save_keeps_previous_checkpoint(launch: Any, reference: Any, rank: int, phase: str) -> None:
    fault = f"kill_in_save@rank={rank},step=12,phase={phase}"
    job = launch(tiny_args("--steps", str(STEPS), "--snapshot-every", "0"), env=child_env(STALWART_FAULTS=fault))
    assert job.wait(120) == 0, job.output()
    assert [e["step"] for e in job.events("resumed")] == [8, 8], "the interrupted save at step 12 must stay invisible"
    committed = [e["step"] for e in job.events("checkpoint_committed")]
    assert committed.count(12) == 1, "step 12 is committed once, by the restarted job"
    _assert_same_as_reference(job, reference)


def test_a_failure_in_the_final_save_still_leaves_the_last_step_durable(launch: Any, reference: Any) -> None:
    """A rank killed inside the run's final save: the job resumes at the last step from node memory, where no
    step is left to run, and makes that save then (found by `stalwart chaos`: a run ended with exit code 0 and
    its newest durable checkpoint ten steps short)."""
    fault = f"kill_in_save@rank=1,step={STEPS},phase=shard_half_written"
    job = launch(tiny_args("--steps", str(STEPS)), env=child_env(STALWART_FAULTS=fault))
    assert job.wait(120) == 0, job.output()
    resumed = job.events("resumed")
    assert {(e["step"], e["tier"]) for e in resumed} == {(STEPS, "memory")}, resumed
    committed = [e["step"] for e in job.events("checkpoint_committed") if e["restart"] == 1]
    assert committed == [STEPS], "the last step's checkpoint was not made after the resume"
    _assert_same_as_reference(job, reference)


def test_corrupt_newest_shard_falls_back_on_every_rank(launch: Any, tmp_path: Path) -> None:
    first = launch(tiny_args("--steps", "12"), name="job")
    assert first.wait(120) == 0, first.output()
    shard = next((tmp_path / "job" / "ckpt" / "step_00000012").glob("rank00001.*.data"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    again = launch(tiny_args("--steps", "14"), name="job")
    assert again.wait(120) == 0, again.output()
    invalid = [e for e in again.events("checkpoint_invalid") if e["restart"] == 0 and e["step"] == 12]
    assert any("xxh3" in (e["error"] or "") for e in invalid)
    assert [e["step"] for e in again.events("resumed")][-2:] == [8, 8]
    kept = list((tmp_path / "job" / "ckpt").glob(f"step_00000012.invalid-*/{shard.name}"))
    assert len(kept) == 1 and kept[0].read_bytes() == bytes(data), "a corrupt checkpoint is set aside, not deleted"
