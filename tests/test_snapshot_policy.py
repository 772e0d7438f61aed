"""The budgeted memory-snapshot interval (policy/snapshot.py): from measured costs, the same on every rank."""

from __future__ import annotations

import pytest

from stalwart.errors import ConfigError
from stalwart.job.job import JobConfig
from stalwart.policy.snapshot import (
    FULL_FLOOR,
    LIGHT_SAMPLES,
    MAX_INTERVAL,
    WARMUP,
    LightCost,
    SnapshotSchedule,
    full_copy_budget,
    interval_for,
)


def test_the_interval_keeps_the_copy_within_the_budget() -> None:
    assert interval_for(0.005, 0.052, 0.03) == 4  # the bench job on 2 cores: 5 ms copy, 52 ms step
    assert interval_for(0.55, 0.057, 0.03) == 322  # the 487M-parameter MLP on an H100
    assert interval_for(0.001, 0.1, 0.03) == 1  # cheaper than the budget: every step
    assert interval_for(0.03, 1.0, 0.03) == 1  # exactly the budget
    assert interval_for(0.0, 0.0, 0.03) == 1
    assert interval_for(1.0, 0.0, 0.03) == MAX_INTERVAL
    for snap, step in [(0.005, 0.052), (0.55, 0.057), (0.2, 0.01)]:
        k = interval_for(snap, step, 0.03)
        assert snap / (k * step) <= 0.03 < snap / ((k - 1) * step) if k > 1 else True


def _run(
    schedule: SnapshotSchedule, steps: int, step_s: float, snap_s: float, peers: float = 0.0, saves: range = range(0)
) -> list[int]:
    """Drive a schedule as the Job does; `peers` is another rank's snapshot cost, for the agreement; `saves` the
    steps where a durable checkpoint is taken after the step's snapshot."""
    taken = []

    def agree(mine_step: float, mine_snap: float) -> tuple[float, float]:
        return mine_step, max(mine_snap, peers)

    for step in range(schedule.next_step, steps + 1):
        schedule.observe_step(step_s)
        if schedule.due(step):
            taken.append(step)
            schedule.taken(step, snap_s, agree)
        if step in saves:
            schedule.served(step)
    return taken


def test_after_the_warmup_snapshots_follow_the_budget() -> None:
    schedule = SnapshotSchedule(None, 0.03, start=0)
    taken = _run(schedule, 40, step_s=0.05, snap_s=0.006)  # interval 4
    assert taken[:WARMUP] == [1, 2, 3]
    assert taken[WARMUP:] == [7, 11, 15, 19, 23, 27, 31, 35, 39]
    assert schedule.interval == 4


def test_a_durable_checkpoint_serves_as_a_full_copy_and_pushes_the_next_one_back() -> None:
    # Interval 8 (12 ms copies of 50 ms steps within 3%); a durable checkpoint every 5 steps: after the warm-up,
    # each checkpoint moves the next full copy to 8 steps after it, so none is due while they keep coming.
    taken = _run(SnapshotSchedule(None, 0.03, start=0), 40, step_s=0.05, snap_s=0.012, saves=range(5, 26, 5))
    assert taken == [1, 2, 3, 25 + 8], "checkpoints at 5..25 keep full copies away (11 without them), then 8 on"
    fixed = SnapshotSchedule(4, 0.03, start=0)
    assert not fixed.served(5) and fixed.due(8), "a fixed interval counts from step 0 whatever is saved"
    early = SnapshotSchedule(None, 0.03, start=0)
    assert not early.served(1), "not during the warm-up: those snapshots allocate the slots"


def test_the_slowest_rank_sets_the_interval_for_everyone() -> None:
    schedule = SnapshotSchedule(None, 0.03, start=100)
    taken = _run(schedule, 140, step_s=0.05, snap_s=0.001, peers=0.012)  # another rank copies 12 ms: interval 8
    assert taken == [101, 102, 103, 111, 119, 127, 135]


