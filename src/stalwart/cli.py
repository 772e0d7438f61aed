"""The `stalwart` command: one subcommand per job a user has (run, demo, ckpt, bench)."""

from __future__ import annotations

import sys
from collections.abc import Callable

from stalwart.errors import EXIT_USER_ERROR, ConfigError, StalwartError

USAGE = """usage: stalwart <command> [options]

commands:
  run      launch a training script with torchrun's flags; restart workers on failure
  demo     train a small GPT on 2 CPU ranks, kill a worker, recover, and compare with a clean run
  ckpt     list, verify, inspect or export a checkpoint directory; sync it to a mirror
  nodes    the node exclusion list: 'nodes list', 'nodes clear [HOST]' (a node the GPU playbook took out)
  preflight  check this node: matmul throughput, a memory pattern test, an all-reduce among its devices
  report   where a run's wall time went: goodput, its breakdown, each failure's detection and recovery
  chaos    run a job under faults (a scenario file, or --suite quick) and check it ends as without them
  sim      simulate failures of a job far larger than this machine: ETTR, lost time, spares, cost
  bench    measure on this machine: 'bench checkpoint' compares stalwart with torch.save and DCP,
           'bench recovery' with torchrun (and torchft when installed), 'bench handover', 'bench overhead',
           'bench reshard'
  version  print stalwart's version (also --version, -V)

'stalwart <command> --help' describes each command."""


def _version(argv: list[str]) -> int:
    from importlib.metadata import version

    print(f"stalwart {version('stalwart')}")
    return 0


def _run(argv: list[str]) -> int:
    from stalwart.supervisor.cli import main

    return main(argv)


def _demo(argv: list[str]) -> int:
    from stalwart.demo.cli import main

    return main(argv)


def _ckpt(argv: list[str]) -> int:
    from stalwart.checkpoint.tools.cli import main

    return main(argv)


def _nodes(argv: list[str]) -> int:
    from stalwart.supervisor.nodes_cli import main

    return main(argv)


def _preflight(argv: list[str]) -> int:
    from stalwart.supervisor.preflight_gate import main

    return main(argv)


def _report(argv: list[str]) -> int:
    from stalwart.telemetry.report_cli import main

    return main(argv)


def _chaos(argv: list[str]) -> int:
    from stalwart.chaos.cli import main

    return main(argv)


def _sim(argv: list[str]) -> int:
    from stalwart.sim.cli import main

    return main(argv)


def _bench(argv: list[str]) -> int:
    from stalwart.bench.cli import main

    return main(argv)


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "run": _run,
    "demo": _demo,
    "ckpt": _ckpt,
    "nodes": _nodes,
    "preflight": _preflight,
    "report": _report,
    "chaos": _chaos,
    "sim": _sim,
    "bench": _bench,
    "version": _version,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name in ("--version", "-V"):
        name = "version"
    command = COMMANDS.get(name)
    if command is None:
        print(f"stalwart: error: unknown command {name!r} (commands: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    try:
        return command(rest)
    except ConfigError as exc:
        print(f"stalwart {name}: error: {exc}", file=sys.stderr)
        return 2
    except StalwartError as exc:
        print(f"stalwart {name}: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"stalwart {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
