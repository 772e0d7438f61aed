"""`stalwart bench recovery`: the same 2-worker gloo job under torchrun, torchft and stalwart, failed the same way.

For each system, in one invocation:
- kills: the job (recovery_job.py) runs a fixed number of steps while one rank (`--kill-rank`, default 1) is
  SIGKILLed from outside at random steps, one failure at a time; for each kill: seconds from the kill to the next
  completed step, steps lost (the last step completed before the kill minus the step the job resumed from), and
  the survivor's stall (the other rank's first completed step after the kill). The final parameters are compared
  with a fault-free run. Killing rank 0 also kills the process that hosts the job's process-group store, so its
  replacement must serve a store the survivor is already trying to reach.
- hang: the same rank is SIGSTOPped; the seconds until the system reports it (a `hang_detected` event), or null if
  it does not within `--hang-wait` seconds.
- goodput: the job runs `--goodput-seconds` with that rank killed every `--kill-every` seconds; goodput is the step
  time of the steps in the final history (a redone step counts once) over the wall time, each step counted at
  the fault-free reference run's median step and again at the run's own steady pace (steady_pace: its steps
  away from start and kills, which leaves out the VM's drift between the two runs).
torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (without it, restarted workers can hang on stale gloo
addresses); `--stock-trials` single-kill runs of stock torchrun report how often it recovers at all. torchft is
measured only if it is installed; otherwise its entries are null with a note. Every process the bench starts is
ended by it, by pid.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.errors import BenchError
from stalwart.runtime.process import spawn
from stalwart.telemetry.events import EventLog

Progress = Callable[[str], None]
FULL_EVERY_STEP = ["--snapshot-every", "1", "--replicated-snapshot-every", "1"]
"""The stalwart_full runs' job options: a full memory snapshot every step (the defaults before the budget)."""
NPROC = 2


