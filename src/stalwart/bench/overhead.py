"""`stalwart bench overhead`: what stalwart costs a training step, with its defaults and with each tier alone.

The same job (overhead_job.py: one rank, an MLP, AdamW) runs plain, without stalwart, and under `stalwart run`
in each configuration of CONFIGS, in `rounds` rounds whose order rotates, so that a machine that drifts (a
shared VM's step time moved by 30% between runs here) weighs on every configuration alike. A configuration's
ratio is its median step time over the plain one's, all rounds pooled. Means are reported too: a durable
checkpoint every 100 steps hides from a median. The inline overhead is measured inside each run: the time
between the end of one step's body and the start of the next (stalwart's work on the training thread) over the
body's time; it is free of the drift between runs but misses what background work takes from the body, and
the commit point of light snapshots, which runs inside the optimizer step: the optimizer step's own median
time is reported for that (plain and per configuration). The
floor is one copy of the whole state into preallocated host memory: what a snapshot every step costs at least.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from stalwart.bench.common import Progress, machine_info, make_run_dir
from stalwart.errors import BenchError
from stalwart.runtime.process import cpu_seconds, start_module
from stalwart.telemetry.events import read_events

NEVER = 10**9
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "durable_only": {"snapshot_every": 0},
    "memory_only": {"checkpoint_every": NEVER},
    "memory_every_step": {"snapshot_every": 1, "checkpoint_every": NEVER},
    "default_spares": {},
    "default_warm_spares": {},
    "default_mirror": {"mirrors": ["mirror"]},
    "no_guard": {"nonfinite_grads": "off", "grad_spike": "off"},
    "no_detectors": {
        "nonfinite_grads": "off",
        "grad_spike": "off",
        "straggler_threshold": None,
        "divergence_every": None,
    },
}
"""JobConfig keywords per configuration. memory_every_step is what the memory tier cost before the budget;
no_guard is the default without the numeric guard (detect/numeric.py), no_detectors without any of the
in-job detectors (guard, stragglers, replica divergence): their cost is the difference to the default.
default_mirror copies each durable checkpoint to a mirror (a directory in the run's own, on the same disk)."""
LAUNCHER: dict[str, list[str]] = {
    "default_spares": ["--spares", "2"],
    "default_warm_spares": ["--spares", "2", "--warm-spares"],
}
"""`stalwart run` options beyond the defaults: two hot spares warming up (at idle priority) while the job trains;
two warm ones, which also run the job's set-up (at idle priority) and park at its loop."""
RUN_TIMEOUT_S = 900
SAMPLE_S = 0.5
"""How often a run's parked spares are sampled (_ParkedSpares)."""


def run_bench(
    *,
    params: int,
    device: str,
    steps: int,
    warmup: int,
    batch: int,
    configs: list[str],
    rounds: int,
    parent: Path | None,
    nproc: int = 1,
    progress: Progress,
) -> dict[str, Any]:
    run_dir, created = make_run_dir(parent)
    started = time.perf_counter()
    failed = False
    try:
        job = {"params": params, "device": device, "steps": steps, "warmup": warmup, "batch": batch, "nproc": nproc}
        order: list[str | None] = [None, *configs]  # None: plain
        runs: dict[str | None, list[dict[str, Any]]] = {name: [] for name in order}
        for r in range(rounds):
            for name in order[r % len(order) :] + order[: r % len(order)]:
                label = f"{name or 'plain'}, round {r + 1} of {rounds}"
                where = run_dir / f"{name or 'plain'}-{r}"
                config = None if name is None else CONFIGS[name]
                runs[name].append(_run(where, label, config, job, progress, LAUNCHER.get(name or "", [])))
        machine = machine_info(run_dir)
    except BenchError:
        failed = True  # the failed run's whole output stays for a look (the error names it)
        raise
    finally:
        if not failed:
            shutil.rmtree(created, ignore_errors=True)
    plain = runs.pop(None)
    return build_report(plain, runs, job, machine, time.perf_counter() - started)  # type: ignore[arg-type]


def _run(
    workdir: Path,
    label: str,
    config: dict[str, Any] | None,
    job: dict[str, Any],
    progress: Progress,
    launcher: list[str],
) -> dict[str, Any]:
    workdir.mkdir(parents=True)
    result = workdir / "result.json"
    args = [
        "-m",
        "stalwart.bench.overhead_job",
        "--result",
        str(result),
        "--params",
        str(job["params"]),
        "--batch",
        str(job["batch"]),
        "--steps",
        str(job["steps"]),
        "--warmup",
        str(job["warmup"]),
        "--device",
        job["device"],
    ]
    log = workdir / "events.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STALWART_", "TORCHELASTIC_", "PET_"))}
    nproc = str(job["nproc"])
    if config is None and nproc == "1":
        cmd = [sys.executable, *args, "--mode", "plain"]
    elif config is None:  # torchrun's own defaults (it sets OMP_NUM_THREADS=1 for several ranks, as stalwart run)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            nproc,
            "--log-dir",
            str(workdir / "torchrun-logs"),
            *args,
            "--mode",
            "plain",
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            "stalwart",
            "run",
            "--nproc-per-node",
            nproc,
            "--event-log",
            str(log),
            *launcher,
            *args,
            "--mode",
            "stalwart",
            "--ckpt",
            str(workdir / "ckpt"),
            "--config",
            json.dumps(config),
        ]
    progress(f"{label}: started")
    clock = time.perf_counter()
    # The launcher (or the plain job) forked with torch imported where this process is one thread, else an
    # interpreter: every run alike (runtime/process.py). Either way it gets SIGTERM if the bench dies.
    proc = start_module(cmd[2], cmd[3:], env=env, out=workdir / "output.log", cwd=workdir, death_signal=signal.SIGTERM)
    parked = _ParkedSpares(log, result)
    try:
        code = parked.watch(proc, RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        proc.wait()
        raise BenchError(f"{label} ran for more than {RUN_TIMEOUT_S} s; stopped it") from exc
    if code != 0 or not result.exists():
        tail = (workdir / "output.log").read_text(errors="replace").strip().splitlines()[-40:]
        sys.stderr.write("".join(f"  | {line}\n" for line in tail))
        raise BenchError(f"{label} failed (exit status {code}); its output's end is above, all of it in {workdir}")
    measured: dict[str, Any] = json.loads(result.read_text())
    if config is not None:
        decisions = [e for e in read_events(log) if e["event"] == "snapshot_interval"]
        measured["snapshot_every"] = (
            decisions[-1]["interval"] if decisions else (config.get("snapshot_every", 1) or None)
        )
        events = read_events(log)
        judged = [e for e in events if e["event"] in ("light_snapshots_kept", "light_snapshots_off")]
        measured["light"] = (
            {"kept": judged[0]["event"] == "light_snapshots_kept", "light_s": judged[0].get("light_s")}
            if judged
            else None
        )
        # Under light snapshots every step, full copies get what those leave of the budget (JobConfig): the
        # judgment of light snapshots says how much, else the last interval decision.
        budgets = [e["full_copy_budget"] for e in judged if "full_copy_budget" in e]
        measured["full_copy_budget"] = budgets[-1] if budgets else decisions[-1]["budget"] if decisions else None
        mirrored = [e for e in read_events(log) if e["event"] == "mirrored"]
        measured["mirrored"] = [{"step": e["step"], "lag_s": e["lag_s"]} for e in mirrored]
        saves = [e for e in read_events(log) if e["event"] == "checkpoint_snapshot" and e.get("rank", 0) == 0]
        measured["save_stalls"] = [e["stall_s"] for e in saves]
        measured["save_costs"] = save_costs(measured["step_times"], [e["step"] for e in saves], job["warmup"])
    measured["parked"] = parked.spares()
    median = statistics.median(measured["step_times"])
    progress(f"{label}: done in {time.perf_counter() - clock:.1f} s (median step {median * 1e3:.2f} ms)")
    return measured


class _ParkedSpares:
    """What each parked warm spare costs in CPU while the job trains: its CPU time (/proc) from the moment it
    logged `spare_parked` until the job wrote its result, sampled twice a second while the run goes. The step
    ratios cannot show a 1% cost on a VM whose pace drifts more than that between runs; a spare's own CPU time can
    (what it does not use, it cannot take from the ranks)."""

    def __init__(self, log: Path, result: Path) -> None:
        self._log, self._result, self._offset = log, result, 0
        self._first: dict[int, tuple[float, float]] = {}
        self._last: dict[int, tuple[float, float]] = {}
        self._memory: dict[int, dict[str, float]] = {}

    def watch(self, proc: Any, timeout_s: float) -> int:
        """Wait for `proc` (raising subprocess.TimeoutExpired after `timeout_s`), sampling the parked spares."""
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                return int(proc.wait(min(SAMPLE_S, max(0.0, deadline - time.monotonic()))))
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(proc.pid), timeout_s)
            self._sample()

    def _sample(self) -> None:
        """Read the log's new `spare_parked` events, then sample every parked spare; the samples count only if the
        job's result is not there after they were taken (the spares are ended after the job's end: their exit is
        not parking)."""
        complete = b""
        with contextlib.suppress(OSError), open(self._log, "rb") as f:
            f.seek(self._offset)
            chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written is read next time
            self._offset += len(complete)
        for line in complete.splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("event") == "spare_parked":
                    self._first.setdefault(int(event["pid"]), (-1.0, -1.0))
                    self._memory[int(event["pid"])] = {k: event[k] for k in ("rss_mb", "private_mb") if k in event}
        samples = {pid: (time.monotonic(), cpu) for pid in self._first if (cpu := cpu_seconds(pid)) is not None}
        if self._result.exists():
            return
        for pid, sample in samples.items():
            if self._first[pid][0] < 0:
                self._first[pid] = sample
            self._last[pid] = sample

    def spares(self) -> list[dict[str, float]]:
        """Per spare sampled at least twice: how long it was watched parked, the CPU time it used meanwhile, and
        its memory as it parked (its event's rss_mb and private_mb)."""
        return [
            {
                "pid": pid,
                "seconds": self._last[pid][0] - first[0],
                "cpu_s": self._last[pid][1] - first[1],
                **self._memory.get(pid, {}),
            }
            for pid, first in self._first.items()
            if first[0] >= 0 and self._last[pid][0] > first[0]
        ]


