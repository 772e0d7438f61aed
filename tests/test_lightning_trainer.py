"""The Lightning Trainer (lightning 2.6) with stalwart's callback (stalwart.integrations.lightning), on 2 CPU ranks
under `stalwart run`: a killed worker costs the survivor the failed step, run again inside the Trainer's loop, and
the run ends with the parameters of the Trainer alone without a failure; a full restart resumes at the last
checkpoint without reading an item before it (tests/scripts/train_lightning.py records every item it serves)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from conftest import child_env, finished, kill_the_launcher, served_script
from conftest import digests as _digests
from conftest import process_log as _log
from conftest import setups as _setups

pytestmark = [pytest.mark.timeout(300)]

SCRIPT = Path(__file__).parent / "scripts" / "train_lightning.py"
BATCH = 4
STEPS = 30


def _args(*extra: str) -> list[str]:
    return ["--nproc-per-node", "2", "--max-restarts", "3", str(SCRIPT), "--out", "out", "--served-log", "served",
            "--setup-log", "setups.txt", "--step-log", "steps", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The Lightning Trainer alone (no stalwart callback), without a failure."""
    with finished(tmp_path_factory.mktemp("lightning-reference"), _args("--plain")) as job:
        yield job


@pytest.mark.parametrize("phase", ["backward", "begin"], ids=["backward", "before-the-forward"])
def test_a_kill_redoes_the_step_inside_the_trainer_and_the_run_ends_bitwise(
    launch: Any, reference: Any, phase: str
) -> None:
    """Rank 1 SIGKILLed at step 13 (in the backward pass: DDP's all-reduce in flight; or before the forward) with
    --wait-for-replacement: the survivor stays in the Trainer's loop, runs step 13 again once the replacement joined,
    and the run ends with the parameters of the Trainer alone; the replacement reads rank 1's items from step 13 on
    and none before; each process ran the script's set-up once, and the Trainer's other callbacks saw each step's
    end once on the survivor."""
    job = launch(_args("--die-at", f"13:{phase}"), env=child_env(STALWART_WAIT_FOR_REPLACEMENT="1"))
    assert job.wait(180) == 0, job.output()[-3000:]
    assert _digests(job) == _digests(reference), "the parameters differ from the Lightning Trainer's without a failure"
    setups = _setups(job)
    assert len(setups) == len(set(setups)) == 3, f"the script's set-up ran once in each process: {setups}"
    _check_stayed_in_loop(job, reference, 13)


def _check_stayed_in_loop(job: Any, reference: Any, resumed: int) -> None:
    """Rank 0 re-formed in its loop and its other callbacks saw each step's end once; the replacement read rank 1's
    items from step `resumed` on, as `reference` served them, and none before."""
    assert [e["rank"] for e in job.events("reformed_in_loop")] == [0], "the survivor re-formed in its loop"
    survivor = job.worker_pids(restart=0)[0]
    assert _log(job, "steps", survivor) == list(range(1, STEPS + 1)), "one batch end a step on the survivor"
    replacement = [e["worker_pid"] for e in job.events("worker_spawned") if e["rank"] == 1][-1]
    rank1 = _log(reference, "served", reference.worker_pids(restart=0)[1])
    assert _log(job, "served", replacement) == rank1[resumed * BATCH :], f"the replacement read from step {resumed} on"


def test_a_stopped_worker_then_a_killed_survivor_end_bitwise_in_the_trainer(launch: Any, reference: Any) -> None:
    """Rank 1 stopped (SIGSTOP) as step 14 begins, between two steps: the agent finds it hung and replaces it while
    rank 0 stays in the Trainer's loop; then rank 0 is killed in the next round inside the optimizer step (its commit
    point passed), and the replacement of rank 1 stays in its loop. The run ends as the Trainer alone without a
    failure."""
    faults = "hang@rank=1,step=13,how=sigstop;kill_in_optimizer@rank=0,step=22,restart=1,phase=after_barrier"
    job = launch(_args(), env=child_env(STALWART_FAULTS=faults, STALWART_WAIT_FOR_REPLACEMENT="1"))
    assert job.wait(240) == 0, job.output()[-3000:]
    assert _digests(job) == _digests(reference), "the parameters differ from the Lightning Trainer's without a failure"
    faults_fired = [e["fault"] for e in job.events("fault_injected")]
    assert faults_fired == ["hang", "kill_in_optimizer"], faults_fired
    assert sorted(e["rank"] for e in job.events("reformed_in_loop")) == [0, 1], "each survivor stayed in its loop"
    setups = _setups(job)
    assert len(setups) == len(set(setups)) == 4, f"the script's set-up ran once in each process: {setups}"


