"""`stalwart bench mirror-read`: how fast a job resumes from a mirror, against the mirror's raw read bandwidth.

Why: after a region's loss a job resumes from a mirror (checkpoint/load/newest.py); its resume reads and verifies
every byte there (the xxh3 of each tensor). The target (issue 46) is at least 80% of what plainly reading the same
files achieves. Per size, one rank's checkpoint of float32 tensors is written to a mirror directory; then, --repeats
times each, the median of:
  raw      every file of that checkpoint read in 8 MiB chunks (the floor: the mirror's own bandwidth)
  resume   a checkpoint directory with no checkpoint and the mirror among its mirrors: `load_latest()` finds the
           step in the mirror, reads it, verifies every tensor and rebuilds the state (the Checkpointer is made
           before the clock starts, as a job's is before it resumes)
With --cold (root only), the page cache is dropped before each read, so both come from the disk; else from memory,
where the difference is stalwart's own work (listing, verification, deserialisation).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from stalwart.bench.common import GB, MB, parse_sizes, positive_int, size_text
from stalwart.errors import BenchError

CHUNK = 8 << 20
TENSORS = 8


def run_bench(sizes: list[int], repeats: int, cold: bool, progress: Any) -> dict[str, Any]:
    """Per size: the median seconds and bandwidth of the raw read and of the resume, and their ratio."""
    if cold and not _can_drop_caches():
        raise BenchError("--cold needs to drop the page cache (root, and /proc/sys/vm/drop_caches writable)")
    rows = []
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="stalwart-bench-mirror-") as root:
            progress(f"{size_text(size)}: writing a checkpoint to the mirror, then {repeats} reads of each kind")
            mirror = Path(root) / "mirror"
            files = _write(mirror, size)
            nbytes = sum(f.stat().st_size for f in files)
            raw, resume = [], []
            for i in range(repeats):
                raw.append(_timed(functools.partial(_read_files, files), cold))
                resume.append(_resume(Path(root) / f"primary{i}", mirror, cold))
        raw_s, resume_s = statistics.median(raw), statistics.median(resume)
        rows.append(
            {
                "bytes": nbytes,
                "raw_s": raw_s,
                "resume_s": resume_s,
                "raw_gb_s": nbytes / raw_s / GB,
                "resume_gb_s": nbytes / resume_s / GB,
                "ratio": raw_s / resume_s,
            }
        )
    return {"repeats": repeats, "cold": cold, "cpu_count": os.cpu_count(), "sizes": rows}


def _write(mirror: Path, size: int) -> list[Path]:
    """A one-rank checkpoint of about `size` bytes at step 1 in `mirror`; its files."""
    import torch

    from stalwart.checkpoint import Checkpointer
    from stalwart.checkpoint.format import layout
    from stalwart.checkpoint.save.step_copy import files_of
    from stalwart.checkpoint.storage import open_storage

    per = max(1, size // TENSORS // 4)
    state = {"step": 1, "objects": {"m": {f"t{i}": torch.randn(per) for i in range(TENSORS)}}}
    ck = Checkpointer.standalone(mirror, keep_last=1)
    try:
        if not ck.save(1, state, wait=True):
            raise BenchError(f"the checkpoint could not be written to {mirror}")
    finally:
        ck.close()
    return [mirror / name for name in files_of(layout.read_manifest(open_storage(mirror), 1))]


def _read_files(files: list[Path]) -> None:
    buf = bytearray(CHUNK)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def _resume(primary: Path, mirror: Path, cold: bool) -> float:
    """Seconds of `load_latest()` alone: the Checkpointer (its persister started, its root checked) is made
    before the clock starts, as a job's is before it resumes."""
    from stalwart.checkpoint import Checkpointer

    ck = Checkpointer.standalone(primary, keep_last=1, mirrors=[{"url": str(mirror)}])
    try:
        restored: Any = None

        def load() -> None:
            nonlocal restored
            restored = ck.load_latest()

        seconds = _timed(load, cold)
    finally:
        ck.close()
    if restored is None or restored.mirror != str(mirror):
        raise BenchError(f"the resume did not come from the mirror {mirror}")
    return float(seconds)


def _timed(run: Any, cold: bool) -> float:
    if cold:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def _can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def add_parser(subparsers: Any) -> Any:
    p = subparsers.add_parser(
        "mirror-read",
        help="a resume from a mirror against the mirror's raw read bandwidth",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sizes", type=parse_sizes, default=[100 * MB, GB], help="default 100MB,1GB")
    p.add_argument("--repeats", type=positive_int, default=3, help="reads of each kind per size (default 3; median)")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each read (root)")
    p.add_argument("--json", action="store_true", help="print one JSON object to stdout instead of a table")
    p.set_defaults(run=_run)
    return p


def _run(args: Any) -> int:
    err = Console(stderr=True)
    try:
        report = run_bench(args.sizes, args.repeats, args.cold, lambda line: err.print(f"bench: {line}"))
    except BenchError as exc:
        print(f"stalwart bench mirror-read: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report))
        return 0
    where = "from the disk (page cache dropped)" if report["cold"] else "from memory (page cache)"
    table = Table(title=f"a resume from a mirror, {where}; median of {report['repeats']}")
    for head in ("checkpoint", "raw read", "resume", "resume / raw bandwidth"):
        table.add_column(head, justify="right")
    for r in report["sizes"]:
        table.add_row(
            size_text(r["bytes"]),
            f"{r['raw_s']:.3f} s ({r['raw_gb_s']:.2f} GB/s)",
            f"{r['resume_s']:.3f} s ({r['resume_gb_s']:.2f} GB/s)",
            f"{r['ratio']:.0%}",
        )
    Console().print(table)
    return 0
