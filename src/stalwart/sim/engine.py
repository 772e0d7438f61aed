"""The simulator: a training job on a large cluster, its failures, and what each costs under a recovery profile.

How: failure times and causes are drawn for `runs` independent runs at once (sim/failures.py), then the job is
advanced failure by failure, every run in the same numpy operation (the loop is over the i-th failure of all
runs, a few hundred steps for a 54-day 16k-GPU job, not over time). Between two failures the job trains, stalling
`C / tau` of each second for checkpoints every `tau` seconds of work (per tier). At a failure the work since the
last usable save of the tier it recovers from is lost; detection, restart (a spare node, or a wait for one when
none is free), and the restore follow (sim/profiles.py). A failure that comes during a recovery cuts it short
and starts another. Spare nodes come back from repair after `repair_s`. With `regions` (sim/outages.py), the
job's regional outages join its failures in the same sequence: one costs the wait for the region or a failover,
a cold start and a restore from storage, and nothing else happens to the job until it trains again. Several
ways through the same outages run side by side as more rows (`simulate_side_by_side`): the loop's cost is
mostly per step, so more rows cost less than more passes.

What it answers: effective training time ratio (ETTR: useful work / wall time, Kokolis et al.), the badput by
category (the goodput categories of telemetry/goodput.py), interruptions by cause, and the cost in GPU-hours,
spares included.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stalwart.sim import outages
from stalwart.sim.failures import DAY, HOUR, NODE, SDC, FailureModel
from stalwart.sim.outages import Regions
from stalwart.sim.profiles import Profile

POLICIES = ("fixed", "young", "daly", "adaptive")
BADPUT = ("checkpoint", "wasted_progress", "detection", "reformation", "waiting_for_node", "restore")
MAX_DURABLE_INTERVAL_S = HOUR
"""The adaptive and optimal policies keep a durable checkpoint at least this often even when memory and peer
copies make storage almost never needed: a whole-job loss (power, a bad release) still needs one."""


@dataclass(frozen=True, slots=True)
class SimJob:
    gpus: int
    days: float
    gpus_per_node: int = 8
    spares: int = 0
    """Spare nodes, each `gpus_per_node` GPUs, idle until a node fails."""
    price_per_gpu_hour: float = 2.0
    """Assumed; only the money column depends on it."""

    @property
    def nodes(self) -> int:
        return max(1, math.ceil(self.gpus / self.gpus_per_node))


@dataclass(frozen=True, slots=True)
class Policy:
    name: str = "adaptive"
    checkpoint_interval_s: float = 1800.0
    """For "fixed": seconds of work between durable checkpoints."""
    snapshot_interval_s: float = 60.0
    """For "fixed": seconds of work between memory snapshots (profiles with a memory tier)."""
    prior_mtbf_s: float = 24 * HOUR
    """For "adaptive": the MTBF it assumes before it has seen a failure (weight: one failure)."""


@dataclass(slots=True)
class Result:
    profile: str
    policy: str
    gpus: int
    days: float
    spares: int
    runs: int
    ettr: float
    """Mean over runs."""
    ettr_p05: float
    ettr_p95: float
    interruptions: float
    """Mean count per run."""
    by_cause: dict[str, float]
    badput: dict[str, float]
    """Share of the wall time, mean over runs."""
    gpu_hours: float
    """(gpus + spares x gpus_per_node) x wall hours."""
    cost: float
    useful_gpu_hours: float
    cost_per_useful_gpu_hour: float
    checkpoint_interval_s: float
    """The durable interval in force at the end (mean over runs)."""
    snapshot_interval_s: float | None
    job_mtbf_h: float


@dataclass(slots=True)
class Runs:
    """Each run's own outcome (arrays of `runs`): what sim/regions.py prices run by run."""

    ettr: np.ndarray
    training_s: np.ndarray
    """Wall seconds spent training (checkpoint stalls and work later lost included)."""
    outages: np.ndarray
    failovers: np.ndarray
    outage_down_s: np.ndarray
    """Wall seconds from each regional outage to training again, summed."""
    outage_lost_s: np.ndarray
    """Work lost to regional outages (seconds of training)."""


