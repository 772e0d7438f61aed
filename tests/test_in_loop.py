"""L1 inside the loop (recovery/in_loop/): a peer's death, wherever in a step it lands, costs the survivors no
run of their script. They keep their process, run their set-up once, and the job ends bitwise identical to a run
without failures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.fsdp

from conftest import alive, check_global_batch_kept, child_env, fault_free_results, tiny_args

STEPS = 24
ARGS = ("--steps", str(STEPS), "--step-sleep", "0.03", "--replicated-snapshot-every", "20")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return fault_free_results(tmp_path_factory.mktemp("in-loop-reference"), *ARGS)


def _setups(job: Any) -> dict[int, int]:
    """pid -> how many times the script's set-up ran in that process."""
    counts: dict[int, int] = {}
    for line in (job.workdir / "setups.log").read_text().split():
        counts[int(line)] = counts.get(int(line), 0) + 1
    return counts


def _check(job: Any, reference: dict[int, dict[str, Any]], survivors: set[int]) -> None:
    results = job.results()
    for rank in reference:
        assert results[rank]["sha256"] == reference[rank]["sha256"], f"rank {rank} differs from the fault-free run"
        assert results[rank]["seen"] == reference[rank]["seen"], "the sample history differs"
    first, second = job.worker_pids(restart=0), job.worker_pids(restart=1)
    assert {r for r in first if first[r] == second[r]} == survivors, f"survivors keep their pid: {first} -> {second}"
    assert all(e["kept"] == (e["rank"] in survivors) for e in job.events("worker_spawned") if e["restart"] == 1)
    setups = _setups(job)
    assert set(setups.values()) == {1}, f"the set-up ran once in every process: {setups}"
    assert {e["rank"] for e in job.events("reformed_in_loop")} == survivors
    assert "inside the training loop" in job.output()
    pids = {e["worker_pid"] for e in job.events("worker_spawned")}
    assert not [pid for pid in pids if alive(pid)], "no worker outlives the launcher"


@pytest.mark.parametrize(
    "where",
    [
        ("--die-at", "13:forward"),
        ("--die-at", "13:backward"),  # inside the backward pass, with DDP's all-reduce of a bucket in flight
        ("--die-at", "13:before_optimizer"),  # the all-reduce done, the update not yet made
        ("STALWART_FAULTS", "kill@rank=1,step=13"),  # between two steps
        ("STALWART_FAULTS", "kill_in_optimizer@rank=1,step=13,phase=before_snapshot"),  # in the commit point
        ("STALWART_FAULTS", "kill_in_optimizer@rank=1,step=13,phase=after_barrier"),
    ],
    ids=lambda w: w[1].split("@")[0] + ":" + w[1].split(":")[-1] if "@" in w[1] else w[1],
)
def test_a_kill_anywhere_in_a_step_keeps_the_survivor_in_its_loop(
    launch: Any, reference: Any, where: tuple[str, str]
) -> None:
    flag, value = where
    extra = (flag, value) if flag.startswith("--") else ()
    env = child_env(**({flag: value} if not flag.startswith("--") else {}))
    job = launch(tiny_args(*ARGS, "--setup-log", "setups.log", *extra), env=env)
    assert job.wait(180) == 0, job.output()
    _check(job, reference, survivors={0})


def test_a_kill_of_the_survivor_right_after_the_reformation(launch: Any, reference: Any, tmp_path: Path) -> None:
    # Rank 1 dies at step 13; rank 0, which stayed in its loop, dies as the redone step starts; the replacement of
    # rank 1 then stays in its own loop and takes the replacement of rank 0.
    fault = "kill@rank=1,step=13;kill@rank=0,step=13,restart=1"
    job = launch(tiny_args(*ARGS, "--setup-log", "setups.log"), env=child_env(STALWART_FAULTS=fault))
    assert job.wait(180) == 0, job.output()
    results = job.results()
    for rank in reference:
        assert results[rank]["sha256"] == reference[rank]["sha256"], f"rank {rank} differs from the fault-free run"
    second, third = job.worker_pids(restart=1), job.worker_pids(restart=2)
    assert third[1] == second[1] and third[0] != second[0]
    assert set(_setups(job).values()) == {1}