def save_costs(step_times: list[float], saved_at: list[int], warmup: int) -> list[float]:
    """What each durable checkpoint cost the loop in all: the save of step S runs after the body of loop step S-1
    and, on a GPU, its copy overlaps step S, whose optimizer step waits for it; so the two intervals S-1 and S
    together, minus two median steps. Saves whose steps fall outside the timed window are left out."""
    median = statistics.median(step_times)
    costs = []
    for s in saved_at:
        i = s - 1 - warmup
        if i >= 0 and i + 1 < len(step_times):
            costs.append(step_times[i] + step_times[i + 1] - 2 * median)
    return costs


def _pooled(runs: list[dict[str, Any]], key: str) -> list[float]:
    return [t for r in runs for t in r[key]]


def _parked_share(runs: list[dict[str, Any]]) -> float | None:
    spares = [s for r in runs for s in r.get("parked", [])]
    seconds = sum(s["seconds"] for s in spares)
    return sum(s["cpu_s"] for s in spares) / seconds if seconds > 0 else None


def _mean_of(runs: list[dict[str, Any]], key: str) -> float | None:
    """The mean of `key` over every parked spare of `runs` that has it; None if none has."""
    found = [s[key] for r in runs for s in r.get("parked", []) if key in s]
    return statistics.fmean(found) if found else None


