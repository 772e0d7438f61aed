"""Regional outages of a training job and the ways it can get through one: what the engine needs to add them to
the failures of a run (sim/engine.py), and nothing about money (sim/regions.py).

An outage takes the job's region away for a while: its compute (every node, with the memory snapshots and peer
copies they hold) and its checkpoint store, whose data comes back with it. Outages are a Poisson process at
`outages_per_year`; each lasts an exponential time of mean `outage_hours`. The job gets through one in one of
three ways (CHOICES), the same outages drawn for each so that they compare on identical events:

- `single`: one region, no mirror. It waits for the region, starts again there and restores from its newest
  durable checkpoint.
- `mirror`: every durable checkpoint is also copied to a second region (docs/disaster-recovery.md). At an outage it
  asks for capacity elsewhere at once and waits for the region at the same time; whichever is ready first wins.
  Elsewhere costs the queue for capacity, a start-up and reading the newest mirrored checkpoint across regions,
  and loses the work since that checkpoint, which lags the primary by the copy's time.
- `standby`: `mirror` with a warm standby in the second region: no queue.

Why a race and not the better of the two in hindsight: nobody knows at the start how long an outage will last.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stalwart.sim.failures import HOUR
from stalwart.sim.profiles import Profile

CHOICES = ("single", "mirror", "standby")
YEAR = 365.25 * 24 * HOUR
PHASES = ("waiting_for_region", "failover_queue")
"""Badput of an outage beyond detection, start-up (re-formation) and restore: the wait for the region to come
back, or the queue for capacity in another."""


@dataclass(frozen=True, slots=True)
class Regions:
    """The outages of the job's region, and one way through them."""

    choice: str = "single"
    """One of CHOICES."""
    outages_per_year: float = 1.0
    """Assumed (docs/simulation.md, "Regions"): outages of the job's region a year, a Poisson process."""
    outage_hours: float = 6.0
    """Assumed: the mean of an outage's exponential duration."""
    failover_queue_hours: float = 2.0
    """Assumed: from asking for the job's capacity in another region to getting it (not for `standby`)."""
    startup_s: float = 600.0
    """Assumed: a cold start of the whole job, in its own region after an outage or in another."""
    checkpoint_gb: float = 5670.0
    """One durable checkpoint: Llama 3 405B's parameters at 14 bytes each (bf16 weights, fp32 master weights and
    two fp32 Adam moments)."""
    cross_region_gbps: float = 100.0
    """Assumed: gigabits per second between regions, for the mirror's copies and a failover's read."""

    def __post_init__(self) -> None:
        if self.choice not in CHOICES:
            raise ValueError(f"unknown regions choice {self.choice!r} (known: {', '.join(CHOICES)})")
        if self.outages_per_year < 0 or self.failover_queue_hours < 0 or self.startup_s < 0:
            raise ValueError("outages_per_year, failover_queue_hours and startup_s must be >= 0")
        if not (self.outage_hours > 0 and self.checkpoint_gb > 0 and self.cross_region_gbps > 0):
            raise ValueError("outage_hours, checkpoint_gb and cross_region_gbps must be positive")

    @property
    def mirrored(self) -> bool:
        return self.choice != "single"

    @property
    def copy_s(self) -> float:
        """Seconds to copy one checkpoint to the other region, or to read it back from there."""
        return self.checkpoint_gb * 8.0 / self.cross_region_gbps

    @property
    def queue_s(self) -> float:
        return 0.0 if self.choice == "standby" else self.failover_queue_hours * HOUR

    def draw(self, seed: int, runs: int, horizon_s: float) -> Outages:
        """The outages of `runs` runs. One unit-rate draw scaled by the rate, from streams of their own: the same
        seed gives the same outages for every choice, and at another rate the same ones moved in time (common
        random numbers for the break-even search), whatever the failures drawn for the runs."""
        times_rng, hours_rng, phase_rng = (
            np.random.default_rng(s) for s in np.random.SeedSequence([seed, 46]).spawn(3)
        )
        if self.outages_per_year == 0:
            empty = np.empty((runs, 0))
            return Outages(empty, empty, empty)
        gap = YEAR / self.outages_per_year
        expected = horizon_s / gap
        width = int(expected + 8 * np.sqrt(expected) + 4)  # more outages than this: probability < 1e-12
        # Drawn (width, runs) and transposed: a run's k-th outage is the same draw whatever the width.
        times = np.cumsum(times_rng.standard_exponential((width, runs)).T, axis=1) * gap
        times[times > horizon_s] = np.inf
        hours = hours_rng.standard_exponential((width, runs)).T * self.outage_hours
        return Outages(times, hours * HOUR, phase_rng.random((width, runs)).T)