@pytest.fixture(scope="module")
def reference3(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    directory = tmp_path_factory.mktemp("in-loop-reference-3")
    from conftest import Launch

    job = Launch(directory, tiny_args(*ARGS, nproc=3), child_env())
    try:
        assert job.wait(180) == 0, job.output()
        return job.results()
    finally:
        job.reap()


@pytest.mark.parametrize(
    "fault",
    [
        "kill@rank=1,step=13;kill@rank=2,step=13",  # two at once
        "hang@rank=1,step=13,how=sigstop;kill@rank=2,step=13",  # a stop and a kill
    ],
    ids=["two_kills", "stop_and_kill"],
)
def test_two_failures_at_once_keep_the_third_rank_in_its_loop(launch: Any, reference3: Any, fault: str) -> None:
    job = launch(tiny_args(*ARGS, "--setup-log", "setups.log", nproc=3), env=child_env(STALWART_FAULTS=fault))
    assert job.wait(240) == 0, job.output()
    first, second = job.worker_pids(restart=0), job.worker_pids(restart=1)
    assert first[0] == second[0] and first[1] != second[1] and first[2] != second[2]
    assert {e["rank"] for e in job.events("reformed_in_loop")} == {0}
    assert set(_setups(job).values()) == {1}
    results = job.results()
    for rank in (0, 1, 2):
        assert results[rank]["seen"] == reference3[rank]["seen"], "the sample history differs"
        assert results[rank]["sha256"] == reference3[rank]["sha256"], f"rank {rank} differs from the fault-free run"


def test_reform_by_rerun_runs_the_script_again_in_the_survivor(launch: Any, reference: Any) -> None:
    """The way before in-loop re-forming, kept as an option: the survivor keeps its process but runs the script
    again, its set-up too."""
    args = ["--reform-by-rerun", *tiny_args(*ARGS, "--setup-log", "setups.log")]
    job = launch(args, env=child_env(STALWART_FAULTS="kill@rank=1,step=13"))
    assert job.wait(180) == 0, job.output()
    first, second = job.worker_pids(restart=0), job.worker_pids(restart=1)
    assert first[0] == second[0] and first[1] != second[1]
    assert _setups(job)[first[0]] == 2, "the survivor ran its set-up again"
    assert not job.events("reformed_in_loop")
    results = job.results()
    assert all(results[r]["sha256"] == reference[r]["sha256"] for r in reference)


fsdp2 = pytest.mark.skipif(
    not hasattr(torch.distributed.fsdp, "fully_shard"), reason="FSDP2 is public (and runs on CPU) from torch 2.6"
)


@fsdp2
def test_fsdp2_survivors_keep_their_shards_in_their_loop(launch: Any, tmp_path: Path) -> None:
    """FSDP2 over the whole world (a 1-D mesh on the default group) with --wait-for-replacement: a kill in the
    forward is absorbed like DDP's, the survivor keeps its process and its shards, and the run ends bitwise
    identical (the lost rank's shards come from node memory); the replacement's FSDP2 set-up runs on its
    placeholder group until its loop starts (recovery/shrink.py)."""
    from conftest import Launch

    args = ("--steps", str(STEPS), "--step-sleep", "0.03", "--fsdp")
    reference = Launch(tmp_path / "reference", tiny_args(*args), child_env())
    try:
        assert reference.wait(180) == 0, reference.output()
        expected = reference.results()
    finally:
        reference.reap()
    env = child_env(STALWART_WAIT_FOR_REPLACEMENT="1")
    job = launch(tiny_args(*args, "--setup-log", "setups.log", "--die-at", "13:forward"), env=env)
    assert job.wait(180) == 0, job.output()
    _check(job, expected, survivors={0})
    assert not job.events("shrunk"), "--wait-for-replacement keeps every step whole"


@fsdp2
@pytest.mark.parametrize(
    ("data", "phase", "nproc", "replacements_die"),
    [
        ("loader", "forward", 2, ()),
        ("own-data", "before_optimizer", 2, ()),
        ("loader", "forward", 3, ()),
        # The first replacement dies as its set-up starts, while the survivors still form their own group and shard
        # among themselves (fc145: they were interrupted there and ran the script again); the second half-way
        # through it, while they train shrunk.
        ("loader", "forward", 3, ("--die-early-in-setup", "1", "--die-in-setup", "2")),
        # The linear layers wrapped together (fully_shard([a, b]), as torchtitan wraps its last norm and output).
        ("loader", "forward", 2, ("--fsdp-together",)),
    ],
    ids=[
        "resumable-loader",
        "own-data",
        "three-ranks",
        "three-ranks-replacements-die-in-their-set-up",
        "wrapped-together",
    ],
)
def test_fsdp2_survivors_shard_among_themselves_and_train_on_while_the_replacement_sets_up(
    launch: Any,
    tmp_path_factory: pytest.TempPathFactory,
    data: str,
    phase: str,
    nproc: int,
    replacements_die: tuple[str, ...],
) -> None:
    """By default FSDP2 survivors do not wait for the replacement's set-up (recovery/in_loop/sharded_stretch.py):
    the survivors shard their modules again in place for their own group, take the lost rank's shards from node
    memory, train on (with a ResumableLoader the global batch kept: their slices grow, 2 of 3 ranks too; with the
    script's own data their own batches), leave their shards in node memory at the grow, and the whole job shards in
    place again and loads them. The set-up ran once in every process; with the loader every sample is seen once and
    the parameters end within the shrink tests' tolerance of a fault-free run."""
    args = ("--steps", str(STEPS), "--step-sleep", "0.05", "--fsdp", "--no-randomness")
    args += ("--own-data",) if data == "own-data" else ()
    env = child_env(STALWART_WAIT_FOR_REPLACEMENT="0")  # the default (the tests' is to wait)
    extra = ("--setup-s", "1", "--setup-log", "setups.log", "--die-at", f"13:{phase}")
    # Replacements that die in their set-up: the survivors re-arm in their loop and train on, once a death.
    extra += replacements_die
    deaths = sum(flag.startswith("--die") for flag in replacements_die)
    job = launch(tiny_args(*args, *extra, nproc=nproc), env=env)
    assert job.wait(180) == 0, job.output()
    results = job.results()
    if data == "loader":
        expected = fault_free_results(tmp_path_factory.mktemp("fsdp-stretch-reference"), *args, nproc=nproc)
        check_global_batch_kept(results, expected, 1e-5)
    assert all(r["finite"] and r["step"] == STEPS for r in results.values()), results
    assert set(_setups(job).values()) == {1}, f"the set-up ran once in every process: {_setups(job)}"
    survivors = [r for r in range(nproc) if r != 1]
    rearmed = sorted((e["rank"], e["restart"]) for e in job.events("shrunk_rearmed"))
    assert rearmed == [(r, 2 + d) for r in survivors for d in range(deaths)], rearmed
    shrunk = sorted(job.events("shrunk"), key=lambda e: e["rank"])
    assert [(e["rank"], e["world_size"], e["full_world_size"]) for e in shrunk] == [
        (r, nproc - 1, nproc) for r in survivors
    ], shrunk
    batch = f"{nproc - 1}/{nproc}" if data == "own-data" else "kept"
    assert all((e["global_batch"], e["shares"], e["step"]) == (batch, [e["rank"]], 13) for e in shrunk), shrunk
    growing = job.events("growing")
    assert len({e["step"] for e in growing}) == 1 and growing[0]["shrunk_steps"] >= 1, growing
    moved = sorted((e["rank"], e["world_from"], e["world_to"]) for e in job.events("resharded_in_place"))
    assert moved == sorted([(r, nproc, nproc - 1) for r in survivors] + [(r, nproc - 1, nproc) for r in survivors]), (
        "sharded among the survivors, then for the whole job again"
    )
    grown_in = 1 + deaths  # the round of the replacement that reached its loop
    resumed = sorted((e["rank"], e["step"], e["tier"]) for e in job.events("resumed") if e["restart"] == grown_in)
    assert resumed == [(r, growing[0]["step"], "memory") for r in range(nproc)], resumed
    assert not job.events("waiting_for_replacement")
    assert f"on {nproc - 1} of {nproc} ranks" in job.output()