def simulate(
    job: SimJob,
    model: FailureModel,
    profile: Profile,
    policy: Policy,
    *,
    runs: int = 64,
    seed: int = 0,
    regions: Regions | None = None,
) -> Result:
    """Simulate `runs` independent runs of `job` (the same draws for the same seed: policies and profiles can
    be compared on identical failures), with the regional outages of `regions` when given."""
    blocks = (regions,) if regions is not None else ()
    return simulate_side_by_side(job, model, profile, policy, blocks, runs=runs, seed=seed)[0][0]


def simulate_side_by_side(
    job: SimJob,
    model: FailureModel,
    profile: Profile,
    policy: Policy,
    regions: Sequence[Regions],
    *,
    runs: int = 64,
    seed: int = 0,
) -> list[tuple[Result, Runs]]:
    """`simulate` with each of `regions` (none: without outages), on the same failures, and each run's outcome.
    One pass for all: the loop costs mostly per step, so another choice costs less as more rows than as another
    pass."""
    if job.gpus < 1 or job.days <= 0 or runs < 1 or job.spares < 0:
        raise ValueError("gpus >= 1, days > 0, runs >= 1 and spares >= 0")
    if policy.name not in POLICIES:
        raise ValueError(f"unknown policy {policy.name!r} (known: {', '.join(POLICIES)})")
    rng = np.random.default_rng(seed)
    horizon = job.days * DAY
    times, causes = model.sample(rng, runs, job.gpus, job.gpus_per_node, horizon)
    blocks = max(1, len(regions))
    rows = runs * blocks
    sides = outages.Sides.of(regions, seed, runs, horizon) if regions else None
    outage_s = copy_phase = np.zeros((rows, 0))
    if sides is not None:
        times, causes, outage_s, copy_phase = outages.merge(
            np.tile(times, (blocks, 1)), np.tile(causes, (blocks, 1)), sides.drawn
        )
    is_outage = causes == outages.OUTAGE
    kinds = np.array([c.kind for c in model.causes])
    hangs = np.array([c.shows_as == "hang" for c in model.causes])
    safe = np.maximum(causes, 0)
    kind = np.where(causes >= 0, kinds[safe], "")
    is_node = kind == NODE
    is_sdc = kind == SDC
    is_hang = (causes >= 0) & hangs[safe]
    mtbf = model.job_mtbf_s(job.gpus)
    probs = model.probabilities()
    sdc_share = float(sum(p for p, c in zip(probs, model.causes, strict=True) if c.kind == SDC))
    intervals = _Intervals(policy, profile, mtbf, sdc_share, rows)
    region_phases = outages.PHASES if sides is not None else ()
    # A recovery's phases, latest first: a failure that cuts one short takes them back in this order.
    undo = ("restore", "reformation", "waiting_for_node", *region_phases, "detection")

    ready = np.zeros(rows)  # when training resumes after the latest failure
    work = np.zeros(rows)  # useful work kept so far (seconds of training)
    bad = {k: np.zeros(rows) for k in (*BADPUT, *region_phases)}
    last = {k: np.zeros(rows) for k in undo}
    seen = np.zeros(rows)  # failures so far (for the adaptive policy)
    took = np.zeros(times.shape, dtype=bool)  # the events the job went through
    repair_until = np.full(times.shape, -np.inf)  # per earlier node failure: when that node is back
    restart_extra = profile.rendezvous_per_node_s * job.nodes
    in_outage = np.zeros(rows, dtype=bool)  # the recovery under way is from a regional outage
    no_time = np.zeros(rows)
    tally = {k: np.zeros(rows) for k in ("outages", "failovers", "outage_down_s", "outage_lost_s")}
    for i in range(times.shape[1]):
        at = times[:, i]
        if not np.isfinite(at).any():
            break
        # While the region is away the job is not running: its failures then, or a second outage, change nothing.
        active = np.isfinite(at) & ~(in_outage & (at < ready))
        out = active & is_outage[:, i]
        took[:, i] = active
        tau_d, tau_m = intervals.now(seen, np.where(active, at, horizon))
        overhead = profile.checkpoint_stall_s / tau_d + (profile.snapshot_stall_s / tau_m if tau_m is not None else 0)
        # A failure during the previous recovery cuts it short: take the time it did not use back, latest phase first.
        early = active & (at < ready)
        spare = np.where(early, ready - at, 0.0)
        for phase in undo:
            cut = np.minimum(spare, last[phase])
            bad[phase] -= cut
            spare -= cut
        span = np.where(active, np.maximum(at - ready, 0.0), 0.0)
        sdc = active & is_sdc[:, i]
        node = active & is_node[:, i]
        detect = np.where(
            sdc, profile.sdc_detect_s, np.where(is_hang[:, i], profile.detect_hang_s, profile.detect_crash_s)
        )
        persist_work = profile.persist_s / (1.0 + overhead)
        if tau_m is None:  # durable checkpoints only: exact cycles of tau of work then C of stall from the restore
            cycle = tau_d + profile.checkpoint_stall_s
            n = np.floor(span / cycle)
            rest = span - n * cycle
            usable = n - ((n > 0) & (rest < profile.persist_s))  # the newest one may still be persisting
            reached = work + n * tau_d + np.minimum(rest, tau_d)
            durable = work + usable * tau_d
            back_to = durable
            bad["checkpoint"] += span - (reached - work)
        else:  # two interleaved tiers: their stalls spread over the work (each far below 1% of it)
            done = span / (1.0 + overhead)
            bad["checkpoint"] += span - done
            reached = work + done
            # Silent corruption: the job trains on, for nothing, until it is found, and rolls back past it.
            durable = _durable_point(reached, tau_d, persist_work)
            memory = np.maximum(np.floor(reached / tau_m) * tau_m, np.minimum(work, reached))
            back_to = np.where(sdc, durable, memory)
        back_to = np.minimum(back_to, reached)
        has_spare = np.zeros(rows, dtype=bool)
        if job.spares > 0:
            has_spare = (repair_until[:, :i] > at[:, None]).sum(axis=1) < job.spares
        phases = {
            "detection": detect,
            "reformation": np.where(node, profile.node_swap_s, profile.process_restart_s) + restart_extra,
            "waiting_for_node": np.where(node & ~has_spare, profile.node_wait_s, 0.0),
            "restore": np.where(profile.memory_tier & ~sdc, profile.restore_memory_s, profile.restore_durable_s),
        }
        if sides is not None:
            phases.update(dict.fromkeys(outages.PHASES, no_time))
        if sides is not None and out.any():  # rare: most steps have no outage in any run
            # The newest checkpoint on the mirror: the primary's newest as it was one copy's lag earlier.
            lag = sides.mirror_lag_s(tau_d, copy_phase[:, i]) / (1.0 + overhead)
            mirrored = np.minimum(_durable_point(np.maximum(reached - lag, 0.0), tau_d, persist_work), durable)
            went = out & sides.fails_over(outage_s[:, i], profile.restore_durable_s)
            back_to = np.where(out, np.where(went, mirrored, np.minimum(durable, reached)), back_to)
            sides.recovery(phases, profile, out, went, outage_s[:, i])
            tally["outages"] += out
            tally["failovers"] += went
            tally["outage_lost_s"] += np.where(out, reached - back_to, 0.0)
        bad["wasted_progress"] += np.where(active, reached - back_to, 0.0)
        resumes, down = at, np.zeros(rows)
        for phase, value in phases.items():
            bad[phase] += np.where(active, value, 0.0)
            last[phase] = np.where(active, value, last[phase])  # a run without an i-th failure keeps its last
            resumes, down = resumes + value, down + value
        repair_until[:, i] = np.where(node, at + profile.repair_s, -np.inf)
        work = np.where(active, back_to, work)
        tally["outage_down_s"] += np.where(out, down, 0.0)
        ready = np.where(active, resumes, ready)
        in_outage = np.where(active, out, in_outage)
        seen += active & ~out
    tau_d, tau_m = intervals.now(seen, np.full(rows, horizon))
    overhead = profile.checkpoint_stall_s / tau_d + (profile.snapshot_stall_s / tau_m if tau_m is not None else 0)
    tail = np.maximum(horizon - ready, 0.0)
    over = np.maximum(ready - horizon, 0.0)  # the last recovery runs past the end: only its part inside counts
    for phase in undo:
        cut = np.minimum(over, last[phase])
        bad[phase] -= cut
        over -= cut
    if tau_m is None:
        cycle = tau_d + profile.checkpoint_stall_s
        done = np.floor(tail / cycle) * tau_d + np.minimum(tail - np.floor(tail / cycle) * cycle, tau_d)
    else:
        done = tail / (1.0 + overhead)
    bad["checkpoint"] += tail - done
    ettr = (work + done) / horizon
    training = horizon - np.sum([bad[phase] for phase in undo], axis=0)
    took &= causes >= 0
    results = []
    for b in range(blocks):
        part = slice(b * runs, (b + 1) * runs)
        counts = np.bincount(causes[part][took[part]], minlength=len(model.causes)) / runs
        by_cause = {c.name: float(k) for c, k in zip(model.causes, counts, strict=True)}
        if sides is not None:
            by_cause["regional outage: waited"] = float((tally["outages"] - tally["failovers"])[part].mean())
            by_cause["regional outage: failed over"] = float(tally["failovers"][part].mean())
        result = Result(
            profile=profile.name,
            policy=policy.name,
            gpus=job.gpus,
            days=job.days,
            spares=job.spares,
            runs=runs,
            ettr=float(ettr[part].mean()),
            ettr_p05=float(np.quantile(ettr[part], 0.05)),
            ettr_p95=float(np.quantile(ettr[part], 0.95)),
            interruptions=float((seen + tally["outages"])[part].mean()),
            by_cause=by_cause,
            badput={k: float(v[part].mean() / horizon) for k, v in bad.items()},
            checkpoint_interval_s=float(np.mean(tau_d[part])),
            snapshot_interval_s=float(np.mean(tau_m[part])) if tau_m is not None else None,
            job_mtbf_h=mtbf / HOUR,
            **_money(job, float(ettr[part].mean())),
        )
        results.append((result, Runs(ettr[part], training[part], **{k: v[part] for k, v in tally.items()})))
    return results


