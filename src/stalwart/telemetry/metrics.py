"""A run's metrics for Prometheus, served by `stalwart run`'s launcher (`--metrics-port`; off by default).

Why in the launcher: the workers already write every fact to the event log; the launcher tails it, so training
pays nothing (no HTTP server, no lock, no extra thread in a worker), and the metrics survive a worker's death.
The server binds 127.0.0.1 unless `--metrics-addr` says otherwise: a training node's ports are not for the world.

Names follow Prometheus' conventions (base units, `_total` for counters, no per-step labels):

    stalwart_step                              completed steps (rank 0)
    stalwart_step_seconds                      the last logged step's time (rank 0)
    stalwart_goodput_ratio                     productive time over wall time so far (telemetry/goodput.py)
    stalwart_restarts_total{reason}            restarts of the workers, by the failure that caused them
    stalwart_checkpoint_stall_seconds_total    training time blocked by checkpoint snapshots (rank 0)
    stalwart_checkpoint_persist_seconds        histogram of the background persists' durations
    stalwart_detector_events_total{event}      events of the detectors (NaN skips, spikes, stragglers, ...)
    stalwart_mirror_step{location}             the newest step copied to each mirror (docs/disaster-recovery.md)
    stalwart_mirror_lag_seconds{location}      how long after its commit that step reached the mirror
    stalwart_mirror_up{location}               1 while the mirror takes copies, 0 from a failed copy until one works
    stalwart_checkpoint_failovers_total        times rank 0 wrote a save to the next location (save/failover.py)
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from stalwart.telemetry.goodput import account

DETECTOR_EVENTS = (
    "nonfinite_gradients",
    "grad_norm_spike",
    "loss_spike",
    "rolled_back",
    "straggler_detected",
    "straggler_evicted",
    "comm_ratio_high",
    "replica_divergence",
    "replicas_repaired",
    "hang_detected",
    "gpu_xid",
    "gpu_risk",
    "gpu_throttled",
    "gpu_ecc_errors",
    "node_excluded",
)
POLL_S = 0.5
GOODPUT_EVERY_S = 5.0


class RunMetrics:
    """The metrics, fed one event at a time."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.step = Gauge("stalwart_step", "Completed training steps (rank 0)", registry=registry)
        self.step_seconds = Gauge("stalwart_step_seconds", "The last logged step's time (rank 0)", registry=registry)
        self.goodput = Gauge("stalwart_goodput_ratio", "Productive time over wall time so far", registry=registry)
        self.restarts = Counter(
            "stalwart_restarts", "Worker restarts, by the failure that caused them", ["reason"], registry=registry
        )
        self.stall = Counter(
            "stalwart_checkpoint_stall_seconds", "Training time blocked by checkpoint snapshots", registry=registry
        )
        self.persist = Histogram(
            "stalwart_checkpoint_persist_seconds",
            "Background persist durations",
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=registry,
        )
        self.detector = Counter("stalwart_detector_events", "Detector events", ["event"], registry=registry)
        self.mirror_step = Gauge(
            "stalwart_mirror_step", "Newest step copied to a mirror", ["location"], registry=registry
        )
        self.mirror_lag = Gauge(
            "stalwart_mirror_lag_seconds", "From a commit to its copy on a mirror", ["location"], registry=registry
        )
        self.mirror_up = Gauge("stalwart_mirror_up", "Whether a mirror takes copies", ["location"], registry=registry)
        self.failovers = Counter(
            "stalwart_checkpoint_failovers",
            "Times rank 0 wrote a save to the next location",
            registry=registry,
        )
        self._cause = "unknown"

    def observe(self, e: dict[str, Any]) -> None:
        kind = e.get("event")
        worker0 = e.get("role") != "agent" and e.get("rank") == 0
        if kind == "step_done" and worker0:
            self.step.set(e.get("step", 0))
            self.step_seconds.set(e.get("step_s", 0.0))
        elif kind == "checkpoint_snapshot" and worker0:
            self.stall.inc(max(0.0, float(e.get("stall_s", 0.0) or 0.0)))
        elif kind == "checkpoint_committed" and e.get("seconds") is not None:
            self.persist.observe(float(e["seconds"]))
        elif kind == "worker_failed":
            cause = _cause(e)
            if cause is not None:
                self._cause = cause
        elif kind == "restarting":
            self.restarts.labels(reason=self._cause).inc()
            self._cause = "unknown"
        if kind in DETECTOR_EVENTS:
            self.detector.labels(event=kind).inc()
        self._mirrors(kind, e, worker0)

    def _mirrors(self, kind: Any, e: dict[str, Any], worker0: bool) -> None:
        """Mirrors (rank 0's persister copies, checkpoint/save/mirroring.py) and failovers (save/failover.py)."""
        where = str(e.get("location", ""))
        if kind == "mirrored":
            self.mirror_step.labels(location=where).set(e.get("step", 0))
            self.mirror_lag.labels(location=where).set(e.get("lag_s", 0.0))
            self.mirror_up.labels(location=where).set(1)
        elif kind == "mirror_unreachable":
            self.mirror_up.labels(location=where).set(0)
        elif kind == "mirror_caught_up":  # also a location caught up by a commit of its own (a failover's end)
            self.mirror_up.labels(location=where).set(1)
        elif kind == "checkpoint_failover" and worker0:
            self.failovers.inc()


def _cause(e: dict[str, Any]) -> str | None:
    """Why a worker failed, or None when it only followed another's failure."""
    if e.get("exitcode") == 75 or e.get("signal") == "SIGTERM":
        return None
    if e.get("hung"):
        return "hang"
    if e.get("exitcode") == 76:
        return "straggler_evicted"
    return "killed" if e.get("signal") else "exited"


class MetricsServer:
    """Serves RunMetrics over HTTP and feeds it by tailing the event log in a thread."""

    def __init__(self, log: Path, port: int, addr: str = "127.0.0.1") -> None:
        self.registry = CollectorRegistry()
        self.metrics = RunMetrics(self.registry)
        self._log = log
        self._server, _ = start_http_server(port, addr=addr, registry=self.registry)
        self.port = int(self._server.server_port)
        self.addr = addr
        self._events: list[dict[str, Any]] = []
        self._offset = 0
        self._partial = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stalwart-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        next_goodput = 0.0
        while not self._stop.wait(POLL_S):
            self.poll()
            if time.monotonic() >= next_goodput:
                next_goodput = time.monotonic() + GOODPUT_EVERY_S
                if self._events:
                    self.metrics.goodput.set(account(self._events).ratio)

    def poll(self) -> None:
        """Read the events appended since the last poll."""
        try:
            with open(self._log, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # a line still being written
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            self._events.append(event)
            self.metrics.observe(event)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._server.shutdown()
        self._server.server_close()
