"""How often does a launcher recover from one SIGKILLed worker? torchrun vs `stalwart run`, same job, same kill.

Each trial launches the demo GPT job (2 ranks, gloo, a checkpoint every 10 steps) under one launcher with
--max-restarts 3, SIGKILLs rank 1 once it has completed `--kill-after` steps, and counts the trial as recovered
if the job then finishes within `--timeout` seconds. Both launchers run the same worker script (stalwart.Job
resumes under either), so the difference is the launcher alone. Prints one line per trial and a summary;
`--json` ends with one JSON line. This is the seed of `stalwart bench recovery` (issue #4).

    python -m stalwart.bench.restart_reliability --trials 10
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stalwart.runtime.env import EVENT_LOG_ENV
from stalwart.runtime.process import spawn
from stalwart.telemetry.events import read_events

LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone"],
    "stalwart": [sys.executable, "-m", "stalwart", "run"],
}


def trial(launcher: str, workdir: Path, kill_after: int, timeout_s: float) -> dict[str, object]:
    events = workdir / "events.jsonl"
    env = {**os.environ, EVENT_LOG_ENV: str(events), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [*LAUNCHERS[launcher], "--nproc-per-node", "2", "--max-restarts", "3"]
    if launcher == "stalwart":
        cmd += ["--event-log", str(events)]
    else:  # torch elastic's log directory in the trial's, not a new one in /tmp that a killed launcher leaves
        cmd += ["--log-dir", str(workdir / "torchrun-logs")]
    cmd += ["-m", "stalwart.demo.train", "--out", str(workdir), "--steps", "60", "--checkpoint-every", "10"]
    log = open(workdir / "output.log", "wb")  # noqa: SIM115
    proc = spawn(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)  # dies with us
    deadline = time.monotonic() + timeout_s
    killed_at = None
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            if killed_at is None:
                evs = list(read_events(events))
                done = [e for e in evs if e["event"] == "step_done" and e["step"] >= kill_after]
                pid = next((e["pid"] for e in evs if e["event"] == "worker_started" and e["rank"] == 1), None)
                if done and pid:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = time.monotonic()
        recovered = proc.poll() == 0
    finally:
        # Workers run in sessions of their own, and a hung one may never have logged its pid: take the
        # launcher's children from /proc before ending the launcher, then end them too (all started here).
        workers = _children(proc.pid) if proc.poll() is None else []
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in workers + [e["pid"] for e in read_events(events) if e["event"] == "worker_started"]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log.close()
    kill_to_step = None
    if killed_at is not None:
        # CLOCK_MONOTONIC is shared by every process of one host, so the workers' stamps compare with ours.
        after = [e["mono"] for e in read_events(events) if e["event"] == "step_done" and e["restart"] > 0]
        kill_to_step = (min(after) - killed_at) if after else None
    return {"recovered": recovered, "exitcode": proc.returncode, "kill_to_step_s": kill_to_step}


def _children(parent: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(stat.parent.name))
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--kill-after", type=int, default=20)
    p.add_argument("--timeout", type=float, default=60)
    p.add_argument("--launchers", default="torchrun,stalwart")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    summary: dict[str, dict[str, object]] = {}
    for name in args.launchers.split(","):
        results = []
        for i in range(args.trials):
            with tempfile.TemporaryDirectory(prefix=f"restart-{name}-") as tmp:
                r = trial(name, Path(tmp), args.kill_after, args.timeout)
            results.append(r)
            k2s = f"{r['kill_to_step_s']:.2f} s" if r["kill_to_step_s"] is not None else "-"
            print(f"{name:9s} trial {i + 1:2d}: recovered={r['recovered']} exit={r['exitcode']} kill->step {k2s}")
        times = [float(str(r["kill_to_step_s"])) for r in results if r["recovered"] and r["kill_to_step_s"] is not None]
        summary[name] = {
            "trials": len(results),
            "recovered": sum(1 for r in results if r["recovered"]),
            "kill_to_step_s_median": statistics.median(times) if times else None,
        }
        print(
            f"{name}: recovered {summary[name]['recovered']}/{len(results)}, median kill->step "
            f"{summary[name]['kill_to_step_s_median']}"
        )
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
