"""`stalwart bench recovery`'s accounting of a goodput run (the runs themselves: test_leftovers, docs)."""

from __future__ import annotations

import pytest

from stalwart.bench.recovery import fault_only, goodput_badput

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