def test_a_full_restart_resumes_at_the_last_checkpoint_without_reading_an_item_before_it(
    launch: Any, reference: Any
) -> None:
    """The whole launcher SIGKILLed after step 16 and step 15's commit (checkpoints every 5 steps), then the same
    command again: it resumes at the last committed step from storage, in the epoch's order, reads rank 1's items
    from that step on and none before,
    and ends bitwise (its generators and its loops' counters restored as the uninterrupted run had them)."""
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


def test_without_wait_for_replacement_the_survivor_trains_on_shrunk_in_the_trainer(launch: Any) -> None:
    """The default: the survivor trains on alone in the Trainer's loop while the replacement sets up, then the job
    grows back; the ranks end as replicas at the last step, each process having run the set-up once."""
    env = child_env(STALWART_WAIT_FOR_REPLACEMENT="0")
    job = launch(_args("--die-at", "13:backward", "--step-sleep", "0.02"), env=env)
    assert job.wait(180) == 0, job.output()[-3000:]
    resized = [(e["from"], e["to"]) for e in job.events("world_resized") if e.get("rank") == 0]
    assert resized[:1] == [(2, 1)], resized
    results = job.results()
    assert results[0]["sha256"] == results[1]["sha256"] and results[0]["step"] == STEPS
    setups = _setups(job)
    assert len(setups) == len(set(setups)) == 3, f"the script's set-up ran once in each process: {setups}"
    assert "on 1 of 2 ranks" in job.output()


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--manual", "--two-optimizers"], "StalwartCallback covers one optimizer"),
        (["--strategy", "fsdp"], "StalwartCallback does not cover CPUFSDPStrategy: it wraps the model in FSDP1"),
        (["--sched-frequency", "2"], "StalwartCallback covers LR schedulers stepped every step (frequency 1)"),
    ],
    ids=["two-optimizers", "fsdp1", "scheduler-frequency"],
)
def test_a_configuration_it_cannot_protect_is_one_line_and_no_restart(launch: Any, extra: list[str], says: str) -> None:
    """Two optimizers (manual optimization), Lightning's FSDP1 strategy (`FSDPStrategy`, whose flat parameters
    stalwart does not snapshot) and an LR schedule stepped every other step (a step run again would step it by the
    loop's counters) are not covered: each rank stops as the fit starts with one line that says why, and the
    launcher does not restart bad input."""
    job = launch(_args(*extra))
    assert job.wait(120) == 78, job.output()[-3000:]
    lines = [line for line in job.output().splitlines() if "StalwartCallback" in line]
    assert len(lines) == 2 and all(line.startswith(f"stalwart: error: {says}") for line in lines), lines
    assert "Traceback" not in job.output()
    assert not job.events("restarting")


FSDP2 = ("--strategy", "model_parallel")
"""Lightning's FSDP2 strategy (ModelParallelStrategy, `fully_shard` in the module's configure_model) over both ranks."""


