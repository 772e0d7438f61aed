"""One committed checkpoint copied from one store to another, as a save commits it: the mirrors' copy.

Used by `stalwart ckpt sync` (tools/sync.py) and by rank 0's persister for a job's mirrors (mirroring.py). The
step's files go first (every rank's meta file and every data file its tensors are in, a delta's base files among
them), each skipped when the destination already holds one of that name and size (a repeated save writes under a new
token, so that is almost always the same file); then the copy is verified where it landed against the source's
manifest (each meta file's size, xxh3 and format, each tensor's xxh3), every file copied again where a skipped one
is not the source's, and the manifest is written last: its presence commits the step there. A copy that does not
verify is not committed (a destination's earlier manifest of the step stays as it was). Imports no torch: the
persister process uses it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import BinaryIO

from stalwart.checkpoint.format import layout
from stalwart.checkpoint.load.verify import read_verified_meta, tensor_problems
from stalwart.checkpoint.storage import Storage, describe_error
from stalwart.errors import CheckpointCorruptError, CheckpointMismatchError

CHUNK_BYTES = 64 << 20
"""A file is copied in reads of this many bytes (one in memory at a time), not whole: a rank's data file can be
many GB."""


@dataclass(frozen=True, slots=True)
class StepCopy:
    """What copying one step did."""

    step: int
    files: int
    """Files copied (0 when the destination held them all)."""
    bytes: int
    seconds: float
    already: bool
    """The destination already held this step, manifest and files."""
    problem: str = ""
    """Why the copy was not committed; empty when it was (or was there already)."""


def copy_step(src: Storage, dst: Storage, step: int, *, verify_existing: bool = False) -> StepCopy:
    """Copy committed `step` from `src` to `dst` (a prepared root). `verify_existing`: a step the destination holds
    already is verified there too, and copied again whole if it fails (a file damaged in place keeps its size).
    Storage errors are raised."""
    started = time.monotonic()
    rel = f"{layout.step_dir_name(step)}/{layout.MANIFEST}"
    text = src.read(rel)
    try:
        manifest = layout.Manifest.parse(text.decode("utf-8"), src.display(rel))
    except (UnicodeDecodeError, CheckpointCorruptError, CheckpointMismatchError) as exc:
        return StepCopy(step, 0, 0, 0.0, False, f"the source's manifest cannot be read ({exc})")
    same_manifest = dst.exists(rel) and dst.read(rel) == text
    names = files_of(manifest)
    files, nbytes = _copy_files(src, dst, names, whole=False)
    problems = verify_copy(dst, manifest) if files or not same_manifest or verify_existing else []
    if same_manifest and files == 0 and not problems:
        return StepCopy(step, 0, 0, time.monotonic() - started, True)
    if problems and files < len(names):
        # A file taken as there already (same name and size) is not the source's: damaged in place, or left there by
        # a save that failed over to this location and was then committed elsewhere (rank 0's meta file, written
        # again where the other ranks' shards were: persister.py). Every file is copied again.
        files, nbytes = _copy_files(src, dst, names, whole=True)
        problems = verify_copy(dst, manifest)
    if problems:
        more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
        problem = f"the copy at {dst.display(layout.step_dir_name(step))} does not verify: {problems[0]}{more}"
        return StepCopy(step, files, nbytes, time.monotonic() - started, False, problem)
    dst.write_bytes(rel, text)  # last: the step is committed there now
    return StepCopy(step, files, nbytes, time.monotonic() - started, False)


def files_of(manifest: layout.Manifest) -> list[str]:
    """Every file a committed checkpoint reads, relative to its root: its ranks' meta files and the data files its
    tensors are in (for a delta, its base's as well)."""
    step_dir = layout.step_dir_name(manifest.step)
    return [f"{step_dir}/{r.meta}" for r in manifest.ranks] + sorted({t.file for t in manifest.tensors.values()})


def verify_copy(storage: Storage, manifest: layout.Manifest) -> list[str]:
    """Every problem of the files `manifest` lists as `storage` holds them, byte for byte against the manifest
    (each meta file's size, xxh3 and format, each tensor's xxh3); an empty list means they are the committed bytes."""
    problems = []
    for rank in manifest.ranks:
        try:
            read_verified_meta(storage, f"{layout.step_dir_name(manifest.step)}/{rank.meta}", rank)
        except CheckpointCorruptError as exc:
            problems.append(str(exc))
    return problems + tensor_problems(storage, manifest)


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


def _copy(src: Storage, dst: Storage, name: str, size: int) -> None:
    def chunks(out: BinaryIO) -> None:
        for offset in range(0, size, CHUNK_BYTES):
            out.write(src.read_range(name, offset, min(CHUNK_BYTES, size - offset)))

    try:
        dst.write(name, chunks)  # atomic: a file is there whole or not at all
    except Exception as exc:
        raise OSError(f"copying {src.display(name)} to {dst.display(name)}: {describe_error(exc)}") from exc
