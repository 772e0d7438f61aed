"""`stalwart sim`: what failures cost a training job of N GPUs over D days, under stalwart and without it.

    stalwart sim --gpus 16384 --days 54                 # the Llama 3 setup: every policy, both systems, spares
    stalwart sim --gpus 100000 --days 30 --policy adaptive --profile stalwart --spares 64 --json
    stalwart sim --validate                             # the comparisons with published figures
    stalwart sim --regions                              # and regional outages: single region, mirror, standby

Prints one row per (system, policy): ETTR (mean and the 5-95% range over the runs), interruptions, where the
lost time went, GPU-hours and money; with `--spares auto` (the default) first the number of spare nodes that
minimises the cost per useful GPU-hour under stalwart's adaptive policy, then every row with that many. With
`--regions` (or any flag of its group), then one row per way through a regional outage (sim/regions.py) and the
outage rate at which a mirror, and a standby, pays for itself.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from rich.table import Table

from stalwart.errors import ConfigError
from stalwart.runtime.args import Parser
from stalwart.sim.engine import BADPUT, POLICIES, Policy, Result, SimJob, simulate
from stalwart.sim.failures import MODELS, FailureModel
from stalwart.sim.outages import Regions
from stalwart.sim.profiles import PROFILES, load_costs
from stalwart.sim.regions import Prices, Study, study
from stalwart.telemetry.console import console

SPARE_CHOICES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


_Parser = Parser


def _positive(kind: type, name: str, *, zero: bool = False) -> Any:
    """A parser of positive numbers (`zero`: or zero) whose error names the flag."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not (value >= 0 if zero else value > 0) or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{name} must be {'>= 0' if zero else 'positive'}, got {text}")
        return value

    return parse


REGION_FLAGS = (  # flag, type, zero allowed, the field of Regions or Prices it sets, help
    ("--region-outages-per-year", float, True, "outages_per_year", "outages of the job's region a year"),
    ("--region-outage-hours", float, False, "outage_hours", "mean hours an outage lasts (exponential)"),
    ("--failover-queue-hours", float, True, "failover_queue_hours", "hours to get the job's capacity elsewhere"),
    ("--failover-startup-s", float, True, "startup_s", "a cold start of the whole job, seconds"),
    ("--checkpoint-gb", float, False, "checkpoint_gb", "one checkpoint's size in GB"),
    ("--cross-region-gbps", float, False, "cross_region_gbps", "Gbit/s between regions, copies and reads"),
    ("--storage-price-gb-month", float, True, "storage_gb_month", "money per GB-month stored"),
    ("--transfer-price-gb", float, True, "transfer_gb", "money per GB sent across regions"),
    ("--standby-fraction", float, True, "standby_fraction", "the standby's cost as a share of the GPU-hours"),
    ("--keep-last", int, False, "keep_last", "checkpoints kept in each location"),
)


def _add_region_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("regions", "regional outages (docs/simulation.md); any of these implies --regions")
    group.add_argument("--regions", action="store_true", help="add the study of regional outages")
    defaults = {**asdict(Regions()), **asdict(Prices())}
    for flag, kind, zero, field, text in REGION_FLAGS:
        parse = _positive(kind, flag, zero=zero)
        group.add_argument(
            flag, type=parse, default=None, dest=field, metavar="N", help=f"{text} (default {defaults[field]:g})"
        )


def _regions(args: argparse.Namespace) -> tuple[Regions, Prices] | None:
    given = {field: getattr(args, field) for *_, field, _ in REGION_FLAGS if getattr(args, field) is not None}
    if not (args.regions or given):
        return None
    prices = {
        k: given.pop(k) for k in ("storage_gb_month", "transfer_gb", "standby_fraction", "keep_last") if k in given
    }
    return Regions(**given), Prices(**prices)


