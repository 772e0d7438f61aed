"""`stalwart ckpt sync SRC DST`: copy a checkpoint directory's committed checkpoints to another location.

Why: a job's durable checkpoints live in one store; if that store's region is lost, the run is lost with it. A copy
in another region or provider (any path or fsspec URL, as a Job's `checkpoint_dir`) lets a new launch there resume
from it (issue 46). This seeds such a mirror, or brings one up to date, or repairs one.

Each committed step is copied as a consistent step, oldest first: its files first (every rank's meta file and
every data file its tensors are in, a delta's base files among them), each skipped when the destination already
holds it whole (files are never rewritten in place: a repeated save writes under a new token, so the same name and
size is the same file); then the copy is verified where it landed against the source's manifest (every meta file's
and every tensor's xxh3), and the manifest is written last: its presence commits the step there, as it does for a
save. A step whose destination already has the same manifest and every file is left alone (with `--verify`, checked
there, and copied again whole if it fails: a file damaged in place keeps its size). A copy that does not
verify is reported and its manifest not written (a destination's earlier manifest of that step stays as it was);
the other steps go on, and the exit status is 1. An interrupted sync leaves files without a manifest, which no load
takes and the next sync completes. Interrupted and quarantined steps are not copied; nothing is removed at either
end, and the source is only read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from stalwart.checkpoint.format import layout
from stalwart.checkpoint.storage import Storage, describe_error
from stalwart.checkpoint.tools.inspect import verify_manifest
from stalwart.errors import CheckpointCorruptError, CheckpointMismatchError

CHUNK_BYTES = 64 << 20
"""A file is copied in reads of this many bytes (one in memory at a time), not whole: a rank's data file can be
many GB."""


@dataclass(frozen=True, slots=True)
class StepCopy:
    """What syncing one step did."""

    step: int
    files: int
    """Files copied (0 when the destination held them all)."""
    bytes: int
    seconds: float
    already: bool
    """The destination already held this step, manifest and files."""
    problem: str = ""
    """Why the copy was not committed; empty when it was (or was there already)."""


def sync(
    src: Storage, dst: Storage, steps: list[int], say: Callable[[str], None], *, verify: bool = False
) -> list[StepCopy]:
    """Copy `steps` (committed in `src`) to `dst`, oldest first; `dst` must be empty or a stalwart checkpoint
    directory (it is created with its marker if needed). `say` gets one line per step. `verify`: a step the
    destination holds already is verified there too, and copied again whole if it fails."""
    layout.prepare_root(dst, create=True)
    done = []
    for step in sorted(steps):
        copy = _sync_step(src, dst, step, verify)
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


def _sync_step(src: Storage, dst: Storage, step: int, verify: bool) -> StepCopy:
    started = time.monotonic()
    rel = f"{layout.step_dir_name(step)}/{layout.MANIFEST}"
    text = src.read(rel)
    try:
        manifest = layout.Manifest.parse(text.decode("utf-8"), src.display(rel))
    except (UnicodeDecodeError, CheckpointCorruptError, CheckpointMismatchError) as exc:
        return StepCopy(step, 0, 0, 0.0, False, f"the source's manifest cannot be read ({exc})")
    same_manifest = dst.exists(rel) and dst.read(rel) == text
    files, bytes_copied = _copy_files(src, dst, files_of(manifest), whole=False)
    problems = verify_manifest(dst, manifest) if files or not same_manifest or verify else []
    if same_manifest and files == 0 and not problems:
        return StepCopy(step, 0, 0, time.monotonic() - started, True)
    if same_manifest and files == 0:  # there, but damaged (--verify): every file copied again
        files, bytes_copied = _copy_files(src, dst, files_of(manifest), whole=True)
        problems = verify_manifest(dst, manifest)
    if problems:
        more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
        problem = f"the copy at {dst.display(layout.step_dir_name(step))} does not verify: {problems[0]}{more}"
        return StepCopy(step, files, bytes_copied, time.monotonic() - started, False, problem)
    dst.write_bytes(rel, text)  # last: the step is committed there now
    return StepCopy(step, files, bytes_copied, time.monotonic() - started, False)


def _copy_files(src: Storage, dst: Storage, names: list[str], *, whole: bool) -> tuple[int, int]:
    """Copy each of `names` the destination lacks or holds at another size (every one when `whole`); how many files
    and bytes were copied."""
    files = nbytes = 0
    for name in names:
        size = src.size(name)
        if not whole and dst.exists(name) and dst.size(name) == size:
            continue
        dst.makedirs(name.rsplit("/", 1)[0])
        _copy(src, dst, name, size)
        files, nbytes = files + 1, nbytes + size
    return files, nbytes


def files_of(manifest: layout.Manifest) -> list[str]:
    """Every file a committed checkpoint reads, relative to its root: its ranks' meta files and the data files its
    tensors are in (for a delta, its base's as well)."""
    step_dir = layout.step_dir_name(manifest.step)
    metas = [f"{step_dir}/{r.meta}" for r in manifest.ranks]
    return metas + sorted({t.file for t in manifest.tensors.values()})


def _copy(src: Storage, dst: Storage, name: str, size: int) -> None:
    def chunks(out: BinaryIO) -> None:
        for offset in range(0, size, CHUNK_BYTES):
            out.write(src.read_range(name, offset, min(CHUNK_BYTES, size - offset)))

    try:
        dst.write(name, chunks)  # atomic: a file is there whole or not at all
    except Exception as exc:
        raise OSError(f"copying {src.display(name)} to {dst.display(name)}: {describe_error(exc)}") from exc
