"""Training on, shrunk, while the replacement starts (recovery/shrink.py): the survivors of a failure do not wait for
its set-up. They take the missing rank's slices of every global batch, the replacement joins at a step boundary once
its loop starts, and no sample is lost or seen twice."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conftest import alive, check_global_batch_kept, child_env, fault_free_results, tiny_args
from stalwart.data.loader import ResumableLoader
from stalwart.recovery.shrink import MicroSteps, Plan

STEPS = 40
ARGS = ("--steps", str(STEPS), "--step-sleep", "0.05", "--no-randomness")
TOLERANCE = 1e-5
"""Largest difference allowed between a parameter of the shrunk run and of the fault-free run, relative to the
parameters' largest magnitude (docs/architecture.md). The tiny job draws no random numbers in its steps here, so
the same samples make the same updates; only the order of floating-point sums differs."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return fault_free_results(tmp_path_factory.mktemp("shrink-reference"), *ARGS)


def _check_global_batch_kept(results: dict[int, Any], reference: dict[int, Any]) -> None:
    check_global_batch_kept(results, reference, TOLERANCE)


def _setups(job: Any) -> dict[str, int]:
    """pid -> how many times the script's set-up ran in that process."""
    counts: dict[str, int] = {}
    for pid in (job.workdir / "setups.log").read_text().split():
        counts[pid] = counts.get(pid, 0) + 1
    return counts


@pytest.mark.parametrize("snapshots", ["full", "light"])
def test_shrink_then_grow_keeps_the_global_batch(launch: Any, reference: Any, snapshots: str) -> None:
    """`snapshots`: a full memory snapshot every step, or light ones (JobConfig's default under re-forming), from
    which the replacement takes its predecessor's per-rank objects: the samples rank 1 saw (checked below)."""
    env = child_env(STALWART_FAULTS="kill@rank=1,step=13", STALWART_WAIT_FOR_REPLACEMENT="0")
    light = ("--snapshot-every", "auto", "--replicated-snapshot-every", "auto") if snapshots == "light" else ()
    job = launch(tiny_args(*ARGS, *light, "--setup-s", "3", "--setup-log", "setups.log"), env=env)
    assert job.wait(180) == 0, job.output()
    results = job.results()

    [shrunk] = job.events("shrunk")
    assert (shrunk["rank"], shrunk["failed_at"], shrunk["world_size"], shrunk["shares"]) == (0, 13, 1, [0, 1])
    [growing] = job.events("growing")
    assert growing["shrunk_steps"] >= 1, "the survivor trained while the replacement ran its set-up"
    grown = {e["rank"]: e for e in job.events("resumed") if "grew back" in e["source"]}
    assert set(grown) == {0, 1} and grown[0]["step"] == growing["step"]
    assert grown[1]["bytes"] > 0 and grown[0]["bytes"] == 0, "the survivor sends, the replacement receives"
    resized = [(e["from"], e["to"], e["tier"]) for e in job.events("world_resized") if e["rank"] == 0]
    assert resized == [(2, 1, "peer"), (1, 2, "peer")], "the world size changes at step boundaries, each said"
    failed_at = shrunk["failed_at"]
    [last] = [e for e in job.events("step_done") if e["rank"] == 1 and e["step"] == failed_at and e["restart"] == 0]
    kind = "full" if last.get("full_copy_step") == failed_at else "light"  # under "auto", a full copy may fall there
    assert kind == snapshots or snapshots == "light", last
    assert grown[1]["own_parts"] == f"{kind} snapshot of step {failed_at}", grown[1]

    assert all(results[rank]["step"] == STEPS for rank in reference)
    _check_global_batch_kept(results, reference)

    first, second = job.worker_pids(restart=0), job.worker_pids(restart=1)
    assert first[0] == second[0] and first[1] != second[1], "the survivor keeps its process"
    counts = _setups(job)
    assert counts[str(first[0])] == 1 and set(counts.values()) == {1}, f"set-up once per process: {counts}"
    assert [e["rank"] for e in job.events("joined_late")] == [1]
    pids = {e["worker_pid"] for e in job.events("worker_spawned")}
    assert not [pid for pid in pids if alive(pid)], "no worker outlives the launcher"


