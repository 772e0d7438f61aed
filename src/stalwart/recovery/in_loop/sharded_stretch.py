"""Training on shrunk with sharded state: FSDP2 survivors shard their modules among themselves, and back at the grow.

Why: a survivor of an FSDP2 job holds only its own shards, so it could not train on without the lost rank's (the
survivors waited for the replacement's whole set-up: 5 s of set-up cost 5 s a kill). But the lost rank's newest full
snapshot is still in node memory (its slots outlive its process; on another node, a peer replica or the node that
holds it sends the parts wanted: recovery/memory_reshard.py), so the survivors can take the whole state from there:

1. once they formed their own group (recovery/shrink.form, W' of the job's W ranks), each shards its FSDP2 modules
   again in place on a mesh of that group (runtime/torch_compat_fsdp.reshard_in_place) and loads the newest step
   every old rank's image is whole for, resharded onto the new shards, its own per-rank objects and generators with
   it (`shard_among_survivors`); a tracked ResumableLoader takes the survivor's slice of W' (each global batch kept
   whole: the slices grow);
2. they train on so (recovery/in_loop/shrunk.py);
3. at the grow each writes its shards of the step reached into node memory as a snapshot of W' ranks, in slots of
   their own kind that no other restore reads (`leave_snapshot`), and the whole job re-forms: the survivors shard in
   place again for W (recovery/in_loop/driver.py), and every rank, the replacement too, loads that step from the
   survivors' images (`grow`), its per-rank objects its own: a survivor's from its image, the replacement's (and
   its generators) from its predecessor's newest snapshot; then the images are removed (`forget`).

A step that can fail on one survivor alone (the in-place reshard, the load, the write) is agreed on, so none is
left waiting in a collective the others never enter.

The learning rate is left as it is (the global batch is kept, or, with the script's own data, the survivors' is
smaller for those steps, as with DDP). Where the modules cannot be sharded again in place (runtime/torch_compat_fsdp
`why_not`: HSDP, hooks it cannot carry) or node memory lacks a whole image of some rank, the
survivors wait for the replacement, as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from stalwart.checkpoint.format import sharded
from stalwart.checkpoint.load.rank_state import Restored
from stalwart.checkpoint.tiers.memory import MemoryTier
from stalwart.data.loader import ResumableLoader
from stalwart.errors import CheckpointCorruptError, ConfigError
from stalwart.recovery import memory_reshard, reform, shrink
from stalwart.recovery.in_loop import survivor
from stalwart.recovery.in_loop.group_side import Grow, NewWorldForShards
from stalwart.recovery.in_loop.port import LoopJob
from stalwart.runtime import torch_compat_fsdp
from stalwart.runtime.dist import Comm, Placement
from stalwart.runtime.process import first_line
from stalwart.telemetry.events import EventLog


def why_not(objects: Iterable[Any], world_size: int, survivors: int) -> str | None:
    """Why the survivors of a job whose tracked `objects` hold sharded state cannot train on at `survivors` of its
    `world_size` ranks; None when they can."""
    objects = list(objects)
    if torch_compat_fsdp.sharded_as(objects) is None:
        return "the job holds sharded state that is not FSDP2 over the whole world (a 1-D mesh of every rank)"
    why = torch_compat_fsdp.why_not(objects, world_size, survivors)
    if why is not None:
        return f"its FSDP2 modules cannot be sharded again in place ({why})"
    if any(isinstance(o, ResumableLoader) and o.batch_size_per_rank is not None for o in objects):
        return (
            "its ResumableLoader's global batch scales with the world (batch_size_per_rank): fewer ranks cannot keep it"
        )
    return None


def loaders_divide(objects: Iterable[Any], kept: tuple[int, ...] | None) -> bool:
    """Whether every tracked ResumableLoader among `objects` can give each of the `kept` survivors a slice of every
    global batch (its global batch divides among them); False without one."""
    loaders = [o for o in objects if isinstance(o, ResumableLoader)]
    if not loaders or not kept:
        return False
    try:
        for loader in loaders:
            loader.check_world(len(kept))
    except ConfigError:
        return False
    return True


def _directory(job: LoopJob) -> Path | None:
    memory = job.parts.snapshots.memory
    return memory.directory if memory is not None else None


def _comm(job: LoopJob, plan: shrink.Plan) -> Comm:
    """stalwart's own group among the survivors (their default group is theirs since shrink.form)."""
    here = job.placement
    survivors = Placement(plan.shrunk_rank, plan.size, here.local_rank, here.restart_count, here.local_world_size)
    return Comm(survivors, timedelta(seconds=job.config.collective_timeout_s))


