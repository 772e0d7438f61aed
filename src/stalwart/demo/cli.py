"""`stalwart demo`: the main job on its embedded defaults.

Trains the demo GPT with 2 CPU ranks under `stalwart run`, SIGKILLs rank 1 at a random step, lets stalwart
recover, then trains the same job without failures and checks that the final parameters are bitwise identical.
"""

from __future__ import annotations

import argparse
import random
import secrets
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from stalwart.demo.runner import JobRun, run_job
from stalwart.errors import ConfigError
from stalwart.runtime.args import pointing_to
from stalwart.telemetry.console import console as make_console

if TYPE_CHECKING:
    from stalwart.demo.summary import Summary

_Parser = pointing_to("stalwart demo")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="stalwart demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="training steps of each run (default 300)")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (default 10)")
    p.add_argument("--seed", type=int, help="seed of the kill step (default: random, printed)")
    p.add_argument("--workdir", help="where the two runs write (default: a new temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (kept anyway with --workdir)")
    p.add_argument("--json", action="store_true", help="end the output with one JSON line of the summary")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per run (default 600)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.steps < 2 * args.checkpoint_every + 2 or args.checkpoint_every < 1:
        raise ConfigError("--steps must leave room for two checkpoints before the end (steps >= 2*every+2)")
    seed = args.seed if args.seed is not None else secrets.randbelow(10**6)
    kill_at = random.Random(seed).randint(args.checkpoint_every + 1, args.steps - args.checkpoint_every - 1)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="stalwart-demo-"))
    if args.workdir and workdir.exists() and any(workdir.iterdir()):
        raise ConfigError(f"--workdir {workdir} is not empty; give a new or empty directory")
    console = make_console(stderr=True)
    console.print(
        Text.assemble(
            ("stalwart demo", "bold"),
            f": GPT on 2 CPU ranks, {args.steps} steps, checkpoint every {args.checkpoint_every}; SIGKILL rank 1 "
            f"at step {kill_at} (seed {seed}); work dir {workdir}",
        )
    )
    try:
        faulty = _run(console, "with a failure", JobRun(workdir / "faulty", args.steps, kill_at=kill_at), args)
        reference = _run(console, "reference, no failure", JobRun(workdir / "reference", args.steps), args)
        from stalwart.demo.summary import summarize  # torch: after the arguments are checked

        summary = summarize(faulty, reference)
    finally:
        if not (args.keep or args.workdir):
            shutil.rmtree(workdir, ignore_errors=True)
    _print(console, summary)
    if args.json:
        print(summary.as_json(), flush=True)
    return 0 if summary.bitwise_identical else 1


def _run(console: Console, title: str, run: JobRun, args: argparse.Namespace) -> JobRun:
    with Progress(
        TextColumn(f"{title:<22}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=not console.is_terminal,
    ) as progress:
        task = progress.add_task(title, total=run.steps)
        last_printed = [0]

        def on_step(step: int) -> None:
            progress.update(task, completed=step)
            if not console.is_terminal and step - last_printed[0] >= 50:
                last_printed[0] = step
                console.print(f"  {title}: step {step}/{run.steps}")

        run_job(
            run,
            nproc=2,
            checkpoint_every=args.checkpoint_every,
            timeout_s=args.timeout,
            on_step=on_step,
            spares=2 if run.kill_at is not None else 0,  # the faulty run recovers into hot spares
        )
    if run.exitcode != 0:
        tail = run.log.read_text(errors="replace").splitlines()[-15:]
        sys.stderr.write("\n".join(tail) + "\n")
        raise ConfigError(f"the demo job ({title}) exited with status {run.exitcode}; its log: {run.log}")
    console.print(f"  {title}: done in {run.seconds:.1f} s")
    return run


def _print(console: Console, s: Summary) -> None:
    table = Table(title="stalwart demo summary", show_header=False)
    table.add_row("failures (worker SIGKILLed)", str(s.failures))
    table.add_row("killed after step", str(s.kill_step))
    table.add_row("resumed at step", f"{s.resumed_from} (from {s.resumed_tier or 'n/a'})")
    table.add_row("restarted into hot spares", "yes" if s.into_spares else "no")
    table.add_row("steps lost", str(s.steps_lost))
    k2s = f"{s.kill_to_step_s:.2f} s" if s.kill_to_step_s is not None else "n/a"
    table.add_row("kill to next completed step", k2s)
    table.add_row("final validation loss", f"{s.final_loss:.4f}")
    table.add_row("run with failure / reference", f"{s.faulty_run_s:.1f} s / {s.reference_run_s:.1f} s")
    verdict = Text("yes", style="green") if s.bitwise_identical else Text("NO", style="red")
    table.add_row("final parameters bitwise identical", verdict)
    make_console().print(table)
