"""The first save after a start: its stall with and without staging allocated ahead (Checkpointer.prepare).

A save's stall is normally one copy into staging memory, but the first save of a process also allocates that
memory (and on a GPU registers it with CUDA), which for gigabytes takes seconds. The Job allocates it on a
background thread after its first step; this measures what that saves, and how long the training thread could
not run meanwhile (the longest gap between its wake-ups: long if the preparing thread holds the GIL):

    python -m stalwart.bench.first_save [--size 1GB] [--device cpu|cuda]

Each variant runs in a fresh Checkpointer over a new temporary directory, which is removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time

import torch

from stalwart.bench.common import MB, parse_size
from stalwart.checkpoint import Checkpointer

TENSORS = 10


def first_and_second(state: dict[str, object], prepare: bool) -> dict[str, float]:
    """Seconds of the first and second save's stall, with staging prepared ahead (and waited for) or not."""
    root = tempfile.mkdtemp(prefix="stalwart-first-save-")
    ck = Checkpointer.standalone(root, keep_last=2, token="first")
    try:
        out: dict[str, float] = {}
        if prepare:
            started = time.perf_counter()
            ck.prepare(state)
            out["prepare_call_s"] = time.perf_counter() - started
            out["main_thread_max_gap_s"] = _main_thread_gap(ck)
            ck._settle_prepare()
            out["prepare_background_s"] = time.perf_counter() - started
        for n, key in ((1, "first_stall_s"), (2, "second_stall_s")):
            started = time.perf_counter()
            ck.save(n, state)
            out[key] = time.perf_counter() - started
            ck.wait_durable()
        return out
    finally:
        ck.close()
        shutil.rmtree(root, ignore_errors=True)


def _main_thread_gap(ck: Checkpointer) -> float:
    """While staging is prepared in the background, the longest this thread went without running: a training
    loop's view of it. Long gaps mean the preparing thread holds the GIL (a CUDA call that does not release it)."""
    gap, last = 0.0, time.perf_counter()
    thread = ck._preparing
    while thread is not None and thread.is_alive():
        time.sleep(0.001)
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    return gap


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m stalwart.bench.first_save", description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1GB", help="state size, as for `stalwart bench checkpoint` (default 1GB)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("first_save: error: --device cuda: torch sees no CUDA device", file=sys.stderr)
        return 2
    size = parse_size(args.size)
    torch.manual_seed(0)
    n = size // 4 // TENSORS
    state = {"step": 1, "objects": {"w": {f"t{i}": torch.randn(n, device=args.device) for i in range(TENSORS)}}}
    report = {
        "bytes": n * 4 * TENSORS,
        "device": args.device,
        "without_prepare": first_and_second(state, prepare=False),
        "with_prepare": first_and_second(state, prepare=True),
    }
    print(json.dumps(report))
    print(
        f"{report['bytes'] / MB:,.0f} MB on {args.device}: first save stalled "
        f"{report['without_prepare']['first_stall_s']:.3f} s without prepare, "
        f"{report['with_prepare']['first_stall_s']:.3f} s with it (second saves "
        f"{report['without_prepare']['second_stall_s']:.3f} / {report['with_prepare']['second_stall_s']:.3f} s); "
        f"while it was prepared, this thread's longest wait to run was "
        f"{report['with_prepare']['main_thread_max_gap_s'] * 1e3:.1f} ms",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
