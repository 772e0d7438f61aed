"""`stalwart ckpt sync SRC DST`: copy a checkpoint directory's committed checkpoints to another location.

Why: a job's durable checkpoints live in one store; if that store's region is lost, the run is lost with it. A copy
in another region or provider (any path or fsspec URL, as a Job's `checkpoint_dir`) lets a new launch there resume
from it (issue 46). This seeds such a mirror, or brings one up to date, or repairs one.

Each committed step is copied as a save commits one, oldest first (checkpoint/save/step_copy.py: its files, then
the copy verified where it landed against the source's manifest, then the manifest). A step the destination holds
already, manifest and files, is left alone (with `--verify`, checked there and copied again whole if it fails: a
file damaged in place keeps its size). A copy that does not verify is reported and its manifest not written (a
destination's earlier manifest of that step stays as it was); the other steps go on, and the exit status is 1. An
interrupted sync leaves files without a manifest, which no load takes and the next sync completes. Interrupted and
quarantined steps are not copied; nothing is removed at either end, and the source is only read.
"""

from __future__ import annotations

from collections.abc import Callable

from stalwart.checkpoint.format import layout
from stalwart.checkpoint.save.step_copy import StepCopy, copy_step
from stalwart.checkpoint.storage import Storage


def sync(
    src: Storage, dst: Storage, steps: list[int], say: Callable[[str], None], *, verify: bool = False
) -> list[StepCopy]:
    """Copy `steps` (committed in `src`) to `dst`, oldest first (a delta's base before it); `dst` must be empty or
    a stalwart checkpoint directory (it is created with its marker if needed). `say` gets one line per step.
    `verify`: a step the destination holds already is verified there too, and copied again whole if it fails."""
    layout.prepare_root(dst, create=True)
    done = []
    for step in sorted(steps):
        copy = copy_step(src, dst, step, verify_existing=verify)
        done.append(copy)
        say(describe(copy))
    return done


def describe(copy: StepCopy) -> str:
    """One line for a step's copy."""
    if copy.problem:
        return f"step {copy.step}: NOT copied: {copy.problem}"
    if copy.already:
        return f"step {copy.step}: already there"
    return f"step {copy.step}: {copy.files} files, {copy.bytes:,} bytes copied and verified in {copy.seconds:.1f} s"
