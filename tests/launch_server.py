"""The tests' launch server: supervisor/launch_server.py's, serving every `stalwart` command the tests start
(conftest.Launch, conftest.stalwart), not `stalwart run` alone, and scripts run as `python SCRIPT ARGS...` would
(conftest.served_script).

Why: a `stalwart run` started as a new interpreter spends about 4.6 s of CPU importing torch (the launcher) and the
training side (its zygote) before it does anything (torch 2.13.0 on the 2-core VM, 2026-11-28), and the suite
starts a few hundred of them on two cores; its other commands pay the import of torch as well. The real entry point
(`python -m stalwart ...`) keeps its own tests: everything started through `spawn` or `subprocess` (the leftovers,
the demo, Slurm, the import tests) and every launch with a prefix (network namespaces).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

# The S3 backend's libraries, imported once here (they start no thread) as `stalwart run`'s own server imports what
# its forks all need: every command and launcher that touches an s3:// URL imports them at first use, 1.2-1.3 s of
# CPU each (2-core VM, 2026-11-30), and one test alone runs nine `stalwart ckpt` commands on a bucket.
import s3fs  # noqa: F401

from stalwart.cli import main
from stalwart.supervisor import cli as _run_cli  # noqa: F401 - imported once, before the forks
from stalwart.supervisor import launch_server


def _any_command(argv: list[str]) -> int:
    """`stalwart <argv>`, or `python SCRIPT ARGS...` for `--script SCRIPT ARGS...` (conftest.served_script)."""
    if argv[:1] != ["--script"]:
        return main(argv)
    sys.argv, sys.path[0] = argv[1:], str(Path(argv[1]).parent)
    runpy.run_path(argv[1], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(launch_server.main(_any_command))
