"""`stalwart sim --regions`: what each way through a regional outage (sim/outages.py) gives and costs, and the
outage rate at which mirroring, or a standby, pays for itself.

Money, per run: the job's GPU-hours (spares included) at the job's price; checkpoint storage, `keep_last`
checkpoints in each location for the job's days; cross-region egress for every copy to the mirror and for each
failover's read; a standby's share of the job's GPU-hours. Cost per useful GPU-hour: the mean cost over the mean
useful GPU-hours, as engine.Result has it, and its 5-95% range over the runs.

The break-even rate: where a choice's cost per useful GPU-hour meets `single`'s, found by regula falsi (Illinois)
on the outage rate, each choice at each rate simulated on the same failures and the same outages moved in time
(common random numbers), so the gap is a smooth function of the rate and a few steps find it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

from stalwart.sim.engine import Policy, Result, Runs, SimJob, simulate_side_by_side
from stalwart.sim.failures import DAY, HOUR, FailureModel
from stalwart.sim.outages import CHOICES, Regions
from stalwart.sim.profiles import Profile

MONTH = 365.25 / 12 * DAY
MAX_RATE_PER_YEAR = 1000.0
"""The break-even search stops here: about one outage every nine hours, far past anything a region has shown."""
TOLERANCE = 0.01
"""The break-even search's precision: the bracket's width over its upper end."""
MAX_STEPS = 40
"""The search's rates at most: with common random numbers it needs a few (docs/simulation.md)."""


@dataclass(frozen=True, slots=True)
class Prices:
    storage_gb_month: float = 0.023
    """S3 Standard's price for the first 50 TB a month (AWS's price list, us-east-1)."""
    transfer_gb: float = 0.02
    """AWS's data transfer between most regions, per GB sent."""
    keep_last: int = 3
    """Checkpoints kept in each location: stalwart.Job's `keep_last` default."""
    standby_fraction: float = 0.1
    """Assumed: a warm standby costs this share of the job's GPU-hours."""

    def __post_init__(self) -> None:
        if self.storage_gb_month < 0 or self.transfer_gb < 0 or self.standby_fraction < 0 or self.keep_last < 1:
            raise ValueError("prices and standby_fraction must be >= 0 and keep_last >= 1")


@dataclass(slots=True)
class Choice:
    choice: str
    ettr: float
    ettr_p05: float
    ettr_p95: float
    outages: float
    """Mean count per run."""
    failovers: float
    hours_down_per_outage: float
    """From an outage to training again, the mean over every outage of every run."""
    work_lost_per_outage_h: float
    badput: dict[str, float]
    """Share of the wall time, mean over runs (the failures' categories and the outages')."""
    gpu_cost: float
    storage_cost: float
    transfer_cost: float
    """Mean over runs."""
    standby_cost: float
    cost: float
    cost_per_useful_gpu_hour: float
    cost_per_useful_p05: float
    cost_per_useful_p95: float


@dataclass(slots=True)
class BreakEven:
    choice: str
    """`mirror` or `standby`, against `single`."""
    per_year: float | None
    """The outage rate at which the two cost the same per useful GPU-hour; None: not below MAX_RATE_PER_YEAR."""
    below: float
    """A rate below it (within TOLERANCE), at which `choice` costs more than `single` (with `per_year` None: the
    highest rate tried)..."""
    above: float | None
    """...and one above, at which it costs less (None with `per_year`)."""
    steps: int
    """Rates simulated in the search."""


@dataclass(slots=True)
class Study:
    profile: str
    policy: str
    spares: int
    runs: int
    seed: int
    regions: dict[str, float]
    prices: dict[str, float]
    choices: list[Choice]
    break_even: list[BreakEven]