def _all_ok(plan: shrink.Plan, ok: bool) -> bool:
    """Whether every survivor says `ok` (one all-reduce on their group): a step that can fail on one survivor alone
    is agreed on, so none is left waiting in a collective the others never enter."""
    (failed,) = shrink.agree(plan, not ok)
    return not failed


def shard_among_survivors(job: LoopJob, plan: shrink.Plan) -> str | None:
    """Step 1 of the module docstring, on every survivor together once their group formed. Returns why not (nothing
    changed: the survivors wait for the replacement instead), None once done. Once the modules began to change, a
    failure on any survivor raises NewWorldForShards on every one: the script runs again."""
    objects = dict(job.tracked.objects)
    why = why_not(objects.values(), plan.world_size, plan.size)
    if why is not None:
        return why
    here = Placement.from_env()
    events = EventLog.from_env(rank=here.rank, restart=here.restart_count)  # the job's own closed as it left
    comm = _comm(job, plan)
    again = "sharding the FSDP2 modules again among the survivors failed ({}); running the script again"
    try:
        directory = _directory(job)
        found = memory_reshard.survey(comm, directory, plan.size, -1)
        if found is None or found.world_size != plan.world_size:
            return f"node memory holds no step of which every one of the {plan.world_size} ranks' images is whole"
        problem = ""
        try:
            modules, seconds = reshard_in_place(objects, plan.world_size, lambda why: NewWorldForShards(why))
        except NewWorldForShards as exc:
            problem, modules, seconds = str(exc), 0, 0.0
        if not _all_ok(plan, not problem):
            raise NewWorldForShards(again.format(problem or "on another survivor"))
        restored = memory_reshard.restore(
            comm, events, directory, found, job.tracked.meshes(), allowed=True, old_rank=plan.rank
        )
        if restored is None:
            raise NewWorldForShards(again.format(f"node memory's step {found.step} could not be read whole"))
        try:
            job.tracked.load(restored)  # of the job's W ranks: its own generators and per-rank objects, resharded
        except Exception as exc:
            problem = f"loading step {found.step} onto the survivors' shards: {first_line(exc)}"
        if not _all_ok(plan, not problem):
            raise NewWorldForShards(again.format(problem or "on another survivor"))
        if found.step != job.step:
            back = "the newest step of which node memory holds every rank's shards"
            events.emit("went_back", step=found.step, failed_at=job.step, why=back)
        events.emit(
            "resharded_in_place",
            step=found.step,
            world_from=plan.world_size,
            world_to=plan.size,
            modules=modules,
            seconds=seconds,
        )
    except NewWorldForShards:
        raise
    except Exception as exc:  # a collective failed: a survivor died meanwhile
        raise NewWorldForShards(again.format(f"a survivor was lost: {first_line(exc)}")) from exc
    finally:
        comm.close()
        events.close()
    survivor.drop_stash()  # the live tensors are the survivors' shards now, not the failed step's
    job.move_to(found.step)
    for obj in objects.values():  # each global batch kept whole: the survivor's slice of W' ranks
        if isinstance(obj, ResumableLoader):
            obj.rebind(plan.shrunk_rank, plan.size)
    return None


STRETCH = "stretch"
"""The slot kind of the images survivors leave at the grow (checkpoint/tiers/slot_files.py): no other restore reads
them, so an image left behind by a grow that failed never passes for a snapshot of the job."""


def leave_snapshot(job: LoopJob, plan: shrink.Plan) -> None:
    """Step 3's first half: this survivor's state of the step reached, as a snapshot of W' ranks in its node-memory
    stretch slot, then agreed: the whole job reads them all next. A write that failed on any survivor raises
    ShrunkFailed on every one (their host runs the script again, from the last snapshot). A tracked
    ResumableLoader is bound to this rank of the whole job again."""
    directory, problem = _directory(job), ""
    if directory is None:
        problem = "no node memory"
    else:
        here = job.placement
        tier = MemoryTier(directory, plan.shrunk_rank, plan.size, here.local_rank, plan.size, kind=STRETCH)
        try:
            state = job.tracked.state(job.step)
            state["world_size"] = plan.size
            tier.snapshot(job.step, state)
        except Exception as exc:  # /dev/shm full, a state that does not serialise
            problem = first_line(exc)
        finally:
            tier.close()
    if not _all_ok(plan, not problem):  # every survivor's image is whole before any rank of the whole job reads it
        raise shrink.ShrunkFailed(f"a survivor could not leave its shards of step {job.step} in node memory: {problem}")
    for obj in job.tracked.objects.values():
        if isinstance(obj, ResumableLoader):
            obj.rebind(plan.rank, plan.world_size)


