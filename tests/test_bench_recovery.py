"""`stalwart bench recovery`: its accounting of a goodput run, and a kill of rank 0 measured under `stalwart run`
(the whole bench: test_leftovers, docs/benchmarks.md)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from conftest import stalwart
from stalwart.bench.recovery import _reference_run, measure_kills, survivor_of
from stalwart.bench.recovery_goodput import SETTLE_S, PacedGoodput, steady_pace
from stalwart.bench.recovery_run import JobShape, Run, _results

SMALL = 128
"""The job's model in the tests that run it: 3 layers of 128 x 128 (50k parameters)."""
STEP = 0.1


def _step(step: int, mono: float, **extra: Any) -> dict[str, Any]:
    return {"event": "step_done", "rank": 0, "step": step, "mono": mono, "step_s": STEP, **extra}


def test_a_goodput_run_is_accounted_in_the_one_model_and_counted_at_a_pace() -> None:
    """The bench's goodput run in telemetry/goodput.py's categories (those of `stalwart report` and `stalwart
    chaos`): launched at 0; step 1 done at 2.0, then every 0.1 s to step 10; rank 1 killed at 3.0, the agent
    notices at 3.05, rank 0's script starts again at 3.2 and resumes step 8 from memory in 0.1 s; steps 9-12
    done again by 3.9; the window ends at 3.95."""
    events = [{"event": "worker_started", "rank": 0, "mono": 0.5}]
    t = 2.0
    for step in range(1, 11):
        events.append(_step(step, round(t, 6)))
        t += STEP
    events += [
        {"event": "fault_injected", "rank": 1, "fault": "kill", "mono": 3.0},
        {"event": "worker_failed", "role": "agent", "mono": 3.05},
        {"event": "worker_started", "rank": 0, "mono": 3.2},
        {"event": "resumed", "rank": 0, "step": 8, "seconds": 0.1, "tier": "memory", "mono": 3.45},
    ]
    events += [_step(step, mono) for step, mono in ((9, 3.6), (10, 3.7), (11, 3.8), (12, 3.9))]
    good = PacedGoodput.of(events, 0.0, 3.95, STEP)
    bad = good.badput_s
    assert bad["wall"] == pytest.approx(3.95)
    assert bad["startup"] == pytest.approx(1.9)  # to the start of the first step
    assert bad["detection"] == pytest.approx(0.05) and bad["reformation"] == pytest.approx(0.15)
    assert bad["restore"] == pytest.approx(0.1)
    assert bad["wasted_progress"] == pytest.approx(3.0 - 2.7)  # steps 9, 10 and the part of 11 before the kill
    assert bad["productive"] + sum(v for k, v in bad.items() if k not in ("productive", "wall")) == pytest.approx(3.95)
    assert good.goodput == pytest.approx(12 * STEP / 3.95), "12 steps kept, each at the reference's 0.1 s"
    assert good.fault_only == pytest.approx(bad["productive"] / 3.95)  # no checkpoint stall here


def test_a_run_without_faults_charges_only_its_start_and_counts_checkpoint_stalls_as_work() -> None:
    events = [_step(i + 1, 1.0 + i * 0.11, snapshot_s=0.01) for i in range(10)]
    good = PacedGoodput.of(events, 0.0, events[-1]["mono"], STEP)
    wall = events[-1]["mono"]
    assert good.badput_s["wasted_progress"] == good.badput_s["detection"] == good.badput_s["restore"] == 0.0
    assert good.badput_s["startup"] == pytest.approx(1.0 - STEP)
    assert good.badput_s["checkpoint"] == pytest.approx(0.1)
    assert good.fault_only == pytest.approx(1 - (1.0 - STEP) / wall)
    assert good.goodput == pytest.approx(10 * STEP / wall)


def test_the_long_run_goodput_charges_failures_not_the_start_up_or_the_machines_noise() -> None:
    """Steps of 0.1 s with every fourth taking 0.3 s (a VM's skewed noise) after a 1 s start, no failure: a long
    run at that pace keeps all of its time; counted at the median step (own_pace) it would seem to lose a third."""
    events, t = [], 1.0
    for i in range(400):
        t = round(t + (0.3 if i % 4 == 3 else STEP), 6)
        events.append(_step(i + 1, t))
    wall = events[-1]["mono"]
    good = PacedGoodput.of(events, 0.0, wall, STEP)
    assert good.steady_step_s == pytest.approx(STEP) and good.steady_mean_s == pytest.approx(0.15, rel=0.01)
    assert good.own_pace == pytest.approx(400 * STEP / wall)
    assert good.long_run == pytest.approx(1.0, abs=0.01), "no failure: a long run keeps everything"
    # One kill at 40 s that costs 2 s (steps resume 2 s later, none lost): the long run is charged those 2 s.
    later = [_step(e["step"], e["mono"] + 2.0) for e in events if e["mono"] > 40.0]
    faulty = [e for e in events if e["mono"] <= 40.0] + later
    faulty.append({"event": "fault_injected", "rank": 1, "fault": "kill", "mono": 40.0})
    hit = PacedGoodput.of(faulty, 0.0, wall + 2.0, STEP)
    assert hit.long_run == pytest.approx(1.0 - 2.0 / (wall + 2.0 - 1.0), abs=0.01)