def test_a_survivor_without_a_snapshot_of_the_failed_step_goes_back_to_its_newest_and_says_why(
    launch: Any, reference: Any
) -> None:
    """Full copies every 5 steps and no light snapshots: the survivor of a kill at step 13 undoes it from its copy
    of step 10, trains on shrunk from there, and a `went_back` event says which step and why."""
    env = child_env(STALWART_FAULTS="kill@rank=1,step=13", STALWART_WAIT_FOR_REPLACEMENT="0")
    job = launch(tiny_args(*ARGS, "--snapshot-every", "5"), env=env)
    assert job.wait(180) == 0, job.output()
    [back] = job.events("went_back")
    assert (back["rank"], back["step"], back["failed_at"]) == (0, 10, 13), back
    assert back["why"] == "no live state of step 13 was kept", back
    [shrunk] = job.events("shrunk")
    assert (shrunk["failed_at"], shrunk["step"]) == (13, 10), shrunk
    _check_global_batch_kept(job.results(), reference)


def test_a_survivor_that_cannot_train_on_shrunk_says_why_on_the_console(launch: Any) -> None:
    """The default, and a kill as the last step begins: nothing is left to train on shrunk, so the survivor waits for
    the replacement, and says why on the console as well as in the event log."""
    env = child_env(STALWART_FAULTS=f"kill@rank=1,step={STEPS - 1}", STALWART_WAIT_FOR_REPLACEMENT="0")
    job = launch(tiny_args(*ARGS), env=env)
    assert job.wait(180) == 0, job.output()
    [waiting] = job.events("waiting_for_replacement")
    assert waiting["why"] == "the failure came at the last step", waiting
    line = "stalwart: rank 0: waiting for the replacement, not training on shrunk: the failure came at the last step"
    assert line in job.output()


def test_a_replacement_dying_in_its_set_up_costs_the_shrunk_survivor_nothing(launch: Any, reference: Any) -> None:
    env = child_env(STALWART_FAULTS="kill@rank=1,step=13", STALWART_WAIT_FOR_REPLACEMENT="0")
    args = tiny_args(*ARGS, "--setup-s", "3", "--setup-log", "setups.log", "--die-in-setup", "1")
    job = launch(args, env=env)
    assert job.wait(180) == 0, job.output()
    [rearmed] = job.events("shrunk_rearmed")
    assert rearmed["rank"] == 0 and rearmed["restart"] == 2, "the survivor re-armed in its shrunk loop"
    assert len(job.events("shrunk")) == 1, "and trained on, shrunk, without going back"
    pids = [job.worker_pids(restart=r) for r in range(3)]
    assert pids[0][0] == pids[1][0] == pids[2][0], "the survivor keeps its process through both rounds"
    results = job.results()
    _check_global_batch_kept(results, reference)
    counts = _setups(job)
    assert counts[str(pids[0][0])] == 1, f"the survivor's set-up ran once: {counts}"
    alive_pids = {e["worker_pid"] for e in job.events("worker_spawned")}
    assert not [pid for pid in alive_pids if alive(pid)], "no worker outlives the launcher"


def test_two_of_four_survivors_train_on_as_a_group_of_their_own(launch: Any, tmp_path_factory: Any) -> None:
    """Two ranks of four killed at once: the two survivors form a group of two (a FileStore on the node), each takes
    its own slice and one missing rank's, and their all-reduce averages over two; the job grows back to four."""
    args = ("--steps", "30", "--step-sleep", "0.05", "--no-randomness", "--gbs", "8", "--num-samples", "64")
    reference = fault_free_results(tmp_path_factory.mktemp("shrink-reference-4"), *args, nproc=4)
    env = child_env(STALWART_FAULTS="kill@rank=1,step=11;kill@rank=3,step=11", STALWART_WAIT_FOR_REPLACEMENT="0")
    job = launch(tiny_args(*args, "--setup-s", "3", nproc=4), env=env)
    assert job.wait(240) == 0, job.output()
    shrunk = {e["rank"]: e for e in job.events("shrunk")}
    assert {r: (e["world_size"], e["shares"]) for r, e in shrunk.items()} == {0: (2, [0, 1]), 2: (2, [2, 3])}
    assert {e["rank"] for e in job.events("growing")} == {0, 2}
    results = job.results()
    _check_global_batch_kept(results, reference)