def main(argv: list[str]) -> int:
    p = _Parser(prog="stalwart sim", description="Simulate failures of a large training job and what they cost.")
    p.add_argument("--gpus", type=_positive(int, "--gpus"), default=16384, help="GPUs in the job (default 16384)")
    p.add_argument("--days", type=_positive(float, "--days"), default=54.0, help="wall-clock days (default 54)")
    p.add_argument("--gpus-per-node", type=_positive(int, "--gpus-per-node"), default=8)
    p.add_argument(
        "--failure-model",
        choices=MODELS,
        default="llama3",
        help="llama3: Llama 3's 419 interruptions in 54 days on 16,384 GPUs and their causes; rsc1, "
        "rsc2: node failure rates of Meta's research clusters (Kokolis et al.)",
    )
    p.add_argument(
        "--weibull-shape",
        type=_positive(float, "--weibull-shape"),
        default=None,
        help="Weibull inter-failure times per node with this shape (default: exponential)",
    )
    p.add_argument("--policy", choices=(*POLICIES, "all"), default="all")
    p.add_argument("--profile", choices=(*PROFILES, "all"), default="all", help="which system's recovery costs")
    p.add_argument("--costs", type=Path, default=None, help="JSON of profile fields (seconds) replacing stalwart's")
    p.add_argument(
        "--checkpoint-interval-s",
        type=_positive(float, "--checkpoint-interval-s"),
        default=1800.0,
        help="the fixed policy's durable checkpoint interval (default 1800)",
    )
    p.add_argument("--spares", default="auto", help="spare nodes, or auto: the count with the lowest cost")
    p.add_argument("--price", type=_positive(float, "--price"), default=2.0, help="money per GPU-hour (default 2.0)")
    p.add_argument("--runs", type=_positive(int, "--runs"), default=64, help="independent runs (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=Path, default=None, help="write a PNG or SVG figure of the results")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--validate", action="store_true", help="compare with published figures (docs/simulation.md)")
    _add_region_flags(p)
    args = p.parse_args(argv)
    if args.validate:
        from stalwart.sim.validate import main as validate

        return validate(args.json)
    started = time.perf_counter()
    model = FailureModel.named(args.failure_model, args.weibull_shape)
    profiles = dict(PROFILES)
    if args.costs is not None:
        profiles["stalwart"] = load_costs(profiles["stalwart"], args.costs)
    chosen = list(profiles) if args.profile == "all" else [args.profile]
    policies = list(POLICIES) if args.policy == "all" else [args.policy]
    base = SimJob(args.gpus, args.days, gpus_per_node=args.gpus_per_node, price_per_gpu_hour=args.price)
    fixed = Policy("fixed", checkpoint_interval_s=args.checkpoint_interval_s)

    def run(profile: str, policy: str, spares: int) -> Result:
        pol = fixed if policy == "fixed" else Policy(policy)
        return simulate(replace(base, spares=spares), model, profiles[profile], pol, runs=args.runs, seed=args.seed)

    sweep: list[Result] = []
    # The spares sweep and the regions study: stalwart's adaptive policy, or the first of those chosen.
    main_profile = "stalwart" if "stalwart" in chosen else chosen[0]
    main_policy = "adaptive" if "adaptive" in policies else policies[0]
    if args.spares == "auto":
        sweep = [run(main_profile, main_policy, s) for s in SPARE_CHOICES]
        spares = min(sweep, key=lambda r: r.cost_per_useful_gpu_hour).spares
    else:
        try:
            spares = int(args.spares)
        except ValueError:
            raise ConfigError(f"--spares must be a number of nodes or auto, got {args.spares!r}") from None
        if spares < 0:
            raise ConfigError(f"--spares must be >= 0, got {spares}")
    results = [run(prof, pol, spares) for prof in chosen for pol in policies]
    regional: Study | None = None
    if (asked := _regions(args)) is not None:
        pol = fixed if main_policy == "fixed" else Policy(main_policy)
        job = replace(base, spares=spares)
        regional = study(job, model, profiles[main_profile], pol, *asked, runs=args.runs, seed=args.seed)
    seconds = time.perf_counter() - started
    if args.plot is not None:
        from stalwart.sim.plot import write

        write(args.plot, results, sweep)
    if args.json:
        print(
            json.dumps(
                {
                    "gpus": args.gpus,
                    "days": args.days,
                    "failure_model": args.failure_model,
                    "weibull_shape": args.weibull_shape,
                    "job_mtbf_h": model.job_mtbf_s(args.gpus) / 3600,
                    "spares": spares,
                    "seconds": round(seconds, 3),
                    "profiles": {name: asdict(profiles[name]) for name in chosen},
                    "results": [asdict(r) for r in results],
                    "spares_sweep": [
                        {
                            "spares": r.spares,
                            "ettr": r.ettr,
                            "cost": r.cost,
                            "cost_per_useful_gpu_hour": r.cost_per_useful_gpu_hour,
                        }
                        for r in sweep
                    ],
                    "plot": str(args.plot) if args.plot else None,
                    **({"regions": asdict(regional)} if regional is not None else {}),
                }
            )
        )
        return 0
    _print(results, sweep, model, args, spares, seconds)
    if regional is not None:
        _print_regions(regional, args.price)
    return 0