@pytest.fixture(scope="module")
def reference_fsdp2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The Lightning Trainer alone with FSDP2, without a failure."""
    with finished(tmp_path_factory.mktemp("lightning-reference-fsdp2"), _args("--plain", *FSDP2)) as job:
        yield job


@pytest.mark.parametrize("phase", ["backward", "optimizer"])
def test_fsdp2_goes_back_to_node_memorys_step_and_runs_the_steps_since_again_bitwise(
    launch: Any, reference_fsdp2: Any, phase: str
) -> None:
    """FSDP2 with node memory's snapshots every 5 steps, rank 1 SIGKILLed at step 13 (in the backward pass, the
    other layer's reduce-scatter done; or inside the optimizer step), with --wait-for-replacement: rank 1's shards
    of step 13 are nowhere, so the job goes back to step 10, the newest whose every shard node memory holds, and the
    survivor runs steps 10 to 13 again in its Trainer's loop (across the epoch's end at step 12) with the batches it
    kept; the run ends with the parameters of the Trainer alone, the replacement reads rank 1's items from step 10
    on and none before, and the survivor's other callbacks see each step's end once."""
    job = launch(_args(*FSDP2, "--snapshot-every", "5", "--die-at", f"13:{phase}"),
                 env=child_env(STALWART_WAIT_FOR_REPLACEMENT="1"))  # fmt: skip
    assert job.wait(180) == 0, job.output()[-3000:]
    assert _digests(job) == _digests(reference_fsdp2), "the parameters differ from the Trainer alone's"
    assert [e["step"] for e in job.events("resumed") if e["rank"] == 0] == [10], "back to node memory's step 10"
    _check_stayed_in_loop(job, reference_fsdp2, 10)


def test_fsdp2_a_redo_past_a_validation_restarts_the_workers_and_ends_bitwise(launch: Any, tmp_path: Path) -> None:
    """FSDP2 with a validation every 11 batches (its loss logged with sync_dist=True: a collective, whose mean over
    gloo Lightning takes as a sum it divides, once `dist.get_backend()` says gloo), node memory's snapshots every 5
    steps, rank 1 SIGKILLed at step 13, --wait-for-replacement: the job goes back to step 10, before the validation
    after step 10, which the replacement's loop would run and the survivor running steps 10-13 again would not (a
    hang). The survivor says so and exits; every worker restarts from node memory, and the run ends as the
    Trainer alone with the same validation."""
    args = (*FSDP2, "--validate-every", "11")
    with finished(tmp_path / "reference", _args("--plain", *args)) as reference:
        job = launch(_args(*args, "--snapshot-every", "5", "--die-at", "13:backward"),
                     env=child_env(STALWART_WAIT_FOR_REPLACEMENT="1"))  # fmt: skip
        assert job.wait(180) == 0, job.output()[-3000:]
        assert _digests(job) == _digests(reference), "the parameters differ from the Trainer alone's"
    says = "stalwart: the job went back to step 10, before a validation after step 10"
    assert says in job.output()
    assert [e["step"] for e in job.events("resumed") if e["rank"] == 1 and e.get("restart", 0) == 2] == [10]


def test_fsdp2_without_wait_for_replacement_the_survivor_reshards_trains_on_shrunk_and_grows_back(
    launch: Any,
) -> None:
    """The default with FSDP2: the survivor reshards the modules onto itself from node memory's step 10 (every
    5 steps), runs the steps since again, trains on alone in the Trainer's loop while the replacement sets up, and
    the job grows back; both ranks reach the last step, the survivor's callbacks seeing each step's end once."""
    env = child_env(STALWART_WAIT_FOR_REPLACEMENT="0")
    job = launch(_args(*FSDP2, "--snapshot-every", "5", "--die-at", "13:backward", "--step-sleep", "0.02"), env=env)
    assert job.wait(180) == 0, job.output()[-3000:]
    resized = [(e["from"], e["to"]) for e in job.events("world_resized") if e.get("rank") == 0]
    assert resized[:1] == [(2, 1)] and (1, 2) in resized, resized
    assert [e["step"] for e in job.events("resharded_in_place") if e["rank"] == 0][:1] == [10]
    assert [r["step"] for r in job.results().values()] == [STEPS, STEPS]
    survivor = job.worker_pids(restart=0)[0]
    assert _log(job, "steps", survivor) == list(range(1, STEPS + 1)), "one batch end a step on the survivor"
    assert "on 1 of 2 ranks" in job.output()


@pytest.fixture(scope="module")
def reference_manual(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The Lightning Trainer alone with manual optimization, without a failure."""
    with finished(tmp_path_factory.mktemp("lightning-reference-manual"), _args("--plain", "--manual")) as job:
        yield job


def test_manual_optimization_runs_the_failed_step_again_and_ends_bitwise(launch: Any, reference_manual: Any) -> None:
    """Manual optimization (the module's training_step zeroes, backs up, steps its optimizer and its LR schedule),
    rank 1 SIGKILLed in step 13's backward pass, with --wait-for-replacement: the survivor runs the module's
    training_step of the failed step again in the Trainer's loop, and the run ends with the parameters of the Trainer
    alone; the survivor's other callbacks see each step's end once."""
    job = launch(_args("--manual", "--die-at", "13:backward"), env=child_env(STALWART_WAIT_FOR_REPLACEMENT="1"))
    assert job.wait(180) == 0, job.output()[-3000:]
    assert _digests(job) == _digests(reference_manual), "the parameters differ from the Trainer alone"
    assert [e["rank"] for e in job.events("reformed_in_loop")] == [0], "the survivor re-formed in its loop"
    survivor = job.worker_pids(restart=0)[0]
    assert _log(job, "steps", survivor) == list(range(1, STEPS + 1)), "one batch end a step on the survivor"


