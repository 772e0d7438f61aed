"""`stalwart bench trainer`: the Hugging Face Trainer (or with `--trainer lightning` the Lightning Trainer)
recovering from a killed worker, side by side: alone under torchrun (its checkpoint every 20 steps, resumed from
on restart), and with stalwart's integration under `stalwart run`, with its defaults and with
`--wait-for-replacement`.

Each system runs the bench's job (bench/trainer_job.py: a tiny GPT-2; bench/lightning_job.py: an MLP; on 2 CPU
ranks, each step padded to `--step-s`, after `--setup-s` of set-up) `--rounds` times without a failure, the
systems taking turns (so that a machine whose pace drifts between runs moves each system's alike; stalwart's
runs serve `--wait-for-replacement` too, which acts only after a failure), then once with rank 1 SIGKILLed as a
step begins.
Reported: the kill to the next step no run had completed before it, the steps done again, whether the run ended
with the parameters of its own run without the kill (and of the Trainer alone), and the median step time without
a failure with its ratio to the Trainer alone's (the integration's overhead): the median of each round's ratio,
and their range. Takes about four minutes with the defaults; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from stalwart.bench.common import Progress, machine_info, positive_int, scratch_dir, seconds, seconds_text
from stalwart.errors import BenchError
from stalwart.telemetry.console import console as make_console

TRAINERS: dict[str, tuple[str, str, str]] = {
    "hf": ("stalwart.bench.trainer_job", "transformers.Trainer", "the Hugging Face Trainer"),
    "lightning": ("stalwart.bench.lightning_job", "lightning.Trainer", "the Lightning Trainer"),
}
"""Each `--trainer`: its job's module, the baseline's name, the report's title."""


WAITING = "stalwart --wait-for-replacement"
"""The system whose runs without a failure are stalwart's defaults' (`--wait-for-replacement` acts only after one)."""


def systems(trainer: str) -> dict[str, tuple[str, list[str]]]:
    """Each system: the job's `--system` and the launcher's command line before its common flags."""
    baseline = "hf" if trainer == "hf" else "plain"
    return {
        f"torchrun + {TRAINERS[trainer][1]}": (baseline, ["-m", "torch.distributed.run", "--standalone"]),
        "stalwart": ("stalwart", ["-m", "stalwart", "run"]),
        WAITING: ("stalwart", ["-m", "stalwart", "run", "--wait-for-replacement"]),
    }


