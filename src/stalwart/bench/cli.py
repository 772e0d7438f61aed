"""`stalwart bench checkpoint`: what a checkpoint costs a training loop, on this machine and this disk.

Measures stalwart next to torch.save, DCP save and DCP async_save, and next to the floor (one memcpy of the
state, one fsync'd write of its bytes), for a model plus AdamW state of --size. Each system runs in its own
process; the run takes a while and reports its progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from stalwart.bench.common import GB, MB, parse_size, positive_int, seconds_text
from stalwart.errors import BenchError, ConfigError
from stalwart.runtime.args import pointing_to
from stalwart.telemetry.console import console as make_console

EXIT_FAILED = 1
LABELS = {
    "torch_save": "torch.save+fsync",
    "dcp_save": "DCP save",
    "dcp_async_save": "DCP async_save",
    "stalwart": "stalwart",
}


_Parser = pointing_to("stalwart bench")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="stalwart bench", description="Benchmarks of stalwart on this machine.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_parser(sub)
    from stalwart.bench import handover, mirror_read, overhead_cli, recovery_cli, reshard, trainer

    recovery_cli.add_parser(sub)
    handover.add_parser(sub)
    overhead_cli.add_parser(sub)
    reshard.add_parser(sub)
    mirror_read.add_parser(sub)
    trainer.add_parser(sub)
    return p


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `checkpoint` sub-command to `stalwart bench`'s sub-parsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "checkpoint",
        help="stall, durable time, throughput, peak RSS and training slowdown of a checkpoint, per system",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--size", type=_size, default=100 * MB, help="model + AdamW state: 100MB, 1GB or <N>MB (default 100MB)"
    )
    p.add_argument(
        "--saves", type=positive_int, default=3, help="timed saves per system, after one warm-up (default 3)"
    )
    p.add_argument(
        "--dir",
        type=Path,
        help="where checkpoints are written: a new directory is made inside it and removed at the end "
        "(default: a new directory under $TMPDIR or /tmp; if that is a tmpfs it measures memory, not a disk)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the model and its state live (default cpu); on cuda the floor is a pinned device-to-host copy",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object to stdout instead of tables")
    p.set_defaults(run=run)
    return p


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.run(args)
    return code


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; a failed measurement is one line on stderr and exit status 1."""
    err = make_console(stderr=True)
    try:
        from stalwart.bench.checkpoint import run_bench  # torch: after the arguments are checked

        report = run_bench(args.size, args.saves, args.dir, lambda line: err.print(f"bench: {line}"), args.device)
    except BenchError as exc:
        print(f"stalwart bench checkpoint: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(report), flush=True)
    else:
        # Piped output gets room for the whole table instead of rich's default of 80 columns.
        print_report(make_console(), report)
    return 0


def print_report(console: Console, report: dict[str, Any]) -> None:
    """The machine, one row per system, and the headline ratios."""
    m = report["machine"]
    console.print(
        f"machine: {m['cpu_count']} CPUs, torch {m['torch']}, python {m['python']}, {m['platform']}\n"
        f"disk: {m['dir']} ({m['filesystem']}); state: {report['state_bytes'] / MB:,.1f} MB "
        f"(model + AdamW), medians of {report['saves']} saves after a warm-up"
    )
    console.print(_systems_table(report))
    console.print(_ratios_table(report))


def _systems_table(report: dict[str, Any]) -> Table:
    floor, systems, ratios = report["floor"], report["systems"], report["ratios"]
    table = Table(title="checkpoint cost per system")
    for column in ("system", "stall", "durable", "GB/s", "peak RSS", "stall÷memcpy", "GB/s÷floor", "bg slowdown"):
        table.add_column(column, justify="left" if column == "system" else "right", no_wrap=True)
    raw_write_s = report["state_bytes"] / floor["write_gbps"] / GB
    table.add_row(
        "floor (pinned copy, write)" if report["machine"].get("device", "cpu") != "cpu" else "floor (memcpy, write)",
        seconds_text(floor["memcpy_s"]),
        seconds_text(raw_write_s),
        f"{floor['write_gbps']:.2f}",
        f"{floor['peak_rss_mb']:,.0f} MB",
        "1.0×",
        "1.0×",
        "",
    )
    for name in LABELS:
        s = systems[name]
        slowdown = s.get("background_slowdown")
        table.add_row(
            LABELS[name],
            seconds_text(s["stall_s"]),
            seconds_text(s["durable_s"]),
            f"{s['write_gbps']:.2f}",
            f"{s['peak_rss_mb']:,.0f} MB",
            f"{ratios['stall_vs_memcpy'][name]:,.1f}×",
            f"{ratios['write_vs_floor'][name]:.2f}×",
            f"{slowdown:.2f}×" if slowdown is not None else "",
        )
    return table


def _ratios_table(report: dict[str, Any]) -> Table:
    ratios = report["ratios"]
    table = Table(title="stalwart compared", show_header=False)
    table.add_row("torch.save stall ÷ stalwart stall", f"{ratios['torch_save_stall_over_stalwart_stall']:.2f}×")
    table.add_row("stalwart stall ÷ DCP async_save stall", f"{ratios['stalwart_stall_over_dcp_async_stall']:.2f}×")
    table.add_row("stalwart stall ÷ memcpy floor", f"{ratios['stall_vs_memcpy']['stalwart']:,.1f}×")
    table.add_row("stalwart write throughput ÷ floor", f"{ratios['write_vs_floor']['stalwart']:.2f}×")
    table.add_row("training step while stalwart persists ÷ idle", f"{ratios['stalwart_background_slowdown']:.2f}×")
    return table
