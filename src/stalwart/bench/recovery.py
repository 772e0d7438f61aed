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
  away from start and kills, which leaves out the VM's drift between the two runs), and at that pace with the
  start-up left out (a long run's goodput at the same failure rate).
The job checkpoints to durable storage every 20 steps under torchrun (its recovery reloads that checkpoint) and
at JobConfig's default cadence under stalwart (its recovery reads live peers and node memory).
torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (without it, restarted workers can hang on stale gloo
addresses); `--stock-trials` single-kill runs of stock torchrun report how often it recovers at all. torchft is
measured only if it is installed; otherwise its entries are null with a note. Every process the bench starts is
ended by it, by pid.
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from stalwart.bench.common import scratch_dir
from stalwart.bench.recovery_goodput import (
    PacedGoodput,
    measure_goodput,
)
from stalwart.bench.recovery_run import (
    DEFAULT_SHAPE,
    NPROC,
    RESTART_CHECKPOINT_EVERY,
    JobShape,
    Progress,
    Run,
    _first_step_after,
    _median_step,
    _note_kill,
    _results,
    _stepped_in_round,
    _wait,
)
from stalwart.errors import BenchError
from stalwart.job.config import CheckpointOptions

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
    system: str,
    workdir: Path,
    schedule: list[int],
    progress: Progress,
    spares: int = 2,
    rank: int = 1,
    shape: JobShape = DEFAULT_SHAPE,
) -> dict[str, Any]:
    """SIGKILLs of `rank` once the job has completed each step of `schedule`, one recovery at a time."""
    kills = len(schedule)
    run = Run(system, workdir, steps=schedule[-1] + 60, spares=spares, shape=shape)
    run.start()
    marks: list[tuple[float, int]] = []
    killed: set[int | None] = {None}
    try:
        for target in schedule:
            # A replacement says it started when its Job starts; a warm spare once it has a rank (after its set-up,
            # when it was taken before it parked), and survivors training on shrunk may pass `target` before that.
            def ready(t: int = target) -> bool:
                return run.last_step() >= t and run.worker_pid(rank) not in killed

            _wait(run, ready, 300, f"step {target} and a live rank {rank}")
            pid = run.worker_pid(rank)
            assert pid is not None
            done = run.last_step()
            mono = _note_kill(run, "SIGKILL from outside", rank, done)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                raise BenchError(f"{system}: rank {rank} (pid {pid}) ended before the bench killed it") from None
            killed.add(pid)
            marks.append((mono, done))
            progress(f"{system}: killed rank {rank} after step {done} ({len(marks)}/{kills})")
            _wait(run, _stepped_in_round(run, len(marks)), 300, "recovery")
        _wait(run, lambda: not run.running(), 300, "the end of the run")
    finally:
        run.stop()
    if run.failed() is not None:
        raise BenchError(f"{system}: the job failed (exit {run.failed()}); see {workdir / 'output.log'}")
    to_step, lost, stall, replaced = [], [], [], []
    for index, (mono, done) in enumerate(marks):
        until = marks[index + 1][0] if index + 1 < len(marks) else float("inf")
        # A step finished by the old workers just after the kill is not a recovery: count from the new round.
        before = max((e.get("restart", 0) for e in run.events if e["mono"] <= mono and "restart" in e), default=0)
        after = [e for e in run.events if e.get("restart", 0) > before]
        if shape.nodes > 1:  # a survivor's node may join the next round without a restart of its own
            after = _after_recovery(run.events, mono)
        first = _first_step_after(after, mono)
        if first is None:
            raise BenchError(f"{system}: no step completed after the kill at step {done}")
        to_step.append(first - mono)
        # torchft's survivor is not restarted: its first step after the kill, whatever its round, is its stall.
        survivor = _first_step_after(run.events if system == "torchft" else after, mono, rank=survivor_of(rank))
        stall.append((survivor if survivor is not None else first) - mono)
        # The killed rank's replacement: its first step of the full job (not one of the survivors' shrunk steps);
        # None when the next kill came first (survivors training on shrunk reach the next kill's step while the
        # replacement still runs its set-up, and that kill is the replacement's).
        full = [e for e in after if e.get("world_size") is None or e.get("world_size") == NPROC]
        replacement = _first_step_after(full, mono, rank=rank)
        replaced.append(replacement - mono if replacement is not None and replacement < until else None)
        # The step the job went on from: a restore's, or the survivors' when they train on shrunk meanwhile (and
        # went on, re-armed, when a replacement in its set-up was killed: nothing of theirs is lost then).
        went_on = ("resumed", "fresh_start", "shrunk", "shrunk_rearmed")
        resumed = [e for e in run.events if e["event"] in went_on and e["mono"] > mono]
        lost.append(max(0, done - (resumed[0].get("step", 0) if resumed else done)))
    return {
        "kill_to_step_s": to_step,
        "steps_lost": lost,
        "survivor_stall_s": stall,
        "replacement_first_step_s": replaced,
        "bitwise_identical": None,
        "step_s_median": _median_step(run.events),
    }


