"""How `Job()` joins the default group (`join_group`), and what a replacement that joins late makes before its loop
(`set_up_placeholder`). Joining late itself, and the job growing back, are in-loop recovery's
(recovery/in_loop/late_join.py); a warm spare is a replacement that joined late after waiting, parked, for a rank
(recovery/warm_spare.py)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from stalwart.job.parts import JobView
from stalwart.job.state import TrackedState
from stalwart.recovery import script_group, warm_spare
from stalwart.recovery.in_loop import survivor
from stalwart.runtime import group as reformable
from stalwart.runtime.dist import Placement, init_process_group
from stalwart.telemetry.events import EventLog


def join_group(placement: Placement, timeout: timedelta) -> tuple[bool, bool]:
    """`Job()` joins the default group: (whether it defers joining for real, whether it made the group). A replacement
    whose survivors may train on shrunk defers it to its loop's start (in_loop/late_join.join_late). A group the
    script made first is kept: under `stalwart run` its call made the re-formable group, a placeholder where this Job
    defers (recovery/script_group.py); any other group the script made is never swapped, whatever the mode."""
    if warm_spare.waiting():
        warm_spare.set_up_started()
    if dist.is_initialized():
        current = reformable.current()
        if current is not None and dist.group.WORLD is current:
            return current.placeholder, False
        script_group.notice_if_plain()
        return False, False
    in_loop = survivor.in_loop()
    deferred = script_group.placeholder_wanted()
    return deferred, init_process_group(placement, timeout, reformable=in_loop, placeholder=deferred)


def set_up_placeholder(job: JobView, created: Any) -> None:
    """What a replacement's Job needs before its loop: its events, the tracked objects, the state (`created`: the
    JobState) and step."""
    placement = job.placement
    if warm_spare.waiting():  # a spare's events carry no rank until it is given one
        job.events = EventLog.from_env(role="warm_spare")
    else:
        job.events = EventLog.from_env(rank=placement.rank, restart=placement.restart_count)
    job.tracked = TrackedState(
        placement.rank, placement.world_size, job.events, None, lr_scaling=job.config.recovery.lr_scaling
    )
    job.state = created
    job.step = 0
    job.resumed_from = None
