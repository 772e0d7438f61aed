"""Bytes written by delta checkpoints on a fine-tuning-like run: a frozen 12-layer body, a trained head.

    python -m stalwart.bench.delta_bytes [--dir /tmp/delta-bench]

Saves 4 checkpoints with full_every=4 (one full, three deltas), 5 AdamW steps apart, prints each checkpoint's
state bytes, bytes written and the ratio, and checks that the newest restores exactly.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from datetime import timedelta

import torch

from stalwart.checkpoint import Checkpointer, layout
from stalwart.checkpoint.storage import LocalStorage
from stalwart.runtime.dist import Comm, Placement
from stalwart.telemetry.events import EventLog


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", help="an empty or new directory (default: a temporary one, removed at the end)")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="stalwart-delta-")
    torch.manual_seed(0)
    body = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(12)])
    head = torch.nn.Linear(512, 512)
    body.requires_grad_(False)
    model = torch.nn.Sequential(body, head)
    optim = torch.optim.AdamW(head.parameters(), lr=1e-3)
    comm = Comm(Placement(rank=0, world_size=1, local_rank=0, restart_count=0), timedelta(seconds=60))
    ck = Checkpointer(root, comm, EventLog(None), keep_last=10, token="d", full_every=4)
    try:
        for step in range(1, 5):
            for _ in range(5):
                loss = model(torch.randn(8, 512)).pow(2).mean()
                optim.zero_grad()
                loss.backward()
                optim.step()
            state = {"step": step, "objects": {"model": model.state_dict(), "optim": optim.state_dict()}}
            ck.save(step, state, wait=True)
        storage = LocalStorage(root)
        for step in range(1, 5):
            m = layout.read_manifest(storage, step)
            kind = "full" if m.base is None else f"delta of {m.base}"
            ratio = m.state_bytes / max(m.written_bytes, 1)
            sizes = f"state {m.state_bytes:>11,} B  written {m.written_bytes:>11,} B"
            print(f"step {step}: {kind:10} {sizes}  {ratio:.1f}x")
        restored = ck.load_latest()
        assert restored is not None
        exact = all(torch.equal(restored.state["objects"]["model"][k], v) for k, v in model.state_dict().items())
        print(f"newest restores exactly: {exact}")
    finally:
        ck.close()
        comm.close()
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
