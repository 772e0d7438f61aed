"""The recovery bench's goodput run: a worker killed every `kill_every` seconds for `seconds`, and where the wall
time went in the one goodput model (telemetry/goodput.py), with the kept steps also counted at the fault-free
reference run's pace and at the run's own steady pace."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalwart.bench.recovery_run import DEFAULT_SHAPE, JobShape, Progress, Run, _note_kill
from stalwart.errors import BenchError
from stalwart.telemetry.goodput import account


@dataclass(frozen=True)
class PacedGoodput:
    """A goodput run's result in telemetry/goodput.py's model (the categories `stalwart report` and `stalwart chaos`
    give), with the kept steps also counted at the fault-free reference run's median step (`goodput`) and at the
    same run's own steady pace (`own_pace`)."""

    goodput: float
    badput_s: dict[str, float]
    """Seconds by the model's categories, with `productive` and `wall`."""
    fault_only: float
    """Goodput charged only for start-up, failures and recoveries (Goodput.fault_only)."""
    steady_step_s: float | None
    own_pace: float | None
    steady_mean_s: float | None = None
    """The mean step of the same steady stretches: the pace a run of this system without failures keeps on this
    machine, its periodic costs (snapshots, checkpoints) and the machine's noise included."""
    long_run: float | None = None
    """What the failures leave of the run's own pace in a long run: the kept steps at `steady_mean_s` over the wall
    time less the start-up (paid once, it tends to nothing in a long run). The issue's goodput targets are of this
    kind ("one of two ranks lost for 5 s every 30 s caps it near 92%"). Why the mean and not `own_pace`'s median:
    a step's time on a shared VM is skewed (a plain torch DDP loop's mean step is a few % above its median,
    docs/benchmarks.md), so counting steps at the median charges a run without any failure for that noise.
    The periodic costs are left to `stalwart bench overhead`, which measures them against a plain loop."""

    @classmethod
    def of(cls, events: list[dict[str, Any]], started: float, end: float, step_s: float) -> PacedGoodput:
        """From a goodput run's events over [started, end] (monotonic), `step_s` the reference's median step."""
        good = account(events, window=(started, end))
        done = sorted(
            (e["mono"], e["step"])
            for e in events
            if e["event"] == "step_done" and e.get("rank") == 0 and e["mono"] <= end
        )
        kills = [e["mono"] for e in events if e["event"] == "fault_injected" and e["mono"] <= end]
        steps = steady_steps(done, kills, started)
        steady = statistics.median(steps) if steps else None
        mean = statistics.mean(steps) if steps else None
        badput = {**good.badput, "productive": good.productive_s, "wall": good.wall_s}
        own = None if steady is None else good.paced(steady)
        after_start = good.wall_s - good.badput["startup"]
        long_run = None if mean is None or after_start <= 0 else good.kept_steps * mean / after_start
        return cls(good.paced(step_s), badput, good.fault_only, steady, own, mean, long_run)


def measure_goodput(
    system: str,
    workdir: Path,
    seconds: float,
    kill_every: float,
    step_s: float,
    progress: Progress,
    spares: int = 2,
    rank: int = 1,
    shape: JobShape = DEFAULT_SHAPE,
) -> PacedGoodput:
    """Productive time kept over wall time, with `rank` killed every `kill_every` seconds: the steps in the final
    history (a redone step counts once) times `step_s`, the median step of the fault-free run. Counting a fixed
    step time, not each step's own, charges a system for everything that slows its steps or runs between them
    (snapshots, spares starting up), not only for the time it is down. Returns that goodput, the same at the
    run's own steady pace (steady_pace), and where the wall time went in telemetry/goodput.py's categories."""
    run = Run(system, workdir, steps=1_000_000, spares=spares, seconds=seconds + 120, shape=shape)
    run.start()
    started = run.started
    try:
        next_kill = started + kill_every
        while time.monotonic() < started + seconds:
            time.sleep(0.05)
            run.poll_events()
            if not run.running():
                raise BenchError(f"{system}: the job exited during the goodput run; see {workdir / 'output.log'}")
            if time.monotonic() >= next_kill:
                pid = run.worker_pid(rank)
                if pid is not None:
                    _note_kill(run, "SIGKILL from outside", rank, run.last_step())
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    progress(f"{system}: goodput run, killed rank {rank} at {time.monotonic() - started:.0f} s")
                next_kill += kill_every
        end = time.monotonic()
    finally:
        run.stop()
    return PacedGoodput.of(run.events, started, end, step_s)


SETTLE_S = 10.0
"""Steps this long after a start or a kill count toward a run's steady pace."""


def steady_steps(done: list[tuple[float, int]], kills: list[float], started: float) -> list[float]:
    """The times of the steps of a goodput run that are more than SETTLE_S seconds from its start and from the
    latest kill, from rank 0's completed steps (time, step), sorted: its pace away from failures. Empty: too few
    steady steps (< 20) to tell a pace."""
    marks = [started, *kills]
    steps = [
        after - before
        for (before, s0), (after, s1) in itertools.pairwise(done)
        if s1 == s0 + 1
        and before - max(m for m in marks if m <= before) > SETTLE_S
        and not any(before < k <= after for k in kills)
    ]
    return steps if len(steps) >= 20 else []


def steady_pace(done: list[tuple[float, int]], kills: list[float], started: float) -> float | None:
    """The median of steady_steps: the pace the same run had at the same time, away from failures. Why: the
    reference run's median step is taken minutes earlier, and a VM's speed drifts between runs by more than the
    goodput target leaves (docs/benchmarks.md has the figures). Counting each kept step at this pace leaves the
    drift out but keeps everything a kill costs within SETTLE_S of it (the replacement's first steps, spares
    starting) and every periodic cost (checkpoint stalls, full copies), and the skew of the machine's noise
    (PacedGoodput.long_run leaves that out). What it cannot see is a slowdown that lasts through the whole run;
    the report gives this pace beside the reference's so that one would show. None: too few steady steps."""
    steps = steady_steps(done, kills, started)
    return statistics.median(steps) if steps else None
