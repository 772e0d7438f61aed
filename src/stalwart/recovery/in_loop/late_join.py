"""A replacement that joins late, and the job growing back to its full size (recovery/shrink.py says why); a warm
spare is one that joins late after waiting, parked, for a rank (recovery/warm_spare.py).

While the survivors of a failure train on shrunk, the replacement's `stalwart.Job()` makes only what the user's
set-up needs (job/joining.set_up_placeholder): its group is a placeholder that runs collectives locally (so DDP's
constructor meets nobody) and its tracked objects are recorded. It joins the job's group for real when its training
loop starts (`join_late`, from `Job.resume`), after announcing itself; the survivors grow back at their next step
boundary, and the whole job takes the lowest survivor's state at the step it reached (`grow`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from stalwart.checkpoint.format import sharded
from stalwart.checkpoint.load.rank_state import Restored
from stalwart.data.loader import ResumableLoader
from stalwart.recovery import reform, script_group, shrink, warm_spare
from stalwart.recovery.in_loop import sharded_stretch, survivor
from stalwart.recovery.in_loop.port import LoopJob
from stalwart.runtime import torch_compat_fsdp
from stalwart.runtime.dist import init_process_group
from stalwart.runtime.process import first_line, say


def join_late(job: LoopJob) -> None:
    """The replacement reached its loop: announce it, then join the job's group (it waits there for the survivors
    to come at their next step boundary) and make every part, as `Job()` makes them for a worker that joins at once.
    Nothing for a job that did not defer it."""
    if not job.membership.deferred:
        return
    spare = warm_spare.waiting()
    objects = dict(job.tracked.objects)
    reshard, set_up_world = False, job.world_size
    if spare:  # parked until the agent gives this spare a lost rank
        shards = bool(sharded.meshes_of(objects.values()))
        provisional = job.placement
        job.placement = warm_spare.park(job.events, provisional)
        moved = (job.placement.rank, job.placement.world_size) != (provisional.rank, provisional.world_size)
        reshard = shards and moved
        if reshard:
            why = torch_compat_fsdp.why_not(objects.values(), provisional.world_size, job.placement.world_size)
            if why is not None or not torch_compat_fsdp.fsdp_modules(objects.values()):
                raise reform.RunAgainInRound(
                    f"a warm spare set up as rank {provisional.rank} holds state sharded for that rank "
                    f"({why or 'no fully_shard'}) and was given rank {job.placement.rank}: its set-up runs again"
                )
        if moved:
            for obj in objects.values():  # its slice of each global batch is the given rank's, not the set-up's
                if isinstance(obj, ResumableLoader):
                    obj.rebind(job.placement.rank, job.placement.world_size)
    started = time.monotonic()
    shrink.announce_ready(job.rank)
    job.events.close()
    reform.abort_process_groups()  # the placeholder
    job.membership.owns_process_group = init_process_group(
        job.placement,
        timedelta(seconds=job.config.collective_timeout_s),
        reformable=True,
        store=script_group.given_store(),  # the script's store holds the round's port on rank 0
    )
    resharded = None
    if reshard:
        resharded = sharded_stretch.reshard_in_place(
            objects,
            set_up_world,
            lambda why: reform.RunAgainInRound(
                f"a warm spare could not shard its FSDP2 modules again for its rank ({why}): its set-up runs again"
            ),
        )
    job.set_up_parts()
    job.tracked.track(**objects)
    job.membership.deferred = False
    if spare:
        job.events.emit("worker_started", world_size=job.world_size, local_rank=job.placement.local_rank, spare=True)
    if resharded is not None:
        job.events.emit(
            "resharded_in_place",
            step=job.step,
            world_from=set_up_world,
            world_to=job.world_size,
            modules=resharded[0],
            seconds=resharded[1],
        )
    job.events.emit("joined_late", world_size=job.world_size, seconds=round(time.monotonic() - started, 4))


def grow(job: LoopJob, capture_rng: Callable[[], dict[str, Any]]) -> bool:
    """In `Job.resume`: when the survivors trained on shrunk, the job takes the lowest survivor's state at the step
    they reached and returns True; False otherwise (the usual restore). A replacement's per-rank objects and random
    generators are its own rank's (`_take_own_parts`), not the survivor's."""
    in_loop = job.parts.in_loop
    plan = in_loop.grow if in_loop is not None else None
    if plan is None:
        return False
    started = time.monotonic()
    if job.rank in plan.receivers:
        job.parts.hooks.joined(plan.step)  # fault injection's seam: a replacement lost while joining
    shards = bool(sharded.meshes_of(job.tracked.objects.values()))
    own_parts: str | None = None
    restored: Restored | None
    if shards:  # the survivors' shards of the step they reached, from their snapshot in node memory
        restored = sharded_stretch.grow(job, plan, capture_rng)
        if job.rank in plan.receivers:
            own_parts = _take_own_parts(job, restored.state, plan.step, capture_rng, sharded_stretch.steps_with_the_job)
        else:
            own_parts = "its own"
    else:
        restored = job.parts.restorer.hand_over(
            plan.step, plan.source, plan.receivers, lambda: job.tracked.state(plan.step)
        )
        if restored is not None:
            own_parts = _take_own_parts(job, restored.state, plan.step, capture_rng)
    if restored is not None:
        job.load_restored(restored)
    if shards:
        sharded_stretch.forget(job)  # after every rank's load: they read the survivors' images
    job.move_to(plan.step)
    job.resumed_from = plan.step
    survivor.drop_stash()
    tier = "memory" if shards else "peer"
    job.events.emit(
        "resumed",
        step=plan.step,
        source=f"{'the survivors in node memory' if shards else f'rank {plan.source}'} (the job grew back)",
        tier=tier,
        bytes=restored.bytes if restored is not None else 0,
        own_parts=own_parts,
        seconds=time.monotonic() - started,
    )
    if job.rank == 0:
        state = "the survivors' shards from node memory" if shards else f"rank {plan.source}'s state"
        say(
            f"stalwart: back at {job.world_size} ranks at step {plan.step}: rank(s) {list(plan.receivers)} joined with "
            f"{state} ({time.monotonic() - started:.2f} s)"
        )
    job.events.emit(
        "world_resized",
        **{"from": job.world_size - len(plan.receivers), "to": job.world_size},
        why=f"rank(s) {list(plan.receivers)} joined",
        tier=tier,
        step=plan.step,
        seconds=round(time.monotonic() - started, 4),
    )
    return True


class _AnyTensor(dict[str, Any]):
    """Stands in for the live replicated tensors when only a light snapshot's per-rank part is wanted."""

    def __contains__(self, key: object) -> bool:
        return True

    def __getitem__(self, key: str) -> torch.Tensor:
        return torch.empty(0)


