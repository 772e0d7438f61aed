"""How a Job's parts end: closed when the job ends (`close`, at the end of the script or at interpreter exit), or
what was made when `Job()` itself fails (`close_partial`). A Job dropped after its group failed is in-loop
recovery's (recovery/in_loop/driver.abandon)."""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from stalwart.job.parts import JobView


def close(job: JobView) -> None:
    """Every part, the process group last (if the job made it), the event log after it."""
    if job.membership.deferred:  # a replacement that never reached its loop (job/joining.py): it made only these
        close_partial(job)
        return
    for close_part in (job.parts.snapshots.close_commit, job.parts.optimizer_hooks.close, job.parts.detectors.close):
        close_part()
    job.parts.heartbeat.close()
    if job.parts.snapshots.memory is not None:
        job.parts.snapshots.memory.close()
    job.checkpointer.close()
    job.comm.close()
    if job.membership.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
        job.membership.owns_process_group = False
    job.events.close()


def close_partial(job: JobView) -> None:
    """After a failed `Job()`: close what it made (a Job the caller never got; job/parts.make_parts closes its own
    when one of them fails), then leave the group."""
    for name in ("comm", "events"):
        part = getattr(job, name, None)
        if part is not None:
            with contextlib.suppress(Exception):
                part.close()
    if job.membership.owns_process_group and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        job.membership.owns_process_group = False
