"""`stalwart chaos`: run a job under faults and check that it ends where a run without them ends.

    stalwart chaos SCENARIO.toml -- train.py --ckpt ckpt ...   # your job, your scenario (chaos/scenario.py)
    stalwart chaos --suite quick                               # every fault type on the built-in job, < 5 min

Each run happens in its own directory under `--workdir` (the job's relative paths land there): `reference/` (no
faults; once, and reused by every scenario) and one per scenario. Per scenario it prints whether the run ended
well, whether every committed checkpoint verifies and whether the final checkpoint is bitwise the reference's,
then each failure's detection, time to the next step, steps lost and tier (telemetry/goodput.py). Exit status:
0 when every scenario passed, 1 when one did not, 2 for bad input.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from stalwart.chaos import harness, netns
from stalwart.chaos.scenario import FaultSpec, Scenario, load
from stalwart.errors import ConfigError
from stalwart.runtime.args import Parser
from stalwart.telemetry.console import console
from stalwart.telemetry.events import read_events
from stalwart.telemetry.goodput import account

TINY_JOB = ["-m", "stalwart.chaos.tiny_job", "--ckpt", "ckpt", "--steps", "80"]


def quick_suite(say: Any = None) -> list[Scenario]:
    """Every fault type once, and the compound cases, on the built-in job (80 steps, checkpoints every 10). The
    network partition needs root (network namespaces): without, it is left out and `say` is told why."""

    def s(name: str, *faults: FaultSpec, expect: str = "identical", require: tuple[str, ...] = ()) -> Scenario:
        return Scenario(name, faults, expect=expect, timeout_s=240, require_events=require)

    why = netns.available()
    if why is not None and say is not None:
        say(f"partition, shrink_and_grow: left out ({why})")
    partition: list[Scenario] = []
    if why is None:
        partition.append(
            Scenario(
                "partition",
                (FaultSpec("partition", step=30, options={"host": 1, "duration_s": 3.0}),),
                nproc_per_node=1,
                hosts=2,
                timeout_s=240,
            )
        )
        # shrink_and_grow: host 1 lost for good, the job goes on at 2 of 4 ranks, then grows back when it is launched
        # again. Both recoveries must take the survivors' live state, which needs light snapshots on when they
        # happen. Fixed so, whatever the load: after 10 steps at 2 ranks the job waits for the grow (tiny_job
        # --grow-to; add_node's step, 30, must not come after that wait's, at least 20 + 10), before its first
        # judgment of their cost at 2 ranks (after policy/snapshot.LIGHT_SAMPLES of them). Without the wait, a host
        # slow to start left the job at 2 ranks for 120 steps, time enough for a judgment under load to turn them
        # off, and the grow took the durable checkpoint. Their budget of 0.5 keeps them at 4 ranks too, where the
        # commit point's barrier crosses the hosts' link, should the loss come after their first judgment there.
        # At 4 ranks a rank's loss is of 2 samples: noisy.
        lose_and_add = (
            FaultSpec("lose_node", step=20, options={"host": 1}),
            FaultSpec("add_node", step=30, options={"host": 1}),
        )
        grow_args = ("--grow-to", "4", "--grow-wait-after", "10")
        job_args = ("--steps", "100", "--loss-spike", "warn", "--light-budget", "0.5", *grow_args)
        partition.append(
            Scenario(
                "shrink_and_grow",
                lose_and_add,
                nproc_per_node=2,
                hosts=2,
                timeout_s=240,
                expect="completes",
                require_events=("world_resized",),
                job_args=job_args,
            )
        )
    return [
        s("kill", FaultSpec("kill", rank=1, step=20)),
        s("hang", FaultSpec("stop", rank=0, step=20)),
        s("slow_rank", FaultSpec("slow", rank=1, step=5, options={"ms": 10})),
        s("nan_batch", FaultSpec("nan", rank=1, step=25), expect="completes"),
        s("loss_spike", FaultSpec("spike", rank=0, step=30, options={"factor": 1000}), expect="completes"),
        s("bit_flip", FaultSpec("flip", rank=1, step=23)),
        s("storage_full", FaultSpec("storage_error", rank=0, step=20, options={"errno": "ENOSPC", "times": 2})),
        s("kill_in_save", FaultSpec("kill_in_save", rank=1, step=30)),
        s("kill_node", FaultSpec("kill_node", step=35)),
        s("corrupt_checkpoint", FaultSpec("corrupt_checkpoint", step=45)),
        s("preemption", FaultSpec("preempt", step=25)),
        # GPU faults at a step, not a time: a time races with the workers' start under load (chaos/scenario.py).
        s("gpu_warning", FaultSpec("gpu_warning", step=15, options={"gpu": 1}), require=("risk_checkpoint",)),
        s("gpu_xid_13", FaultSpec("gpu_xid", step=15, options={"gpu": 1, "xid": 13}), require=("gpu_action",)),
        s("stop_and_kill", FaultSpec("stop", rank=0, step=20), FaultSpec("kill", rank=1, step=20)),
        s(
            "kill_during_recovery",
            FaultSpec("kill", rank=1, step=20),
            FaultSpec("kill", rank=0, step=20, options={"restart": 1}),
        ),
        # The checkpoint directory down from step 5 until step 35 (saves 10-30 commit in the mirror and it is
        # caught up afterwards), and lost with every host once a checkpoint reached the mirror (chaos/store_faults.py).
        Scenario(
            "store_outage",
            (FaultSpec("store_outage", step=5, options={"until_step": 35}),),
            timeout_s=240,
            launcher_args=("--mirror", "mirror", "--failover-s", "0.2"),
            require_events=("checkpoint_failover", "mirror_caught_up"),
        ),
        Scenario(
            "region_loss",
            (FaultSpec("region_loss", step=45),),
            timeout_s=240,
            launcher_args=("--mirror", "mirror"),
            require_events=("mirrored",),
        ),
        *partition,
    ]


STEP_S = 0.03
"""About how long a step of the built-in job takes here (25 ms of stand-in compute and the rest): --minutes
becomes a step count with it."""


def soak_suite(minutes: float) -> tuple[list[Scenario], list[str]]:
    """Poisson faults on the built-in job for about `minutes` (kills of either rank, a hang, a lost node; one fault
    every 36 s on average), with the job sized to run that long without faults; and that job."""
    steps = max(100, int(minutes * 60 / STEP_S))
    faults = (
        FaultSpec("kill", rank=1, mtbf_s=90),
        FaultSpec("kill", rank=0, mtbf_s=120),
        FaultSpec("stop", rank=1, mtbf_s=180),
        FaultSpec("kill_node", mtbf_s=360),
    )
    scenario = Scenario("soak", faults, timeout_s=minutes * 60 * 4 + 300, seed=int(minutes * 1000) % 997)
    return [scenario], ["-m", "stalwart.chaos.tiny_job", "--ckpt", "ckpt", "--steps", str(steps)]


@dataclass(slots=True)
class Outcome:
    scenario: str
    faults: list[str]
    passed: bool
    exit_code: int | None
    seconds: float
    checkpoints_ok: bool
    identical: bool | None
    problems: list[str] = field(default_factory=list)
    goodput: float = 0.0
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    sent: list[str] = field(default_factory=list)


_Parser = Parser


def main(argv: list[str]) -> int:
    options, job = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = _Parser(prog="stalwart chaos", description="Run a job under faults; check it ends as without them.")
    p.add_argument("scenario", nargs="?", type=Path, help="a scenario file (TOML); or --suite")
    p.add_argument(
        "--suite",
        choices=("quick", "soak"),
        help="built-in scenarios: quick (every fault type, < 5 min), soak (Poisson faults, --minutes)",
    )
    p.add_argument("--minutes", type=float, default=10.0, help="--suite soak: about how long (default 10)")
    p.add_argument("--workdir", type=Path, default=None, help="where the runs go (default: a new temporary dir)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(options)
    if (args.scenario is None) == (args.suite is None):
        raise ConfigError("give a scenario file or --suite quick")
    if args.suite and job:
        raise ConfigError("--suite runs the built-in job; give your own job with a scenario file")
    if not 0 < args.minutes < 10_000:
        raise ConfigError(f"--minutes must be a positive number, got {args.minutes}")
    out = console(stderr=True)
    say = (lambda line: out.print(f"[chaos] {line}")) if not args.json else (lambda line: None)
    notes: list[str] = []  # what a suite left out, and why
    if args.suite == "soak":
        scenarios, job = soak_suite(args.minutes)
    else:
        scenarios = quick_suite(notes.append) if args.suite else [load(args.scenario)]
        for line in notes:
            say(line)
        job = job or TINY_JOB
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="stalwart-chaos-"))
    first = scenarios[0]
    say(f"reference run (no faults) in {workdir / 'reference'}")
    reference = harness.run_job(
        None,
        job,
        workdir / "reference",
        say,
        timeout_s=first.timeout_s,
        nproc=first.world_size,
        max_restarts=first.max_restarts,
        launcher_args=first.launcher_args,
    )
    if reference.exit_code != 0:
        raise ConfigError(
            f"the reference run (no faults) failed with status {reference.exit_code}; see "
            f"{reference.directory / 'output.log'}"
        )
    outcomes = []
    for scenario in scenarios:
        say(f"{scenario.name}: {'; '.join(f.label for f in scenario.faults)}")
        outcome = run_scenario(scenario, job, workdir, say)
        outcomes.append(outcome)
        say(
            f"{scenario.name}: {'passed' if outcome.passed else 'FAILED: ' + '; '.join(outcome.problems)} "
            f"({outcome.seconds:.1f} s)"
        )
    passed = all(o.passed for o in outcomes)
    if args.json:
        print(
            json.dumps(
                {"workdir": str(workdir), "passed": passed, "notes": notes, "scenarios": [asdict(o) for o in outcomes]}
            )
        )
    else:
        _print(outcomes, workdir)
    return 0 if passed else 1


def run_scenario(scenario: Scenario, job: list[str], workdir: Path, say: Any) -> Outcome:
    result = harness.run_job(
        scenario,
        [*job, *scenario.job_args],
        workdir / scenario.name,
        say,
        timeout_s=scenario.timeout_s,
        nproc=scenario.nproc_per_node,
        max_restarts=scenario.max_restarts,
        launcher_args=scenario.launcher_args,
        hosts=scenario.hosts,
    )
    problems: list[str] = []
    if result.exit_code is None:
        problems.append(f"did not finish within {scenario.timeout_s:g} s")
    elif result.exit_code != 0:
        problems.append(f"stalwart run exited with status {result.exit_code}")
    from stalwart.chaos import verdict  # torch: after the arguments are checked

    ckpt = result.directory / scenario.checkpoint_dir
    bad = verdict.verify_checkpoints(ckpt)
    problems += bad
    identical = None
    if scenario.expect == "identical" and result.exit_code == 0:
        differ = verdict.compare_final(ckpt, workdir / "reference" / scenario.checkpoint_dir)
        identical = not differ
        problems += differ
    events = list(read_events(result.log))
    seen = {e.get("event") for e in events}
    problems += [f"no {name} event" for name in scenario.require_events if name not in seen]
    g = account(events)
    return Outcome(
        scenario.name,
        [f.label for f in scenario.faults],
        not problems,
        result.exit_code,
        round(result.seconds, 2),
        not bad,
        identical,
        problems,
        round(g.ratio, 4),
        [asdict(r) for r in g.recoveries],
        result.sent,
    )


def _print(outcomes: list[Outcome], workdir: Path) -> None:
    out = console()
    table = Table(title=f"chaos: {sum(o.passed for o in outcomes)} of {len(outcomes)} scenarios passed")
    for column in (
        "scenario",
        "faults",
        "result",
        "bitwise",
        "goodput",
        "recoveries: detection / to next step / steps lost / state from",
    ):
        wraps = column.startswith(("faults", "recoveries"))  # long ones fold; the short ones keep their width
        table.add_column(column, no_wrap=not wraps, min_width=None if wraps else len(column))
    for o in outcomes:
        recoveries = (
            ", ".join(
                f"{r['kind']} {_s(r['detection_s'])} / {_s(r['recovery_s'])} / {r['steps_lost']} / {r['tier'] or '?'}"
                for r in o.recoveries
            )
            or "none"
        )
        bitwise = "yes" if o.identical else "-" if o.identical is None else "NO"
        table.add_row(
            o.scenario,
            "; ".join(o.faults),
            "passed" if o.passed else "FAILED",
            bitwise,
            f"{100 * o.goodput:.0f}%",
            recoveries,
        )
    out.print(table)
    for o in outcomes:
        for problem in o.problems:
            out.print(f"{o.scenario}: {problem}")
    out.print(f"{sum(o.seconds for o in outcomes):.0f} s of runs; each run's output.log and events.jsonl: {workdir}")


def _s(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds:.2f} s"
