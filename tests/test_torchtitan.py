"""torchtitan (0.3) with stalwart's checkpoint manager (stalwart.integrations.torchtitan), on 2 CPU ranks under
`stalwart run`: tests/scripts/train_torchtitan.py runs torchtitan's Trainer loop as written with torchtitan's own
components and FSDP2 (torchtitan's Trainer itself needs a GPU; docs/integrations.md: a run of it by hand). A killed rank
costs the survivor the steps back to the state it restored, run again inside the loop with the batches they drew;
a full restart resumes at the last checkpoint without reading an item before it; both end bitwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import child_env, committed_steps, finished, kill_the_launcher
from conftest import digests as _digests
from conftest import process_log as _log
from conftest import setups as _setups

pytest.importorskip("torchtitan.components.checkpointer")

pytestmark = [pytest.mark.timeout(300)]

SCRIPT = Path(__file__).parent / "scripts" / "train_torchtitan.py"
BATCH = 2
STEPS = 30


def _args(*extra: str) -> list[str]:
    return ["--nproc-per-node", "2", "--max-restarts", "3", str(SCRIPT), "--out", "out", "--served-log", "served",
            "--setup-log", "setups.txt", "--step-log", "steps", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The same loop with torchtitan's own CheckpointManager (disabled), without a failure."""
    with finished(tmp_path_factory.mktemp("torchtitan-reference"), _args("--plain")) as job:
        yield job


@pytest.mark.parametrize("phase", ["backward", "begin", "optimizer"])
def test_a_kill_redoes_the_steps_inside_the_loop_and_the_run_ends_bitwise(
    launch: Any, reference: Any, phase: str
) -> None:
    """Rank 1 SIGKILLed at step 13 (in its backward pass, before the forward, or in the optimizer step) with
    --wait-for-replacement: the survivor stays in torchtitan's loop, runs the steps since the restored one again
    with the batches they drew, and the run ends with the parameters of the run without a failure; the replacement
    reads rank 1's items from the restored step on and none before; each process ran the set-up once, and the
    survivor's loop saw each step end once. Each step checks that its all-reduced loss is finite, as torchtitan's
    Trainer does: after the kill before the forward the survivor's absorbed all-gather leaves garbage in it, the check
    raises, and the step is recovered from all the same; the last loss each step logged is the reference's."""
    job = launch(_args("--die-at", f"13:{phase}"), env=child_env(STALWART_WAIT_FOR_REPLACEMENT="1"))
    assert job.wait(180) == 0, job.output()[-3000:]
    assert _digests(job) == _digests(reference), "the parameters differ from the run without a failure"
    assert [e["rank"] for e in job.events("reformed_in_loop")] == [0], "the survivor re-formed in its loop"
    setups = _setups(job)
    assert len(setups) == len(set(setups)) == 3, f"the set-up ran once in each process: {setups}"
    survivor = job.worker_pids(restart=0)[0]
    assert _log(job, "steps", survivor) == list(range(1, STEPS + 1)), "one step end a step in the survivor's loop"
    assert _log(job, "served", survivor) == _log(reference, "served", reference.worker_pids(restart=0)[0])
    [resumed] = [e for e in job.events("resumed") if e["rank"] == 1]
    replacement = [e["worker_pid"] for e in job.events("worker_spawned") if e["rank"] == 1][-1]
    rank1 = _log(reference, "served", reference.worker_pids(restart=0)[1])
    assert _log(job, "served", replacement) == rank1[resumed["step"] * BATCH :], "read from the restored step on"
    assert _losses(job, survivor) == _losses(reference, reference.worker_pids(restart=0)[0])


def _losses(job: Any, pid: int) -> dict[int, str]:
    """Each step's all-reduced loss as the process last logged it (a step run again logs again)."""
    lines = (job.workdir / "steps" / f"loss{pid}.txt").read_text().splitlines()
    return {int(step): loss for step, loss in (line.split() for line in lines)}


def test_a_full_restart_resumes_at_the_last_checkpoint_without_reading_an_item_before_it(
    launch: Any, reference: Any
) -> None:
    """The whole launcher SIGKILLed after step 16 and step 15's commit (checkpoint.interval 5), then the same
    command again: it resumes at the last committed step from storage, reads rank 1's items from that step on and
    none before, and ends bitwise (the data loader's new iterator does not shift the restored generator)."""
    first = launch(_args("--step-sleep", "0.2"), name="job")
    last = kill_the_launcher(first, 16, 15)  # 15, or a later one if its commit landed first
    again = launch(_args(), name="job")  # the same directory
    assert again.wait(180) == 0, again.output()[-3000:]
    assert _digests(again) == _digests(reference)
    resumes = again.events("resumed")
    [resumed] = [e for e in resumes if e["rank"] == 1 and e.get("restart", 0) == 0 and e["step"] == last]
    assert resumed["tier"] == "durable", resumed
    rank1 = _log(reference, "served", reference.worker_pids(restart=0)[1])
    pid = [e["worker_pid"] for e in again.events("worker_spawned") if e["rank"] == 1][-1]
    assert _log(again, "served", pid) == rank1[last * BATCH :], f"no item before step {last} was read again"


