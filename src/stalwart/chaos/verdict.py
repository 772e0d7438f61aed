"""A chaos run's checkpoints judged: every committed one valid, the final one bitwise the reference run's; and the
`corrupt_checkpoint` fault, which damages the newest one (the harness sends it, chaos/harness.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from stalwart.checkpoint.format import layout
from stalwart.checkpoint.storage import open_storage
from stalwart.checkpoint.tools.inspect import verify


def corrupt_newest(root: Path) -> str | None:
    """Flip one byte in the middle of the newest committed checkpoint's first data file."""
    storage = open_storage(str(root), None)
    steps = layout.committed_steps(storage)
    if not steps:
        return None
    step_dir = root / layout.step_dir_name(steps[0])
    data = sorted(step_dir.glob("*.data"))
    if not data:
        return None
    path = data[0]
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0x5A]) if byte else b"\x01")
    return str(path.relative_to(root.parent))


def verify_checkpoints(root: Path) -> list[str]:
    """Every problem of every committed checkpoint under `root`."""
    storage = open_storage(str(root), None)
    return [f"step {step}: {p}" for step in layout.committed_steps(storage) for p in verify(storage, step)]


def compare_final(root: Path, reference: Path) -> list[str]:
    """Why the newest checkpoint under `root` is not bitwise the newest under `reference` (none: it is)."""
    a, b = open_storage(str(root), None), open_storage(str(reference), None)
    steps_a, steps_b = layout.committed_steps(a), layout.committed_steps(b)
    if not steps_a or not steps_b:
        return [f"no committed checkpoint in {root if not steps_a else reference}"]
    if steps_a[0] != steps_b[0]:
        return [f"the final checkpoint is of step {steps_a[0]}, the reference's of step {steps_b[0]}"]
    ma, mb = layout.read_manifest(a, steps_a[0]), layout.read_manifest(b, steps_b[0])
    # The tracked objects' tensors, every one; not the RNG states: a generator the job never seeds (numpy's,
    # Python's) differs between any two runs, and a wrongly restored one that matters (torch's, through dropout)
    # shows in the parameters anyway.
    ours = {t: e for t, e in ma.tensors.items() if not _not_compared(t)}
    theirs = {t: e for t, e in mb.tensors.items() if not _not_compared(t)}
    problems = []
    if set(ours) != set(theirs):
        problems.append(f"the final checkpoints hold different tensors ({len(ours)} and {len(theirs)})")
    differ = sorted(t for t in set(ours) & set(theirs) if ours[t].xxh3 != theirs[t].xxh3)
    if differ:
        problems.append(f"{len(differ)} of {len(ours)} tensors differ from the reference's (first: {differ[0]})")
    return problems


def _not_compared(tensor: str) -> bool:
    """RNG states (see compare_final) and the detectors' own state (the loss-spike window: after a recovery from
    a light snapshot it lacks the last step's loss, docs/detectors.md); neither is training state."""
    return "/rng/" in tensor or "/detectors/" in tensor