def _print(
    results: list[Result],
    sweep: list[Result],
    model: FailureModel,
    args: argparse.Namespace,
    spares: int,
    seconds: float,
) -> None:
    out = console()
    shape = f"Weibull k={args.weibull_shape:g}" if args.weibull_shape else "exponential"
    out.print(
        f"{args.gpus:,} GPUs for {args.days:g} days, failure model {args.failure_model} ({shape}): job MTBF "
        f"{model.job_mtbf_s(args.gpus) / 3600:.2f} h; {args.runs} runs, seed {args.seed}"
    )
    if sweep:
        table = Table(title=f"spare nodes ({sweep[0].profile}, {sweep[0].policy} policy)")
        for column in ("spares", "ETTR", "waiting for a node", "GPU-hours", "cost per useful GPU-hour"):
            table.add_column(column, justify="right", no_wrap=True)
        for r in sweep:
            mark = " <" if r.spares == spares else ""
            table.add_row(
                str(r.spares),
                f"{100 * r.ettr:.2f}%",
                f"{100 * r.badput['waiting_for_node']:.2f}%",
                f"{r.gpu_hours:,.0f}",
                f"{r.cost_per_useful_gpu_hour:.4f}{mark}",
            )
        out.print(table)
    table = Table(title=f"{spares} spare nodes")
    columns = (
        "system",
        "policy",
        "ETTR",
        "5-95%",
        "interruptions",
        "checkpoint every",
        *[b.replace("_", " ") for b in BADPUT],
        "cost",
    )
    for column in columns:
        table.add_column(column, justify="left" if column in ("system", "policy") else "right", no_wrap=True)
    for r in results:
        every = f"{r.checkpoint_interval_s:.0f} s" + (
            f" / {r.snapshot_interval_s:.0f} s" if r.snapshot_interval_s else ""
        )
        table.add_row(
            r.profile,
            r.policy,
            f"{100 * r.ettr:.2f}%",
            f"{100 * r.ettr_p05:.1f}-{100 * r.ettr_p95:.1f}%",
            f"{r.interruptions:.0f}",
            every,
            *[f"{100 * r.badput[b]:.2f}%" for b in BADPUT],
            f"{r.cost:,.0f}",
        )
    out.print(table)
    out.print(
        f"checkpoint every: durable / memory snapshot (seconds of work). Cost at {args.price:g} per GPU-hour, "
        f"spares included. {seconds:.2f} s."
    )


def _print_regions(s: Study, price: float) -> None:
    r = s.regions
    out = console()
    table = Table(
        title=f"regional outages: {r['outages_per_year']:g} a year, {r['outage_hours']:g} h on average "
        f"({s.profile}, {s.policy} policy, {s.spares} spare nodes)"
    )
    columns = (
        *("choice", "ETTR", "5-95%", "outages", "failed over", "down per outage", "work lost per outage"),
        *("storage", "transfer", "standby", "cost per useful GPU-hour", "5-95% "),
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "choice" else "right", no_wrap=True)
    for c in s.choices:
        table.add_row(
            c.choice,
            f"{100 * c.ettr:.2f}%",
            f"{100 * c.ettr_p05:.1f}-{100 * c.ettr_p95:.1f}%",
            f"{c.outages:.2f}",
            f"{c.failovers:.2f}",
            f"{c.hours_down_per_outage:.2f} h",
            f"{c.work_lost_per_outage_h:.2f} h",
            f"{c.storage_cost:,.0f}",
            f"{c.transfer_cost:,.0f}",
            f"{c.standby_cost:,.0f}",
            f"{c.cost_per_useful_gpu_hour:.4f}",
            f"{c.cost_per_useful_p05:.4f}-{c.cost_per_useful_p95:.4f}",
        )
    out.print(table)
    copy_s = r["checkpoint_gb"] * 8 / r["cross_region_gbps"]
    out.print(
        f"A checkpoint of {r['checkpoint_gb']:,.0f} GB, {s.prices['keep_last']} kept in each location, copied or "
        f"read across regions in {copy_s:.0f} s at {r['cross_region_gbps']:g} Gbit/s; a failover queues "
        f"{r['failover_queue_hours']:g} h for capacity (none with the standby) and starts in "
        f"{r['startup_s']:g} s. Prices: {price:g} per GPU-hour, {s.prices['storage_gb_month']:g} per GB-month, "
        f"{s.prices['transfer_gb']:g} per GB across regions, the standby {s.prices['standby_fraction']:g} of the "
        "GPU-hours."
    )
    for b in s.break_even:
        if b.per_year is None:
            out.print(f"{b.choice} does not pay for itself below {b.below:g} regional outages a year.")
        else:
            out.print(
                f"{b.choice} pays for itself above {b.per_year:.1f} regional outages a year (it costs more per useful "
                f"GPU-hour than single at {b.below:.1f}, less at {b.above:.1f})."
            )