def test_without_wait_for_replacement_the_survivor_trains_on_shrunk_in_the_loop(launch: Any) -> None:
    """The default: the survivor reshards the FSDP2 state to itself and trains on alone in torchtitan's loop while
    the replacement sets up, then the job grows back and ends at the last step, each process having run the set-up
    once."""
    env = child_env(STALWART_WAIT_FOR_REPLACEMENT="0")
    job = launch(_args("--die-at", "13:backward", "--step-sleep", "0.02"), env=env)
    assert job.wait(180) == 0, job.output()[-3000:]
    resized = [(e["from"], e["to"]) for e in job.events("world_resized") if e.get("rank") == 0]
    assert resized[:1] == [(2, 1)], resized
    assert {r["step"] for r in job.results().values()} == {STEPS}
    setups = _setups(job)
    assert len(setups) == len(set(setups)) == 3, f"the set-up ran once in each process: {setups}"
    assert "on 1 of 2 ranks" in job.output()


def test_a_policy_it_does_not_carry_out_is_one_line_and_no_restart(launch: Any) -> None:
    """checkpoint.load_step: each rank stops at the Trainer's set-up with one line that says why, and the launcher
    does not restart bad input."""
    job = launch(_args("--load-step", "10"))
    assert job.wait(120) == 78, job.output()[-3000:]
    out = job.output()
    assert "checkpoint.load_step=10 is not supported with StalwartCheckpointManager" in out
    assert "Traceback" not in out


def test_the_entry_point_makes_any_checkpoint_config_stalwarts() -> None:
    """`-m stalwart.integrations.torchtitan` swaps the parsed config's checkpoint manager: torchtitan's policy
    fields carried over, checkpoints on, torchtitan's default folder replaced by stalwart's own."""
    from torchtitan.components.checkpointer import CheckpointManager

    from stalwart.integrations.torchtitan import DEFAULT_FOLDER, StalwartCheckpointManager, stalwart_config

    theirs = CheckpointManager.Config(enable=False, interval=7, keep_latest_k=4, folder="checkpoint")
    ours = stalwart_config(theirs)
    assert isinstance(ours, StalwartCheckpointManager.Config)
    assert (ours.enable, ours.interval, ours.keep_latest_k, ours.folder) == (True, 7, 4, DEFAULT_FOLDER)
    assert stalwart_config(CheckpointManager.Config(folder="/data/ckpt")).folder == "/data/ckpt"
    assert stalwart_config(ours) is ours


def test_a_checkpoint_taken_as_a_step_is_run_again_restarts_bitwise(launch: Any, reference: Any) -> None:
    """Checkpoints every 3 steps and rank 1 killed at step 13: the survivor restores 9 (step 12's save was still
    persisting, as in most runs here) or 12, and runs the steps since again. Then the job is started afresh from the
    newest checkpoint before the failure, the later ones set aside: when the restore was 9, that is step 12's as the
    redo rewrote it, which must record the data loader's position at step 12, not the live loader's (already past
    13); either way the run ends with the parameters of the run without a failure and reads from that step on."""
    env = child_env(STALWART_WAIT_FOR_REPLACEMENT="1")
    first = launch(_args("--every", "3", "--die-at", "13:begin"), env=env, name="job")
    assert first.wait(180) == 0, first.output()[-3000:]
    before = max(s for s in committed_steps(first.workdir / "ckpt") if s < 13)
    aside = first.workdir / "aside"
    aside.mkdir()
    for step in committed_steps(first.workdir / "ckpt"):
        if step > before:
            (first.workdir / "ckpt" / f"step_{step:08d}").rename(aside / f"step_{step:08d}")
    again = launch(_args("--every", "3"), name="job")  # the same directory
    assert again.wait(180) == 0, again.output()[-3000:]
    assert _digests(again) == _digests(reference)
    pid = [e["worker_pid"] for e in again.events("worker_spawned") if e["rank"] == 1][-1]
    rank1 = _log(reference, "served", reference.worker_pids(restart=0)[1])
    assert _log(again, "served", pid) == rank1[before * BATCH :], f"resumed at {before}, read from there on"


def test_a_run_whose_data_runs_out_ends_with_its_last_step_durable(launch: Any) -> None:
    """45 steps asked of 40 steps of data: torchtitan's loop breaks in step 41 without saving; the manager's close
    makes step 40 durable (checkpoint.interval 100: no checkpoint otherwise after the start)."""
    job = launch(_args("--steps", "45", "--every", "100"))
    assert job.wait(180) == 0, job.output()[-3000:]
    assert committed_steps(job.workdir / "ckpt")[-1:] == [40]
    assert {r["step"] for r in job.results().values()} == {41}, "torchtitan counts the step it broke out of"


def test_steps_run_again_are_validated_where_the_loop_would_validate(launch: Any) -> None:
    """A validator every 4 steps (an all-reduce and a draw from torch's generator, as torchtitan's makes) and rank 1
    killed at step 13 with --wait-for-replacement: the survivor validates again at the step it restored (the state
    was taken before that step's validation) and at each step it runs again that the loop validates at (12 at
    least), so its collectives meet the replacement's and the run ends with the parameters of the same run without
    a failure."""
    plain = launch(_args("--plain", "--validate-every", "4"), name="plain")
    assert plain.wait(180) == 0, plain.output()[-3000:]
    env = child_env(STALWART_WAIT_FOR_REPLACEMENT="1")
    job = launch(_args("--validate-every", "4", "--die-at", "13:begin"), env=env)
    assert job.wait(180) == 0, job.output()[-3000:]
    assert _digests(job) == _digests(plain)
    survivor = job.worker_pids(restart=0)[0]
    [resumed] = [e for e in job.events("resumed") if e["rank"] == 0]
    again = [s for s in range(resumed["step"], 13) if s % 4 == 0]  # the restored step's too: its state predates it
    validated = _log(job, "steps", f"val{survivor}.txt")
    assert validated == [4, 8, 12, *again, *range(16, STEPS + 1, 4)], validated