RECOVERED = ("resumed", "fresh_start", "shrunk", "shrunk_rearmed", "reformed_in_loop")
"""Events that say a system went on after a failure: a restore, a fresh start, survivors training on shrunk."""


def _after_recovery(events: list[dict[str, Any]], mono: float) -> list[dict[str, Any]]:
    """The events from the first recovery after the kill at `mono` on: on several nodes a survivor's node may join
    the next round as a membership change, its restart count unchanged, so the round's count cannot tell a step
    finished in flight just after the kill from one after the recovery."""
    marks = [e["mono"] for e in events if e["event"] in RECOVERED and e["mono"] > mono]
    return [e for e in events if marks and e["mono"] >= min(marks)]


def measure_hang(
    system: str,
    workdir: Path,
    wait_s: float,
    progress: Progress,
    spares: int = 2,
    rank: int = 1,
    shape: JobShape = DEFAULT_SHAPE,
) -> float | None:
    """Seconds from SIGSTOPping `rank` to the system's hang report; None if none came within `wait_s`."""
    seconds = 300 + wait_s + 120 + shape.setup_s
    run = Run(system, workdir, steps=100_000, spares=spares, seconds=seconds, shape=shape)
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
            found += [
                e["mono"]
                for e in run.events
                if system == "torchft" and e["event"] == "step_done" and e["mono"] > mono and e.get("participants") == 1
            ]
            if found:
                return min(found) - mono
            time.sleep(0.05)
        return None
    finally:
        run.stop()


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