@dataclass(frozen=True, slots=True)
class _Setup:
    """One (job, failures, profile, policy, runs, seed): what each choice at each rate is simulated against."""

    job: SimJob
    model: FailureModel
    profile: Profile
    policy: Policy
    prices: Prices
    runs: int
    seed: int

    def run(self, blocks: list[Regions]) -> list[tuple[Result, Runs]]:
        job, model, profile, policy = self.job, self.model, self.profile, self.policy
        return simulate_side_by_side(job, model, profile, policy, blocks, runs=self.runs, seed=self.seed)

    def priced(self, blocks: list[Regions]) -> list[Choice]:
        return [_priced(self.job, r, self.prices, *ran) for r, ran in zip(blocks, self.run(blocks), strict=True)]


def study(
    job: SimJob,
    model: FailureModel,
    profile: Profile,
    policy: Policy,
    regions: Regions,
    prices: Prices,
    *,
    runs: int = 64,
    seed: int = 0,
) -> Study:
    """Every choice at `regions`' outage rate, and the break-even rate of `mirror` and of `standby`."""
    setup = _Setup(job, model, profile, policy, prices, runs, seed)
    # With no outage every choice goes through the same runs: one block prices all three.
    calm = replace(regions, choice="single", outages_per_year=0.0)
    *now, calm_run = setup.run([*(replace(regions, choice=c) for c in CHOICES), calm])
    choices = {c: _priced(job, replace(regions, choice=c), prices, *ran) for c, ran in zip(CHOICES, now, strict=True)}
    at_zero = {c: _priced(job, replace(calm, choice=c), prices, *calm_run).cost_per_useful_gpu_hour for c in CHOICES}
    searches = [
        _Search(
            c,
            regions.outages_per_year,
            at_zero=at_zero[c] - at_zero["single"],
            at_rate=choices[c].cost_per_useful_gpu_hour - choices["single"].cost_per_useful_gpu_hour,
        )
        for c in CHOICES[1:]
    ]
    # The searches advance together, each rate's `single` and the choice side by side in one simulation.
    while busy := [s for s in searches if s.result is None]:
        rates = [(s, s.rate()) for s in busy]
        blocks = [replace(regions, choice=c, outages_per_year=r) for s, r in rates for c in ("single", s.choice)]
        priced = setup.priced(blocks)
        for k, search in enumerate(busy):
            search.tell(priced[2 * k + 1].cost_per_useful_gpu_hour - priced[2 * k].cost_per_useful_gpu_hour)
    settings = {k: v for k, v in asdict(regions).items() if k != "choice"}
    evens = [s.result for s in searches if s.result is not None]
    return Study(
        profile.name, policy.name, job.spares, runs, seed, settings, asdict(prices), list(choices.values()), evens
    )


def outcome(
    job: SimJob,
    model: FailureModel,
    profile: Profile,
    policy: Policy,
    regions: Regions,
    prices: Prices,
    *,
    runs: int = 64,
    seed: int = 0,
) -> Choice:
    """`regions.choice` at `regions.outages_per_year`, priced."""
    return _Setup(job, model, profile, policy, prices, runs, seed).priced([regions])[0]


