"""`stalwart bench overhead`: the step time of the same job plain and under stalwart, per configuration.

Runs one rank of an MLP with AdamW without stalwart and under `stalwart run` with its defaults, with the
durable tier alone, with the memory tier alone (budgeted interval), with a memory snapshot every step and with
two hot spares warming up beside it (`--spares 2`), with two warm spares that also run the job's set-up and park
(`--warm-spares`; their CPU time while parked and their memory are printed too), with each durable checkpoint
copied to a mirror (`mirrors=`), and without the guard or the detectors, and prints each configuration's median
step time over the plain one (the ratio), the time stalwart takes on the training thread between steps (inline),
the snapshot interval it chose, and the floor: one copy of the state into host memory, what a snapshot every step
costs at the least.
About three minutes on CPU with the defaults; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from stalwart.bench.common import positive_int
from stalwart.bench.overhead import CONFIGS, run_bench
from stalwart.errors import BenchError
from stalwart.telemetry.console import console as make_console

_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "overhead",
        help="step time plain vs under stalwart: defaults and each tier alone, as ratios",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model trains (default cpu)")
    p.add_argument("--params", type=_params, help="model parameters: 4M, 400M, 1.5B (default 4M; 400M on cuda)")
    p.add_argument("--batch", type=positive_int, help="batch size (default 64; 1024 on cuda)")
    p.add_argument("--steps", type=positive_int, default=300, help="steps per run (default 300)")
    p.add_argument("--warmup", type=positive_int, default=20, help="first steps left out of the times (default 20)")
    p.add_argument(
        "--configs",
        type=_configs,
        default=list(CONFIGS),
        help=f"comma-separated, of {', '.join(CONFIGS)} (default: all)",
    )
    p.add_argument(
        "--nproc", type=positive_int, default=1, help="ranks (DDP over gloo; plain runs under torchrun; default 1)"
    )
    p.add_argument(
        "--rounds", type=positive_int, default=2, help="runs of each configuration, order rotating (default 2)"
    )
    p.add_argument("--dir", type=Path, help="where the runs write (default: a new temporary directory)")
    p.add_argument("--json", action="store_true", help="print one JSON object to stdout instead of tables")
    p.set_defaults(run=run)
    return p


def _params(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmbg]?)\s*", text.lower())
    if m is None or float(m.group(1)) * _SUFFIX[m.group(2)] < 64:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count (e.g. 4M, 400M, 1.5B)")
    return int(float(m.group(1)) * _SUFFIX[m.group(2)])


def _configs(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown configuration {unknown[0] if unknown else text!r}; choose from {', '.join(CONFIGS)}"
        )
    return names


def run(args: argparse.Namespace) -> int:
    err = make_console(stderr=True)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwind: children end too
    if args.warmup >= args.steps - 1:
        print("stalwart bench overhead: error: --warmup must leave at least 2 timed steps", file=sys.stderr)
        return 2
    cuda = args.device == "cuda"
    try:
        report = run_bench(
            params=args.params or (400_000_000 if cuda else 4_000_000),
            device=args.device,
            steps=args.steps,
            warmup=args.warmup,
            batch=args.batch or (1024 if cuda else 64),
            configs=args.configs,
            rounds=args.rounds,
            nproc=args.nproc,
            parent=args.dir,
            progress=lambda line: err.print(f"bench: {line}"),
        )
    except BenchError as exc:
        print(f"stalwart bench overhead: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report), flush=True)
    else:
        print_report(make_console(), report)
    return 0


def _light(rounds: list[dict[str, Any] | None]) -> str:
    """ ", light every step (0.35 ms)" when light snapshots stayed on in every round, ", light off (...)" else."""
    judged = [r for r in rounds if r]
    if not judged:
        return ""
    costs = "/".join(f"{r['light_s'] * 1e3:.2f}" for r in judged if r.get("light_s") is not None)
    kept = all(r["kept"] for r in judged)
    return f", light {'every step' if kept else 'off'} ({costs} ms)" if costs else ""


def print_report(console: Console, report: dict[str, Any]) -> None:
    m = report["machine"]
    console.print(
        f"machine: {m['cpu_count']} CPUs, torch {m['torch']}, python {m['python']}; device {report['device']}\n"
        f"job: {report['nproc']} rank(s), MLP of {report['params'] / 1e6:,.1f}M parameters + AdamW "
        f"({report['state_bytes'] / 1e6:,.0f} MB of state), batch {report['batch']}, "
        f"{report['steps']} steps, the first {report['warmup']} left out"
    )
    table = Table(title="step time under stalwart ÷ plain")
    columns = (
        "configuration",
        "median step",
        "ratio",
        "mean step",
        "mean ratio",
        "inline",
        "optimizer step",
        "detectors",
        "snapshot every",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "configuration" else "right", no_wrap=True)
    table.add_row(
        "plain (no stalwart)",
        f"{report['plain_step_s'] * 1e3:.2f} ms",
        "1.00×",
        f"{report['plain_mean_step_s'] * 1e3:.2f} ms",
        "1.00×",
        "",
        f"{report['plain_optimizer_step_s'] * 1e3:.2f} ms",
        "",
        "",
    )
    for name, c in report["configs"].items():
        every = c["snapshot_every"]
        table.add_row(
            name,
            f"{c['step_s'] * 1e3:.2f} ms",
            f"{c['ratio']:.3f}×",
            f"{c['mean_step_s'] * 1e3:.2f} ms",
            f"{c['mean_ratio']:.3f}×",
            f"{100 * c['inline_overhead']:+.2f}%",
            f"{c['optimizer_step_s'] * 1e3:.2f} ms",
            "" if c.get("detector_s") is None else f"{c['detector_s'] * 1e3:.3f} ms ({100 * c['detector_share']:.2f}%)",
            ("never" if not every else f"{every} steps") + _light(c.get("light") or []),
        )
    console.print(table)
    for name, c in report["configs"].items():
        if c.get("parked_cpu_share") is not None:
            console.print(
                f"{name}: each parked warm spare used {100 * c['parked_cpu_share']:.3f}% of one core while the job "
                f"trained ({c['parked_spares']} spares parked {c['parked_s']:.0f} s in all over {report['rounds']} "
                "rounds; their CPU time from /proc, in 10 ms ticks)"
                + (
                    f"; each held {c['parked_rss_mb']:,.0f} MB resident, {c['parked_private_mb']:,.0f} MB of it its "
                    "own (the rest shared with the process it was forked from)"
                    if c.get("parked_private_mb") is not None
                    else ""
                )
            )
    for name, c in report["configs"].items():
        if c.get("mirrored"):
            lags = sorted(m["lag_s"] for m in c["mirrored"])
            console.print(
                f"{name}: {len(lags)} checkpoints mirrored, each {lags[0]:.2f}-{lags[-1]:.2f} s after its commit"
            )
    floor = report["floor"]
    console.print(
        f"floor: one copy of the state takes {floor['memcpy_s'] * 1e3:.2f} ms, so a snapshot every step costs at "
        f"least {floor['every_step_ratio']:.2f}× plain.\n"
        f"detectors: the guard's and detectors' own time on the training thread per step, and its share of the "
        f"step's body, timed inside the runs.\n"
        f"inline: stalwart's time on the training thread between steps, over the steps' own time, in the same "
        f"runs. The plain runs' medians spread {report['plain_spread']:.3f}× over {report['rounds']} rounds: "
        "ratios closer to 1 than that are within this machine's noise."
    )