def test_a_survivor_takes_the_missing_ranks_slices_of_each_global_batch() -> None:
    data = list(range(48))
    alone = [ResumableLoader(data, global_batch_size=8, seed=1, rank=r, world_size=4) for r in range(4)]
    shrunk = [ResumableLoader(data, global_batch_size=8, seed=1, rank=r, world_size=4) for r in (0, 2)]
    for loader, plan in zip(shrunk, (Plan((0, 2), 4, 0), Plan((0, 2), 4, 2)), strict=True):
        assert plan.shares == ((0, 1) if plan.rank == 0 else (2, 3))
        loader.take_shares(plan.shares)
    streams = [iter(loader) for loader in shrunk]
    for batch in range(3):
        got = {int(i) for s in streams for _ in range(2) for i in next(s)}
        want = {int(i) for ld in alone for i in next(iter(ld))}  # each new iterator goes on from its position
        assert got == want, f"global batch {batch}"
        assert all(ld.state_dict()["batch"] == batch + 1 for ld in shrunk), "the position moves once per batch"


@pytest.mark.parametrize("zero_grad_first", [True, False])
def test_micro_steps_make_the_full_jobs_update(zero_grad_first: bool) -> None:
    torch.manual_seed(0)
    xs = [torch.randn(4, 3) for _ in range(2)]

    def model_and_optimizer() -> tuple[torch.nn.Linear, torch.optim.Optimizer, Any]:
        torch.manual_seed(1)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    full, opt, sched = model_and_optimizer()  # two ranks' mean: one update, its gradient clipped
    opt.zero_grad()
    (sum(full(x).pow(2).mean() for x in xs) / 2).backward()
    norm = torch.nn.utils.clip_grad_norm_(full.parameters(), 0.05)
    assert norm > 0.05, "the clipping matters in this test"
    opt.step()
    sched.step()

    model, opt, sched = model_and_optimizer()
    micro = MicroSteps([opt], [sched], scale=0.5)
    for index, x in enumerate(xs):
        micro.begin(index, len(xs))
        try:
            if zero_grad_first:
                opt.zero_grad()
            model(x).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # the full job's clip, in the last slice only
            opt.step()
            if not zero_grad_first:
                opt.zero_grad()
            sched.step()
        finally:
            micro.end()
    micro.close()
    assert sched.last_epoch == 1, "the scheduler steps once per step of the full job"
    assert "step" not in opt.__dict__ or hasattr(opt.step, "_wrapped_by_lr_sched"), "the optimizer is as it was"
    for a, b in zip(model.parameters(), full.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_shrinking_is_off_with_wait_for_replacement(monkeypatch: pytest.MonkeyPatch) -> None:
    from stalwart.recovery import shrink

    monkeypatch.setenv("STALWART_KEPT_RANKS", "0,2")
    monkeypatch.setenv("STALWART_WAIT_FOR_REPLACEMENT", "0")
    assert shrink.plan(0, 4) == Plan((0, 2), 4, 0)
    assert shrink.plan(0, 3) is None, "W' must divide W for the survivors to keep the global batch"
    assert shrink.plan(0, 3, own_data=True) == Plan((0, 2), 3, 0, own_data=True), "own data: any W' < W"
    assert shrink.plan(0, 3, own_data=True).shares == (0,), "a survivor draws only its own batches"
    assert shrink.defers_joining(), "the replacement joins at its loop's start whatever W'"
    monkeypatch.setenv("STALWART_WAIT_FOR_REPLACEMENT", "1")
    assert shrink.plan(0, 4) is None and shrink.plan(0, 3, own_data=True) is None and not shrink.defers_joining()


def test_survivors_with_their_own_data_train_on_with_a_smaller_global_batch(launch: Any) -> None:
    """The script draws its own batches in its loop (no ResumableLoader): the survivor does not wait for the
    replacement's set-up; it redoes the failed step with its own batch and trains on at one rank of two, DDP
    averaging over the survivors (torchft's semantics: those steps' global batch is half). The replacement takes
    the survivor's replicated state and its predecessor's own sampler, so the ranks end as replicas."""
    env = child_env(STALWART_FAULTS="kill@rank=1,step=13", STALWART_WAIT_FOR_REPLACEMENT="0")
    args = tiny_args(*ARGS, "--own-data", "--setup-s", "3", "--setup-log", "setups.log")
    job = launch(args, env=env)
    assert job.wait(180) == 0, job.output()
    [shrunk] = job.events("shrunk")
    assert (shrunk["rank"], shrunk["failed_at"], shrunk["step"], shrunk["world_size"]) == (0, 13, 13, 1), shrunk
    assert (shrunk["own_data"], shrunk["shares"], shrunk["global_batch"]) == (True, [0], "1/2"), shrunk
    [growing] = job.events("growing")
    assert growing["shrunk_steps"] >= 1, "the survivor trained while the replacement ran its set-up"
    n = growing["shrunk_steps"]
    trained = f"step {growing['step']}" if n == 1 else f"{n} steps (14-{growing['step']})"
    line = f"stalwart: trained {trained} on 1 of 2 ranks"
    assert line in job.output() and "global batch was the survivors' own, 1/2" in job.output(), job.output()[-3000:]
    shrunk_steps = [e["step"] for e in job.events("step_done") if e.get("world_size") == 1]
    assert shrunk_steps == list(range(14, growing["step"] + 1)), "the failed step redone, then one step each"
    results = job.results()
    assert {r["step"] for r in results.values()} == {STEPS}
    assert results[0]["sha256"] == results[1]["sha256"], "the ranks end as replicas"
    first, second = job.worker_pids(restart=0), job.worker_pids(restart=1)
    assert first[0] == second[0] and first[1] != second[1], "the survivor keeps its process"
    counts = _setups(job)
    assert set(counts.values()) == {1} and len(counts) == 3, f"set-up once per process: {counts}"
    seen0 = results[0]["seen"]
    assert len(seen0) == STEPS * 3, "the survivor saw its own batch of every step once (the failed one redone)"


def test_own_data_with_wait_for_replacement_ends_bitwise(launch: Any, tmp_path_factory: Any) -> None:
    """--wait-for-replacement keeps the exact behaviour: the survivor waits in its loop and the run ends bitwise
    identical to one without the failure."""
    reference = fault_free_results(tmp_path_factory.mktemp("own-data-reference"), *ARGS, "--own-data")
    env = child_env(STALWART_FAULTS="kill@rank=1,step=13", STALWART_WAIT_FOR_REPLACEMENT="1")
    job = launch(tiny_args(*ARGS, "--own-data", "--setup-s", "1"), env=env)
    assert job.wait(180) == 0, job.output()
    assert not job.events("shrunk") and job.events("reformed_in_loop")
    results = job.results()
    assert {r: (results[r]["step"], results[r]["sha256"]) for r in results} == {
        r: (reference[r]["step"], reference[r]["sha256"]) for r in reference
    }


@pytest.mark.parametrize("phase", ["forward", "backward", "before_optimizer"])
def test_own_data_survives_a_death_in_every_phase_of_a_step(launch: Any, phase: str) -> None:
    """Rank 1 kills itself inside step 13's forward, backward (DDP's all-reduce of other buckets in flight) or
    before its optimizer step: the survivor's step fails or its update is dropped, it undoes the step from its
    snapshot, redoes it with its own batch and trains on shrunk; the job grows back and ends as replicas."""
    env = child_env(STALWART_WAIT_FOR_REPLACEMENT="0")
    job = launch(tiny_args(*ARGS, "--own-data", "--setup-s", "1", "--die-at", f"13:{phase}"), env=env)
    assert job.wait(180) == 0, job.output()
    [shrunk] = job.events("shrunk")
    assert shrunk["own_data"] and shrunk["step"] == 13, shrunk
    results = job.results()
    assert {r["step"] for r in results.values()} == {STEPS}
    assert results[0]["sha256"] == results[1]["sha256"], "the ranks end as replicas"
    assert len(results[0]["seen"]) == STEPS * 3, "the survivor saw its own batch of every step once"


def test_own_data_survives_a_stop_then_a_kill(launch: Any) -> None:
    """Rank 1 stopped (SIGSTOP: the agent kills it as hung), the survivor trains on; then rank 0 is killed in the
    next round, while it trains alone or after the job grew back (whichever came first). The run ends at its last
    step with the ranks as replicas."""
    faults = "hang@rank=1,step=12,how=sigstop;kill@rank=0,step=30,restart=1"
    env = child_env(STALWART_FAULTS=faults, STALWART_WAIT_FOR_REPLACEMENT="0")
    job = launch(tiny_args(*ARGS, "--own-data"), env=env)
    assert job.wait(240) == 0, job.output()
    assert job.events("shrunk"), "the survivor of the stop trained on"
    results = job.results()
    assert {r["step"] for r in results.values()} == {STEPS}
    assert results[0]["sha256"] == results[1]["sha256"], "the ranks end as replicas"
