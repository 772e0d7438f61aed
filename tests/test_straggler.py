"""Straggler detection (detect/straggler.py): a rank slower than the others is flagged, a clean run never is."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from conftest import child_env, tiny_args
from stalwart.detect.straggler import PERSIST, WARMUP, WINDOW, StragglerDetector
from stalwart.telemetry.events import EventLog, read_events


def _run(
    tmp_path: Path, compute: Any, steps: int, world_size: int = 3, wait: Any = lambda step: 0.005
) -> tuple[list[dict[str, Any]], Any]:
    """Rank 0's detector over `steps` steps; `compute(rank, step)` is each rank's compute time of a step. The
    other ranks' window medians come through the gather, as the all-gather would bring them."""
    log = tmp_path / "events.jsonl"
    windows: dict[int, list[list[float]]] = {r: [] for r in range(world_size)}
    current: dict[int, list[float]] = {r: [] for r in range(world_size)}

    def gather(mine: list[int]) -> Any:
        out = [mine]
        for r in range(1, world_size):
            values = sorted(current[r])
            out.append([round(values[len(values) // 2] * 1e6) if values else -1])
        for r in range(world_size):
            windows[r].append(current[r])
            current[r] = []
        return lambda: out

    det = StragglerDetector(0, world_size, EventLog(log), gather, announce=True)
    clock = 1000.0
    for step in range(1, steps + 1):
        det.step_started(clock)
        for r in range(1, world_size):
            if step > WARMUP:
                current[r].append(compute(r, step))
        det._last_grad = clock + compute(0, step)  # what the gradient hook stamps
        det._optimizer_ready()  # what the optimizer's pre-hook stamps: the real clock, not this one
        det._optimizer_at = det._last_grad + wait(step)
        clock += 1.0
        det.step_done(step)
    return list(read_events(log)), det


def test_a_rank_slowed_by_a_fifth_is_flagged_within_fifty_steps(tmp_path: Path) -> None:
    rng = random.Random(0)
    slow_from = 40

    def compute(rank: int, step: int) -> float:
        base = 0.020 * (1 + rng.uniform(-0.05, 0.05))
        return base * 1.2 if rank == 2 and step > slow_from else base

    events, det = _run(tmp_path, compute, 200)
    found = [e for e in events if e["event"] == "straggler_detected"]
    assert [e["straggler"] for e in found] == [2], found
    assert found[0]["step"] - slow_from <= 50 and found[0]["score"] > 1.1
    assert found[0]["individual"] > 1.1, "slower than its own start, too"
    assert det.flagged == {2}


def test_a_flagged_rank_that_recovers_is_cleared(tmp_path: Path) -> None:
    def compute(rank: int, step: int) -> float:
        return 0.030 if rank == 1 and 30 < step <= 100 else 0.020

    events, det = _run(tmp_path, compute, 200)
    kinds = [(e["event"], e["straggler"]) for e in events if e["event"].startswith("straggler")]
    assert kinds == [("straggler_detected", 1), ("straggler_cleared", 1)]
    cleared = next(e for e in events if e["event"] == "straggler_cleared")
    assert cleared["step"] <= 100 + (PERSIST + 1) * WINDOW
    assert not det.flagged


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_clean_thousand_step_run_flags_nobody(tmp_path: Path, world_size: int) -> None:
    rng = random.Random(1)

    def compute(rank: int, step: int) -> float:  # 10% jitter per step, and now and then a 3x hiccup
        hiccup = 3.0 if rng.random() < 0.02 else 1.0
        return 0.020 * (1 + rng.uniform(-0.1, 0.1)) * hiccup

    events, _ = _run(tmp_path, compute, 1000, world_size)
    assert not [e for e in events if e["event"].startswith("straggler")]


def test_with_two_ranks_the_slow_one_is_found_against_the_other(tmp_path: Path) -> None:
    """A median of two is their mean: scored against it, a 20% slower rank would read 1.09 and hide."""
    events, _ = _run(tmp_path, lambda rank, step: 0.024 if rank == 1 else 0.020, 100, world_size=2)
    assert [e["straggler"] for e in events if e["event"] == "straggler_detected"] == [1]


def test_a_sustained_rise_of_the_time_spent_waiting_for_gradients_is_reported(tmp_path: Path) -> None:
    def wait(step: int) -> float:
        return 0.030 if 100 < step <= 200 else 0.004

    events, _ = _run(tmp_path, lambda rank, step: 0.020, 300, wait=wait)
    comm = [(e["event"], e["step"]) for e in events if e["event"].startswith("comm_ratio")]
    assert comm == [("comm_ratio_high", 130), ("comm_ratio_normal", 230)], comm
    high = next(e for e in events if e["event"] == "comm_ratio_high")
    assert high["ratio"] == pytest.approx(0.6) and high["baseline"] == pytest.approx(0.167, abs=0.001)


def test_jitter_in_the_wait_is_not_a_rise(tmp_path: Path) -> None:
    rng = random.Random(2)
    events, _ = _run(tmp_path, lambda rank, step: 0.020, 1000, wait=lambda step: 0.004 * rng.uniform(0.5, 1.5))
    assert not [e for e in events if e["event"].startswith("comm_ratio")]


# -- under stalwart run: three ranks, one slowed by a fifth ---------------------------------------------------


def _straggler_job(
    launch: Any, steps: int, faults: str = "", *extra: str, name: str = "job", compute_s: float = 0.02
) -> Any:
    every = ("--every", "1000", "--snapshot-every", "0")
    args = ("--steps", str(steps), "--compute-sleep", str(compute_s), *every, *extra)
    env = child_env(STALWART_FAULTS=faults) if faults else child_env()
    job = launch(tiny_args(*args, "--gbs", "6", nproc=3), env=env, name=name)
    assert job.wait(300) == 0, job.output()
    return job


def test_a_rank_slowed_by_a_fifth_under_stalwart_run_is_flagged(launch: Any) -> None:
    """Flagged once, by rank 0, only the slowed rank. How many steps that takes depends on the machine's load: within
    50 on a quiet 2-core VM, 70 in a fresh-clone suite beside a process spinning on one core (2026-11-28), so the
    run is long enough for either and the test asserts no bound."""
    job = _straggler_job(launch, 150, "slow@rank=2,step=20,ms=4")  # 20% of the 20 ms of compute
    found = job.events("straggler_detected")
    assert [(e["rank"], e["straggler"]) for e in found] == [(0, 2)], "rank 0 reports it, once"
    assert found[0]["step"] > 20 and found[0]["score"] >= 1.1
    assert "rank 2 is a straggler" in job.output()
    # A warning sign is met with a durable checkpoint at once, on every rank at the same step.
    risk = job.events("risk_checkpoint")
    assert sorted((e["rank"], e["step"], e["taken"]) for e in risk) == [(r, found[0]["step"], True) for r in range(3)]
    committed = {e["step"] for e in job.events("checkpoint_committed")}
    assert found[0]["step"] in committed


def test_a_clean_run_under_stalwart_run_flags_nobody(launch: Any) -> None:
    """Steady state under the launcher: no rank's own work reads as slower. Three ranks share two cores with the rest
    of the suite, so the CPU part of each step (about 3 ms here) is stretched by scheduling: at 20 ms of compute a
    window's median was seen 3.1 ms (1.14x) over the others' beside another test, and in one of seven fresh-clone
    suites (fc36) three windows in a row crossed 10% and 2 ms (2026-11-29). At 50 ms a false flag needs a rank delayed
    5 ms a step, every step, for 30 steps; the detector's own logic under jitter is the 1000-step test above."""
    job = _straggler_job(launch, 300, compute_s=0.05)
    assert not job.events("straggler_detected")


def test_an_evicted_straggler_is_replaced_and_the_run_ends_as_without_it(launch: Any) -> None:
    """straggler_policy="evict": after the risk checkpoint is durable the straggler leaves (exit 76), the others
    re-form with a replacement (the slowing fault was its process's), and the run ends bitwise as a fault-free one."""
    memory = ("--snapshot-every", "1")  # the replacement restores from node memory
    job = _straggler_job(launch, 120, "slow@rank=2,step=20,ms=4", *memory, "--straggler-policy", "evict")
    reference = _straggler_job(launch, 120, "", *memory, name="reference")
    found, *later = job.events("straggler_detected")
    evicted, *_ = job.events("straggler_evicted")
    assert (found["straggler"], found["restart"]) == (2, 0), found
    assert (evicted["rank"], evicted["step"]) == (2, found["step"])
    failed = [(e["rank"], e["exitcode"]) for e in job.events("worker_failed")]
    assert (2, 76) in failed
    assert "rank 2 (pid" in job.output() and "left as a straggler" in job.output()
    # The replacement is not slow. Another rank may be, for a while, on the 2-core VM beside three other tests (fc94,
    # 2026-11-30: rank 1's compute 28 ms against the others' 22 ms, 50 steps later): it is evicted and replaced like
    # any straggler, and the run still ends as a fault-free one.
    assert not [e for e in later if e["straggler"] == 2], f"the replacement was found slow: {later}"
    found_at = {(e["straggler"], e["step"]) for e in [found, *later]}
    assert all((e["rank"], e["step"]) in found_at for e in job.events("straggler_evicted")), "only stragglers leave"
    results, expected = job.results(), reference.results()
    for rank in range(3):
        assert results[rank]["sha256"] == expected[rank]["sha256"]


def test_one_collective_carries_every_gather_of_a_window() -> None:
    from stalwart.runtime.dist import GatherBatch

    sent: list[list[int]] = []

    def gather_later(values: list[int]) -> Any:
        sent.append(list(values))
        return lambda: [list(values), [v * 10 for v in values]]  # what two ranks would send

    batch = GatherBatch(gather_later)
    first, second = batch.gather([1, 2]), batch.gather([3])
    with pytest.raises(RuntimeError, match="before flush"):
        first()
    batch.flush()
    assert sent == [[1, 2, 3]], "one collective"
    assert first() == [[1, 2], [10, 20]] and second() == [[3], [30]]
    batch.flush()
    assert sent == [[1, 2, 3]], "nothing gathered since: no collective"