def _take_own_parts(
    job: LoopJob,
    state: dict[str, Any],
    step: int,
    capture_rng: Callable[[], dict[str, Any]],
    stays: Callable[[Any], bool] = lambda obj: isinstance(obj, ResumableLoader),
) -> str:
    """Into `state` (the survivor's), this rank's own per-rank objects, random generators and detector history
    from the newest snapshot its predecessor left in node memory (at most `step`): the survivors stood in for the
    missing rank while the job ran shrunk, so what the missing rank's own objects recorded until its failure
    (the samples it saw, its generators) goes on from there. Without one, the replacement keeps its own
    generators and takes the survivor's per-rank objects. The replicated objects, and those `stays` names (a
    ResumableLoader: its position is global; with sharded state everything that steps with the job,
    sharded_stretch.steps_with_the_job), are the survivor's either way. Returns where they came from (the `resumed`
    event's `own_parts`)."""
    own, source = None, "none in node memory"
    memory = job.parts.snapshots.memory
    if memory is not None:
        full = [s for s in memory.steps() if s <= step]
        light = [s for s in memory.steps(light=True) if s <= step]
        replicated = {n: v for n, v in state["objects"].items() if n in job.tracked.replicated}
        try:
            if light and (not full or light[0] > full[0]):
                source = f"light snapshot of step {light[0]}"
                _, content = memory.light(light[0])
                own = memory.load_light(light[0], content, _AnyTensor(), replicated).state
            elif full:
                source = f"full snapshot of step {full[0]}"
                own = memory.load(full[0]).state
        except Exception as exc:  # a torn or foreign image: the survivor's parts are still a whole state
            source = f"{source} unreadable ({first_line(exc)})"
    if own is None:
        state["rng"] = capture_rng()
        return f"the survivor's, with this process's own generators: {source}"
    objects = job.tracked.objects
    for name in state["objects"]:
        obj = objects.get(name)
        mine = name not in job.tracked.replicated and not (obj is not None and stays(obj))
        if mine and name in own["objects"]:
            state["objects"][name] = own["objects"][name]
    state["rng"] = own["rng"]
    if "detectors" in own:
        state["detectors"] = own["detectors"]
    return source