@dataclass(slots=True)
class Outages:
    """Arrays (runs x K), sorted in time, +inf past a run's last outage."""

    at_s: np.ndarray
    duration_s: np.ndarray
    copy_phase: np.ndarray
    """Uniform in [0, 1): where in the mirror's back-to-back copies the outage falls (see `mirror_lag_s`)."""


OUTAGE = -2
"""An outage's cause in the merged sequence of events (a failure's indexes the failure model's causes)."""


@dataclass(slots=True)
class Sides:
    """Several `Regions` side by side, `runs` rows each (engine.simulate_side_by_side): their settings as arrays
    over the rows, and their outages."""

    startup_s: np.ndarray
    copy_s: np.ndarray
    queue_s: np.ndarray
    mirrored: np.ndarray
    drawn: Outages

    @classmethod
    def of(cls, blocks: Sequence[Regions], seed: int, runs: int, horizon_s: float) -> Sides:
        each = [r.draw(seed, runs, horizon_s) for r in blocks]
        width = max(d.at_s.shape[1] for d in each)

        def stacked(name: str, pad: float) -> np.ndarray:
            return np.vstack(
                [np.pad(getattr(d, name), ((0, 0), (0, width - d.at_s.shape[1])), constant_values=pad) for d in each]
            )

        def per_row(values: list[float]) -> np.ndarray:
            return np.repeat(np.array(values), runs)

        return cls(
            startup_s=per_row([r.startup_s for r in blocks]),
            copy_s=per_row([r.copy_s for r in blocks]),
            queue_s=per_row([r.queue_s for r in blocks]),
            mirrored=per_row([r.mirrored for r in blocks]).astype(bool),
            drawn=Outages(stacked("at_s", np.inf), stacked("duration_s", 0.0), stacked("copy_phase", 0.0)),
        )

    def mirror_lag_s(self, tau_s: np.ndarray, phase: np.ndarray) -> np.ndarray:
        """How far the mirror's newest checkpoint lags the primary's, in seconds before the primary's persist
        ends. The product keeps one copy pending per mirror, the newest commit: a copy shorter than the interval
        copies each checkpoint once it is persisted (lag: the copy); a longer one runs back to back, each copying
        the newest commit at its start, so the newest finished copy began between one and two copies ago."""
        return np.where(self.copy_s > tau_s, self.copy_s * (1.0 + phase), self.copy_s)

    def fails_over(self, duration_s: np.ndarray, restore_durable_s: float) -> np.ndarray:
        """Whether the job is ready in another region before its own is back (the race of the module docstring);
        the start-up is the same either way."""
        return self.mirrored & (self.queue_s + self.copy_s < duration_s + restore_durable_s)

    def recovery(
        self, phases: dict[str, np.ndarray], profile: Profile, out: np.ndarray, went: np.ndarray, duration_s: np.ndarray
    ) -> None:
        """An outage's recovery, in place of a failure's where `out`: noticed as a hang, then the wait for the
        region or the queue elsewhere, a cold start, and the restore from the primary store or across regions
        (where it `went`)."""
        stayed = out & ~went
        phases["detection"] = np.where(out, profile.detect_hang_s, phases["detection"])
        phases["reformation"] = np.where(out, self.startup_s, phases["reformation"])
        phases["waiting_for_node"] = np.where(out, 0.0, phases["waiting_for_node"])
        restore = np.where(went, self.copy_s, profile.restore_durable_s)
        phases["restore"] = np.where(out, restore, phases["restore"])
        phases["waiting_for_region"] = np.where(stayed, duration_s, 0.0)
        phases["failover_queue"] = np.where(went, self.queue_s, 0.0)


def merge(
    times: np.ndarray, causes: np.ndarray, drawn: Outages
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Failures and outages as one sequence per row, in time: the times, the causes (OUTAGE for an outage), each
    outage's duration and copy phase (0 for a failure)."""
    at = np.concatenate([times, drawn.at_s], axis=1)
    order = np.argsort(at, axis=1, kind="stable")
    none = np.zeros(times.shape)
    columns = (
        at,
        np.concatenate([causes, np.where(np.isfinite(drawn.at_s), OUTAGE, -1)], axis=1),
        np.concatenate([none, drawn.duration_s], axis=1),
        np.concatenate([none, drawn.copy_phase], axis=1),
    )
    at, cause, duration, phase = (np.take_along_axis(c, order, axis=1) for c in columns)
    return at, cause, duration, phase
