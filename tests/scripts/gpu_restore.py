"""GPU check of a memory-tier restore into CUDA tensors (issue #33: 10 GB/s or faster), run by
`bash scripts/gpu_checks.sh restore` on a lent GPU.

A state of SIZE_GB (default 2) in 64 MB float32 tensors is snapshotted into node memory (/dev/shm), then restored
into CUDA tensors the way a job restores: `MemoryTier.load(step)` and a copy into each tensor. Three restores
each way: into pageable memory (the path before the pinned read) and into pinned memory (the product's path when
CUDA is in use, checkpoint/tiers/slot.read_buffer). Prints one JSON object: seconds and GB/s of each restore,
the load (read from /dev/shm) and the copy to the GPU apart.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import torch

import stalwart.checkpoint.tiers.slot as slot_module
from stalwart.checkpoint.tiers.memory import MemoryTier

SIZE_GB = float(os.environ.get("SIZE_GB", "2"))
CHUNK = 16 << 20  # float32 elements: 64 MB a tensor


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = max(1, int(SIZE_GB * (1 << 30) / (4 * CHUNK)))
    state = {f"t{i}": torch.full((CHUNK,), float(i)) for i in range(n)}
    targets = {k: torch.empty_like(v, device=device) for k, v in state.items()}
    nbytes = sum(v.numel() * 4 for v in state.values())
    directory = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    tier = MemoryTier(directory, rank=0, world_size=1)
    results: dict[str, list[dict[str, float]]] = {}
    try:
        tier.snapshot(1, {"step": 1, "objects": {"m": state}, "rng": {}})
        if device == "cuda":
            torch.cuda.init()
        real = slot_module.restores_to_gpu
        ways = (("pageable", False), ("pinned", True)) if device == "cuda" else (("pageable", False),)  # a dry run
        for way, pinned in ways:
            slot_module.restores_to_gpu = lambda p=pinned: p
            runs = []
            for _ in range(3):
                started = time.perf_counter()
                got = tier.load(1).state["objects"]["m"]
                loaded = time.perf_counter()
                for k, t in targets.items():
                    t.copy_(got[k], non_blocking=pinned)
                if device == "cuda":
                    torch.cuda.synchronize()
                done = time.perf_counter()
                assert all(torch.equal(targets[k].cpu()[:4], state[k][:4]) for k in ("t0", f"t{n - 1}"))
                seconds = done - started
                runs.append({"load_s": round(loaded - started, 4), "copy_s": round(done - loaded, 4),
                             "seconds": round(seconds, 4), "gbps": round(nbytes / seconds / 1e9, 2)})  # fmt: skip
            results[way] = runs
        slot_module.restores_to_gpu = real
    finally:
        tier.close()
        shutil.rmtree(directory, ignore_errors=True)
    print(json.dumps({"device": device, "bytes": nbytes, **results}), flush=True)


if __name__ == "__main__":
    main()
