"""The two ways a worker leaves its training loop on purpose: a preemption every rank agreed on, and the eviction
of a persistent straggler. Both first make the state of the step durable, so that nothing is lost by leaving."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from stalwart.checkpoint.manager import Checkpointer
from stalwart.detect.hang import HangTimer
from stalwart.detect.heartbeat import PHASE_DONE, PHASE_SAVE, Heartbeat
from stalwart.errors import EXIT_EVICTED
from stalwart.telemetry.events import EventLog


def preempt(
    step: int,
    saved: bool,
    save: Callable[[], object],
    checkpointer: Checkpointer,
    events: EventLog,
    heartbeat: Heartbeat,
    *,
    is_main: bool,
) -> None:
    """Every rank, at the step they agreed on: a last durable checkpoint (`save`, unless this step's is `saved`
    already), then a clean exit (status 0), so the launcher, which got SIGTERM, ends without a restart and the
    next launch resumes from this step."""
    if not saved:
        save()
    else:
        checkpointer.wait_durable()
    events.emit("preempted", step=step)
    if is_main:
        print(f"stalwart: preempted: the checkpoint of step {step} is durable; exiting", file=sys.stderr, flush=True)
    heartbeat.beat(step, PHASE_DONE, None)
    raise SystemExit(0)


def evict(
    step: int,
    straggler: int,
    rank: int,
    checkpointer: Checkpointer,
    events: EventLog,
    heartbeat: Heartbeat,
    hang: HangTimer,
) -> None:
    """Every rank, at the step the straggler was flagged: once the checkpoint of this step is durable, the
    straggler's process leaves; the others meet its absence at their next collective and re-form with its
    replacement (the `straggler_policy` option)."""
    heartbeat.beat(step, PHASE_SAVE, hang.grace())
    checkpointer.wait_durable()  # collective: the state of this step outlives the eviction
    if rank != straggler:
        return
    events.emit("straggler_evicted", step=step, straggler=straggler)
    print(
        f"stalwart: rank {straggler} leaves as a straggler at step {step}; a replacement takes its place",
        file=sys.stderr,
        flush=True,
    )
    heartbeat.close()
    os._exit(EXIT_EVICTED)  # no clean-up that could wait on the peers: they are about to re-form without it
