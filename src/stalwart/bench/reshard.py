"""`stalwart bench reshard`: what loading sharded state at another world size costs, against reading its bytes once.

One run: `--from` ranks save `--size` of FSDP2-like state (parameters sharded Shard(0) over a 1-D mesh) with
stalwart.Job, as a durable checkpoint and as full snapshots in node memory (a directory in /dev/shm, as `stalwart
run` gives the memory tier); then, for each world size of `--to` and each tier of `--tiers`, that many ranks
(a) read the saved bytes once with plain reads, each its share (the floor of any load of those bytes; the faster
of a read before and one after (b)), and (b) resume with allow_world_size_change, which reshards: each rank reads
the saved shards that overlap its new ones (durable: checked against their xxh3) and fills its new shards
(bench/reshard_worker.py). The seconds are the slowest rank's. The checkpoint's files were just written, so both
read the page cache: the durable floor is this machine's memory and page-cache bandwidth, not its disk. Every
process is ended by the bench; the directories are removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from stalwart.bench.common import GB, Progress, parse_size, positive_int, run_ranks, scratch_dir
from stalwart.errors import BenchError

TIMEOUT_S = 900.0
WORKER = "stalwart.bench.reshard_worker"
TIERS = ("durable", "memory")
_SHM = Path("/dev/shm")


def _launch(phase: str, world: int, ckpt: Path, rows: int, root: Path, memory: Path | None = None) -> dict[str, Any]:
    """Run `world` ranks of the worker's `phase` (with the memory tier in `memory`); (slowest rank's seconds, bytes
    over all ranks)."""
    name = f"{phase}-{world}-{'memory' if memory is not None else 'durable'}"
    out = root / name
    tier = ["--memory", str(memory)] if memory is not None else []
    args = ["--phase", phase, "--ckpt", str(ckpt), "--rows", str(rows), "--out", str(out), *tier]
    run_ranks(WORKER, world, args, root, f"{phase} at {world} ranks", TIMEOUT_S)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    return {"seconds": max(r["seconds"] for r in ranks), "bytes": sum(r["bytes"] for r in ranks), "ranks": ranks}


def run_bench(
    size: int, source: int, targets: list[int], parent: Path | None, progress: Progress, tiers: list[str] | None = None
) -> dict[str, Any]:
    from stalwart.bench.reshard_worker import TENSORS, WIDTH  # torch: after the arguments are checked

    tiers = tiers or list(TIERS)
    rows = max(1, size // (TENSORS * WIDTH * 4))
    state = rows * TENSORS * WIDTH * 4
    with scratch_dir(parent, "stalwart-bench-reshard-") as root:
        memory = Path(tempfile.mkdtemp(prefix="stalwart-bench-reshard-", dir=_SHM if _SHM.is_dir() else None))
        try:
            ckpt = root / "ckpt"
            progress(f"saving {state / GB:.2f} GB of sharded state from {source} ranks (checkpoint and node memory)")
            _launch("save", source, ckpt, rows, root, memory)
            rounds = [
                _round(world, tier, ckpt, rows, root, memory if tier == "memory" else None, state, progress)
                for world in targets
                for tier in tiers
            ]
        finally:
            shutil.rmtree(memory, ignore_errors=True)
        return {
            "state_bytes": state,
            "from": source,
            "tensors": TENSORS,
            "rounds": rounds,
            "machine": {"cpu_count": os.cpu_count()},
        }


def _round(
    world: int, tier: str, ckpt: Path, rows: int, root: Path, memory: Path | None, state: int, progress: Progress
) -> dict[str, Any]:
    where = "node memory" if memory is not None else "the checkpoint's files"
    progress(f"{world} ranks: reading {where} once (the floor)")
    floor = _launch("floor", world, ckpt, rows, root, memory)
    progress(f"{world} ranks: resuming from {where} with resharding")
    load = _launch("load", world, ckpt, rows, root, memory)
    again = _launch("floor", world, ckpt, rows, root, memory)  # the faster of two: the page cache as warm as for it
    floor = min(floor, again, key=lambda f: f["seconds"])
    if load["bytes"] != state:
        raise BenchError(f"the {world} ranks hold {load['bytes']} bytes after resharding, not {state}")
    read_from = {r["tier"] for r in load["ranks"]}
    if read_from != {tier}:
        raise BenchError(f"the {world} ranks resumed from {sorted(map(str, read_from))}, not from {tier}")
    progress(f"{world} ranks, {tier}: floor {floor['seconds']:.3f} s, reshard {load['seconds']:.3f} s")
    return {
        "to": world,
        "tier": tier,
        "floor_s": floor["seconds"],
        "floor_bytes": floor["bytes"],
        "reshard_s": load["seconds"],
        "ratio": load["seconds"] / floor["seconds"],
    }


def add_parser(subparsers: Any) -> Any:
    p = subparsers.add_parser(
        "reshard",
        help="load sharded state at another world size, against reading its bytes once",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--size", type=parse_size, default=GB, help="sharded state: 1GB (default), 250MB, ...")
    p.add_argument("--from", dest="source", type=positive_int, default=4, help="ranks that save it (default 4)")
    p.add_argument("--to", type=_worlds, default=[2, 3], help="world sizes that load it, comma-separated (default 2,3)")
    p.add_argument("--tiers", type=_tiers, default=list(TIERS), help="durable,memory (default: both)")
    p.add_argument("--dir", type=Path, help="where the runs write (default: a new temporary directory)")
    p.add_argument("--json", action="store_true", help="print one JSON object to stdout instead of a table")
    p.set_defaults(run=_run)
    return p


def _tiers(text: str) -> list[str]:
    tiers = [part.strip() for part in text.split(",")]
    if not tiers or set(tiers) - set(TIERS):
        raise argparse.ArgumentTypeError(f"--tiers takes {','.join(TIERS)} or one of them, got {text!r}")
    return tiers


def _worlds(text: str) -> list[int]:
    return [positive_int(part) for part in text.split(",")]


def _run(args: Any) -> int:
    err = Console(stderr=True)
    try:
        report = run_bench(
            args.size, args.source, args.to, args.dir, lambda line: err.print(f"bench: {line}"), args.tiers
        )
    except BenchError as exc:
        print(f"stalwart bench reshard: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report))
        return 0
    table = Table(
        title=f"reshard {report['state_bytes'] / GB:.2f} GB saved by {report['from']} ranks "
        f"({report['tensors']} parameters, Shard(0))"
    )
    for column in ("to", "from", "floor: read once", "reshard", "reshard / floor", "GB/s"):
        table.add_column(column, justify="right")
    for r in report["rounds"]:
        table.add_row(
            str(r["to"]),
            r["tier"],
            f"{r['floor_s']:.3f} s",
            f"{r['reshard_s']:.3f} s",
            f"{r['ratio']:.2f}x",
            f"{report['state_bytes'] / GB / r['reshard_s']:.2f}",
        )
    Console().print(table)
    return 0
