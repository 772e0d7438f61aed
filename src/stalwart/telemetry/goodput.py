"""Goodput accounting over a run's event log: where the wall time went.

Why: "it recovered" is not a number. What a user pays for is the wall time that did not move training forward;
Google's ml-goodput-measurement splits it into productive time and badput by cause, and so does this module:

- productive: time on steps that are in the final history, less the checkpoint stalls inside it;
- startup: from the launch to the first step of the first attempt, less the restore;
- checkpoint: the blocking part of saves (`checkpoint_snapshot` stall) and of memory snapshots (`snapshot_s`);
- restore: loading the state after a start (`resumed` seconds) and after a rollback;
- wasted progress: time on steps that a failure or a rollback threw away (redone later), including the part of a
  step that was running when it failed;
- detection: from a failure to the launcher noticing it (known when the failure is: an injected fault, or a
  hang's silence);
- re-formation: from the launcher noticing to the new attempt's workers starting (rendezvous, process group,
  spares, restarts);
- other: the rest (the gap between a worker's start and its first step, the end of the run).

How: the job's progress is rank 0's. Its events are cut into segments at every restart (a new attempt, by the
launcher's restart count) and every rollback. Within a segment, step completions (`step_done`, every
`log_every` steps and the first after a start) give a piecewise-linear map from step to time, from the
segment's first step start at its resume step. The next segment's resume step says how far the segment's work
was kept: time up to that step's completion is productive, the rest is wasted. Gaps between segments are
split between detection, re-formation, restore and other from the launcher's and the worker's events.
Reads only the log: works live (on a log being written) and after the run.

One model for every command that reports goodput: `stalwart report`, `stalwart chaos` and `stalwart bench
recovery` (which gives it a window of its own and also counts the kept steps at a fixed pace, `Goodput.paced`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

CATEGORIES = ("startup", "checkpoint", "restore", "wasted_progress", "detection", "reformation", "other")


@dataclass(slots=True)
class Recovery:
    """One failure or rollback as the log tells it."""

    kind: str
    """What happened: a fault's kind, "worker_failed", "hang" or "rollback"."""
    at_s: float
    """Seconds from the launch."""
    detection_s: float | None
    recovery_s: float
    """From the failure to the end of the first step completed after it. Where the failure's time is unknown (a
    kill from outside), from the last step the failed worker completed (its last heartbeat), at most a step
    before it."""
    steps_lost: int
    tier: str | None
    phases: dict[str, float] = field(default_factory=dict)
    """The time from the failure to the start of the next step, by phase: detection, reformation, restore, other
    (`recovery_s` goes on to that step's end)."""
    wasted_s: float = 0.0
    """Time spent on steps this failure threw away (they were redone)."""


@dataclass(slots=True)
class Attempt:
    """One stretch of uninterrupted progress (an attempt of the workers, or the part of one before a rollback)."""

    ended_by: str
    """A fault's kind, "worker_failed", "hang", "rollback", or "finished" for the last one."""
    points: list[tuple[float, int]]
    """(seconds from the launch, completed steps), from the stretch's first step start."""