@pytest.fixture(scope="module")
def reference_accumulating(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The Lightning Trainer alone with accumulate_grad_batches=2, without a failure."""
    with finished(tmp_path_factory.mktemp("lightning-reference-ga"), _args("--plain", "--ga", "2")) as job:
        yield job


@pytest.mark.parametrize(
    ("die_at", "resumed"), [("13:backward:1", 13), ("13:optimizer:1", 14)], ids=["last-backward", "optimizer"]
)
def test_gradient_accumulation_runs_every_micro_batch_of_the_failed_step_again(
    launch: Any, reference_accumulating: Any, die_at: str, resumed: int
) -> None:
    """accumulate_grad_batches=2, rank 1 SIGKILLed at step 13's second micro-batch, in its backward pass (DDP's
    all-reduce in flight, the first micro-batch's gradients accumulated without a sync) or inside its optimizer step
    (the gradients all-reduced: the survivor's step 13 completes and its failure comes in step 14), with
    --wait-for-replacement: the survivor runs the failed step's two micro-batches again in the Trainer's loop and the
    run ends with the parameters of the Trainer alone; the replacement reads rank 1's items from the resumed step's
    first micro-batch on and none before; the Trainer's other callbacks saw each micro-batch's end once."""
    job = launch(_args("--ga", "2", "--die-at", die_at), env=child_env(STALWART_WAIT_FOR_REPLACEMENT="1"))
    assert job.wait(180) == 0, job.output()[-3000:]
    assert _digests(job) == _digests(reference_accumulating), "the parameters differ from the Trainer alone's"
    assert [e["rank"] for e in job.events("reformed_in_loop")] == [0], "the survivor re-formed in its loop"
    assert [e["step"] for e in job.events("resumed") if e["rank"] == 1 and e.get("restart", 0) > 0] == [resumed]
    survivor = job.worker_pids(restart=0)[0]
    ends = [s for step in range(STEPS) for s in (step, step + 1)]  # each micro-batch's end: the step it left
    assert _log(job, "steps", survivor) == ends, "one batch end a micro-batch on the survivor"
    replacement = [e["worker_pid"] for e in job.events("worker_spawned") if e["rank"] == 1][-1]
    rank1 = _log(reference_accumulating, "served", reference_accumulating.worker_pids(restart=0)[1])
    assert _log(job, "served", replacement) == rank1[resumed * 2 * BATCH :], "the replacement read from its step on"


@pytest.mark.parametrize("stop", [12, 24], ids=["inside-an-epoch", "at-an-epochs-end"])
def test_one_process_resumes_in_the_order_its_epoch_began_with(tmp_path: Path, stop: int) -> None:
    """One process, no launcher: Lightning adds no DistributedSampler, and a shuffling DataLoader draws each epoch's
    order from the global generator as the epoch begins. A run stopped at step 12 (of an epoch of 24 batches) and
    started again to step 30 resumes in that epoch's order (the generators of its start put back), reads none of
    its first 12 batches, and ends with the parameters of the Trainer alone run to step 30; one stopped at the
    epoch's last step goes on with the next epoch from its start."""

    def run(workdir: Path, *extra: str) -> None:  # forked from the tests' launch server: torch imported
        workdir.mkdir(exist_ok=True)
        out = workdir / "output.log"
        proc = served_script(SCRIPT, ["--out", "out", "--served-log", "served", *extra], child_env(), workdir, out)
        assert proc.wait(120) == 0, out.read_text()[-3000:]

    run(tmp_path / "plain", "--plain")
    run(tmp_path / "job", "--steps", str(stop))
    for f in (tmp_path / "job" / "served").glob("*.txt"):
        f.unlink()
    run(tmp_path / "job")
    read = lambda d: [int(s) for f in (d / "served").glob("*.txt") for s in f.read_text().split()]  # noqa: E731
    assert read(tmp_path / "job") == read(tmp_path / "plain")[stop * BATCH :]
    digest = lambda d: (d / "out" / "rank0.json").read_text()  # noqa: E731
    assert digest(tmp_path / "job") == digest(tmp_path / "plain")


@pytest.mark.skipif(not os.environ.get("STALWART_TEST_BENCH_TRAINER"), reason="six launches, run on request")
def test_bench_trainer_lightning_runs_every_system_and_reports_one_json_object(tmp_path: Path) -> None:
    """A short `stalwart bench trainer --trainer lightning`, as the HF one (tests/test_hf_trainer.py): the Trainer
    alone under torchrun and stalwart's two modes; waiting for the replacement ends as without the kill and redoes
    no completed step. On request: `STALWART_TEST_BENCH_TRAINER=1 .venv/bin/python -m pytest
    tests/test_lightning_trainer.py -k bench`."""
    import json

    from conftest import stalwart

    done = stalwart("bench", "trainer", "--trainer", "lightning", "--steps", "10", "--kill-at", "5", "--step-s",
                    "0.05", "--json", "--rounds", "1", "--dir", str(tmp_path), cwd=tmp_path, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    systems = json.loads(done.stdout)["systems"]
    assert list(systems) == ["torchrun + lightning.Trainer", "stalwart", "stalwart --wait-for-replacement"]
    waited = systems["stalwart --wait-for-replacement"]
    assert waited["as_without_the_kill"] and waited["as_trainer_alone"] and waited["steps_done_again"] == 0
    assert not list(tmp_path.glob("stalwart-bench-trainer-*")), "the runs' files are removed"
