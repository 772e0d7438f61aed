"""`stalwart run`'s command line: torchrun's own parser (every flag and PET_* variable behaves the same) with
stalwart's additions, and the checks that turn a bad combination into one line."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from stalwart.detect.hang import parse_timeout
from stalwart.errors import ConfigError
from stalwart.runtime.args import pointing_to
from stalwart.runtime.env import (
    EVENT_LOG_ENV,
    HANG_TIMEOUT_ENV,
    IN_LOOP_ENV,
    METRICS_PORT_ENV,
    MIRRORS_ENV,
    PREEMPT_NOTICE_ENV,
    QUIET_ENV,
    REFORM_ENV,
    SPARES_ENV,
    WAIT_FOR_REPLACEMENT_ENV,
    WARM_SPARES_ENV,
)
from stalwart.supervisor import preflight_gate, slurm
from stalwart.supervisor.preempt_notice import check_source

_OneLineParser = pointing_to("stalwart run")
DEFAULT_EVENT_LOG = "stalwart-logs/events.jsonl"


DEFAULT_MAX_RESTARTS = 3
"""torchrun's default is 0, which turns any failure into a failed job; a resilience launcher should restart."""


def build_parser() -> argparse.ArgumentParser:
    """torchrun's own parser (so every flag and PET_* variable behaves the same) with stalwart's additions."""
    from torch.distributed.run import get_args_parser

    torch_parser = get_args_parser()
    parser = _OneLineParser(
        prog="stalwart run",
        description="Launch a training script on this node with torchrun's flags; restart workers on failure.",
        parents=[torch_parser],
        add_help=False,
        formatter_class=torch_parser.formatter_class,
    )
    own = parser.add_argument_group("stalwart's own options (the others are torchrun's, as torchrun takes them)")
    own.add_argument(
        "--no-slurm",
        action="store_true",
        help="under Slurm, take nothing from its SLURM_* variables (by default the node count, rendezvous endpoint "
        "and id, and GPUs per node come from the job step when not given; docs/schedulers.md)",
    )
    own.add_argument(
        "--event-log",
        default=os.environ.get(EVENT_LOG_ENV, DEFAULT_EVENT_LOG),
        help=f"JSONL event log shared with the workers (default: ${EVENT_LOG_ENV} or {DEFAULT_EVENT_LOG})",
    )
    own.add_argument(
        "--quiet",
        action="store_true",
        default=os.environ.get(QUIET_ENV, "") not in ("", "0"),
        help="rank 0 prints no start line (what protects the run) and no progress line every log_every steps; "
        f"failures, recoveries and errors are still said (${QUIET_ENV}=1 also does)",
    )
    own.add_argument(
        "--hang-timeout",
        default=os.environ.get(HANG_TIMEOUT_ENV, "auto"),
        help="seconds a worker may go without a heartbeat inside the training loop before it is killed as hung "
        "and the group restarted; 'auto' (default) calibrates it from the step times (3x their 99th percentile, "
        "at least 2 s, with grace for the first steps and waited saves)",
    )
    own.add_argument(
        "--spares",
        type=int,
        default=int(os.environ.get(SPARES_ENV, "0")),
        help="hot spare processes this agent keeps ready (torch imported, started at the lowest CPU priority); a "
        "worker that dies is replaced by a ready spare instead of a new interpreter (default 0)",
    )
    own.add_argument(
        "--warm-spares",
        action="store_true",
        default=os.environ.get(WARM_SPARES_ENV) == "1",
        help="the spares run the script's set-up before they are needed, up to job.steps(), and wait there; a "
        "lost rank's spare then joins with the survivors' state at their next step, whatever the set-up costs "
        "(needs --spares N and re-forming; each node keeps its own). The script must not keep the rank it reads before "
        "job.steps() in objects it does not track (docs/architecture.md)",
    )
    own.add_argument(
        "--no-reform",
        action="store_true",
        default=os.environ.get(REFORM_ENV) == "0",
        help="when a worker fails, end and restart every worker of the node (torchrun's way) instead of keeping "
        "the survivors' processes and re-forming the group with them (default: re-form; ${REFORM_ENV}=0 also "
        "turns it off)".replace("${REFORM_ENV}", REFORM_ENV),
    )
    own.add_argument(
        "--reform-by-rerun",
        action="store_true",
        default=os.environ.get(IN_LOOP_ENV) == "0",
        help="survivors of a failure run the script again in their process instead of re-forming inside their "
        "training loop (the way before in-loop re-forming; ${IN_LOOP_ENV}=0 also does)".replace(
            "${IN_LOOP_ENV}", IN_LOOP_ENV
        ),
    )
    own.add_argument(
        "--wait-for-replacement",
        action="store_true",
        default=os.environ.get(WAIT_FOR_REPLACEMENT_ENV) == "1",
        help="after a failure the survivors wait for the replacement's set-up instead of training on at the smaller "
        "world size meanwhile with the global batch kept (the default); the job then ends bitwise "
        "identical to a run without the failure (${ENV}=1 also does)".replace("${ENV}", WAIT_FOR_REPLACEMENT_ENV),
    )
    own.add_argument(
        "--replace-wait-s",
        type=float,
        default=REPLACE_WAIT_S,
        help="under --nnodes MIN:MAX, seconds the job waits for a lost node's replacement (or a waiting node) "
        "before it goes on with the nodes it has; the first rendezvous keeps torch's wait for late starters "
        f"(default {REPLACE_WAIT_S:g}; docs/schedulers.md)",
    )
    own.add_argument(
        "--mirror",
        action="append",
        metavar="URL",
        help="also keep each committed checkpoint at this location, a path or fsspec URL as checkpoint_dir "
        "(repeatable): the job's Job copies each commit there in the background, verified (a script's own "
        "mirrors= wins; ${ENV}, one per line, also does)".replace("${ENV}", MIRRORS_ENV),
    )
    own.add_argument(
        "--failover-s",
        type=float,
        metavar="S",
        help="with mirrors: seconds a save tries checkpoint_dir before it writes to the first mirror instead "
        "(a script's own failover_s= wins; default 20)",
    )
    preflight_gate.add_arguments(own)
    own.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ[METRICS_PORT_ENV]) if os.environ.get(METRICS_PORT_ENV, "").isdigit() else None,
        help="serve the run's Prometheus metrics on this port (0: any free one; default: off)",
    )
    own.add_argument(
        "--preempt-grace-s",
        type=float,
        default=30.0,
        help="on SIGTERM (a preemption), seconds the workers get to take a last durable checkpoint at an agreed "
        "step and exit, before they are stopped (default 30; 0: stop at once); the launcher then exits 143",
    )
    own.add_argument(
        "--preempt-notice",
        default=os.environ.get(PREEMPT_NOTICE_ENV) or None,
        metavar="SOURCE",
        help="a preemption notice to watch: an http(s) URL of the cloud's metadata service (GCE's "
        ".../instance/preempted, AWS's .../spot/instance-action) or file:PATH; at the notice, the same as SIGTERM",
    )
    own.add_argument(
        "--preload",
        default=None,
        metavar="MODULES",
        help="modules (comma-separated) imported once before the workers are forked, so that no worker and no "
        "replacement imports them again: the script's heavy frameworks (default: $STALWART_PRELOAD, plus the "
        "stalwart integrations the script imports, which bring transformers or lightning; 'none': nothing)",
    )
    own.add_argument(
        "--metrics-addr",
        default="127.0.0.1",
        help="the address the metrics listen on (default 127.0.0.1: this host only)",
    )
    if "PET_MAX_RESTARTS" not in os.environ:
        parser.set_defaults(max_restarts=DEFAULT_MAX_RESTARTS)
    for action in parser._actions:  # torchrun's help of the flag whose default stalwart changes says torchrun's
        if "--max-restarts" in action.option_strings:
            action.help = (
                f"how many times the workers are restarted after failures before the job fails (stalwart's default "
                f"{DEFAULT_MAX_RESTARTS}, or $PET_MAX_RESTARTS; torchrun's is 0)"
            )
    return parser


