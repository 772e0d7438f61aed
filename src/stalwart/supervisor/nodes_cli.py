"""`stalwart nodes list|clear [HOST]`: read and clear the node exclusion list (supervisor/exclusion.py)."""

from __future__ import annotations

import json

from stalwart.runtime.args import Parser
from stalwart.supervisor import exclusion

_Parser = Parser


def main(argv: list[str]) -> int:
    p = _Parser(prog="stalwart nodes", description="The nodes stalwart run refuses to start on, and why.")
    sub = p.add_subparsers(dest="what", required=True)
    listing = sub.add_parser("list", help="print the excluded nodes")
    listing.add_argument("--json", action="store_true")
    clearing = sub.add_parser("clear", help="let a node (default: this one) take work again")
    clearing.add_argument("host", nargs="?", help="default: this host")
    args = p.parse_args(argv)
    path = exclusion.exclusion_file()
    if args.what == "clear":
        host = args.host or exclusion.this_host()
        if not exclusion.clear(host):
            print(f"{host} is not excluded ({path})")
            return 0
        print(f"{host} may take work again ({path})")
        return 0
    nodes = exclusion.listed()
    if args.json:
        print(json.dumps([_as_dict(e) for e in nodes]))
        return 0
    if not nodes:
        print(f"no node is excluded ({path})")
    for e in nodes:
        print(f"{e.host}: {e.reason} ({e.action}, since {e.time})")
        print("  to keep the scheduler off it too: " + "  or  ".join(exclusion.scheduler_commands(e)))
    return 0


def _as_dict(e: exclusion.Exclusion) -> dict[str, object]:
    return {
        "host": e.host,
        "reason": e.reason,
        "action": e.action,
        "time": e.time,
        "suggested": exclusion.scheduler_commands(e),
    }
