"""`stalwart bench handover`: what handing a survivor's live state to a replacement on the same node costs, by each
way stalwart has (recovery/node_handover.py), next to the machine's floor.

Two processes over gloo on this machine: rank 1 holds the state (8 float32 tensors, as a survivor's), rank 0 has
built tensors of the same shapes (as a replacement's model) and needs the state in them. Per size and way, the
median of --repeats rounds of the replacement's seconds, from both being ready to the state in its tensors ("in its
model") and to the state handed over ("handed over"):
  broadcast  a gloo broadcast of one buffer (the way across nodes)
  file       the survivor writes a file in /dev/shm, the replacement maps it copy-on-write (the fallback on one node)
  direct     the replacement reads the survivor's memory straight into its model's tensors (process_vm_readv; the
             default on one node, where the replacement has the tensor)
  direct: new memory  the same into new memory (a tensor the replacement lacks: a fresh optimizer's state)
The floor: one copy of the state into the replacement's tensors, and one copy that allocates (a clone).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from stalwart.bench.common import GB, MB, parse_sizes, positive_int, run_ranks, size_text
from stalwart.errors import BenchError

WORKER = "stalwart.bench.handover_worker"
WAYS = ("broadcast", "file", "direct_new", "direct")
HEADS = ("broadcast", "file", "direct: new memory", "direct: into the model")
TIMEOUT_S = 1800.0


def run_bench(sizes: list[int], repeats: int, progress: Any) -> dict[str, Any]:
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    with (
        tempfile.TemporaryDirectory(prefix="stalwart-bench-handover-") as root,
        tempfile.TemporaryDirectory(prefix="stalwart-bench-handover-", dir=shm) as memory,
    ):
        out = Path(root)
        progress(
            f"handing over {', '.join(size_text(n) for n in sizes)} between two processes, {repeats} rounds each way"
        )
        args = ["--sizes", ",".join(map(str, sizes)), "--repeats", str(repeats), "--out", str(out), "--shm", memory]
        run_ranks(WORKER, 2, args, out, "the hand-overs", TIMEOUT_S)
        results = json.loads((out / "rank0.json").read_text())
    return {"repeats": repeats, "cpu_count": os.cpu_count(), "sizes": results}


def add_parser(subparsers: Any) -> Any:
    p = subparsers.add_parser(
        "handover",
        help="a survivor's live state to a replacement on one node, by each way, against a copy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sizes", type=parse_sizes, default=[10 * MB, 100 * MB, GB], help="default 10MB,100MB,1GB")
    p.add_argument("--repeats", type=positive_int, default=3, help="rounds per size and way (default 3; the median)")
    p.add_argument("--json", action="store_true", help="print one JSON object to stdout instead of a table")
    p.set_defaults(run=_run)
    return p


def _run(args: Any) -> int:
    err = Console(stderr=True)
    try:
        report = run_bench(args.sizes, args.repeats, lambda line: err.print(f"bench: {line}"))
    except BenchError as exc:
        print(f"stalwart bench handover: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report))
        return 0
    sizes = report["sizes"]
    table = Table(title=f"hand-over on one node, seconds to the state in the model (median of {report['repeats']})")
    table.add_column("way")
    for r in sizes:
        table.add_column(size_text(r["bytes"]), justify="right")
    table.add_row("floor: copy into the model", *(f"{r['floor']['copy_s']:.3f}" for r in sizes))
    table.add_row("floor: copy into new memory", *(f"{r['floor']['allocating_copy_s']:.3f}" for r in sizes))
    lanes = sizes[0]["floor"]["threads"] if sizes else 1
    table.add_row(f"floor: copy, {lanes} threads", *(f"{r['floor']['copy_all_cores_s']:.3f}" for r in sizes))
    for way, head in zip(WAYS, HEADS, strict=True):
        table.add_row(head, *(f"{r[way]['loaded_s']:.3f} ({r[way]['handed_s']:.3f})" for r in sizes))
    table.add_row("direct / floor: copy", *(f"{r['direct']['loaded_s'] / r['floor']['copy_s']:.2f}x" for r in sizes))
    table.add_row(
        f"direct / floor: {lanes} threads",
        *(f"{r['direct']['loaded_s'] / r['floor']['copy_all_cores_s']:.2f}x" for r in sizes),
    )
    Console().print(table)
    print("(in brackets: seconds until the state was handed over, before its copy into the model)")
    return 0
