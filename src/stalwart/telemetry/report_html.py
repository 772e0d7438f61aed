"""The HTML page of `stalwart report`: a run's timeline, goodput breakdown and recoveries, as one file.

Why a page and not only the terminal table: a timeline shows at a glance what a table cannot, when each fault
landed, how long the job stood still and how much work it redid; and one self-contained file (figures inline as
SVG, no scripts, no external links) can be attached to a ticket or opened on a laptop without the run's machine.

The figures come from matplotlib (Agg, no display needed); it is imported here only, so training never pays for
it. Everything is computed from the event log by telemetry/goodput.py; this module only draws.
"""

from __future__ import annotations

import html
import io
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stalwart.telemetry.goodput import Goodput, breakdown_rows

COLORS = {
    "productive": "#2e7d32",
    "startup": "#90a4ae",
    "checkpoint": "#1565c0",
    "restore": "#6a1b9a",
    "wasted_progress": "#c62828",
    "detection": "#ef6c00",
    "reformation": "#f9a825",
    "other": "#bdbdbd",
}
PHASES = ("detection", "reformation", "restore", "other")
MAX_RUG = 300
"""Committed checkpoints drawn along the timeline's bottom; more only paint a bar."""
MAX_POINTS = 2000
"""Points per attempt on the timeline (keeps the page small for a run of hours)."""
MARKS = {  # event -> (label, colour, line style) on the timeline
    "fault_injected": ("fault", "#c62828", "-"),
    "worker_failed": ("failure noticed", "#ef6c00", ":"),
    "hang_detected": ("hang detected", "#ef6c00", ":"),
    "rolled_back": ("rollback", "#6a1b9a", "--"),
    "preemption_requested": ("preemption", "#37474f", "--"),
    "risk_checkpoint": ("risk checkpoint", "#1565c0", "--"),
}
NOTABLE = (
    "fault_injected",
    "worker_failed",
    "hang_detected",
    "rolled_back",
    "checkpoint_committed",
    "checkpoint_invalid",
    "checkpoint_write_failed",
    "nonfinite_gradients",
    "batch_skipped",
    "loss_spike",
    "grad_norm_spike",
    "straggler_detected",
    "replica_divergence",
    "gpu_risk",
    "gpu_xid",
    "risk_checkpoint",
    "preempted",
    "node_excluded",
    "spares_started",
)


def render(g: Goodput, events: list[dict[str, Any]], source: Path) -> str:
    """The page for the run whose events these are (`g` = account(events))."""
    start = _launch_time(events)
    figures = [
        (
            "Progress",
            "Completed steps against wall time, one line per attempt (x: where an attempt's work "
            "stopped); vertical lines mark faults, the launcher noticing a failure, rollbacks and risk checkpoints; "
            "ticks along the bottom, committed checkpoints. Steps drawn again after a drop were redone.",
            _timeline(g, events, start),
        ),
        (
            "Where the wall time went",
            "Goodput categories (Google's ml-goodput-measurement): productive time, and badput by cause.",
            _breakdown(g),
        ),
    ]
    if g.recoveries:
        figures.append(
            (
                "Recoveries",
                "From each failure (or rollback) to the next step, by phase; the number is the steps redone.",
                _recoveries(g),
            )
        )
    summary = [
        ("event log", html.escape(str(source))),
        ("wall time", f"{g.wall_s:.1f} s"),
        ("steps", str(g.final_step)),
        ("goodput", f"{100 * g.ratio:.1f}%"),
        ("failures and rollbacks", str(len(g.recoveries))),
        ("ended", html.escape(_ending(events))),
    ]
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>stalwart report: {html.escape(source.parent.name or str(source))}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>stalwart report</h1>",
        _table(["", ""], summary, cls="summary"),
    ]
    for title, caption, svg in figures:
        parts += [
            f"<h2>{html.escape(title)}</h2>",
            f"<figure>{svg}<figcaption>{html.escape(caption)}</figcaption></figure>",
        ]
    rows = [(n.replace("_", " "), f"{s:.2f}", f"{100 * share:.1f}%") for n, s, share in breakdown_rows(g)]
    parts += ["<h2>Breakdown</h2>", _table(["", "seconds", "share"], rows)]
    if g.recoveries:
        rec = [
            (
                str(i),
                html.escape(r.kind),
                f"{r.at_s:.1f} s",
                _s(r.detection_s),
                _s(r.phases.get("reformation")),
                _s(r.phases.get("restore")),
                _s(r.recovery_s),
                str(r.steps_lost),
                html.escape(r.tier or "?"),
            )
            for i, r in enumerate(g.recoveries, 1)
        ]
        parts += [
            "<h2>Failures and rollbacks</h2>",
            _table(
                ["#", "what", "at", "detection", "re-formation", "restore", "to next step", "steps lost", "state from"],
                rec,
            ),
        ]
    counts = Counter(str(e.get("event")) for e in events if e.get("event") in NOTABLE)
    if counts:
        parts += ["<h2>Events</h2>", _table(["event", "count"], [(k, str(counts[k])) for k in NOTABLE if k in counts])]
    parts.append(f"<footer>written {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by stalwart report</footer>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _launch_time(events: list[dict[str, Any]]) -> float:
    started = [e["mono"] for e in events if e.get("event") == "launcher_started" and "mono" in e]
    return float(min(started)) if started else float(min(e.get("mono", 0.0) for e in events))


def _ending(events: list[dict[str, Any]]) -> str:
    exits = [e for e in events if e.get("event") == "launcher_exit"]
    if not exits:
        return "still running (or the launcher was killed)"
    last = exits[-1]
    return f"{last.get('reason', '?')} (exit status {last.get('exitcode', '?')})"


def _s(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds:.2f} s"


def _table(header: list[str], rows: Sequence[tuple[str, ...]], cls: str = "") -> str:
    head = "".join(f"<th>{h}</th>" for h in header) if any(header) else ""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    thead = f"<thead><tr>{head}</tr></thead>" if head else ""
    return f'<table class="{cls}">{thead}<tbody>{body}</tbody></table>'


def _figure(width: float, height: float) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")  # no display; the page embeds the SVG text
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "font.size": 9, "axes.spines.top": False, "axes.spines.right": False})
    return plt.subplots(figsize=(width, height), layout="constrained")


