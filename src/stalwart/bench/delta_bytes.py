"""Bytes written by delta checkpoints on a fine-tuning-like run: a frozen 12-layer body, a trained head.

    python -m stalwart.bench.delta_bytes [--dir /tmp/delta-bench]

Saves 4 checkpoints with full_every=4 (one full, three deltas), 5 AdamW steps apart, prints each checkpoint's
state bytes, bytes written and the ratio, and checks that the newest restores exactly.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile

import torch

from stalwart.checkpoint import Checkpointer
from stalwart.checkpoint.tools.inspect import list_entries, open_root


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
    ck = Checkpointer.standalone(root, keep_last=10, full_every=4)
    try:
        for step in range(1, 5):
            for _ in range(5):
                loss = model(torch.randn(8, 512)).pow(2).mean()
                optim.zero_grad()
                loss.backward()
                optim.step()
            state = {"step": step, "objects": {"model": model.state_dict(), "optim": optim.state_dict()}}
            ck.save(step, state, wait=True)
        for e in sorted(list_entries(open_root(root)), key=lambda e: e.step):  # what `stalwart ckpt list` shows
            ratio = e.bytes / max(e.written_bytes, 1)
            sizes = f"state {e.bytes:>11,} B  written {e.written_bytes:>11,} B"
            print(f"step {e.step}: {e.kind:10} {sizes}  {ratio:.1f}x")
        restored = ck.load_latest()
        assert restored is not None
        exact = all(torch.equal(restored.state["objects"]["model"][k], v) for k, v in model.state_dict().items())
        print(f"newest restores exactly: {exact}")
    finally:
        ck.close()
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
