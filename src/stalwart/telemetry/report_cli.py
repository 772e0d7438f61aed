"""`stalwart report [RUN]`: where a run's wall time went, from its event log (telemetry/goodput.py).

RUN is an event log (`stalwart run --event-log`), or a directory holding one as `events.jsonl` or
`stalwart-logs/events.jsonl` (stalwart run's default); without it, $STALWART_EVENT_LOG or the current directory.
Prints the goodput and its breakdown and one line per failure or rollback (detection, recovery, steps lost, tier),
and writes a self-contained HTML page with figures (telemetry/report_html.py) next to the log as `report.html`
(`--html PATH` elsewhere, `--no-html` not at all); `--json` prints the same numbers as one object. Works on a log
still being written.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.table import Table

from stalwart.errors import ConfigError
from stalwart.runtime.args import Parser
from stalwart.runtime.env import EVENT_LOG_ENV
from stalwart.telemetry.console import console
from stalwart.telemetry.events import read_events
from stalwart.telemetry.goodput import Goodput, account, breakdown_rows

CANDIDATES = ("events.jsonl", "stalwart-logs/events.jsonl")


_Parser = Parser


def find_log(path: Path) -> Path:
    if path.is_file():
        return path
    if path.is_dir():
        for name in CANDIDATES:
            if (path / name).is_file():
                return path / name
        raise ConfigError(f"{path} holds no event log ({' or '.join(CANDIDATES)})")
    raise ConfigError(f"{path} does not exist")


def main(argv: list[str]) -> int:
    p = _Parser(prog="stalwart report", description="Where a run's wall time went: goodput and recoveries.")
    p.add_argument(
        "run",
        type=Path,
        nargs="?",
        default=None,
        help="an event log, or a directory holding events.jsonl or stalwart-logs/events.jsonl (default: "
        f"${EVENT_LOG_ENV} if set, else here, where `stalwart run` wrote stalwart-logs/events.jsonl)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (and write no page unless --html)")
    p.add_argument(
        "--html",
        type=Path,
        default=None,
        help="where to write the HTML page (default: report.html next to the event log)",
    )
    p.add_argument("--no-html", action="store_true", help="write no HTML page")
    args = p.parse_args(argv)
    if args.html is not None and args.no_html:
        raise ConfigError("give --html PATH or --no-html, not both")
    log = find_log(args.run if args.run is not None else Path(os.environ.get(EVENT_LOG_ENV) or Path.cwd()))
    events = list(read_events(log))
    if not events:
        raise ConfigError(f"{log} holds no events")
    if not any(e.get("event") in ("launcher_started", "worker_started") for e in events):
        raise ConfigError(f"{log} is not a stalwart event log (no launcher or worker events)")
    g = account(events)
    page = None if args.no_html or (args.json and args.html is None) else args.html or log.parent / "report.html"
    if page is not None:
        _write_page(page, g, events, log)
    if args.json:
        print(
            json.dumps(
                {
                    "log": str(log),
                    "goodput": g.ratio,
                    "wall_s": g.wall_s,
                    "productive_s": g.productive_s,
                    "badput": g.badput,
                    "final_step": g.final_step,
                    "html": str(page) if page else None,
                    "recoveries": [asdict(r) for r in g.recoveries],
                }
            )
        )
        return 0
    out = console()
    out.print(f"run: {log}\nwall time {g.wall_s:.1f} s, {g.final_step} steps, goodput {100 * g.ratio:.1f}%")
    table = Table(title="where the wall time went")
    for column in ("", "seconds", "share"):
        table.add_column(column, justify="left" if not column else "right", no_wrap=True)
    for name, seconds, share in breakdown_rows(g):
        table.add_row(name.replace("_", " "), f"{seconds:.2f}", f"{100 * share:.1f}%")
    out.print(table)
    if g.recoveries:
        rec = Table(title="failures and rollbacks")
        for column in ("#", "what", "at", "detection", "to next step", "steps lost", "state from"):
            rec.add_column(column, justify="left" if column in ("what", "state from") else "right", no_wrap=True)
        for i, r in enumerate(g.recoveries, 1):
            detection = f"{r.detection_s:.2f} s" if r.detection_s is not None else "?"
            rec.add_row(
                str(i), r.kind, f"{r.at_s:.1f} s", detection, f"{r.recovery_s:.2f} s", str(r.steps_lost), r.tier or "?"
            )
        out.print(rec)
    else:
        out.print("no failures or rollbacks")
    if page is not None:
        out.print(f"report: {page}")
    return 0


def _write_page(page: Path, g: Goodput, events: list[dict[str, Any]], log: Path) -> None:
    """Write the page through a temporary file, so a failed write never leaves half a page (or replaces a good one)."""
    from stalwart.telemetry.report_html import render

    text = render(g, events, log)
    if page.is_dir():
        raise ConfigError(f"--html {page} is a directory; give a file name")
    partial = page.with_name(page.name + ".partial")
    try:
        partial.write_text(text, encoding="utf-8")
        partial.replace(page)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise ConfigError(f"cannot write the report page {page}: {exc.strerror or exc}") from exc
