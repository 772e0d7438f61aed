"""`stalwart report RUN`: where a run's wall time went, from its event log (telemetry/goodput.py).

RUN is an event log (`stalwart run --event-log`), or a directory holding one as `events.jsonl` or
`stalwart-logs/events.jsonl` (stalwart run's default). Prints the goodput and its breakdown and one line per
failure or rollback (detection, recovery, steps lost, tier); `--json` prints the same as one object. Works on a
log still being written.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import NoReturn

from rich.table import Table

from stalwart.errors import ConfigError
from stalwart.telemetry.console import console
from stalwart.telemetry.events import read_events
from stalwart.telemetry.goodput import account, breakdown_rows

CANDIDATES = ("events.jsonl", "stalwart-logs/events.jsonl")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


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
    p.add_argument("run", type=Path, help="an event log, or a directory holding events.jsonl")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    log = find_log(args.run)
    events = list(read_events(log))
    if not events:
        raise ConfigError(f"{log} holds no events")
    if not any(e.get("event") in ("launcher_started", "worker_started") for e in events):
        raise ConfigError(f"{log} is not a stalwart event log (no launcher or worker events)")
    g = account(events)
    if args.json:
        print(json.dumps({"log": str(log), "goodput": g.ratio, "wall_s": g.wall_s, "productive_s": g.productive_s,
                          "badput": g.badput, "final_step": g.final_step,
                          "recoveries": [asdict(r) for r in g.recoveries]}))  # fmt: skip
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
            rec.add_row(str(i), r.kind, f"{r.at_s:.1f} s", detection, f"{r.recovery_s:.2f} s", str(r.steps_lost),
                        r.tier or "?")  # fmt: skip
        out.print(rec)
    else:
        out.print("no failures or rollbacks")
    return 0