class _Search:
    """Where `choice`'s gap to `single` (its cost per useful GPU-hour less single's) changes sign, by regula falsi
    (Illinois) on the outage rate: ask `rate()`, simulate, `tell` the gap there, until `result` is set."""

    def __init__(self, choice: str, rate: float, *, at_zero: float, at_rate: float) -> None:
        """`at_zero` and `at_rate`: the gaps already known at rate 0 and at `rate`."""
        self.choice, self.steps, self.kept = choice, 0, 0
        self.result: BreakEven | None = None
        if at_zero <= 0:  # nothing extra to pay (free storage and transfer, no standby): it pays at any rate
            self.result = BreakEven(choice, 0.0, 0.0, 0.0, 0)
        self.lo, self.g_lo = (rate, at_rate) if rate > 0 and at_rate > 0 else (0.0, at_zero)
        self.bracketed = rate > 0 and at_rate <= 0
        self.hi, self.g_hi = rate, at_rate
        if not self.bracketed:
            # The gap falls about linearly with the rate: aim past the line's zero, then widen until it is passed.
            line = rate * at_zero / (at_zero - at_rate) if rate > 0 and at_rate < at_zero else 0.0
            self.hi = min(max(1.5 * line, 2 * self.lo, 1.0), MAX_RATE_PER_YEAR)
        self.asked = self.hi

    def rate(self) -> float:
        """The next rate to simulate: the upper end while it is not yet past the sign change, then where the
        line between the two ends crosses zero (kept off the ends)."""
        self.asked = self.hi
        if self.bracketed:
            lo, hi, margin = self.lo, self.hi, TOLERANCE * (self.hi - self.lo)
            self.asked = min(max((lo * self.g_hi - hi * self.g_lo) / (self.g_hi - self.g_lo), lo + margin), hi - margin)
        return self.asked

    def tell(self, gap: float) -> None:
        self.steps += 1
        if not self.bracketed:
            if gap <= 0:
                self.g_hi, self.bracketed = gap, True
            elif self.hi >= MAX_RATE_PER_YEAR:
                self.result = BreakEven(self.choice, None, self.hi, None, self.steps)
                return
            else:
                self.lo, self.g_lo, self.hi = self.hi, gap, min(4 * self.hi, MAX_RATE_PER_YEAR)
        elif gap > 0:
            self.lo, self.g_lo = self.asked, gap
            self.g_hi = self.g_hi / 2 if self.kept == 1 else self.g_hi  # Illinois: an end kept twice counts half
            self.kept = 1
        else:
            self.hi, self.g_hi = self.asked, gap
            self.g_lo = self.g_lo / 2 if self.kept == -1 else self.g_lo
            self.kept = -1
        if self.bracketed and (self.hi - self.lo <= TOLERANCE * self.hi or self.steps >= MAX_STEPS):
            self.result = BreakEven(self.choice, (self.lo + self.hi) / 2, self.lo, self.hi, self.steps)


def _priced(job: SimJob, regions: Regions, prices: Prices, result: Result, runs: Runs) -> Choice:
    wall_h = job.days * DAY / HOUR
    locations = 2 if regions.mirrored else 1
    storage = regions.checkpoint_gb * prices.keep_last * locations * prices.storage_gb_month * job.days * DAY / MONTH
    standby = (
        prices.standby_fraction * job.gpus * wall_h * job.price_per_gpu_hour if regions.choice == "standby" else 0.0
    )
    transfer = np.zeros(runs.ettr.shape)
    if regions.mirrored:
        # One copy per checkpoint, or back to back when a copy takes longer than the interval; one read per failover.
        copies = runs.training_s / max(result.checkpoint_interval_s, regions.copy_s)
        transfer = (copies + runs.failovers) * regions.checkpoint_gb * prices.transfer_gb
    cost = result.cost + storage + standby + transfer
    useful = job.gpus * wall_h * runs.ettr
    per_useful = cost / np.maximum(useful, 1e-9)
    outages = max(float(runs.outages.sum()), 1.0)
    return Choice(
        choice=regions.choice,
        ettr=result.ettr,
        ettr_p05=result.ettr_p05,
        ettr_p95=result.ettr_p95,
        outages=float(runs.outages.mean()),
        failovers=float(runs.failovers.mean()),
        hours_down_per_outage=float(runs.outage_down_s.sum()) / outages / HOUR,
        work_lost_per_outage_h=float(runs.outage_lost_s.sum()) / outages / HOUR,
        badput=result.badput,
        gpu_cost=result.cost,
        storage_cost=storage,
        transfer_cost=float(transfer.mean()),
        standby_cost=standby,
        cost=float(cost.mean()),
        cost_per_useful_gpu_hour=float(cost.mean() / useful.mean()),
        cost_per_useful_p05=float(np.quantile(per_useful, 0.05)),
        cost_per_useful_p95=float(np.quantile(per_useful, 0.95)),
    )