def test_a_decision_is_reported_with_its_inputs_after_the_warmup_and_when_the_interval_changes() -> None:
    schedule = SnapshotSchedule(None, 0.03, start=0)
    decisions = []
    for step in range(1, 60):
        schedule.observe_step(0.05)
        if schedule.due(step):
            decisions.append(schedule.taken(step, 0.006 if step < 30 else 0.0005, lambda a, b: (a, b)))
    made = [(d.step, d.interval, d.step_s, d.snapshot_s) for d in decisions if d is not None]
    assert made == [(3, 4, 0.05, 0.006), (31, 1, 0.05, 0.0005)]
    cheap = SnapshotSchedule(None, 0.03, start=0)
    first = [cheap.taken(step, 0.0001, lambda a, b: (0.05, b)) for step in (1, 2, 3, 4)]
    assert [d is not None for d in first] == [False, False, True, False], "the first decision, even of 1 step"


def test_a_fixed_interval_counts_from_step_zero_whatever_the_resume_step() -> None:
    schedule = SnapshotSchedule(5, 0.03, start=13)
    assert _run(schedule, 40, step_s=0.05, snap_s=1.0) == [15, 20, 25, 30, 35, 40]


def test_jitter_in_the_costs_does_not_move_the_interval() -> None:
    schedule = SnapshotSchedule(None, 0.02, start=0)
    intervals = []
    for step in range(1, 400):
        schedule.observe_step(0.063)
        if schedule.due(step):
            cost = [0.0051, 0.0043, 0.0047, 0.0038, 0.0052][step % 5]  # asks for 5, 4, 4, 4 or 5 steps
            schedule.taken(step, cost, lambda a, b: (a, b))
            intervals.append(schedule.interval)
    assert len(set(intervals[3:])) == 1, intervals
    schedule.taken(400, 0.05, lambda a, b: (0.063, b))  # ten times the cost: the interval follows
    assert schedule.interval == interval_for(0.05, 0.063, 0.02)


def test_light_snapshots_are_judged_on_their_measured_cost_after_enough_samples() -> None:
    cost = LightCost(0.01)
    for _ in range(LIGHT_SAMPLES - 1):
        cost.observe(0.004)
    assert not cost.judged(), "too few samples to judge"
    cost.observe(0.004)
    assert cost.judged() and cost.mine() == 0.004
    assert cost.too_dear(0.004, 0.067), "4 ms of a 67 ms step is over 1%: full copies instead"
    assert not cost.too_dear(0.0006, 0.067), "0.6 ms is within it"
    assert not cost.too_dear(0.004, 0.0), "no step time measured: nothing to judge"


def test_full_copies_get_what_light_snapshots_leave_of_the_budget_and_at_least_a_quarter() -> None:
    assert full_copy_budget(0.01, None, 0.0) == pytest.approx(0.01 * FULL_FLOOR), "before light is judged"
    assert full_copy_budget(0.01, 0.0002, 0.05) == pytest.approx(0.006), "0.4% of the steps to light, 0.6% left"
    assert full_copy_budget(0.01, 0.00045, 0.05) == pytest.approx(0.0025), "light at 0.9%: the floor"
    assert full_copy_budget(0.01, 0.0, 0.05) == pytest.approx(0.01)
    light, step = 0.00049, 0.05  # at the edge of the light share: kept, and full copies keep their floor
    assert not LightCost(0.01).too_dear(light, step)
    assert LightCost(0.01).too_dear(0.00051, step)
    assert light / step + full_copy_budget(0.01, light, step) <= 0.01 * (1 + FULL_FLOOR) + 1e-12


@pytest.mark.parametrize("bad", [-1, "often", 1.5, True])
def test_a_bad_snapshot_every_is_one_clear_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="snapshot_every"):
        JobConfig.of("x", snapshot_every=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, 1, -0.1, "3%"])
def test_a_bad_snapshot_budget_is_one_clear_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="snapshot_budget"):
        JobConfig.of("x", snapshot_budget=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, 1, -0.1, "2%", None])
def test_a_bad_light_snapshot_budget_is_one_clear_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="light_snapshot_budget"):
        JobConfig.of("x", light_snapshot_budget=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -3, "sometimes", 2.0, False])
def test_a_bad_replicated_snapshot_every_is_one_clear_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="replicated_snapshot_every"):
        JobConfig.of("x", replicated_snapshot_every=bad)  # type: ignore[arg-type]


def test_the_defaults_are_budgeted_full_copies_and_light_snapshots() -> None:
    config = JobConfig.of("x")
    assert (config.snapshot.every, config.snapshot.budget) == ("auto", 0.01)
    assert config.snapshot.light_budget == 0.02, "their own budget, apart from the full copies' 1%"
    assert config.snapshot.replicated_every == "auto"
