"""The Hugging Face Trainer under stalwart (stalwart.integrations.hf): tests/scripts/train_hf.py, a tiny GPT-2 in
the Trainer's own loop on 2 CPU ranks under `stalwart run`. Rank 1 killed in the backward pass, before the
optimizer step or between two steps: the survivor stays in the Trainer's loop, runs the failed step again and the
run ends with the parameters and the logged losses of `transformers.Trainer` alone without the failure, bit for bit
(the tests' default: the survivor waits for the replacement), the replacement reading no item before the step it
joined at. A full restart resumes at the last checkpoint without reading an item before it. Without
--wait-for-replacement the survivor trains on shrunk."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from conftest import child_env, finished, kill_the_launcher, stalwart
from conftest import digests as _digests
from conftest import process_log as _log
from conftest import setups as _setups
from stalwart.errors import ConfigError

pytest.importorskip("transformers")

SCRIPT = Path(__file__).parent / "scripts" / "train_hf.py"
BATCH = 4  # per device
STEPS = 30


def _args(*extra: str) -> list[str]:
    return ["--nproc-per-node", "2", "--max-restarts", "3", str(SCRIPT), "--out", "out", "--served-log", "served",
            "--setup-log", "setups.txt", "--step-log", "steps", *extra]  # fmt: skip


def _losses(job: Any) -> list[str]:
    """The Trainer's log lines of the loss, as rank 0 printed them."""
    return re.findall(r"\{'loss': '[^']*'", job.output())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """transformers.Trainer alone, without a failure."""
    with finished(tmp_path_factory.mktemp("hf-reference"), _args("--plain")) as job:
        yield job


@pytest.mark.parametrize(
    "fault",
    # Between two steps and inside the optimizer step: test_a_stopped_worker_then_a_killed_survivor_end_bitwise_...
    [("--die-at", "13:backward"), ("--die-at", "13:begin")],
    ids=["backward", "before-the-forward"],
)
def test_a_kill_redoes_the_step_inside_the_trainer_and_the_run_ends_bitwise(
    launch: Any, reference: Any, fault: tuple[str, str]
) -> None:
    flag, value = fault
    env = child_env(**({flag: value} if not flag.startswith("--") else {}))
    # The replicas' divergence check every 5 steps: the Trainer's progress, replicated, must be the same everywhere.
    job = launch(_args("--divergence-every", "5", *((flag, value) if flag.startswith("--") else ())), env=env)
    assert job.wait(180) == 0, job.output()[-3000:]
    assert _digests(job) == _digests(reference), "the parameters differ from transformers.Trainer's without a failure"
    assert _losses(job) == _losses(reference), "the Trainer's logged losses differ"
    assert [e["rank"] for e in job.events("reformed_in_loop")] == [0], "rank 0 stayed in the Trainer's loop"
    setups = _setups(job)
    assert len(setups) == len(set(setups)) == 3, f"the script's set-up ran once in each process: {setups}"
    [resumed] = [e for e in job.events("resumed") if e["rank"] == 1]
    assert resumed["step"] == 13 and resumed["tier"] != "durable", resumed
    survivor, replacement = job.worker_pids(restart=0)[0], job.worker_pids(restart=1)[1]
    assert _log(job, "steps", survivor) == list(range(1, STEPS + 1)), "the Trainer's callbacks saw each step end once"
    # The replacement read rank 1's items from step 13 on, as the run without the failure did, and none before.
    rank1 = _log(reference, "served", reference.worker_pids(restart=0)[1])
    assert _log(job, "served", replacement) == rank1[13 * BATCH :]


def test_gradient_accumulation_runs_every_micro_batch_of_the_failed_step_again(launch: Any) -> None:
    args = ("--ga", "2", "--steps", "15")
    reference = launch(_args("--plain", *args), name="reference")
    job = launch(_args("--die-at", "7:backward", *args), name="killed")
    for run in (reference, job):
        assert run.wait(180) == 0, run.output()[-3000:]
    assert _digests(job) == _digests(reference)
    assert _losses(job) == _losses(reference)
    assert [e["rank"] for e in job.events("reformed_in_loop")] == [0]


