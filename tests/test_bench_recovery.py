"""`stalwart bench recovery`: its accounting of a goodput run, and a kill of rank 0 measured under `stalwart run`
(the whole bench: test_leftovers, docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.bench.recovery import _reference_run, measure_kills, survivor_of
from stalwart.bench.recovery_goodput import SETTLE_S, fault_only, goodput_badput, steady_pace
from stalwart.bench.recovery_run import _results

STEP = 0.1


def test_badput_splits_a_run_with_one_kill_into_its_parts() -> None:
    # Launched at 0; step 1 done at 2.0 (1.9 s of start-up); steps 2..10 every 0.1 s, step 5 slower by 0.05 s;
    # killed at 3.0 after step 10; resumed from step 8: step 9 done again at 3.6, then 10..12 every 0.1 s.
    done = [(2.0, 1)]
    t = 2.0
    for step in range(2, 11):
        t += STEP + (0.05 if step == 5 else 0.0)
        done.append((round(t, 6), step))
    kill = 3.0
    after = [(3.6, 9), (3.7, 10), (3.8, 11), (3.9, 12)]
    done += after
    end = 3.95
    badput = goodput_badput(done, [kill], 0.0, end, STEP)
    assert badput["startup"] == pytest.approx(1.9)
    assert badput["recovery"] == pytest.approx(3.6 - STEP - kill)  # to the start of the first step after it
    assert badput["redone"] == pytest.approx(2 * STEP)  # steps 9 and 10 again
    assert badput["tail"] == pytest.approx(0.05)
    kept = 12 * STEP
    wall = badput.pop("wall")
    assert wall == pytest.approx(end)
    lost = badput["startup"] + badput["recovery"] + badput["redone"] + badput["tail"]
    assert fault_only({**badput, "wall": wall}) == pytest.approx(1 - lost / end)
    assert kept + sum(badput.values()) == pytest.approx(end)  # slower_steps is the rest: its value is checked here
    # What is left: step 5's extra 0.05 s and the part of step 11 that ran before the kill (3.0 - 2.95).
    assert badput["slower_steps"] == pytest.approx(0.05 + (kill - done[9][0]))


def test_a_run_without_faults_has_only_startup_and_slower_steps() -> None:
    done = [(1.0 + i * 0.11, i + 1) for i in range(10)]
    badput = goodput_badput(done, [], 0.0, done[-1][0], STEP)
    assert badput["recovery"] == badput["redone"] == badput["tail"] == 0.0
    assert fault_only(badput) == pytest.approx(1 - 0.9 / done[-1][0])
    assert fault_only(None) is None
    assert badput["startup"] == pytest.approx(0.9)
    assert badput["slower_steps"] == pytest.approx(9 * 0.01)


def test_a_second_kill_before_the_next_step_keeps_the_system_down_from_the_first() -> None:
    done = [(1.0, 1), (1.1, 2), (1.2, 3), (2.5, 3), (2.6, 4)]
    badput = goodput_badput(done, [1.25, 1.9], 0.0, 2.6, STEP)
    assert badput["recovery"] == pytest.approx(2.5 - STEP - 1.25)
    assert badput["redone"] == pytest.approx(STEP)


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

    bad = {"startup": 2.0, "recovery": 3.0, "redone": 0.3, "tail": 0.0, "slower_steps": 20.0, "wall": 300.0}
    system = {
        "kill_to_step_s_median": 0.45, "kill_to_step_s_max": 0.5, "steps_lost_max": 0, "survivor_stall_s_median": 0.4,
        "hang_detect_s": 0.5, "goodput": 0.881, "goodput_own_pace": 0.934, "bitwise_identical": True,
        "step_s_median": 0.05, "badput_s": bad, "goodput_fault_only": 0.982,
        "own_pace_badput_s": {**bad, "slower_steps": 10.0}, "goodput_step_s": {"reference": 0.0514, "own_pace": 0.0532},
    }  # fmt: skip
    out = io.StringIO()
    report = {"kills": 5, "job": {"model": "m"}, "systems": {"torchrun": system, "stalwart": system},
              "ratios": {"torchrun_over_stalwart_kill_to_step": 7.0}, "stock_torchrun": None}  # fmt: skip
    print_report(Console(file=out, width=240), report)
    text = out.getvalue()
    assert "88.1% (93.4%)" in text
    assert "stalwart, at its own pace (53.2 ms a step" in text and "reference 51.4 ms): " in text
    assert "slower steps 10.0 s" in text and "slower steps 20.0 s" in text


def test_a_killed_rank_0_is_measured_from_its_survivor_rank_1(tmp_path: Path) -> None:
    # Rank 0 hosts the job's process-group store: its replacement serves the store the survivor waits for.
    lines: list[str] = []
    assert survivor_of(0) == 1 and survivor_of(1) == 0
    expected = _reference_run("stalwart", tmp_path / "reference", 30 + 60, lines.append)  # measure_kills: +60
    kills = measure_kills("stalwart", tmp_path / "kills", [30], lines.append, spares=1, rank=0)
    assert "stalwart: killed rank 0 after step 30 (1/1)" in lines[-1]
    assert _results(tmp_path / "kills") == expected, "bitwise identical to the fault-free run"
    assert len(kills["kill_to_step_s"]) == len(kills["survivor_stall_s"]) == 1
    assert 0 < kills["survivor_stall_s"][0] < 60 and 0 < kills["kill_to_step_s"][0] < 60
    assert kills["steps_lost"] in ([0], [1])
    killed = [e for e in _events(tmp_path / "kills") if e["event"] == "fault_injected"]
    assert [(e["rank"], e["fault"]) for e in killed] == [(0, "SIGKILL from outside")]
    pids = {(e["rank"], e["pid"]) for e in _events(tmp_path / "kills") if e["event"] == "worker_started"}
    assert sorted(rank for rank, _ in pids) == [0, 0, 1], "rank 0 was replaced; rank 1 survived, re-formed in place"


def test_a_bad_kill_rank_is_one_line() -> None:
    out = subprocess.run([sys.executable, "-m", "stalwart", "bench", "recovery", "--kill-rank", "2"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--kill-rank" in lines[0], out.stderr


def _events(workdir: Path) -> list[dict[str, object]]:
    from stalwart.telemetry.events import read_events

    return read_events(workdir / "events.jsonl")