def summarize(
    kills: dict[str, Any], hang_s: float | None, good: PacedGoodput | None, reference_step_s: float
) -> dict[str, Any]:
    return {
        "kill_to_step_s_median": statistics.median(kills["kill_to_step_s"]),
        "kill_to_step_s_max": max(kills["kill_to_step_s"]),
        "steps_lost_max": max(kills["steps_lost"]),
        "survivor_stall_s_median": statistics.median(kills["survivor_stall_s"]),
        "hang_detect_s": hang_s,
        "goodput": good.goodput if good is not None else None,
        "badput_s": good.badput_s if good is not None else None,
        "goodput_fault_only": good.fault_only if good is not None else None,
        "goodput_own_pace": good.own_pace if good is not None else None,
        "goodput_long_run": good.long_run if good is not None else None,
        "goodput_step_s": {
            "reference": reference_step_s,
            "own_pace": good.steady_step_s if good is not None else None,
            "own_mean": good.steady_mean_s if good is not None else None,
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
    shape: JobShape = DEFAULT_SHAPE,
) -> dict[str, Any]:
    """Every system's figures on the same job and the same kills; `shape.setup_s`: the seconds its script spends
    before its loop (what a failure costs a system that runs the script again)."""
    if not 0 <= kill_rank < NPROC:
        raise BenchError(f"--kill-rank must be 0 or 1 (the job has {NPROC} ranks), not {kill_rank}")
    rng = random.Random(seed)
    with scratch_dir(parent, "stalwart-bench-recovery-") as root:
        schedule = kill_schedule(kills, gap, rng)
        progress(f"fault-free reference run of {schedule[-1] + 60} steps (stalwart run, no spares)")
        ref = Run("stalwart", root / "reference", steps=schedule[-1] + 60, spares=0, shape=shape)
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
        torchft = importlib.util.find_spec("torchft") is not None and shape.nodes == 1 and not shape.fsdp
        names = ["torchrun", *(["torchft"] if torchft else []), "stalwart", *(["stalwart_full"] if full else [])]
        for name in names:
            expected = reference
            if name == "torchft":  # its allreduce differs from DDP's: compare with its own fault-free run
                expected = _reference_run(name, root / "torchft-reference", schedule[-1] + 60, progress, shape)
            k = measure_kills(name, root / f"{name}-kills", schedule, progress, spares, kill_rank, shape)
            k["bitwise_identical"] = _results(root / f"{name}-kills") == expected
            hang = measure_hang(name, root / f"{name}-hang", hang_wait, progress, spares, kill_rank, shape)
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
                    shape,
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
            if name.startswith("stalwart") and shape.own_data:
                systems[name]["note"] += (
                    "; the job draws its own data, so the survivor trains on alone with its own batches while the "
                    "replacement starts (a smaller global batch for those steps): not bitwise identical by design "
                    "(--wait-for-replacement is)"
                )
        if not torchft:
            systems["torchft"] = _torchft_entry(shape.nodes, shape.fsdp)
        stock = stock_torchrun(root, stock_trials, 45.0, progress) if stock_trials else None
    base, ours = systems["torchrun"], systems["stalwart"]
    wrap = "FSDP2" if shape.fsdp else "DDP"
    return {
        "job": {
            "nproc": NPROC,
            "nodes": shape.nodes,
            "model": f"3-layer MLP, {3 * (shape.width**2 + shape.width) / 1e6:.1f}M parameters, {wrap}, AdamW",
            "data": "own (each rank draws its batches in its loop)" if shape.own_data else "ResumableLoader",
            "checkpoint_every": {
                "torchrun": RESTART_CHECKPOINT_EVERY,
                "stalwart": CheckpointOptions.__dataclass_fields__["every"].default,
            },
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
        "setup_s": shape.setup_s,
        "width": shape.width,
        "own_data": shape.own_data,
        "fsdp": shape.fsdp,
        "warm_spares": shape.warm_spares,
        "nodes": shape.nodes,
    }


def _reference_run(
    system: str, workdir: Path, steps: int, progress: Progress, shape: JobShape = DEFAULT_SHAPE
) -> dict[int, str]:
    progress(f"{system}: fault-free reference run of {steps} steps")
    run = Run(system, workdir, steps=steps, shape=shape)
    run.start()
    try:
        _wait(run, lambda: not run.running(), 900, f"{system}'s reference run")
    finally:
        run.stop()
    results = _results(workdir)
    if len(results) != NPROC:
        raise BenchError(f"{system}: the reference run failed; see {workdir / 'output.log'}")
    return results


def _torchft_entry(nodes: int = 1, fsdp: bool = False) -> dict[str, Any]:
    keys = (
        "kill_to_step_s_median",
        "kill_to_step_s_max",
        "steps_lost_max",
        "survivor_stall_s_median",
        "hang_detect_s",
        "goodput",
        "goodput_own_pace",
    )
    note = "torchft is not installed in this environment (pip install 'stalwart[bench]' or torchft); not measured"
    if nodes > 1:
        note = "torchft's driver runs its replica groups on one node; not measured with --nodes"
    if fsdp:
        note = "torchft's driver replicates its model (DDP-like replica groups); not measured with --fsdp"
    return {**dict.fromkeys(keys), "note": note}