def test_a_full_restart_resumes_at_the_last_checkpoint_without_reading_an_item_before_it(
    launch: Any, reference: Any
) -> None:
    """The whole launcher SIGKILLed after step 25 and step 20's commit (checkpoints every 10 steps), then the same
    command again: it resumes at the last committed step from storage, reads rank 1's items from that step on and
    none before, and ends bitwise."""
    first = launch(_args("--step-sleep", "0.2"), name="job")
    last = kill_the_launcher(first, 25, 20)  # 20, or a later one if its commit landed first
    again = launch(_args(), name="job")  # the same directory
    assert again.wait(180) == 0, again.output()[-3000:]
    assert _digests(again) == _digests(reference)
    resumes = again.events("resumed")
    [resumed] = [e for e in resumes if e["rank"] == 1 and e.get("restart", 0) == 0 and e["step"] == last]
    assert resumed["tier"] == "durable", resumed
    rank1 = _log(reference, "served", reference.worker_pids(restart=0)[1])
    pid = [e["worker_pid"] for e in again.events("worker_spawned") if e["rank"] == 1][-1]
    assert _log(again, "served", pid) == rank1[last * BATCH :], f"no item before step {last} was read again"


def test_without_wait_for_replacement_the_survivor_trains_on_shrunk_in_the_trainer(launch: Any) -> None:
    job = launch(_args("--die-at", "13:backward"), env=child_env(STALWART_WAIT_FOR_REPLACEMENT="0"))
    assert job.wait(180) == 0, job.output()[-3000:]
    resized = [(e["from"], e["to"]) for e in job.events("world_resized") if e.get("rank") == 0]
    assert resized[:1] == [(2, 1)], resized
    results = job.results()
    assert results[0]["sha256"] == results[1]["sha256"] and results[0]["step"] == STEPS
    setups = _setups(job)
    assert len(setups) == len(set(setups)) == 3, f"the script's set-up ran once in each process: {setups}"
    # The losses the Trainer logs stay the model's (about ln 64 = 4.16 at the start): after the grow the replacement
    # takes the survivors' mean for the steps since the last log line (its predecessor's sum is older).
    losses = [float(v.split("'")[-2]) for v in _losses(job)]
    assert len(losses) == STEPS // 5 and all(3.5 < v < 4.3 for v in losses), f"the logged losses: {losses}"


def test_the_callback_alone_on_a_plain_trainer_says_why_it_cannot() -> None:
    """At the plain Trainer's init (its on_init_end), before any set-up: stalwart's Trainer sets itself on the
    callback before that."""
    from stalwart.integrations.hf import StalwartCallback

    with pytest.raises(ConfigError, match=r"StalwartCallback needs stalwart\.integrations\.hf\.Trainer in place of"):
        StalwartCallback("ckpt").on_init_end(None, None, None)
    with pytest.raises(ConfigError, match="a checkpoint directory or a job=, one of them"):
        StalwartCallback()


def test_an_iterable_dataset_is_one_line_and_no_restart(launch: Any) -> None:
    """An IterableDataset (its position is not a function of the step; Accelerate dispatches its batches from rank
    0) is not covered: each rank stops at the Trainer's init with one line that says why, and the launcher does not
    restart bad input."""
    job = launch(_args("--iterable"))
    assert job.wait(120) == 78, job.output()[-3000:]
    lines = [line for line in job.output().splitlines() if "iterable dataset" in line]
    says = "stalwart: error: stalwart.integrations.hf does not cover an iterable dataset (Stream)"
    assert len(lines) == 2 and all(line.startswith(says) for line in lines), lines
    assert "Traceback" not in job.output()
    assert not job.events("restarting")


