"""One rank of `stalwart bench handover` (bench/handover.py): rank 1 is the survivor holding the live state, rank 0
the replacement that needs it, on one node. For each size and each way, the replacement's seconds from the moment
both are ready to the state in its own model's tensors (built already, as a replacement's are), and to the state
handed over (before that copy). Writes rank<R>.json in --out."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stalwart.recovery import node_handover
from stalwart.runtime.dist import Comm, Placement

SOURCE, READER = 1, 0
TENSORS = 8
"""The state: 8 float32 tensors of equal size (a model and its AdamW state, in few large pieces)."""
WAYS = ("broadcast", "file", "direct_new", "direct")


def _state(size: int) -> list[torch.Tensor]:
    n = max(1, size // (4 * TENSORS))
    return [torch.full((n,), float(i)) for i in range(TENSORS)]


def _spans(state: list[torch.Tensor]) -> tuple[list[tuple[int, int]], int]:
    spans, total = [], 0
    for t in state:
        nbytes = t.numel() * t.element_size()
        spans.append((total, nbytes))
        total += -(-nbytes // 64) * 64
    return spans, total


def _hand_over(
    way: str, comm: Comm, state: list[torch.Tensor], shm: Path, round_: int, offer: node_handover.Offer
) -> list[torch.Tensor] | None:
    """Each piece of the state on the reader as bytes (None on the source), by `way`, as recovery/live_handover.py
    does it: `direct` reads into the reader's own tensors, `direct_new` into new memory, both where the source's
    `offer` says (learned as the ranks agreed to the hand-over, as the restore's LightReady carries it)."""
    spans, size = _spans(state)
    mine = comm.rank == SOURCE
    if way in ("direct", "direct_new"):
        # As the restore reads (recovery/live_handover.py's hand_over_and_load): no agreement of its own; the verdict
        # rides on the load's, which `_measure` makes after the clock stopped.
        into: list[torch.Tensor | None] | None = list(state) if way == "direct" and not mine else None
        got = node_handover.read_offered(comm.rank, SOURCE, offer, spans, size, into)
        if got is None:
            raise RuntimeError("the kernel refused reading the source's memory")
        return None if mine else got
    if way == "file":
        path = node_handover.path_of(shm, round_, SOURCE)
        if mine:
            try:
                node_handover.write(path, [(off, t) for (off, _), t in zip(spans, state, strict=True)], size)
                comm.barrier()
                comm.barrier()
            finally:
                node_handover.remove(path)
            return None
        comm.barrier()
        buf = node_handover.read(path, size)
        comm.barrier()
    else:
        buf = torch.empty(size, dtype=torch.uint8)
        if mine:
            for (off, nbytes), t in zip(spans, state, strict=True):
                buf[off : off + nbytes].copy_(t.view(torch.uint8))
        comm.broadcast_tensor(buf, SOURCE)
        if mine:
            return None
    return [buf[off : off + nbytes] for off, nbytes in spans]


def _measure(comm: Comm, size: int, repeats: int, shm: Path) -> dict[str, Any]:
    state = _state(size) if comm.rank == SOURCE else [torch.empty_like(t) for t in _state(size)]
    if comm.rank == READER:
        for t in state:
            t.fill_(-1.0)  # the replacement's model: built, its pages touched
    spans, _ = _spans(state)
    out: dict[str, Any] = {"bytes": sum(n for _, n in spans)}
    for way in WAYS:
        handed, loaded = [], []
        for r in range(repeats):
            with node_handover.offering(state if comm.rank == SOURCE and way.startswith("direct") else None) as offer:
                # both ready: the ranks agree to the hand-over, as the restore's LightReady gather (with the offer)
                told = node_handover.Offer(*comm.all_gather_ints(list(offer))[SOURCE])
                started = time.perf_counter()
                got = _hand_over(way, comm, state, shm, r, told)
                took = time.perf_counter() - started
                if got is not None:
                    with torch.no_grad():  # a piece read into its tensor is copied onto itself: nothing is copied
                        for piece, t in zip(got, state, strict=True):
                            t.copy_(piece.view(torch.float32))
                    handed.append(took)
                    loaded.append(time.perf_counter() - started)
                comm.barrier()  # the source offers its memory until every read ended (the restore's agreement)
            if got is not None:
                if not all(bool((t == float(i)).all()) for i, t in enumerate(state)):
                    raise RuntimeError(f"{way}: the state arrived wrong")
                for t in state:
                    t.fill_(-1.0)
            del got
        if comm.rank == READER:
            out[way] = {"handed_s": statistics.median(handed), "loaded_s": statistics.median(loaded)}
    if comm.rank == READER:
        copies, allocs = [], []
        src = _state(size)
        for _ in range(repeats):
            started = time.perf_counter()
            with torch.no_grad():
                for t, s in zip(state, src, strict=True):
                    t.copy_(s)
            copies.append(time.perf_counter() - started)
            started = time.perf_counter()
            fresh = [s.clone() for s in src]
            allocs.append(time.perf_counter() - started)
            del fresh
        lanes = min(os.cpu_count() or 1, 4)  # as many threads as the direct read copies on (runtime/cross_memory.py)
        torch.set_num_threads(lanes)
        wide = []
        for r in range(repeats + 1):  # the first round starts the threads, not timed
            started = time.perf_counter()
            with torch.no_grad():
                for t, s in zip(state, src, strict=True):
                    t.copy_(s)
            if r:
                wide.append(time.perf_counter() - started)
        torch.set_num_threads(1)
        out["floor"] = {
            "copy_s": statistics.median(copies),
            "allocating_copy_s": statistics.median(allocs),
            "copy_all_cores_s": statistics.median(wide),
            "threads": lanes,
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m stalwart.bench.handover_worker")
    p.add_argument("--sizes", required=True, help="bytes, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shm", type=Path, required=True, help="the node memory directory both ranks write their files in")
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(minutes=10))
    comm = Comm(Placement(rank, 2, rank, 0), timedelta(minutes=10))
    results = [_measure(comm, int(size), args.repeats, args.shm) for size in args.sizes.split(",")]
    comm.close()
    dist.destroy_process_group()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
