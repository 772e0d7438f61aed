"""Warm spares (recovery/warm_spare.py): with `--spares N --warm-spares` a spare runs the script's set-up before any
rank fails and parks at `job.steps()`; a lost rank's spare joins at the survivors' next step boundary with their
live state, so no process runs the set-up after the failure."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch
import torch.distributed.fsdp

from conftest import alive, child_env, fault_free_results, tiny_args

STEPS = 40
ARGS = ("--steps", str(STEPS), "--step-sleep", "0.05", "--no-randomness", "--setup-s", "1")
HOLD = ("--hold-at", "10", "--hold-file", "go")
"""The job waits at step 10 until the test has killed its rank (a spare parks only after the pool's refill delay,
5 s, and its set-up, however long that takes under load): no test races the job's end, and no step is run only
to keep the job alive meanwhile (200 such steps were most of these tests' CPU)."""


def _launch_with_warm_spare(launch: Any, wait: bool, *extra: str) -> Any:
    env = child_env(STALWART_WAIT_FOR_REPLACEMENT="1" if wait else "0")
    args = tiny_args(*ARGS, *HOLD, "--setup-log", "setups.log", *extra)
    return launch(["--spares", "1", "--warm-spares", *args], env=env)


def _go_on(job: Any) -> None:
    """Let the job past its hold (HOLD)."""
    (job.workdir / "go").touch()


def _kill_once_a_spare_parked(job: Any, rank: int) -> tuple[int, int]:
    """SIGKILL `rank` from outside once a warm spare is parked; (the spare's pid, the killed pid)."""
    [parked] = job.wait_for(lambda: job.events("spare_parked"), 120, "a warm spare to park")
    # What it costs the node, reported as it parks: its memory, most of it shared with the zygote; no GPU here.
    assert 0 < parked["private_mb"] < parked["rss_mb"] and parked["gpu_mb"] == 0, parked
    victim = job.worker_pids(restart=0)[rank]
    os.kill(victim, signal.SIGKILL)
    _go_on(job)
    return parked["pid"], victim


def _setups(job: Any) -> dict[int, int]:
    counts: dict[int, int] = {}
    for pid in (job.workdir / "setups.log").read_text().split():
        counts[int(pid)] = counts.get(int(pid), 0) + 1
    return counts


def _the_spare_became(job: Any, spare: int, rank: int) -> None:
    """The parked spare's process is the lost rank's replacement; every process ran the set-up once."""
    started = [e for e in job.events("worker_started") if e.get("spare")]
    assert [(e["pid"], e["rank"], e["restart"]) for e in started][:1] == [(spare, rank, 1)], started
    assert job.worker_pids(restart=1)[rank] == spare
    assert [e["rank"] for e in job.events("joined_late")][:1] == [rank]
    counts = _setups(job)
    assert set(counts.values()) == {1}, f"each process ran the set-up once: {counts}"
    assert spare in counts and len(counts) >= 3, counts
    assert not [e for e in job.events("spare_died")], "no spare died"


def test_a_warm_spare_takes_the_lost_rank_without_a_set_up(launch: Any) -> None:
    """The default mode: the survivor trains on shrunk for at most a step or two (the spare is ready at once), then
    the spare joins with the survivor's state; the ranks end as replicas. The spare ran its set-up as rank 1, the
    rank it is given: nothing to say about the rank it read."""
    job = _launch_with_warm_spare(launch, False, "--rank-from-env")
    spare, _ = _kill_once_a_spare_parked(job, rank=1)
    assert job.wait(240) == 0, job.output()[-3000:]
    results = job.results()
    assert {r["step"] for r in results.values()} == {STEPS}
    assert results[0]["sha256"] == results[1]["sha256"], "the ranks end as replicas"
    _the_spare_became(job, spare, rank=1)
    assert "a warm spare became rank" not in job.output()
    # The survivor's live state when it kept it (the job grew back); else node memory's newest copy: light
    # snapshots over their budget are turned off (reforming's why), as the policy intends. Never the durable tier.
    [resumed] = [e for e in job.events("resumed") if e["pid"] == spare]
    assert resumed["tier"] in ("peer", "memory") and resumed["rank"] == 1, resumed
    # When the job grew back from the survivor's state, the person watching is told, once.
    grown = [e for e in job.events("world_resized") if e["rank"] == 0 and "joined" in e.get("why", "")]
    assert len(grown) == ("grew back" in resumed["source"]), (grown, resumed)
    for e in grown:
        assert f"stalwart: back at 2 ranks at step {e['step']}: rank(s) [1] joined" in job.output()
    pids = {e["worker_pid"] for e in job.events("worker_spawned")}
    assert not [pid for pid in pids if alive(pid)], "no worker outlives the launcher"


def test_a_warm_spare_given_another_rank_than_it_read_says_so(launch: Any) -> None:
    """Rank 0 lost: the spare, set up as rank 1 (the node's last local rank), becomes rank 0 and says in one line
    that its set-up read rank 1 (the script reads RANK before its loop)."""
    job = _launch_with_warm_spare(launch, False, "--rank-from-env")
    spare, _ = _kill_once_a_spare_parked(job, rank=0)
    assert job.wait(240) == 0, job.output()[-3000:]
    _the_spare_became(job, spare, rank=0)
    lines = [line for line in job.output().splitlines() if "a warm spare became rank 0" in line]
    assert len(lines) == 1 and "which it read there (os.environ['RANK'])" in lines[0], job.output()[-3000:]


def test_with_wait_for_replacement_a_warm_spare_ends_bitwise(launch: Any, tmp_path_factory: Any) -> None:
    """Rank 0 lost: the spare, set up as rank 1, trains rank 0's slice of each global batch (its ResumableLoader
    follows the rank it was given; until 2026-11-30 it kept the set-up's slice, a sample twice a step and one never)."""
    reference = fault_free_results(tmp_path_factory.mktemp("warm-reference"), *ARGS[:-2])
    job = _launch_with_warm_spare(launch, True)
    spare, _ = _kill_once_a_spare_parked(job, rank=0)
    assert job.wait(240) == 0, job.output()[-3000:]
    assert not job.events("shrunk"), "the survivor waited for the spare"
    _the_spare_became(job, spare, rank=0)
    results = job.results()
    assert {r: results[r]["sha256"] for r in results} == {r: reference[r]["sha256"] for r in reference}


@pytest.mark.parametrize("flags", [("--warm-spares",), ("--warm-spares", "--spares", "1", "--no-reform")])
def test_warm_spares_without_what_they_need_is_one_line(launch: Any, flags: tuple[str, ...]) -> None:
    job = launch([*flags, *tiny_args("--steps", "1")], env=child_env())
    assert job.wait(60) == 2, job.output()
    lines = [line for line in job.output().splitlines() if line.strip()]
    assert len(lines) == 1 and "--warm-spares" in lines[0], lines


def test_gpus_are_counted_with_telemetry_off_too(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Turning GPU telemetry off must not hide the node's GPUs from the warm spares' check: their device files
    count then; CUDA_VISIBLE_DEVICES set empty (a CPU job on a GPU machine) counts none."""
    from stalwart.supervisor.gpu_watch import visible_gpus

    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    monkeypatch.setenv("STALWART_GPU_TELEMETRY", "off")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpus(tmp_path) == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus(tmp_path) == 0


def test_on_a_node_with_gpus_warm_spares_are_off_in_one_line_and_spares_stay_hot(launch: Any, tmp_path: Any) -> None:
    """A warm spare runs the set-up as the node's last local rank: on GPUs its model would sit on that training
    rank's GPU. The node's GPUs as the telemetry provider counts them (a scripted one here) turn warming off."""
    from stalwart.detect.gpu_providers import write_script

    script = tmp_path / "gpus.json"
    write_script(script, {"devices": 2, "samples": []})
    env = child_env(STALWART_GPU_TELEMETRY=str(script))
    job = launch(["--spares", "1", "--warm-spares", *tiny_args("--steps", "3")], env=env)
    assert job.wait(120) == 0, job.output()
    [off] = job.events("warm_spares_off")
    assert off["why"] == "2 GPU(s) on this node", off
    assert [line for line in job.output().splitlines() if "--warm-spares is off" in line], job.output()
    assert not job.events("spare_parked"), "no spare ran the set-up"


def test_a_spare_killed_while_parked_is_replaced_by_a_new_one(launch: Any) -> None:
    """A parked spare's death is the pool's business: it starts another (after its refill delay), which runs the
    set-up and parks; the next lost rank takes that one."""
    job = _launch_with_warm_spare(launch, False)
    [first] = job.wait_for(lambda: job.events("spare_parked"), 120, "a warm spare to park")
    os.kill(first["pid"], signal.SIGKILL)
    second = job.wait_for(
        lambda: [e for e in job.events("spare_parked") if e["pid"] != first["pid"]], 120, "another spare to park"
    )[0]
    victim = job.worker_pids(restart=0)[1]
    os.kill(victim, signal.SIGKILL)
    _go_on(job)
    assert job.wait(240) == 0, job.output()[-3000:]
    [died] = job.events("spare_died")
    assert died["spare_pid"] == first["pid"] and died["parking"], died
    assert job.worker_pids(restart=1)[1] == second["pid"], "the new spare took the lost rank"
    assert "warm spares in a row died" not in job.output(), "a parked spare's death is no failed set-up"


def test_a_warm_spare_killed_while_joining_is_a_failure_like_any_other(launch: Any) -> None:
    """The spare given rank 1 dies after it joined the survivor's group and before the survivor's state reached it
    (chaos/faults.py `kill_in_join`). The survivor, at its step boundary in the hand-over, re-forms again and trains
    on; the pool's next spare (or a new process) takes rank 1; the run ends with the ranks as replicas."""
    env = child_env(STALWART_WAIT_FOR_REPLACEMENT="0", STALWART_FAULTS="kill_in_join@rank=1,step=0,restart=1")
    args = tiny_args(*ARGS, *HOLD, "--setup-log", "setups.log")
    job = launch(["--spares", "1", "--warm-spares", *args], env=env)
    spare, _ = _kill_once_a_spare_parked(job, rank=1)
    assert job.wait(240) == 0, job.output()[-3000:]
    [fired] = job.events("fault_injected")
    assert fired["fault"] == "kill_in_join" and fired["pid"] == spare, fired
    assert not alive(spare)
    results = job.results()
    assert sorted(results) == [0, 1] and {r["step"] for r in results.values()} == {STEPS}, results
    assert results[0]["sha256"] == results[1]["sha256"], "the ranks end as replicas"
    final = job.worker_pids(restart=max(e["restart"] for e in job.events("worker_spawned")))
    assert final[1] != spare, final


def test_two_ranks_lost_at_once_with_one_warm_spare(launch: Any) -> None:
    """Ranks 1 and 2 of 3 killed together: one takes the parked spare, the other a new process that runs the
    set-up; the survivor trains on meanwhile and the job grows back to 3."""
    env = child_env(STALWART_WAIT_FOR_REPLACEMENT="0")
    args = tiny_args(*ARGS, *HOLD, "--setup-log", "setups.log", "--gbs", "6", nproc=3)
    job = launch(["--spares", "1", "--warm-spares", *args], env=env)
    [parked] = job.wait_for(lambda: job.events("spare_parked"), 120, "a warm spare to park")
    first = job.worker_pids(restart=0)
    for rank in (1, 2):
        os.kill(first[rank], signal.SIGKILL)
    _go_on(job)
    assert job.wait(240) == 0, job.output()[-3000:]
    results = job.results()
    assert sorted(results) == [0, 1, 2] and len({r["sha256"] for r in results.values()}) == 1, results
    final = job.worker_pids(restart=max(e["restart"] for e in job.events("worker_spawned")))
    assert parked["pid"] in final.values() and final[0] == first[0], (parked, final)
    counts = _setups(job)
    assert set(counts.values()) == {1}, f"each process ran the set-up once: {counts}"


@pytest.mark.skipif(
    not hasattr(torch.distributed.fsdp, "fully_shard"), reason="FSDP2 is public (and runs on CPU) from torch 2.6"
)
def test_a_warm_spare_with_sharded_state_given_another_rank_shards_it_again_in_place(
    launch: Any, tmp_path_factory: Any
) -> None:
    """FSDP2: the spare's set-up sharded the model for the rank it ran as (1); given rank 0 it shards its modules
    again as rank 0 in its process (its set-up does not run again: it ran it until 2026-11-30), and the run ends
    bitwise identical (sharded state waits for the replacement; the lost rank's shards come from node memory)."""
    fsdp = ("--steps", str(STEPS), "--step-sleep", "0.05", "--no-randomness", "--fsdp")
    reference = fault_free_results(tmp_path_factory.mktemp("warm-fsdp-reference"), *fsdp)
    env = child_env(STALWART_WAIT_FOR_REPLACEMENT="0")
    extra = ("--setup-s", "1", "--setup-log", "setups.log")
    job = launch(["--spares", "1", "--warm-spares", *tiny_args(*fsdp, *extra, *HOLD)], env=env)
    spare, _ = _kill_once_a_spare_parked(job, rank=0)
    assert job.wait(240) == 0, job.output()[-3000:]
    assert "its set-up runs again" not in job.output()
    assert job.worker_pids(restart=1)[0] == spare
    assert _setups(job)[spare] == 1, "the spare's set-up ran once, as rank 1"
    resharded = [e for e in job.events("resharded_in_place") if e["pid"] == spare]
    assert [(e["rank"], e["world_from"], e["world_to"], e["modules"]) for e in resharded] == [(0, 2, 2, 3)], resharded
    restarts = [e["restart"] for e in job.events("restarting")]
    assert restarts == [1], f"the spare trained as rank 0, not replaced again: {restarts}\n{job.output()[-3000:]}"
    results = job.results()
    assert {r: results[r]["sha256"] for r in results} == {r: reference[r]["sha256"] for r in reference}


def test_leaving_idle_priority_covers_the_threads_and_children_made_in_the_set_up() -> None:
    """A spare's set-up runs at SCHED_IDLE; what it started then (torch's threads, a DataLoader's kept workers)
    inherited it and must leave it with the spare when it is given a rank."""
    import threading
    import time

    from stalwart.recovery import warm_spare

    main = threading.get_native_id()
    assert warm_spare._set_policy([main], os.SCHED_IDLE)
    child = os.fork()
    if child == 0:
        time.sleep(30)
        os._exit(0)
    try:
        assert os.sched_getscheduler(child) == os.SCHED_IDLE, "a child inherits the set-up's priority"
        threads = warm_spare._own_threads()
        assert main in threads and child in threads
        assert warm_spare._set_policy(threads, os.SCHED_OTHER)
        assert os.sched_getscheduler(0) == os.SCHED_OTHER and os.sched_getscheduler(child) == os.SCHED_OTHER
    finally:
        warm_spare._set_policy([main], os.SCHED_OTHER)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