def test_an_engine_it_cannot_run_a_step_again_through_is_refused_and_fsdp2_is_said_untested() -> None:
    """Accelerate's engines as the Trainer's init leaves them (DeepSpeed and FSDP need a GPU, so the Trainer's
    attributes stand in): DeepSpeed and FSDP1 are refused saying which and why, FSDP2 gets one line at start, DDP
    nothing."""
    from types import SimpleNamespace

    from stalwart.integrations.hf_state import check_engine

    def trainer(deepspeed: bool = False, fsdp: int | None = None) -> Any:
        plugin = None if fsdp is None else SimpleNamespace(fsdp_version=fsdp)
        state = SimpleNamespace(fsdp_plugin=plugin, deepspeed_plugin=object() if deepspeed else None)
        return SimpleNamespace(
            is_deepspeed_enabled=deepspeed, is_fsdp_enabled=fsdp is not None, accelerator=SimpleNamespace(state=state)
        )

    with pytest.raises(ConfigError, match="does not cover DeepSpeed: its engine accumulates gradients"):
        check_engine(trainer(deepspeed=True))
    with pytest.raises(ConfigError, match=r"does not cover FSDP1 .*fsdp_config=\{'version': 2\}"):
        check_engine(trainer(fsdp=1))
    assert "FSDP2 under the Hugging Face Trainer has not been tested" in (check_engine(trainer(fsdp=2)) or "")
    assert check_engine(trainer()) is None


def test_bench_trainer_refuses_a_kill_after_the_last_step_in_one_line(tmp_path: Path) -> None:
    done = stalwart("bench", "trainer", "--steps", "10", "--kill-at", "10", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "--kill-at 10 must be below --steps 10" in done.stderr


@pytest.mark.skipif(not os.environ.get("STALWART_TEST_BENCH_TRAINER"), reason="six launches, run on request")
def test_bench_trainer_runs_every_system_and_reports_one_json_object(tmp_path: Path) -> None:
    """A short `stalwart bench trainer`: the Trainer alone under torchrun and stalwart's two modes, each without a
    failure (two rounds, taking turns) and with rank 1 killed; stalwart waiting for the replacement ends as without
    the kill and redoes no completed step. Launches of a transformers job: minutes beside the suite, so it runs on
    request (`STALWART_TEST_BENCH_TRAINER=1 .venv/bin/python -m pytest tests/test_hf_trainer.py -k bench`)."""
    done = stalwart("bench", "trainer", "--steps", "10", "--kill-at", "5", "--step-s", "0.05", "--json",
                    "--rounds", "2", "--dir", str(tmp_path), cwd=tmp_path, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    systems = report["systems"]
    assert list(systems) == ["torchrun + transformers.Trainer", "stalwart", "stalwart --wait-for-replacement"]
    waited = systems["stalwart --wait-for-replacement"]
    assert waited["as_without_the_kill"] and waited["as_trainer_alone"] and waited["steps_done_again"] == 0
    assert all(s["kill_to_next_step_s"] > 0 and s["median_step_s"] > 0 for s in systems.values())
    # Two rounds each, taking turns; --wait-for-replacement's runs without a failure are stalwart's own.
    assert all(len(s["step_time_ratios"]) == 2 for s in systems.values()) and report["rounds"] == 2
    assert waited["step_time_ratios"] == systems["stalwart"]["step_time_ratios"]
    assert not list(tmp_path.glob("stalwart-bench-trainer-*")), "the runs' files are removed"


def test_a_stopped_worker_then_a_killed_survivor_end_bitwise_in_the_trainer(launch: Any, reference: Any) -> None:
    """Rank 1 stopped (SIGSTOP) as step 14 begins, between two steps: the agent finds it hung and replaces it while
    rank 0 stays in the Trainer's loop; then rank 0 is killed in the next round inside the optimizer step (its commit
    point passed), and the replacement of rank 1 stays in its loop. The run ends as the Trainer alone without a
    failure."""
    faults = "hang@rank=1,step=13,how=sigstop;kill_in_optimizer@rank=0,step=22,restart=1,phase=after_barrier"
    job = launch(_args("--divergence-every", "5"), env=child_env(STALWART_FAULTS=faults))
    assert job.wait(240) == 0, job.output()[-3000:]
    assert _digests(job) == _digests(reference), "the parameters differ from transformers.Trainer's without a failure"
    assert _losses(job) == _losses(reference), "the Trainer's logged losses differ"
    faults_fired = [e["fault"] for e in job.events("fault_injected")]
    assert faults_fired == ["hang", "kill_in_optimizer"], faults_fired
    assert sorted(e["rank"] for e in job.events("reformed_in_loop")) == [0, 1], "each survivor stayed in its loop"
    setups = _setups(job)
    assert len(setups) == len(set(setups)) == 4, f"the script's set-up ran once in each process: {setups}"
