"""Entry of `stalwart run`: parse, launch, map errors to one line and an exit status."""

from __future__ import annotations

import sys
import time

from stalwart.supervisor import launcher, run_args


def say(message: str) -> None:
    sys.stderr.write(f"[stalwart run {time.strftime('%H:%M:%S')}] {message}\n")
    sys.stderr.flush()


def main(argv: list[str]) -> int:
    args = run_args.parse(argv)
    if args.scheduler_note:
        say(args.scheduler_note)
    return launcher.launch(args, say)
