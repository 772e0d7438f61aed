"""The recovery bench's goodput run: a worker killed every `kill_every` seconds for `seconds`, and where the wall
time went, counted at the fault-free reference run's pace and at the run's own steady pace."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from stalwart.bench.recovery_run import Progress, Run, _note_kill
from stalwart.errors import BenchError


@dataclass(frozen=True)
class PacedGoodput:
    """A goodput run's result, counted twice: each kept step at the fault-free reference run's median step
    (`goodput`, `badput_s`), and at the same run's own steady pace (`own_pace`, `own_pace_badput_s`)."""

    goodput: float
    badput_s: dict[str, float]
    steady_step_s: float | None
    own_pace: float | None
    own_pace_badput_s: dict[str, float] | None


def measure_goodput(
    system: str,
    workdir: Path,
    seconds: float,
    kill_every: float,
    step_s: float,
    progress: Progress,
    spares: int = 2,
    rank: int = 1,
) -> PacedGoodput:
    """Productive time kept over wall time, with `rank` killed every `kill_every` seconds: the steps in the final
    history (a redone step counts once) times `step_s`, the median step of the fault-free run. Counting a fixed
    step time, not each step's own, charges a system for everything that slows its steps or runs between them
    (snapshots, spares starting up), not only for the time it is down. Returns the goodput and where the rest of
    the wall time went (`badput`); the same again at the run's own steady pace (steady_pace)."""
    run = Run(system, workdir, steps=1_000_000, spares=spares, seconds=seconds + 120)
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
    done = sorted((e["mono"], e["step"]) for e in run.events
                  if e["event"] == "step_done" and e.get("rank") == 0 and e["mono"] <= end)  # fmt: skip
    if not done:
        return PacedGoodput(0.0, {}, None, None, None)
    first = min(step for _, step in done)
    final = max(step for _, step in done)  # steps first..final are the history; a redone step counts once
    kills = [e["mono"] for e in run.events if e["event"] == "fault_injected" and e["mono"] <= end]
    badput = goodput_badput(done, kills, started, end, step_s)
    steady = steady_pace(done, kills, started)
    own = None if steady is None else goodput_badput(done, kills, started, end, steady)
    kept, wall = final - first + 1, end - started
    return PacedGoodput(kept * step_s / wall, badput, steady, None if steady is None else kept * steady / wall, own)


SETTLE_S = 10.0
"""Steps this long after a start or a kill count toward a run's steady pace."""


def steady_pace(done: list[tuple[float, int]], kills: list[float], started: float) -> float | None:
    """The median time of a step in the stretches of a goodput run that are more than SETTLE_S seconds from its
    start and from the latest kill, from rank 0's completed steps (time, step), sorted: the pace the same run
    had at the same time, away from failures. Why: the reference run's median step is taken minutes earlier,
    and this VM's speed drifts between runs by more than the goodput target leaves (two fault-free 2-minute
    runs 4 minutes apart: medians 51.4 and 52.8 ms; the first 30 s of two goodput runs, before any kill: 53.9
    and 57.7 ms, 2026-11-25). Counting each kept step at this pace leaves the drift out but keeps everything a
    kill costs within SETTLE_S of it (the replacement's first steps, spares starting) and every periodic cost
    (checkpoint stalls, full copies). What it cannot see is a slowdown that lasts through the whole run; the
    report gives this pace beside the reference's so that one would show. None: too few steady steps (< 20)."""
    marks = [started, *kills]
    steps = [
        after - before
        for (before, s0), (after, s1) in itertools.pairwise(done)
        if s1 == s0 + 1 and before - max(m for m in marks if m <= before) > SETTLE_S
        and not any(before < k <= after for k in kills)
    ]  # fmt: skip
    return statistics.median(steps) if len(steps) >= 20 else None


def goodput_badput(
    done: list[tuple[float, int]], kills: list[float], started: float, end: float, step_s: float
) -> dict[str, float]:
    """Where the wall time not spent on kept steps went, in seconds, from rank 0's completed steps (time, step),
    sorted, and the kills' times; each step is counted at `step_s`:
    - `startup`: from the launch to the start of the first step;
    - `recovery`: from each kill (the first, if several came before the next step) to the start of the next
      completed step (the system's down time; the part of a step that ran before its kill is in `slower_steps`);
    - `redone`: steps done a second time after a restart;
    - `tail`: the unfinished step at the end of the run;
    - `slower_steps`: the rest, training time above `step_s` per step (snapshots, checkpoint stalls, spares
      starting, contention, noise; negative when the steps ran faster than `step_s`).
    With the kept steps' time they add up to `wall`, the wall time, which is reported too."""
    badput = {"startup": done[0][0] - step_s - started, "recovery": 0.0, "redone": 0.0, "tail": end - done[-1][0]}
    best = done[0][1]
    for (before, _), (after, step) in itertools.pairwise(done):
        killed = [k for k in kills if before < k <= after]
        if killed:
            badput["recovery"] += max(0.0, after - step_s - killed[0])  # a second kill meanwhile: still down
        if step <= best:
            badput["redone"] += step_s
        best = max(best, step)
    kept = (best - done[0][1] + 1) * step_s
    badput["slower_steps"] = (end - started) - kept - sum(badput.values())
    badput["wall"] = end - started
    return badput


def fault_only(badput: dict[str, float] | None) -> float | None:
    """The goodput with the steps' own speed left out: the share of the wall time not lost to start-up,
    recovery, redone steps or the unfinished last step. The goodput proper compares every step with the
    fault-free run's median step, taken minutes earlier; on a shared VM whose speed drifts by 10-30% over a
    bench run that part can swamp the rest (goodputs above 100% were seen), while these parts do not depend on it."""
    if not badput:
        return None
    lost = badput["startup"] + badput["recovery"] + badput["redone"] + badput["tail"]
    wall = badput.get("wall", 0.0)
    return 1.0 - lost / wall if wall > 0 else None
