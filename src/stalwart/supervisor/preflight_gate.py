"""Running the pre-flight node check (detect/preflight.py): before `stalwart run` lets this node join, and by hand
as `stalwart preflight`.

`stalwart run --preflight auto|on|off` (default auto: on when NVML sees a GPU, so a GPU node is checked before
every launch and a CPU-only run pays nothing). The check runs in a child process (the agent must not hold a CUDA
context), one device after another and then an all-reduce among `--nproc-per-node` processes. A node that fails
goes on the exclusion list with the reason (supervisor/exclusion.py) and the launch stops with one line and
exit status 2: the rendezvous forms without it, and `stalwart run` refuses it until `stalwart nodes clear`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from stalwart.detect import preflight_limits
from stalwart.detect.gpu_providers import nvml_device_count
from stalwart.errors import ConfigError
from stalwart.runtime.args import Parser
from stalwart.runtime.env import PREFLIGHT_ENV
from stalwart.runtime.process import start_module
from stalwart.supervisor import exclusion
from stalwart.supervisor.peer_check import PAYLOAD_MB, PeerCheck, route_address
from stalwart.telemetry.events import EventLog

MODES = ("auto", "on", "off")
TIMEOUT_S = 600.0


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`stalwart run`'s pre-flight flags."""
    parser.add_argument(
        "--preflight",
        choices=MODES,
        default=os.environ.get(PREFLIGHT_ENV, "auto"),
        help="check this node before it joins (matmul throughput, a memory pattern test, an all-reduce among its "
        "devices); a node that fails is excluded; auto (default): when NVML sees a GPU",
    )
    parser.add_argument(
        "--preflight-min-tflops",
        type=float,
        default=None,
        help="pre-flight: fail a device under this matmul throughput",
    )
    parser.add_argument(
        "--preflight-min-busbw-gbps",
        type=float,
        default=None,
        help="pre-flight: fail under this all-reduce bus bandwidth (GB/s)",
    )
    parser.add_argument(
        "--preflight-peer-mb",
        type=int,
        default=PAYLOAD_MB,
        help="between nodes, at the job's first start: MB sent over each node's link to the next "
        f"to time it (default {PAYLOAD_MB}; 0: no check; also off with --preflight off)",
    )
    parser.add_argument(
        "--preflight-min-link-gbps",
        type=float,
        default=None,
        help="between nodes: report a link under this bandwidth (GB/s) as slow, besides any under a "
        "quarter of the median",
    )


def peer_check(args: argparse.Namespace, multi_node: bool, store_host: str, store_port: int) -> PeerCheck | None:
    """The check between nodes the agent makes at its first start (supervisor/peer_check.py), if any."""
    if args.preflight_peer_mb < 0 or (args.preflight_min_link_gbps is not None and args.preflight_min_link_gbps <= 0):
        raise ConfigError("--preflight-peer-mb must be >= 0 and --preflight-min-link-gbps > 0")
    if not multi_node or args.preflight == "off" or args.preflight_peer_mb == 0:
        return None
    address = args.local_addr or route_address(store_host, store_port)
    return PeerCheck(address, args.preflight_peer_mb, args.preflight_min_link_gbps)


def gate(args: argparse.Namespace, events: EventLog, nproc: int, say: Any) -> None:
    """Run the check if asked; ConfigError (exit 2) when the node fails it, after excluding it."""
    mode = args.preflight
    if mode not in MODES:
        raise ConfigError(f"--preflight must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off" or (mode == "auto" and nvml_device_count() == 0):
        return
    argv = ["--ranks", str(max(1, nproc))]
    if args.preflight_min_tflops is not None:
        argv += ["--min-tflops", str(args.preflight_min_tflops)]
    if args.preflight_min_busbw_gbps is not None:
        argv += ["--min-busbw-gbps", str(args.preflight_min_busbw_gbps)]
    say("pre-flight check of this node ...")
    done = _run_check(argv)
    report = None
    if done is not None and done[0] == 0:
        with contextlib.suppress(ValueError, IndexError):
            report = json.loads(done[1].strip().splitlines()[-1])
    if report is None:
        why = "timed out" if done is None else (done[2].strip().splitlines() or ["no output"])[-1]
        events.emit("preflight_failed", error=why)
        raise ConfigError(f"the pre-flight check could not run on this node: {why}")
    events.emit("preflight", **{k: v for k, v in report.items() if k != "failures"}, failures=report["failures"])
    say(summary(report))
    if not report["failures"]:
        return
    reason = "pre-flight check: " + "; ".join(report["failures"])
    entry = exclusion.exclude(reason, report["action"])
    events.emit("node_excluded", host=entry.host, reason=reason, action=entry.action)
    raise ConfigError(
        f"this node ({entry.host}) failed the {reason} ({entry.action}); it is excluded until `stalwart nodes "
        f"clear` (list: {exclusion.exclusion_file()})"
    )


def _run_check(argv: list[str]) -> tuple[int, str, str] | None:
    """`python -m stalwart.detect.preflight ARGV` in a child: its exit status, stdout and stderr; None when it ran
    past TIMEOUT_S. The child is a fork of this launcher where it is one thread (torch imported already: a new
    interpreter's import of it was 3-4 s of CPU on the 2-core VM, 2026-11-30), else a new interpreter; either way
    the CUDA context is the child's, never the launcher's."""
    with tempfile.TemporaryDirectory(prefix="stalwart-preflight-") as tmp:
        out, err = Path(tmp) / "out", Path(tmp) / "err"
        proc = start_module("stalwart.detect.preflight", argv, env=dict(os.environ), out=out, err=err)
        try:
            code = proc.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return None
        return code, out.read_text(errors="replace"), err.read_text(errors="replace")


def summary(report: dict[str, Any]) -> str:
    """One line: every device's throughput and memory test, the all-reduce, the time."""
    parts = [
        f"{d['device']} {d['tflops']:.3g} TFLOPS, memory {'ok' if not d['memory_errors'] else 'BAD'}"
        for d in report["devices"]
    ]
    if report.get("busbw_gbps") is not None:
        parts.append(f"all-reduce x{report['collective_ranks']} {report['busbw_gbps']:.3g} GB/s")
    verdict = "FAILED" if report["failures"] else "passed"
    return f"pre-flight {verdict} in {report['seconds']:.1f} s: " + "; ".join(parts)


_Parser = Parser


def main(argv: list[str]) -> int:
    """`stalwart preflight`: the check by hand; exit 1 when the node fails it."""
    p = _Parser(prog="stalwart preflight", description="Check this node before it takes work (detect/preflight.py).")
    p.add_argument("--nproc", type=int, default=1, help="processes for the all-reduce test (1: none)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--exclude", action="store_true", help="put this node on the exclusion list if it fails")
    preflight_limits.add_limit_arguments(p)
    args = p.parse_args(argv)
    if args.nproc < 1 or (args.memory_mb is not None and args.memory_mb < 1) or args.seconds <= 0:
        raise ConfigError("--nproc and --memory-mb must be positive, --seconds above 0")
    from stalwart.detect import preflight  # torch: after the arguments are checked

    report = json.loads(preflight.check(preflight_limits.limits_from(args), args.nproc).to_json())
    print(json.dumps(report) if args.json else summary(report))
    if not args.json:
        for failure in report["failures"]:
            print(f"  {failure}")
    if report["failures"] and args.exclude:
        entry = exclusion.exclude("pre-flight check: " + "; ".join(report["failures"]), report["action"])
        print(f"{entry.host} is excluded ({exclusion.exclusion_file()})")
    return 1 if report["failures"] else 0