def test_the_steady_pace_leaves_out_the_start_and_the_seconds_after_each_kill() -> None:
    # 0.1 s steps from 1 s to 60 s, except 0.3 s steps for 10 s after the start and after the kill at 30 s, and
    # one step across the kill: the steady pace is the 0.1 s of the rest, whatever those slow stretches hold.
    done, t, step = [], 1.0, 1
    while t < 60.0:
        slow = t < SETTLE_S or 30.0 <= t < 30.0 + SETTLE_S
        t = round(t + (0.3 if slow else 0.1), 6)
        done.append((t, step))
        step += 1
    assert steady_pace(done, [30.0], 0.0) == pytest.approx(0.1)
    assert steady_pace(done, [], 0.0) == pytest.approx(0.1), "the stretch after 30 s is slow but too short to matter"
    assert steady_pace(done[:40], [], 0.0) is None, "no step 10 s after the start: no pace"


def test_the_report_gives_both_goodputs_and_the_two_paces() -> None:
    import io

    from rich.console import Console

    from stalwart.bench.recovery_cli import print_report

    bad = {"startup": 2.0, "checkpoint": 1.0, "restore": 0.5, "wasted_progress": 0.3, "detection": 0.2,
           "reformation": 1.0, "other": 10.0, "productive": 285.0, "wall": 300.0}  # fmt: skip
    system = {
        "kill_to_step_s_median": 0.45, "kill_to_step_s_max": 0.5, "steps_lost_max": 0, "survivor_stall_s_median": 0.4,
        "hang_detect_s": 0.5, "goodput": 0.881, "goodput_own_pace": 0.934, "goodput_long_run": 0.95,
        "bitwise_identical": True, "step_s_median": 0.05, "badput_s": bad, "goodput_fault_only": 0.953,
        "goodput_step_s": {"reference": 0.0514, "own_pace": 0.0532, "own_mean": 0.0545},
    }  # fmt: skip
    out = io.StringIO()
    report = {"kills": 5, "job": {"model": "m"}, "systems": {"torchrun": system, "stalwart": system},
              "ratios": {"torchrun_over_stalwart_kill_to_step": 7.0}, "stock_torchrun": None}  # fmt: skip
    print_report(Console(file=out, width=240), report)
    text = out.getvalue()
    assert "88.1% (93.4%, 95.0%)" in text
    assert "stalwart, kept steps counted at its own pace: 53.2 ms a step" in text and "reference's: 51.4 ms" in text
    assert "mean 54.5 ms (the long run's)" in text
    assert "productive 285.0 s; startup 2.0 s, checkpoint 1.0 s" in text and "wasted progress 0.3 s" in text
    assert "charged only for failures 95.3%" in text


_TOLD = (
    "fault_injected",
    "reforming",
    "went_back",
    "waiting_for_replacement",
    "shrunk",
    "resumed",
    "light_snapshots_off",
)


def test_a_killed_rank_0_is_measured_from_its_survivor_rank_1(tmp_path: Path) -> None:
    # Rank 0 hosts the job's process-group store: its replacement serves the store the survivor waits for.
    lines: list[str] = []
    assert survivor_of(0) == 1 and survivor_of(1) == 0
    # A small model (`--width`): what is measured is the recovery, and the default's compute was most of the
    # test's CPU (2 ranks at ~85% for 180 steps of ~0.1 s).
    small = JobShape(width=SMALL)
    expected = _reference_run("stalwart", tmp_path / "reference", 30 + 60, lines.append, small)  # kills: +60
    kills = measure_kills("stalwart", tmp_path / "kills", [30], lines.append, spares=1, rank=0, shape=small)
    # Killed once the bench saw step 30 done: the small model's steps are fast enough for a later one to be done by
    # then (32 in a suite run).
    killed_after = re.fullmatch(r"stalwart: killed rank 0 after step (\d+) \(1/1\)", lines[-1])
    assert killed_after is not None and int(killed_after[1]) >= 30, lines[-1]
    assert _results(tmp_path / "kills") == expected, "bitwise identical to the fault-free run"
    assert len(kills["kill_to_step_s"]) == len(kills["survivor_stall_s"]) == 1
    assert 0 < kills["survivor_stall_s"][0] < 60 and 0 < kills["kill_to_step_s"][0] < 60
    # The survivor keeps its live state unless light snapshots were judged over their budget before the kill: at
    # this width they cost about 1 ms of a 10-16 ms step, over the 2% budget, and the judgement comes near step 32
    # (fc41, 2026-11-29: killed after step 31, judged at 32, failed at 34). Then the run resumes from the newest full
    # copy in node memory, as the policy intends: both outcomes are correct, and the result is bitwise the same.
    (reforming,) = [e for e in _events(tmp_path / "kills") if e["event"] == "reforming"]
    told = [
        {k: e.get(k) for k in ("event", "rank", "restart", "step", "failed_at", "why", "tier", "kept_live_state")}
        for e in _events(tmp_path / "kills")
        if e["event"] in _TOLD
    ]
    went_back = [e for e in told if e["event"] == "went_back"]
    if reforming["kept_live_state"] and not went_back:
        assert kills["steps_lost"] in ([0], [1]), told
    elif reforming["kept_live_state"]:
        # Kept, but its own state of the failed step did not serve (once in CI, 2026-11-30: 10 steps lost; not
        # reproduced here in 29 runs, 15 of them five at a time beside a spinning core): it went back to its newest
        # full copy in node memory, as recover's fallback intends, and said why. The result is still bitwise.
        (back,) = went_back
        assert kills["steps_lost"] == [int(killed_after[1]) - back["step"]] and back["why"], told
    else:
        assert reforming["why"] == "light snapshots are off", reforming
        # From the newest full copy in node memory, or, where the survivor trained on from it while the replacement
        # started (the default), from the survivor's state when the job grew back: both never from storage.
        resumed = [e for e in _events(tmp_path / "kills") if e["event"] == "resumed"]
        assert resumed and all(e["tier"] == "memory" or "grew back" in e["source"] for e in resumed), resumed
    killed = [e for e in _events(tmp_path / "kills") if e["event"] == "fault_injected"]
    assert [(e["rank"], e["fault"]) for e in killed] == [(0, "SIGKILL from outside")]
    pids = {(e["rank"], e["pid"]) for e in _events(tmp_path / "kills") if e["event"] == "worker_started"}
    assert sorted(rank for rank, _ in pids) == [0, 0, 1], "rank 0 was replaced; rank 1 survived, re-formed in place"


