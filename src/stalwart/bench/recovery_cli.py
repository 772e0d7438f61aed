"""`stalwart bench recovery`: torchrun, torchft and stalwart recovering the same job from the same failures.

Runs the 2-worker CPU job (gloo, a 4M-parameter MLP unless --width says otherwise, a checkpoint every 20 steps)
under each system: SIGKILLs of a worker at random steps, a SIGSTOPped worker, and a goodput run with a worker
killed every 30 s. stalwart runs twice: with its defaults (light memory snapshots every step, full copies on a
cost budget) and as stalwart_full (a full memory snapshot every step, the defaults before the budget). Takes
about 30 minutes with the defaults (the goodput runs are 5 minutes each); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from stalwart.bench.common import positive_int, seconds
from stalwart.bench.recovery_goodput import SETTLE_S
from stalwart.bench.recovery_run import WIDTH, JobShape
from stalwart.errors import BenchError
from stalwart.telemetry.console import console as make_console


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "recovery",
        help="kill-to-next-step, steps lost, hang detection and goodput: torchrun vs torchft vs stalwart",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--kills", type=positive_int, default=5, help="SIGKILLs per system in the kill phase (default 5)")
    p.add_argument("--gap", type=positive_int, default=160, help="steps between kills, at most (default 160)")
    p.add_argument("--hang-wait", type=float, default=30.0, help="seconds to wait for a hang report (default 30)")
    p.add_argument("--goodput-seconds", type=float, default=300.0, help="goodput run length, 0 to skip (default 300)")
    p.add_argument("--kill-every", type=float, default=30.0, help="seconds between kills in the goodput run")
    p.add_argument("--stock-trials", type=int, default=3, help="single-kill runs of stock torchrun (default 3)")
    p.add_argument(
        "--kill-rank",
        type=int,
        default=1,
        choices=(0, 1),
        help="the rank killed and stopped (default 1); rank 0 also hosts the job's process-group store",
    )
    p.add_argument("--spares", type=int, default=2, help="stalwart run --spares for stalwart's runs (default 2)")
    p.add_argument("--no-full", action="store_true", help="skip the stalwart_full runs (a full snapshot every step)")
    p.add_argument(
        "--setup-s",
        type=seconds,
        default=0.0,
        help="seconds the job's script spends before its loop, as "
        "a real job's dataset indexing and model building do (default 0)",
    )
    p.add_argument(
        "--own-data",
        action="store_true",
        help="the job draws its own batches in its loop (its own generator per rank), as most scripts do, "
        "instead of through stalwart's ResumableLoader",
    )
    p.add_argument(
        "--warm-spares",
        action="store_true",
        help="stalwart's spares (--spares) run the job's set-up before they are needed (stalwart run --warm-spares)",
    )
    p.add_argument(
        "--wait-for-replacement",
        action="store_true",
        help="stalwart's survivors wait for the replacement instead of training on shrunk (stalwart run's flag): "
        "each kill then includes the hand-over of the survivor's state to the replacement",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="the job's model sharded with FSDP2 (fully_shard, torch >= 2.6) instead of replicated with DDP "
        "(torchrun and stalwart)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        choices=(1, 2),
        help="the job's 2 ranks on this many nodes: 2 runs two launchers on loopback, one rank each, meeting "
        "through the c10d rendezvous as two machines would (torchrun and stalwart; default 1)",
    )
    p.add_argument(
        "--width",
        type=positive_int,
        default=WIDTH,
        help=f"the job's model: 3 linear layers of WIDTH x WIDTH (default {WIDTH}: 4.0M parameters)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the kill steps (default 0)")
    p.add_argument("--dir", type=Path, help="where the runs write (default: a new temporary directory)")
    p.add_argument("--json", action="store_true", help="print one JSON object to stdout instead of tables")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    err = make_console(stderr=True)
    # SIGTERM unwinds like Ctrl-C, so every run's `finally` ends the processes it started.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        from stalwart.bench.recovery import run_bench  # torch: after the arguments are checked

        if args.fsdp:
            import torch.distributed.fsdp

            if not hasattr(torch.distributed.fsdp, "fully_shard"):
                raise BenchError(f"--fsdp needs FSDP2's public fully_shard (torch >= 2.6); this is {torch.__version__}")

        report = run_bench(
            kills=args.kills,
            gap=args.gap,
            hang_wait=args.hang_wait,
            goodput_seconds=args.goodput_seconds,
            kill_every=args.kill_every,
            stock_trials=args.stock_trials,
            seed=args.seed,
            spares=max(0, args.spares),
            full=not args.no_full,
            kill_rank=args.kill_rank,
            shape=JobShape(
                setup_s=args.setup_s,
                width=args.width,
                own_data=args.own_data,
                warm_spares=args.warm_spares,
                wait_for_replacement=args.wait_for_replacement,
                nodes=args.nodes,
                fsdp=args.fsdp,
            ),
            parent=args.dir,
            progress=lambda line: err.print(f"bench: {line}"),
        )
    except BenchError as exc:
        print(f"stalwart bench recovery: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report), flush=True)
    else:
        print_report(make_console(), report)
    return 0


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} s"


def print_report(console: Console, report: dict[str, Any]) -> None:
    killed = report["job"].get("killed_rank", 1)
    setup = f", {report['setup_s']:g} s of set-up before the loop" if report.get("setup_s") else ""
    setup += ", each rank drawing its own data" if report.get("own_data") else ""
    setup += ", warm spares" if report.get("warm_spares") else ""
    setup += f", on {report['nodes']} nodes" if report.get("nodes", 1) > 1 else ""
    title = f"recovery, {report['kills']} kills of rank {killed} per system ({report['job']['model']}{setup})"
    table = Table(title=title)
    for column in (
        "system",
        "kill→step median",
        "max",
        "steps lost max",
        "survivor stall",
        "hang detect",
        "goodput (own pace, long run)",
        "bitwise identical",
        "median step",
    ):
        table.add_column(column, justify="left" if column == "system" else "right")
    for name, s in report["systems"].items():
        goodput = "n/a" if s.get("goodput") is None else f"{100 * s['goodput']:.1f}%"
        if s.get("goodput_own_pace") is not None:
            long_run = s.get("goodput_long_run")
            tail = "" if long_run is None else f", {100 * long_run:.1f}%"
            goodput += f" ({100 * s['goodput_own_pace']:.1f}%{tail})"
        identical = {True: "yes", False: "NO", None: "n/a"}[s.get("bitwise_identical")]
        table.add_row(
            name,
            _s(s["kill_to_step_s_median"]),
            _s(s["kill_to_step_s_max"]),
            "n/a" if s["steps_lost_max"] is None else str(s["steps_lost_max"]),
            _s(s["survivor_stall_s_median"]),
            _s(s["hang_detect_s"]),
            goodput,
            identical,
            _s(s.get("step_s_median")),
        )
    console.print(table)
    for name, s in report["systems"].items():
        if s.get("note"):
            console.print(f"{name}: {s['note']}")
    for name, s in report["systems"].items():
        every = (s.get("samples") or {}).get("replacement_first_step_s") or []
        firsts = [v for v in every if v is not None]
        if firsts:
            median, cut = statistics.median(firsts), len(every) - len(firsts)
            early = f"; {cut} replacement(s) killed before their first step" if cut else ""
            console.print(
                f"{name}: the replacement's first step, after the kill: median {median:.2f} s, "
                f"max {max(firsts):.2f} s (its set-up included){early}"
            )
    for name, s in report["systems"].items():
        if s.get("badput_s"):
            bad = s["badput_s"]
            parts = ", ".join(
                f"{part.replace('_', ' ')} {v:.1f} s" for part, v in bad.items() if part not in ("wall", "productive")
            )
            console.print(
                f"{name}, goodput run of {bad['wall']:.0f} s: productive {bad['productive']:.1f} s; {parts} "
                f"(telemetry/goodput.py's categories); charged only for failures {100 * s['goodput_fault_only']:.1f}%"
            )
            pace = s.get("goodput_step_s") or {}
            if pace.get("own_pace"):
                mean = f", mean {1e3 * pace['own_mean']:.1f} ms (the long run's)" if pace.get("own_mean") else ""
                console.print(
                    f"{name}, kept steps counted at its own pace: {1e3 * pace['own_pace']:.1f} ms a step "
                    f"(median of its steps {SETTLE_S:.0f} s or more from a start or kill{mean}); at the "
                    f"reference's: {1e3 * pace['reference']:.1f} ms"
                )
    ratio = report["ratios"]["torchrun_over_stalwart_kill_to_step"]
    console.print(f"torchrun ÷ stalwart, kill to next step: {ratio:.1f}×")
    stock = report.get("stock_torchrun")
    if stock:
        console.print(f"stock torchrun (shared store): recovered {stock['recovered']} of {stock['trials']} kills")