TIMEOUT_S = 600.0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "trainer",
        help="the Hugging Face Trainer after a killed worker: alone under torchrun vs stalwart's integration",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--trainer",
        choices=tuple(TRAINERS),
        default="hf",
        help="hf: the Hugging Face Trainer (a tiny GPT-2; default); lightning: the Lightning Trainer (an MLP)",
    )
    p.add_argument("--steps", type=positive_int, default=80, help="steps per run (default 80)")
    p.add_argument("--kill-at", type=positive_int, default=53, help="rank 1 dies as the step after this begins")
    p.add_argument("--step-s", type=seconds, default=0.1, help="seconds each step is padded to (default 0.1)")
    p.add_argument("--setup-s", type=seconds, default=0.0, help="seconds of the script's set-up (default 0)")
    p.add_argument(
        "--rounds", type=positive_int, default=4, help="runs without a failure per system, taking turns (default 4)"
    )
    p.add_argument("--dir", type=Path, help="where the runs' files go (a new directory inside, removed at the end)")
    p.add_argument("--json", action="store_true", help="print one JSON object to stdout instead of tables")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    err = make_console(stderr=True)
    if args.kill_at >= args.steps:
        print(
            f"stalwart bench trainer: error: --kill-at {args.kill_at} must be below --steps {args.steps}",
            file=sys.stderr,
        )
        return 2
    hf = args.trainer == "hf"
    package, needs = ("transformers", "'transformers>=5'") if hf else ("lightning", "'lightning>=2.6'")
    try:
        __import__(package)  # the job's; checked before minutes of runs
    except ImportError:
        print(f"stalwart bench trainer: error: needs {package}: pip install {needs}", file=sys.stderr)
        return 2
    try:
        report = run_bench(
            args.steps,
            args.kill_at,
            args.step_s,
            args.setup_s,
            args.dir,
            lambda line: err.print(f"bench: {line}"),
            trainer=args.trainer,
            rounds=args.rounds,
        )
    except BenchError as exc:
        print(f"stalwart bench trainer: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report), flush=True)
    else:
        print_report(make_console(), report)
    return 0


def run_bench(
    steps: int,
    kill_at: int,
    step_s: float,
    setup_s: float,
    parent: Path | None,
    progress: Progress,
    *,
    trainer: str = "hf",
    rounds: int = 1,
) -> dict[str, Any]:
    """Every system's runs (`rounds` without a failure, the systems taking turns, then one with the kill); the
    report's JSON object."""
    job = TRAINERS[trainer][0]
    chosen = systems(trainer)
    clean: dict[str, list[dict[str, Any]]] = {name: [] for name in chosen}
    killed: dict[str, dict[str, Any]] = {}

    def one(i: int, name: str, kill: bool, label: str) -> dict[str, Any]:
        system, launcher = chosen[name]
        out = tmp / f"{i}-{label}"
        progress(f"{name}: {'rank 1 killed after step ' + str(kill_at) if kill else 'no failure'} ({label}) ...")
        started = time.monotonic()
        _launch(job, system, launcher, out, steps, step_s, setup_s, kill_at if kill else -1)
        progress(f"{name}: done in {time.monotonic() - started:.1f} s")
        return _read(out)

    with scratch_dir(parent, "stalwart-bench-trainer-") as tmp:
        machine = machine_info(tmp)
        for r in range(rounds):
            for i, name in enumerate(chosen):
                if name == WAITING:  # the flag changes nothing without a failure: stalwart's own runs serve
                    continue
                clean[name].append(one(i, name, False, f"clean-{r + 1}-of-{rounds}"))
        if WAITING in clean:
            clean[WAITING] = clean["stalwart"]
        for i, name in enumerate(chosen):
            killed[name] = one(i, name, True, "killed")
    results = {name: _measure(clean[name], killed[name]) for name in chosen}
    baseline_name = next(iter(chosen))
    baseline = results[baseline_name]
    for name, measured in results.items():
        measured["as_trainer_alone"] = measured["final"] == baseline["clean_final"]
        ratios = [
            _median_step(mine) / _median_step(theirs)
            for mine, theirs in zip(clean[name], clean[baseline_name], strict=True)
        ]
        measured["step_time_ratios"] = ratios
        measured["step_time_ratio"] = statistics.median(ratios)
    return {
        "machine": machine,
        "trainer": trainer,
        "steps": steps,
        "kill_at": kill_at,
        "step_s": step_s,
        "setup_s": setup_s,
        "rounds": rounds,
        "systems": results,
    }


def _launch(
    job: str, system: str, launcher: list[str], out: Path, steps: int, step_s: float, setup_s: float, kill: int
) -> None:
    out.mkdir(parents=True)
    cmd = [
        sys.executable,
        *launcher,
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        "-m",
        job,
        "--system",
        system,
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--step-s",
        str(step_s),
        "--setup-s",
        str(setup_s),
        "--kill-at",
        str(kill),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # As `stalwart bench recovery` runs torchrun: stock torchrun's restarted workers share the agent's store and
    # often hang in their first init_process_group (docs/benchmarks.md, "stock torchrun recovered").
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    with open(out / "output.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out, start_new_session=True)
        try:
            code = proc.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise BenchError(f"a run did not end within {TIMEOUT_S:.0f} s; its output: {out / 'output.log'}") from exc
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher's workers too, whatever happened
            proc.wait()
    if code != 0:
        tail = (out / "output.log").read_text(errors="replace").strip().splitlines()[-1:] or [""]
        raise BenchError(f"{' '.join(launcher[1:])} exited with {code}: {tail[0]}")


def _read(out: Path) -> dict[str, Any]:
    ends = []
    for path in out.glob("steps-*.txt"):
        pid = int(path.stem.split("-")[1])
        ends += [(int(g), float(t), pid) for g, t in (line.split() for line in path.read_text().splitlines())]
    kill = out / "kill.txt"
    final = {p.stem: json.loads(p.read_text())["sha256"] for p in sorted(out.glob("rank*.json"))}
    return {
        "ends": sorted(ends, key=lambda e: e[1]),
        "kill_t": float(kill.read_text()) if kill.exists() else None,
        "final": final,
    }


def _median_step(run: dict[str, Any]) -> float:
    """A run's median time between two step ends, on its rank that ended the most steps."""
    per_pid: dict[int, list[float]] = {}
    for _, t, pid in run["ends"]:
        per_pid.setdefault(pid, []).append(t)
    times = max(per_pid.values(), key=len)
    return statistics.median(b - a for a, b in itertools.pairwise(times))


def _measure(cleans: list[dict[str, Any]], killed: dict[str, Any]) -> dict[str, Any]:
    """One system's figures: its runs without a failure (each ends as the first) and its run with the kill."""
    clean = cleans[0]
    kill_t = killed["kill_t"]
    if kill_t is None:
        raise BenchError("the killed run's rank 1 did not die where asked")
    before = max((g for g, t, _ in killed["ends"] if t < kill_t), default=0)
    after = [(g, t) for g, t, _ in killed["ends"] if t > kill_t]
    if not after:
        raise BenchError("the killed run completed no step after the kill")
    first_new = min(t for g, t in after if g > before)
    resumed_at = min(g for g, _ in after) - 1
    if any(run["final"] != clean["final"] for run in cleans):
        raise BenchError("two runs of one system without a failure ended with different parameters")
    return {
        "kill_to_next_step_s": first_new - kill_t,
        "steps_done_again": before - resumed_at,
        "as_without_the_kill": killed["final"] == clean["final"],
        "median_step_s": statistics.median(_median_step(run) for run in cleans),
        "final": killed["final"],
        "clean_final": clean["final"],
    }


def print_report(console: Console, report: dict[str, Any]) -> None:
    m = report["machine"]
    trainer = report.get("trainer", "hf")
    model = "a tiny GPT-2" if trainer == "hf" else "an MLP"
    console.print(
        f"machine: {m['cpu_count']} CPUs, torch {m['torch']}, python {m['python']}, {m['platform']}\n"
        f"job: {model} in the Trainer's loop on 2 CPU ranks, {report['steps']} steps padded to "
        f"{report['step_s']} s, {report['setup_s']} s of set-up; rank 1 SIGKILLed after step {report['kill_at']}; "
        f"{report.get('rounds', 1)} run(s) without a failure per system, taking turns"
    )
    table = Table(title=f"{TRAINERS[trainer][2]} after a killed worker")
    for column in (
        "system",
        "kill → next step",
        "steps done again",
        "ends as without the kill",
        "ends as the Trainer alone",
        "median step",
        "step time ÷ alone",
    ):
        table.add_column(column, justify="left" if column == "system" else "right", no_wrap=True)
    for name, r in report["systems"].items():
        table.add_row(
            name,
            seconds_text(r["kill_to_next_step_s"]),
            str(r["steps_done_again"]),
            "yes" if r["as_without_the_kill"] else "no",
            "yes" if r["as_trainer_alone"] else "no",
            seconds_text(r["median_step_s"]),
            _ratio_text(r),
        )
    console.print(table)


def _ratio_text(r: dict[str, Any]) -> str:
    """The median of the rounds' step-time ratios, with their range when there were several."""
    ratios = r.get("step_time_ratios") or [r["step_time_ratio"]]
    text = f"{r['step_time_ratio']:.3f}×"
    return text if len(ratios) < 2 else f"{text} ({min(ratios):.3f}-{max(ratios):.3f})"