def _money(job: SimJob, ettr: float) -> dict[str, float]:
    wall_h = job.days * DAY / HOUR
    gpu_hours = (job.gpus + job.spares * job.gpus_per_node) * wall_h
    useful = job.gpus * wall_h * ettr
    cost = gpu_hours * job.price_per_gpu_hour
    per_useful = cost / useful if useful > 0 else math.inf
    return {"gpu_hours": gpu_hours, "cost": cost, "useful_gpu_hours": useful, "cost_per_useful_gpu_hour": per_useful}


def _durable_point(reached: np.ndarray, tau: np.ndarray | float, persist_work: np.ndarray | float) -> np.ndarray:
    """The newest durable checkpoint usable at `reached`: the last multiple of tau whose persist has finished."""
    return np.maximum(np.floor(np.maximum(reached - persist_work, 0.0) / tau) * tau, 0.0)


class _Intervals:
    """The checkpoint and snapshot intervals in force (seconds of work), per run."""

    def __init__(self, policy: Policy, profile: Profile, mtbf_s: float, sdc_share: float, runs: int) -> None:
        self.policy, self.profile, self.mtbf_s, self.sdc_share, self.runs = policy, profile, mtbf_s, sdc_share, runs

    def now(self, seen: np.ndarray, at: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        p, prof = self.policy, self.profile
        tier = prof.memory_tier and prof.snapshot_stall_s > 0
        if p.name == "fixed":
            tau_d = np.full(self.runs, p.checkpoint_interval_s)
            return tau_d, np.full(self.runs, p.snapshot_interval_s) if tier else None
        # adaptive: the rate seen so far, from a prior worth one failure; the others: the model's rate, known ahead
        mtbf = (p.prior_mtbf_s + at) / (1.0 + seen) if p.name == "adaptive" else np.full(self.runs, self.mtbf_s)
        formula = young if p.name == "young" else daly
        durable_mtbf = mtbf / self.sdc_share if tier and self.sdc_share > 0 else mtbf if not tier else None
        if durable_mtbf is None:
            tau_d = np.full(self.runs, MAX_DURABLE_INTERVAL_S)
        else:
            tau_d = formula(prof.checkpoint_stall_s, durable_mtbf)
            if tier:
                tau_d = np.minimum(tau_d, MAX_DURABLE_INTERVAL_S)
        if not tier:
            return tau_d, None
        return tau_d, formula(prof.snapshot_stall_s, mtbf)


def young(cost_s: float, mtbf_s: np.ndarray) -> np.ndarray:
    """policy/interval.young over an array of MTBFs."""
    return np.sqrt(2.0 * cost_s * mtbf_s)


def daly(cost_s: float, mtbf_s: np.ndarray) -> np.ndarray:
    """policy/interval.daly over an array of MTBFs."""
    x = cost_s / (2.0 * mtbf_s)
    higher = np.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + np.sqrt(x) / 3.0 + x / 9.0) - cost_s
    return np.where(cost_s < 2.0 * mtbf_s, higher, mtbf_s)