def build_report(
    plain: list[dict[str, Any]],
    results: dict[str, list[dict[str, Any]]],
    job: dict[str, Any],
    machine: dict[str, Any],
    seconds: float,
) -> dict[str, Any]:
    pooled = _pooled(plain, "step_times")
    plain_s, plain_mean = statistics.median(pooled), statistics.fmean(pooled)
    plain_optimizer_s = statistics.median(_pooled(plain, "optimizer_times"))
    configs = {}
    for name, runs in results.items():
        steps, bodies = _pooled(runs, "step_times"), _pooled(runs, "body_times")
        step_s, mean_s = statistics.median(steps), statistics.fmean(steps)
        configs[name] = {
            "step_s": step_s,
            "ratio": step_s / plain_s,
            "mean_step_s": mean_s,
            "mean_ratio": mean_s / plain_mean,
            "inline_overhead": (mean_s - statistics.fmean(bodies)) / statistics.fmean(bodies),
            "optimizer_step_s": statistics.median(_pooled(runs, "optimizer_times")),
            # The guard's and detectors' own time on the training thread (Job.detector_seconds), per step: free of
            # the drift between runs, which hides anything under a few percent in the ratios here.
            "detector_s": statistics.fmean(r["detector_s"] for r in runs)
            if all("detector_s" in r for r in runs)
            else None,
            "detector_share": statistics.fmean(r["detector_s"] for r in runs) / statistics.fmean(bodies)
            if all("detector_s" in r for r in runs)
            else None,
            "detector_breakdown_s": {
                k: statistics.fmean(r["detector_breakdown_s"][k] for r in runs)
                for k in runs[0].get("detector_breakdown_s", {})
            },
            # Each durable save's stall as the Job measured it, and its whole cost in step time (save_costs):
            # on a GPU the copy overlaps the next step, so the second is the one to compare with the floor.
            "save_stall_s": [t for r in runs for t in r.get("save_stalls", [])],
            "save_cost_s": [t for r in runs for t in r.get("save_costs", [])],
            "snapshot_every": runs[-1].get("snapshot_every"),
            "full_copy_budget": runs[-1].get("full_copy_budget"),
            # Light snapshots (several ranks): whether they stayed on, and their judged cost per step, per round.
            "light": [r.get("light") for r in runs],
            # Parked warm spares: CPU time over time parked, pooled over every spare of every round (a share of
            # one core); None where the configuration has none.
            "parked_cpu_share": _parked_share(runs),
            "parked_spares": sum(len(r.get("parked", [])) for r in runs),
            "parked_s": sum(s["seconds"] for r in runs for s in r.get("parked", [])),
            "parked_rss_mb": _mean_of(runs, "rss_mb"),
            "parked_private_mb": _mean_of(runs, "private_mb"),
            # default_mirror: the checkpoints copied to the mirror, and how far behind their commit each landed.
            "mirrored": [m for r in runs for m in r.get("mirrored", [])],
            "config": CONFIGS[name],
            "launcher": LAUNCHER.get(name, []),
        }
    memcpy_s = statistics.median(p["memcpy_s"] for p in plain)
    medians = [statistics.median(p["step_times"]) for p in plain]
    return {
        "plain_step_s": plain_s,
        "plain_mean_step_s": plain_mean,
        "plain_optimizer_step_s": plain_optimizer_s,
        "plain_spread": max(medians) / min(medians),
        "rounds": len(plain),
        "configs": configs,
        "floor": {"memcpy_s": memcpy_s, "every_step_ratio": (plain_s + memcpy_s) / plain_s},
        "params": plain[0]["params"],
        "state_bytes": plain[0]["state_bytes"],
        **{k: job[k] for k in ("device", "steps", "warmup", "batch", "nproc")},
        "machine": machine,
        "seconds": seconds,
    }