def grow(job: LoopJob, plan: Grow, capture_rng: Callable[[], dict[str, Any]]) -> Restored:
    """Step 3's second half, on every rank of the whole job in its restore: the survivors' snapshot of the step they
    reached, resharded onto this rank's shards. A survivor keeps its own per-rank objects (its image's) and its
    generators as they are; a replacement reads a survivor's, and takes its predecessor's per-rank objects and
    generators from node memory afterwards (late_join._take_own_parts: all but what `steps_with_the_job` names).
    CheckpointCorruptError when the images are not there whole: no rank holds the state of that step otherwise.
    `forget` once it is loaded."""
    directory = _directory(job)
    kept = [r for r in range(job.world_size) if r not in plan.receivers]
    found = memory_reshard.survey(job.comm, directory, job.world_size, -1, STRETCH)
    if found is None or (found.world_size, found.step) != (len(kept), plan.step):
        raise CheckpointCorruptError(
            f"node memory holds no whole snapshot of the {len(kept)} survivors at step {plan.step}, which their "
            f"shards were left in (found: {found})"
        )
    own = job.rank in kept
    old_rank = kept.index(job.rank) if own else job.rank % found.world_size
    restored = memory_reshard.restore(
        job.comm, job.events, directory, found, job.tracked.meshes(), allowed=True, old_rank=old_rank
    )
    if restored is None:
        raise CheckpointCorruptError(f"the survivors' snapshot of step {plan.step} could not be read whole")
    state = {**restored.state, "rng": capture_rng()} if own else restored.state
    return dataclasses.replace(restored, state=state, world_size=job.world_size)


def forget(job: LoopJob) -> None:
    """Once every rank loaded the survivors' images (a barrier), each removes its node's stretch slots of its local
    rank: they served their one grow."""
    job.comm.barrier()
    directory = _directory(job)
    if directory is None:
        return
    for path in directory.glob(f"local{job.placement.local_rank:05d}.{STRETCH}*"):
        with contextlib.suppress(OSError):
            path.unlink()


def steps_with_the_job(obj: Any) -> bool:
    """Whether `obj`'s state is the job's, whichever rank holds it: shards (modules, optimizers, anything holding
    DTensors), a learning-rate scheduler (it steps with the optimizers, the same on every rank), a grad scaler (one
    loss scale), a ResumableLoader (its position is global). A replacement takes these from the survivors' images,
    not from its predecessor's older snapshot."""
    from torch.amp import GradScaler  # FSDP's ShardedGradScaler too: one loss scale for the whole job
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    kinds = (torch.nn.Module, torch.optim.Optimizer, LRScheduler, ReduceLROnPlateau, ResumableLoader, GradScaler)
    return isinstance(obj, kinds) or bool(sharded.meshes_of([obj]))


def reshard_in_place(
    objects: dict[str, Any], world_size: int, fallback: Callable[[str], reform.RunAgainInRound]
) -> tuple[int, float]:
    """The tracked FSDP2 modules, sharded for `world_size` ranks (or as another rank), sharded again in this process
    for the rank and world of the group just made (runtime/torch_compat_fsdp.py), instead of running the script's
    set-up again: a warm spare given another rank (here), a survivor whose world size changed (in_loop/driver.py).
    The restore or hand-over that follows writes the state into the new shards. A failure part-way raises
    `fallback(why)`: part of the model may be undone, and only the script's set-up builds it again. Returns the
    modules sharded again and the seconds it took."""
    started = time.monotonic()
    try:
        modules = torch_compat_fsdp.reshard_in_place(objects.values(), world_size)
    except Exception as exc:
        raise fallback(first_line(exc)) from exc
    return modules, round(time.monotonic() - started, 4)