REPLACE_WAIT_S = 1.0
"""The default of --replace-wait-s. A spare node on the wait list joins the next round at once, whatever this is
(the round completes when the maximum node count is there); the other survivors join within a poll of the
rendezvous (0.05 s per node, supervisor/rendezvous.py), which this leaves time for. A node rebooting, rescheduled by
Kubernetes or Slurm, or an agent started again (its imports alone take seconds) is not worth stalling every other
node for: the job goes on without it and grows back when it joins. It was 5 s until a lost node's agent was known
gone at once (supervisor/lifeline.py); the lost node's keep-alive (6 s) came before it anyway."""

_STATIC_FLAGS = (
    "--rdzv-backend",
    "--rdzv_backend",
    "--master-addr",
    "--master_addr",
    "--master-port",
    "--master_port",
    "--node-rank",
    "--node_rank",
)


_STATIC_ENV = ("PET_RDZV_BACKEND", "PET_MASTER_ADDR", "PET_MASTER_PORT", "PET_NODE_RANK")


def parse(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.scheduler_note = ""
    step = slurm.SlurmStep.from_env(os.environ)
    if step is not None and slurm.applies(_own(argv, args)):
        added = slurm.launch_defaults(step, slurm.given_options(_own(argv, args), os.environ))
        argv = [*added, *argv]
        args = build_parser().parse_args(argv)
        args.scheduler_note = slurm.note(step, added)
    # torchrun defaults to the static backend on a fixed port (29500). stalwart uses c10d unless the user chose
    # a backend or gave torchrun's static flags (--master-addr/--master-port/--node-rank), which keep working.
    chose = any(a.split("=")[0] in _STATIC_FLAGS for a in _own(argv, args)) or any(e in os.environ for e in _STATIC_ENV)
    if not chose:
        args.rdzv_backend = "c10d"
    elif args.rdzv_backend == "static" and str(args.nnodes) in ("1", "1:1"):
        # The static backend makes restarted workers share the agent's store, which keeps the dead round's
        # addresses (the torchrun hang this launcher exists to fix). On one node, rendezvous with c10d on the
        # address and port the user asked for instead; several static nodes keep torchrun's behaviour.
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = args.rdzv_endpoint or f"{args.master_addr}:{args.master_port or 0}"
    _validate(args)
    return args


def _own(argv: list[str], args: argparse.Namespace) -> list[str]:
    """The arguments before the training script: stalwart run's own (those after it are the script's)."""
    return argv[: argv.index(args.training_script) if args.training_script in argv else len(argv)]


def _validate(args: argparse.Namespace) -> None:
    nproc = str(args.nproc_per_node)
    try:
        count: int | None = int(nproc)
    except ValueError:
        count = None
    if count is not None and count < 1:
        raise ConfigError(f"--nproc-per-node must be at least 1, got {nproc}")
    from stalwart.runtime import torch_compat  # torch: imported already, stalwart run's parser is torchrun's

    words = ("cpu", "gpu", "xpu", "auto", torch_compat.custom_device_name())
    if count is None and nproc not in words:  # torchrun's own check: a traceback deep in its launch
        raise ConfigError(f"--nproc-per-node takes a number of processes or {', '.join(words)}; got {nproc!r}")
    if not 0 <= args.preempt_grace_s < float("inf"):
        raise ConfigError(f"--preempt-grace-s must be a number of seconds >= 0, got {args.preempt_grace_s}")
    if args.preempt_notice is not None:
        check_source(args.preempt_notice)
        if args.preempt_grace_s <= 0:
            raise ConfigError("--preempt-notice needs a grace period (--preempt-grace-s > 0) for the last checkpoint")
    try:
        parse_timeout(args.hang_timeout)
    except ValueError as exc:
        raise ConfigError(f"--hang-timeout: {exc}") from exc
    if args.spares < 0:
        raise ConfigError(f"--spares must be >= 0, got {args.spares}")
    if args.spares and args.no_python:
        raise ConfigError(
            "--spares runs Python scripts in pre-started interpreters; it cannot be used with --no-python"
        )
    if args.warm_spares and not args.spares:
        raise ConfigError("--warm-spares needs spares to warm: add --spares N (N >= 1)")
    if args.warm_spares and args.no_reform:
        raise ConfigError("--warm-spares needs re-forming in place (a spare joins the survivors); drop --no-reform")
    if args.spares and _spawned_only(args):
        raise ConfigError(
            f"--spares cannot be combined with {_spawned_only(args)} (workers in pre-started spares "
            "write to the launcher's own stdout and stderr and are not re-bound)"
        )
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if not 0 <= args.replace_wait_s < float("inf"):
        raise ConfigError(f"--replace-wait-s must be a number of seconds >= 0, got {args.replace_wait_s}")
    if args.failover_s is not None and not 0 < args.failover_s < float("inf"):
        raise ConfigError(f"--failover-s must be a positive number of seconds, got {args.failover_s}")
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    if not 0 < min_nodes <= max_nodes:
        raise ConfigError(f"--nnodes must be N or MIN:MAX with 0 < MIN <= MAX, got {args.nnodes}")
    if max_nodes > 1 and args.rdzv_backend != "static" and not args.rdzv_endpoint and not args.standalone:
        raise ConfigError("--nnodes above 1 needs --rdzv-endpoint HOST:PORT reachable from every node")
    script = args.training_script
    if args.module:
        try:
            found = importlib.util.find_spec(script) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ConfigError(f"module {script!r} cannot be found by this Python ({sys.executable})")
    elif args.no_python:
        if not (shutil.which(script) or os.access(script, os.X_OK)):
            raise ConfigError(f"program {script!r} does not exist or is not executable")
    elif not Path(script).is_file():
        raise ConfigError(f"training script {script!r} does not exist")


def _spawned_only(args: argparse.Namespace) -> str:
    """The torchrun options that only processes spawned for the worker can honour (empty if none is set):
    output redirection and filters, NUMA binding. Workers in hosts (spares, re-formed survivors) cannot."""
    used = [
        flag for flag, name in (("--redirects", "redirects"), ("--tee", "tee")) if str(getattr(args, name, "0")) != "0"
    ]
    used += [
        flag
        for flag, name in (
            ("--duplicate-stdout-filters", "duplicate_stdout_filters"),
            ("--duplicate-stderr-filters", "duplicate_stderr_filters"),
            ("--numa-binding", "numa_binding"),
        )
        if getattr(args, name, None)
    ]
    return ", ".join(used)


def in_hosts(args: argparse.Namespace) -> bool:
    """Whether workers run in hosts forked from the zygote (torch imported once, supervisor/zygote.py): Python
    workers without the options only torch elastic's own spawned processes honour. Also under --no-reform, whose
    restarts then start every worker anew without each importing torch again."""
    return not (args.no_python or _spawned_only(args))


def reforms(args: argparse.Namespace) -> bool:
    """Whether survivors re-form in place: needs Python workers in hosts, which cannot redirect their output or
    be NUMA-bound; with those options, or --no-python, a failure restarts every worker as torchrun does."""
    return not (args.no_reform or args.no_python or _spawned_only(args))


def parse_nnodes(text: str) -> tuple[int, int]:
    try:
        parts = [int(p) for p in str(text).split(":")]
    except ValueError as exc:
        raise ConfigError(f"--nnodes must be N or MIN:MAX, got {text}") from exc
    if len(parts) == 1:
        return parts[0], parts[0]
    if len(parts) == 2:
        return parts[0], parts[1]
    raise ConfigError(f"--nnodes must be N or MIN:MAX, got {text}")