def _svg(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buffer = io.StringIO()
    fig.savefig(buffer, format="svg")
    plt.close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg") :]  # the XML prologue and doctype do not belong inside HTML


def _timeline(g: Goodput, events: list[dict[str, Any]], start: float) -> str:
    fig, ax = _figure(10, 3.8)
    for i, attempt in enumerate(g.attempts):
        points = attempt.points
        if len(points) > MAX_POINTS:  # a long run logs every step: a few thousand points draw the same line
            stride = -(-len(points) // MAX_POINTS)
            points = [*points[::stride], points[-1]]
        ts = [t for t, _ in points]
        steps = [s for _, s in points]
        ax.plot(
            ts,
            steps,
            color=COLORS["productive"] if attempt.ended_by == "finished" else "#455a64",
            lw=1.4,
            label="progress" if i == 0 else None,
        )
        if attempt.ended_by != "finished" and ts:
            ax.plot([ts[-1]], [steps[-1]], "x", color=COLORS["wasted_progress"], ms=6)
    seen: set[str] = set()
    for e in events:
        kind = e.get("event")
        if kind not in MARKS or "mono" not in e:
            continue
        if kind == "risk_checkpoint" and e.get("rank") not in (0, None):
            continue
        if kind == "rolled_back" and e.get("rank") not in (0, None):
            continue
        label, color, style = MARKS[str(kind)]
        ax.axvline(
            float(e["mono"]) - start,
            color=color,
            ls=style,
            lw=0.9,
            alpha=0.8,
            label=label if label not in seen else None,
        )
        seen.add(label)
        if kind == "fault_injected" and len(g.recoveries) <= 20:  # beyond that the names overlap
            ax.annotate(
                str(e.get("fault", "fault")),
                (float(e["mono"]) - start, 1.0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha="right",
                fontsize=7,
                color=color,
            )
    committed = [float(e["mono"]) - start for e in events if e.get("event") == "checkpoint_committed" and "mono" in e]
    if 0 < len(committed) <= MAX_RUG:  # a rug along the bottom: when each durable checkpoint became usable
        ax.plot(
            committed,
            [0] * len(committed),
            "|",
            color=COLORS["checkpoint"],
            ms=9,
            mew=1.2,
            clip_on=False,
            label="checkpoint committed",
        )
    ax.set_xlabel("seconds from the launch")
    ax.set_ylabel("completed steps")
    ax.set_xlim(left=0, right=max(g.wall_s, 1e-3))
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8, frameon=True, framealpha=0.9)
    return _svg(fig)


def _breakdown(g: Goodput) -> str:
    rows = breakdown_rows(g)
    fig, ax = _figure(10, 0.35 * len(rows) + 0.8)
    names = [n.replace("_", " ") for n, _, _ in rows]
    seconds = [s for _, s, _ in rows]
    bars = ax.barh(names, seconds, color=[COLORS[n] for n, _, _ in rows])
    ax.invert_yaxis()
    for bar, (_, s, share) in zip(bars, rows, strict=True):
        ax.annotate(
            f" {s:.1f} s  {100 * share:.1f}%",
            (bar.get_width(), bar.get_y() + bar.get_height() / 2),
            va="center",
            fontsize=8,
        )
    ax.set_xlabel("seconds")
    ax.set_xlim(right=max([*seconds, 1e-3]) * 1.25)
    return _svg(fig)


def _recoveries(g: Goodput) -> str:
    shown = g.recoveries[:60]  # beyond that one bar per failure is unreadable; the table lists them all
    fig, ax = _figure(10, 0.28 * len(shown) + 1.2)
    labels = [f"#{i} {r.kind} at {r.at_s:.0f} s" for i, r in enumerate(shown, 1)]
    left = [0.0] * len(shown)
    for phase in PHASES:
        widths = [r.phases.get(phase, 0.0) for r in shown]
        ax.barh(
            labels, widths, left=left, color=COLORS["reformation" if phase == "reformation" else phase], label=phase
        )
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for y, (r, x) in enumerate(zip(shown, left, strict=True)):
        ax.annotate(f" {r.steps_lost} steps redone, state from {r.tier or '?'}", (x, y), va="center", fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the failure to the start of the next step")
    ax.set_xlim(right=max([*left, 1e-3]) * 1.6)
    ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize=8, frameon=False, ncols=len(PHASES))
    return _svg(fig)


_CSS = """
body { font-family: system-ui, sans-serif; max-width: 1040px; margin: 2em auto; color: #212121; }
h1 { font-size: 1.6em; } h2 { font-size: 1.2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.5em 0; font-variant-numeric: tabular-nums; }
td, th { padding: 0.2em 0.8em; border-bottom: 1px solid #e0e0e0; text-align: right; }
td:first-child, th:first-child { text-align: left; }
table.summary td:first-child { color: #616161; }
figure { margin: 0; } figure svg { width: 100%; height: auto; }
figcaption { color: #616161; font-size: 0.9em; }
footer { margin-top: 2em; color: #9e9e9e; font-size: 0.8em; }
"""