@dataclass(slots=True)
class Goodput:
    wall_s: float
    productive_s: float
    badput: dict[str, float]
    final_step: int
    kept_steps: int = 0
    """Steps of the final history done inside the wall time (a redone step counts once)."""
    recoveries: list[Recovery] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    """Progress over time, for the report's timeline."""

    @property
    def ratio(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def paced(self, step_s: float) -> float:
        """Goodput with each kept step counted at `step_s` (a fault-free run's step time) instead of its own: it
        also charges what slowed the steps down (snapshots, spares starting, contention), not only the time down."""
        return self.kept_steps * step_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def fault_only(self) -> float:
        """Goodput charged only for start-up, failures and their recoveries: checkpoint stalls count as work."""
        return (self.productive_s + self.badput["checkpoint"]) / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(slots=True)
class _Segment:
    start: float  # first step's start
    resume: int  # completed steps when it started
    points: list[tuple[int, float]]  # (completed steps, time)
    end: float  # when its work stopped (failure, rollback, finish)
    stall_s: float = 0.0
    failure_at: float | None = None  # when its failure happened, if the log says
    detected_at: float | None = None
    kind: str = "finished"
    restore_s: float = 0.0  # the restore that started it
    tier: str | None = None

    def time_of(self, step: int) -> float:
        """When this segment completed `step` steps (interpolated between logged completions)."""
        points = [(self.resume, self.start), *self.points]
        steps = [s for s, _ in points]
        if step <= points[0][0]:
            return self.start
        if step >= points[-1][0]:
            return points[-1][1]
        i = bisect.bisect_left(steps, step)
        (s0, t0), (s1, t1) = points[i - 1], points[i]
        return t0 + (t1 - t0) * (step - s0) / (s1 - s0)

    @property
    def reached(self) -> int:
        return self.points[-1][0] if self.points else self.resume


def account(events: Iterable[dict[str, Any]], *, window: tuple[float, float] | None = None) -> Goodput:
    """The goodput of the run whose events these are (one run: one launcher's log), from its launch to its exit,
    or over `window` (monotonic start and end; events after the end are left out)."""
    events = sorted(events, key=lambda e: e.get("mono", 0.0))
    if window is not None:
        events = [e for e in events if e.get("mono", 0.0) <= window[1]]
    agent = [e for e in events if e.get("role") == "agent"]
    rank0 = [e for e in events if e.get("role") != "agent" and e.get("rank") == 0]
    if not events:
        return Goodput(0.0, 0.0, dict.fromkeys(CATEGORIES, 0.0), 0)
    start = next((e["mono"] for e in agent if e["event"] == "launcher_started"), events[0]["mono"])
    end = next((e["mono"] for e in reversed(agent) if e["event"] == "launcher_exit"), events[-1]["mono"])
    if window is not None:
        start, end = window
    segments = _segments(rank0, agent, events)
    badput = dict.fromkeys(CATEGORIES, 0.0)
    productive = 0.0
    recoveries: list[Recovery] = []
    if not segments:
        badput["startup"] = end - start
        return Goodput(end - start, 0.0, badput, 0)
    first = segments[0]
    badput["restore"] += first.restore_s
    badput["startup"] += max(0.0, first.start - start - first.restore_s)
    attempts = [
        Attempt(s.kind, [(round(s.start - start, 3), s.resume)] + [(round(t - start, 3), n) for n, t in s.points])
        for s in segments
    ]
    for i, seg in enumerate(segments):
        nxt = segments[i + 1] if i + 1 < len(segments) else None
        kept = min(nxt.resume, seg.reached) if nxt is not None else seg.reached
        kept_at = seg.time_of(kept)
        productive += kept_at - seg.start - seg.stall_s
        badput["checkpoint"] += seg.stall_s
        wasted = max(0.0, seg.end - kept_at)
        badput["wasted_progress"] += wasted
        if nxt is None:
            badput["other"] += max(0.0, end - seg.end)
            continue
        gap = nxt.start - seg.end
        detected = seg.detected_at if seg.detected_at is not None else seg.end
        detection = max(0.0, detected - seg.end) if seg.failure_at is not None else 0.0
        restarted = _worker_started(rank0, detected, nxt.start) if seg.kind != "rollback" else None
        reform = max(0.0, restarted - detected) if restarted is not None else 0.0
        restore = min(nxt.restore_s, max(0.0, gap - detection - reform))
        badput["detection"] += detection
        badput["reformation"] += reform
        badput["restore"] += restore
        other = max(0.0, gap - detection - reform - restore)
        badput["other"] += other
        lost = max(0, seg.reached - nxt.resume)
        phases = {"detection": detection, "reformation": reform, "restore": restore, "other": other}
        recoveries.append(
            Recovery(
                seg.kind,
                round(seg.end - start, 3),
                round(detection, 3) if seg.failure_at is not None else None,
                round((nxt.points[0][1] if nxt.points else nxt.start) - seg.end, 3),
                lost,
                nxt.tier,
                {k: round(v, 3) for k, v in phases.items()},
                round(wasted, 3),
            )
        )
    wall = end - start
    badput["other"] += wall - productive - sum(badput.values())  # what the segments' own accounting missed
    final = max(s.reached for s in segments)
    return Goodput(wall, productive, badput, final, final - first.resume, recoveries, attempts)


def _worker_started(rank0: list[dict[str, Any]], after: float, before: float) -> float | None:
    """When rank 0 was running again: its new worker started, or, a survivor that stayed in its loop
    (recovery/in_loop/), its restore began."""
    for e in rank0:
        if e["event"] == "worker_started" and after <= e["mono"] <= before:
            return float(e["mono"])
        if e["event"] == "resumed" and after <= e["mono"] <= before:
            return float(e["mono"]) - float(e.get("seconds", 0.0))
        if e["event"] == "shrunk" and after <= e["mono"] <= before:  # it trains on at a smaller size at once
            return float(e["mono"])
    return None


def _segments(rank0: list[dict[str, Any]], agent: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[_Segment]:
    """Rank 0's work cut at restarts and rollbacks."""
    segments: list[_Segment] = []
    current: _Segment | None = None
    pending_restore, pending_tier, resume = 0.0, None, 0
    for e in rank0:
        kind = e["event"]
        if kind in ("worker_started", "reforming"):  # a new worker, or a survivor leaving its failed group
            if current is not None:
                current.kind = "worker_failed"
                segments.append(current)
            current = None
            pending_restore, pending_tier, resume = 0.0, None, 0
        elif kind == "resumed" and current is None:
            pending_restore, pending_tier, resume = float(e.get("seconds", 0.0)), e.get("tier"), int(e["step"])
        elif kind == "shrunk":  # a survivor trains on at a smaller size from its own snapshot (recovery/shrink.py)
            pending_restore, pending_tier, resume = 0.0, "memory", int(e["step"])
        elif kind == "rolled_back":
            if current is not None:
                current.kind = "rollback"
                current.failure_at = current.detected_at = current.end = (
                    current.points[-1][1] if current.points else current.start
                )
                segments.append(current)
            current = None
            pending_restore, pending_tier, resume = float(e.get("seconds", 0.0)), e.get("tier"), int(e["step"])
        elif kind == "step_done":
            step, t = int(e["step"]), float(e["mono"])
            if current is None:
                begun = t - float(e.get("step_s", 0.0))
                current = _Segment(begun, resume, [], t, restore_s=pending_restore, tier=pending_tier)
            current.points.append((step, t))
            current.end = t
            current.stall_s += float(e.get("snapshot_s", 0.0) or 0.0)
        elif kind == "checkpoint_snapshot" and current is not None:
            current.stall_s += float(e.get("stall_s", 0.0) or 0.0)
        elif kind == "job_finished" and current is not None:
            current.end = max(current.end, e["mono"])
    if current is not None:
        segments.append(current)
    _attach_failures(segments, agent, events, rank0)
    return segments


def _attach_failures(
    segments: list[_Segment], agent: list[dict[str, Any]], events: list[dict[str, Any]], rank0: list[dict[str, Any]]
) -> None:
    """For each segment a restart ended: when its failure happened (a fault's own event, a hang's silence) and
    when the launcher noticed (its first `worker_failed` or `hang_detected` after the segment's last step)."""
    for i, seg in enumerate(segments[:-1]):
        if seg.kind == "rollback":
            continue
        nxt_start = segments[i + 1].start
        noticed = [
            e
            for e in agent
            if e["event"] in ("worker_failed", "hang_detected") and seg.end - 1.0 <= e["mono"] <= nxt_start
        ]
        if not noticed:  # the launcher itself died (a node lost): whoever killed it said so, or nobody did
            lost = [
                e
                for e in events
                if e["event"] == "fault_injected"
                and e.get("fault") in ("kill_node", "preempt", "region_loss")
                and seg.start <= e["mono"] <= nxt_start
            ]
            if lost:
                seg.failure_at = seg.detected_at = float(lost[0]["mono"])
                seg.kind = str(lost[0]["fault"])
                seg.end = max(min(seg.end, seg.failure_at), seg.start)
            continue
        first = noticed[0]
        seg.detected_at = float(first["mono"])
        _reached_by_beat(seg, [e for e in noticed if e.get("last_step_mono", 0.0) <= seg.detected_at])
        # The cause: an injected fault, or the agent acting on a GPU's XID (it stops that GPU's worker itself).
        faults = [
            e
            for e in events
            if e["event"] in ("fault_injected", "gpu_action") and seg.start <= e["mono"] <= seg.detected_at
        ]
        hang = next((e for e in noticed if e["event"] == "hang_detected"), None)
        if faults:
            first_fault = faults[0]
            seg.failure_at = float(first_fault["mono"])
            seg.kind = "gpu_xid" if first_fault["event"] == "gpu_action" else str(first_fault.get("fault", "fault"))
        elif hang is not None:
            seg.failure_at, seg.kind = float(hang["mono"]) - float(hang.get("silent_s", 0.0)), "hang"
        if seg.failure_at is not None:
            seg.end = min(max(seg.end, seg.failure_at), seg.detected_at)


def _reached_by_beat(seg: _Segment, noticed: list[dict[str, Any]]) -> None:
    """The steps the segment completed past its last `step_done` (logged every `log_every` steps): the agent's
    `worker_failed` says how many the failed worker had completed by its last heartbeat and when (its ranks step
    together), so that the steps redone and the time to the next step count from there, not from the last log."""
    beats = [(int(e["last_step"]), float(e["last_step_mono"])) for e in noticed if "last_step_mono" in e]
    if not beats:
        return
    step, at = max(beats)
    if step > seg.reached and at >= (seg.points[-1][1] if seg.points else seg.start):
        seg.points.append((step, at))
        seg.end = max(seg.end, at)


def breakdown_rows(g: Goodput) -> list[tuple[str, float, float]]:
    """(category, seconds, share of the wall time), productive first."""
    rows = [("productive", g.productive_s, g.ratio)]
    rows += [(name, g.badput[name], g.badput[name] / g.wall_s if g.wall_s else 0.0) for name in CATEGORIES]
    return rows