@pytest.mark.parametrize("wait", [False, True])
def test_wait_for_replacement_reaches_stalwart_run_and_nothing_else(tmp_path: Path, wait: bool) -> None:
    """`--wait-for-replacement` is stalwart run's flag for stalwart's launches; torchrun's take no such thing."""
    shape = JobShape(wait_for_replacement=wait)
    stalwart_cmd, _ = Run("stalwart", tmp_path, steps=10, shape=shape).command()
    assert ("--wait-for-replacement" in stalwart_cmd) is wait
    assert stalwart_cmd.index("--wait-for-replacement" if wait else "run") < stalwart_cmd.index(
        "stalwart.bench.recovery_job"
    )
    torchrun_cmd, _ = Run("torchrun", tmp_path, steps=10, shape=shape).command()
    assert "--wait-for-replacement" not in torchrun_cmd


@pytest.mark.parametrize("system", ["torchrun", "stalwart"])
def test_two_nodes_are_two_launchers_of_one_rank_meeting_at_one_rendezvous(tmp_path: Path, system: str) -> None:
    """`--nodes 2`: each node's launcher places one of the job's two ranks, both at the same c10d endpoint, and
    the recovery after a kill is counted from the first event that says the job went on (a survivor's node may
    keep its restart count)."""
    from stalwart.bench.recovery import _after_recovery

    run = Run(system, tmp_path, steps=10, shape=JobShape(nodes=2))
    commands = [[a for a in run.command(node, 4242)[0] if "torchrun-logs" not in a] for node in (0, 1)]
    assert commands[0] == commands[1] and "--standalone" not in commands[0]
    for flag in ("--nnodes=2", "--nproc-per-node=1", "--rdzv-endpoint=127.0.0.1:4242", "--rdzv-backend=c10d"):
        assert flag in commands[0], commands[0]
    assert "--nproc-per-node=2" in Run(system, tmp_path, steps=10).command()[0]
    events = [
        {"event": "step_done", "mono": 1.0, "restart": 0},  # finished in flight, before the survivor saw the kill
        {"event": "shrunk", "mono": 2.0, "restart": 0},
        {"event": "step_done", "mono": 2.5, "restart": 0},
    ]
    assert [e["mono"] for e in _after_recovery(events, 0.5)] == [2.0, 2.5]


def test_a_bad_kill_rank_is_one_line() -> None:
    out = stalwart("bench", "recovery", "--kill-rank", "2", env=dict(os.environ), timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--kill-rank" in lines[0], out.stderr


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "five"])
def test_a_bad_setup_time_is_one_line(value: str) -> None:
    out = stalwart("bench", "recovery", f"--setup-s={value}", env=dict(os.environ), timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--setup-s" in lines[0] and "seconds" in lines[0], out.stderr


def test_a_dir_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    taken = tmp_path / "a-file"
    taken.write_text("mine")
    out = stalwart("bench", "recovery", "--dir", str(taken), env=dict(os.environ), timeout=60)
    assert out.returncode != 0 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--dir" in lines[0], out.stderr
    assert taken.read_text() == "mine", "nothing is lost"


def _events(workdir: Path) -> list[dict[str, object]]:
    from stalwart.telemetry.events import read_events

    return read_events(workdir / "events.jsonl")