@dataclass
class Run:
    """One launch of the bench job under one system, watched through its event log."""

    system: str
    workdir: Path
    steps: int
    spares: int = 2
    seconds: float | None = None
    """A bound on the job's wall time (the hang and goodput runs stop it themselves long before)."""
    stock: bool = False
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    offset: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def log(self) -> Path:
        return self.workdir / "events.jsonl"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("STALWART_", "TORCHELASTIC_", "PET_"))}
        env.update(STALWART_EVENT_LOG=str(self.log), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        until = [] if self.seconds is None else ["--until", f"{time.time() + self.seconds:.0f}"]
        job = ["-m", "stalwart.bench.recovery_job", "--out", str(self.workdir), "--steps", str(self.steps), *until]
        if self.system == "stalwart_full":
            job += FULL_EVERY_STEP
        if self.system == "torchft":
            cmd = [sys.executable, "-m", "stalwart.bench.torchft_driver", "--out", str(self.workdir), "--steps",
                   str(self.steps), *until]  # fmt: skip
        elif self.system == "torchrun":
            if not self.stock:
                env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            # Its log directory in the run's (torch elastic's default, a new one in /tmp, outlives a SIGKILL).
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}",
                   "--max-restarts=100", "--log-dir", str(self.workdir / "torchrun-logs"), *job]  # fmt: skip
        else:
            cmd = [sys.executable, "-m", "stalwart", "run", "--nproc-per-node", str(NPROC), "--max-restarts", "100",
                   "--spares", str(self.spares), "--event-log", str(self.log), *job]  # fmt: skip
        out = open(self.workdir / "output.log", "wb")  # noqa: SIM115 - closed with the process in stop()
        self.started = time.monotonic()
        # Its own session (the bench signals the whole group), and SIGTERM to the launcher if the bench dies.
        self.proc = spawn(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        out.close()

    def poll_events(self) -> list[dict[str, Any]]:
        try:
            with open(self.log, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n") + 1
        new = []
        for line in chunk[:end].splitlines():
            with contextlib.suppress(ValueError):
                new.append(json.loads(line))
        self.offset += end
        self.events.extend(new)
        return new

    def worker_pid(self, rank: int) -> int | None:
        """The newest pid of `rank` (from the workers' own `worker_started` events)."""
        pids = [e["pid"] for e in self.events if e["event"] == "worker_started" and e.get("rank") == rank]
        return pids[-1] if pids else None

    def last_step(self) -> int:
        return max((e["step"] for e in self.events if e["event"] == "step_done"), default=0)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """End the launcher and every worker this run started (pids from its own events and /proc)."""
        if self.proc is None:
            return
        workers = _descendants(self.proc.pid)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.poll_events()
        known = {e["pid"] for e in self.events if e["event"] == "worker_started"}
        for pid in set(workers) | known:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, pp in parents.items() if pp == parent]
        found += children
        frontier += children
    return found


def _note_kill(run: Run, what: str, rank: int, step: int) -> float:
    """Record the fault in the run's event log (so every time is on one CLOCK_MONOTONIC) and return its time."""
    record = EventLog(run.log, role="bench").emit("fault_injected", fault=what, rank=rank, step=step)
    return float(record["mono"])


def _wait(run: Run, until: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        if not run.running():
            run.poll_events()
            if until():
                return
            raise BenchError(f"{run.system}: the job exited ({run.proc.returncode if run.proc else '?'}) while "
                             f"waiting for {what}; see {run.workdir / 'output.log'}")  # fmt: skip
        if time.monotonic() > deadline:
            raise BenchError(f"{run.system}: timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.02)
        run.poll_events()


# ------------------------------------------------------------------------------------------------- the phases


def kill_schedule(kills: int, gap: int, rng: random.Random) -> list[int]:
    """The steps after which a rank is killed: random, between gap/2 and gap steps apart."""
    schedule, step = [], 40
    for _ in range(kills):
        step += rng.randint(gap // 2, gap)
        schedule.append(step)
    return schedule


def survivor_of(rank: int) -> int:
    """The rank that is not killed (the job has NPROC == 2 ranks)."""
    return NPROC - 1 - rank


def measure_kills(
    system: str, workdir: Path, schedule: list[int], progress: Progress, spares: int = 2, rank: int = 1
) -> dict[str, Any]:
    """SIGKILLs of `rank` once the job has completed each step of `schedule`, one recovery at a time."""
    kills = len(schedule)
    run = Run(system, workdir, steps=schedule[-1] + 60, spares=spares)
    run.start()
    marks: list[tuple[float, int]] = []
    try:
        for target in schedule:
            _wait(run, lambda t=target: run.last_step() >= t, 300, f"step {target}")  # type: ignore[misc]
            pid = run.worker_pid(rank)
            if pid is None:
                raise BenchError(f"{system}: no pid for rank {rank}")
            done = run.last_step()
            mono = _note_kill(run, "SIGKILL from outside", rank, done)
            os.kill(pid, signal.SIGKILL)
            marks.append((mono, done))
            progress(f"{system}: killed rank {rank} after step {done} ({len(marks)}/{kills})")
            _wait(run, _stepped_in_round(run, len(marks)), 300, "recovery")
        _wait(run, lambda: not run.running(), 300, "the end of the run")
    finally:
        run.stop()
    if run.proc is not None and run.proc.returncode != 0:
        raise BenchError(f"{system}: the job failed (exit {run.proc.returncode}); see {workdir / 'output.log'}")
    to_step, lost, stall = [], [], []
    for mono, done in marks:
        # A step finished by the old workers just after the kill is not a recovery: count from the new round.
        before = max((e.get("restart", 0) for e in run.events if e["mono"] <= mono and "restart" in e), default=0)
        after = [e for e in run.events if e.get("restart", 0) > before]
        first = _first_step_after(after, mono)
        if first is None:
            raise BenchError(f"{system}: no step completed after the kill at step {done}")
        to_step.append(first - mono)
        # torchft's survivor is not restarted: its first step after the kill, whatever its round, is its stall.
        survivor = _first_step_after(run.events if system == "torchft" else after, mono, rank=survivor_of(rank))
        stall.append((survivor if survivor is not None else first) - mono)
        resumed = [e for e in run.events if e["event"] in ("resumed", "fresh_start") and e["mono"] > mono]
        lost.append(done - (resumed[0].get("step", 0) if resumed else done))
    return {
        "kill_to_step_s": to_step,
        "steps_lost": lost,
        "survivor_stall_s": stall,
        "bitwise_identical": None,
        "step_s_median": _median_step(run.events),
    }


def _stepped_in_round(run: Run, restart: int) -> Callable[[], bool]:
    """Whether a worker of restart round `restart` (or later) has completed a step."""
    return lambda: any(e["event"] == "step_done" and e.get("restart", 0) >= restart for e in run.events)


def _first_step_after(events: list[dict[str, Any]], mono: float, rank: int | None = None) -> float | None:
    times = [e["mono"] for e in events if e["event"] == "step_done" and e["mono"] > mono
             and (rank is None or e.get("rank") == rank)]  # fmt: skip
    return min(times) if times else None


def _median_step(events: list[dict[str, Any]]) -> float | None:
    steps = [e["step_s"] for e in events if e["event"] == "step_done" and e.get("rank") == 0 and e["step"] > 5]
    return statistics.median(steps) if steps else None


def _results(workdir: Path) -> dict[int, str]:
    out = {}
    for rank in range(NPROC):
        path = workdir / f"result-rank{rank}.json"
        if path.exists():
            out[rank] = json.loads(path.read_text())["sha256"]
    return out


def measure_hang(
    system: str, workdir: Path, wait_s: float, progress: Progress, spares: int = 2, rank: int = 1
) -> float | None:
    """Seconds from SIGSTOPping `rank` to the system's hang report; None if none came within `wait_s`."""
    run = Run(system, workdir, steps=100_000, spares=spares, seconds=300 + wait_s + 120)
    run.start()
    try:
        _wait(run, lambda: run.last_step() >= 60, 300, "step 60")
        pid = run.worker_pid(rank)
        if pid is None:
            raise BenchError(f"{system}: no pid for rank {rank}")
        mono = _note_kill(run, "SIGSTOP from outside", rank, run.last_step())
        os.kill(pid, signal.SIGSTOP)
        progress(f"{system}: SIGSTOPped rank {rank}; waiting up to {wait_s:.0f} s for a hang report")
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and run.running():
            run.poll_events()
            found = [e["mono"] for e in run.events if e["event"] == "hang_detected" and e["mono"] > mono]
            # torchft reports nothing; it has moved on once the survivor commits a step without the hung replica.
            found += [e["mono"] for e in run.events if system == "torchft" and e["event"] == "step_done"
                      and e["mono"] > mono and e.get("participants") == 1]  # fmt: skip
            if found:
                return min(found) - mono
            time.sleep(0.05)
        return None
    finally:
        run.stop()


@dataclass(frozen=True)
class Goodput:
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
) -> Goodput:
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
        return Goodput(0.0, {}, None, None, None)
    first = min(step for _, step in done)
    final = max(step for _, step in done)  # steps first..final are the history; a redone step counts once
    kills = [e["mono"] for e in run.events if e["event"] == "fault_injected" and e["mono"] <= end]
    badput = goodput_badput(done, kills, started, end, step_s)
    steady = steady_pace(done, kills, started)
    own = None if steady is None else goodput_badput(done, kills, started, end, steady)
    kept, wall = final - first + 1, end - started
    return Goodput(kept * step_s / wall, badput, steady, None if steady is None else kept * steady / wall, own)


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


def stock_torchrun(workdir: Path, trials: int, timeout: float, progress: Progress) -> dict[str, Any]:
    """How often stock torchrun (sharing the agent's store with restarted workers) recovers from one kill."""
    recovered = 0
    for i in range(trials):
        run = Run("torchrun", workdir / f"stock-{i}", steps=120, stock=True)
        run.start()
        try:
            _wait(run, lambda r=run: r.last_step() >= 40, 300, "step 40")  # type: ignore[misc]
            pid = run.worker_pid(1)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + timeout
            while run.running() and time.monotonic() < deadline:
                time.sleep(0.1)
            ok = run.proc is not None and run.proc.poll() == 0
        finally:
            run.stop()
        recovered += ok
        progress(f"stock torchrun trial {i + 1}/{trials}: {'recovered' if ok else 'did not recover'}")
    return {"trials": trials, "recovered": recovered, "timeout_s": timeout}


# ---------------------------------------------------------------------------------------------- the report


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


def summarize(
    kills: dict[str, Any], hang_s: float | None, good: Goodput | None, reference_step_s: float
) -> dict[str, Any]:
    badput = good.badput_s if good is not None else None
    return {
        "kill_to_step_s_median": statistics.median(kills["kill_to_step_s"]),
        "kill_to_step_s_max": max(kills["kill_to_step_s"]),
        "steps_lost_max": max(kills["steps_lost"]),
        "survivor_stall_s_median": statistics.median(kills["survivor_stall_s"]),
        "hang_detect_s": hang_s,
        "goodput": good.goodput if good is not None else None,
        "badput_s": badput,
        "goodput_fault_only": fault_only(badput),
        "goodput_own_pace": good.own_pace if good is not None else None,
        "own_pace_badput_s": good.own_pace_badput_s if good is not None else None,
        "goodput_step_s": {
            "reference": reference_step_s,
            "own_pace": good.steady_step_s if good is not None else None,
        },
        "bitwise_identical": kills["bitwise_identical"],
        "step_s_median": kills["step_s_median"],
        "samples": kills,
    }


def run_bench(
    *,
    kills: int,
    gap: int,
    hang_wait: float,
    goodput_seconds: float,
    kill_every: float,
    stock_trials: int,
    seed: int,
    parent: Path | None,
    progress: Progress,
    spares: int = 2,
    full: bool = True,
    kill_rank: int = 1,
) -> dict[str, Any]:
    if not 0 <= kill_rank < NPROC:
        raise BenchError(f"--kill-rank must be 0 or 1 (the job has {NPROC} ranks), not {kill_rank}")
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="stalwart-bench-recovery-", dir=parent) as tmp:
        root = Path(tmp)
        schedule = kill_schedule(kills, gap, rng)
        progress(f"fault-free reference run of {schedule[-1] + 60} steps (stalwart run, no spares)")
        ref = Run("stalwart", root / "reference", steps=schedule[-1] + 60, spares=0)
        ref.start()
        try:
            _wait(ref, lambda: not ref.running(), 900, "the reference run")
        finally:
            ref.stop()
        reference = _results(root / "reference")
        reference_step_s = _median_step(ref.events) or 0.0
        if len(reference) != NPROC:
            raise BenchError(f"the reference run failed; see {root / 'reference' / 'output.log'}")
        systems: dict[str, Any] = {}
        torchft = importlib.util.find_spec("torchft") is not None
        names = ["torchrun", *(["torchft"] if torchft else []), "stalwart", *(["stalwart_full"] if full else [])]
        for name in names:
            expected = reference
            if name == "torchft":  # its allreduce differs from DDP's: compare with its own fault-free run
                expected = _reference_run(name, root / "torchft-reference", schedule[-1] + 60, progress)
            k = measure_kills(name, root / f"{name}-kills", schedule, progress, spares, kill_rank)
            k["bitwise_identical"] = _results(root / f"{name}-kills") == expected
            hang = measure_hang(name, root / f"{name}-hang", hang_wait, progress, spares, kill_rank)
            good = None
            if goodput_seconds > 0:
                progress(
                    f"{name}: goodput run of {goodput_seconds:.0f} s, rank {kill_rank} killed every {kill_every:.0f} s"
                )
                good = measure_goodput(
                    name,
                    root / f"{name}-goodput",
                    goodput_seconds,
                    kill_every,
                    reference_step_s,
                    progress,
                    spares,
                    kill_rank,
                )
            systems[name] = summarize(k, hang, good, reference_step_s)
            if name == "torchrun" and hang is None:
                systems[name]["note"] = (
                    f"no hang detection: a SIGSTOPped rank was not reported within {hang_wait:.0f} s (survivors "
                    "wait for the collective timeout)"
                )
            if name == "torchft":
                systems[name]["note"] = (
                    "lighthouse + 2 replica groups (PureDistributedDataParallel: torchft's DistributedDataParallel "
                    "crashes the survivor too, see bench/torchft_job.py), a dead replica restarted by the bench's "
                    "driver at once; the "
                    "survivor trains on alone (min_replica_size=1), so kill_to_step is the restarted replica's first "
                    "committed step, hang_detect_s the survivor's first step without the stopped replica, and "
                    "bitwise_identical compares with torchft's own fault-free run"
                )
            if name == "stalwart":
                systems[name]["note"] = (
                    "stalwart run with JobConfig's defaults: a light memory snapshot every step while they cost "
                    "at most 2% of a step (the survivor keeping the replicated state live), full copies within "
                    "what they leave of a 1% budget, at least a quarter of it"
                )
            if name == "stalwart_full":
                systems[name]["note"] = (
                    "stalwart run with JobConfig(snapshot_every=1, replicated_snapshot_every=1): a full memory "
                    "snapshot every step, the defaults before the snapshot budget"
                )
        if not torchft:
            systems["torchft"] = _torchft_entry()
        stock = stock_torchrun(root, stock_trials, 45.0, progress) if stock_trials else None
    base, ours = systems["torchrun"], systems["stalwart"]
    return {
        "job": {
            "nproc": NPROC,
            "model": "3-layer MLP, 4.0M parameters, DDP, AdamW",
            "checkpoint_every": 20,
            "stalwart_spares": spares,
            "killed_rank": kill_rank,
        },
        "kills": kills,
        "systems": systems,
        "stock_torchrun": stock,
        "ratios": {
            "torchrun_over_stalwart_kill_to_step": base["kill_to_step_s_median"] / ours["kill_to_step_s_median"],
            **(
                {
                    "torchrun_over_stalwart_full_kill_to_step": base["kill_to_step_s_median"]
                    / systems["stalwart_full"]["kill_to_step_s_median"]
                }
                if "stalwart_full" in systems
                else {}
            ),
        },
        "machine": {"cpu_count": os.cpu_count(), "python": sys.version.split()[0]},
    }


def _reference_run(system: str, workdir: Path, steps: int, progress: Progress) -> dict[int, str]:
    progress(f"{system}: fault-free reference run of {steps} steps")
    run = Run(system, workdir, steps=steps)
    run.start()
    try:
        _wait(run, lambda: not run.running(), 900, f"{system}'s reference run")
    finally:
        run.stop()
    results = _results(workdir)
    if len(results) != NPROC:
        raise BenchError(f"{system}: the reference run failed; see {workdir / 'output.log'}")
    return results


def _torchft_entry() -> dict[str, Any]:
    keys = ("kill_to_step_s_median", "kill_to_step_s_max", "steps_lost_max", "survivor_stall_s_median",
            "hang_detect_s", "goodput", "goodput_own_pace")  # fmt: skip
    note = "torchft is not installed in this environment (pip install 'stalwart[bench]' or torchft); not measured"
    return {**dict.fromkeys(keys), "note": note}
