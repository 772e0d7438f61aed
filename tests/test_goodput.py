"""Goodput accounting (telemetry/goodput.py) and `stalwart report`: where a run's wall time went."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import child_env, tiny_args
from stalwart.telemetry.goodput import CATEGORIES, account


def _agent(event: str, t: float, **fields: Any) -> dict[str, Any]:
    return {"event": event, "mono": t, "role": "agent", **fields}


def _worker(event: str, t: float, restart: int = 0, **fields: Any) -> dict[str, Any]:
    return {"event": event, "mono": t, "rank": 0, "restart": restart, **fields}


def _steps(first: int, last: int, t0: float, step_s: float, restart: int = 0) -> list[dict[str, Any]]:
    """Steps first..last completed every step_s from t0 (the first completes at t0 + step_s)."""
    return [_worker("step_done", t0 + (s - first + 1) * step_s, restart, step=s, step_s=step_s)
            for s in range(first, last + 1)]  # fmt: skip


def _total(g: Any) -> float:
    return g.productive_s + sum(g.badput.values())


def test_a_clean_run_is_startup_productive_and_checkpoint_stalls() -> None:
    events = [_agent("launcher_started", 0.0), _worker("worker_started", 1.0), _worker("fresh_start", 1.5),
              *_steps(1, 10, 2.0, 0.5), _worker("checkpoint_snapshot", 4.6, stall_s=0.1),
              _worker("job_finished", 7.0), _agent("launcher_exit", 7.5)]  # fmt: skip
    g = account(events)
    assert g.wall_s == 7.5 and g.final_step == 10
    assert g.badput["startup"] == pytest.approx(2.0)  # launch to the first step's start
    assert g.productive_s == pytest.approx(5.0 - 0.1)
    assert g.badput["checkpoint"] == pytest.approx(0.1)
    assert g.badput["other"] == pytest.approx(0.5)  # the end of the run
    assert _total(g) == pytest.approx(g.wall_s) and not g.recoveries


def test_a_kill_costs_detection_reformation_restore_and_the_redone_steps() -> None:
    events = [
        _agent("launcher_started", 0.0), _worker("worker_started", 0.5), _worker("fresh_start", 0.6),
        *_steps(1, 10, 1.0, 1.0),  # step 10 done at 11.0
        {"event": "fault_injected", "mono": 11.5, "rank": 1, "restart": 0, "fault": "kill", "step": 10},
        _agent("worker_failed", 12.0, rank=1), _agent("restarting", 12.0),
        _worker("worker_started", 13.0, 1),
        _worker("resumed", 13.5, 1, step=8, tier="durable", seconds=0.4),
        *_steps(9, 20, 14.0, 1.0, 1),  # resumed at 8: steps 9 and 10 are done again
        _worker("job_finished", 26.0, 1), _agent("launcher_exit", 26.0),
    ]  # fmt: skip
    g = account(events)
    assert g.final_step == 20
    (r,) = g.recoveries
    assert (r.kind, r.steps_lost, r.tier) == ("kill", 2, "durable")
    assert r.detection_s == pytest.approx(0.5)  # fault 11.5, noticed 12.0
    assert g.badput["detection"] == pytest.approx(0.5)
    assert g.badput["reformation"] == pytest.approx(1.0)  # noticed 12.0, worker started 13.0
    assert g.badput["restore"] == pytest.approx(0.4)
    # Kept: steps 1-8 of the first attempt (8 s) and 9-20 of the second (12 s); wasted: steps 9-10 and the half
    # step before the kill.
    assert g.productive_s == pytest.approx(20.0)
    assert g.badput["wasted_progress"] == pytest.approx(2.5)
    assert _total(g) == pytest.approx(g.wall_s)


def test_a_hang_is_detected_after_its_silence() -> None:
    events = [
        _agent("launcher_started", 0.0), _worker("worker_started", 0.0), *_steps(1, 5, 0.0, 1.0),
        _agent("hang_detected", 9.0, rank=1, silent_s=4.0), _agent("worker_failed", 9.1, rank=1),
        _worker("worker_started", 9.5, 1), _worker("resumed", 9.6, 1, step=5, tier="memory", seconds=0.1),
        *_steps(6, 8, 10.0, 1.0, 1), _agent("launcher_exit", 13.0),
    ]  # fmt: skip
    g = account(events)
    (r,) = g.recoveries
    assert r.kind == "hang" and r.detection_s == pytest.approx(4.0) and r.steps_lost == 0
    assert _total(g) == pytest.approx(g.wall_s)


def test_a_rollback_wastes_the_steps_it_undoes() -> None:
    events = [
        _agent("launcher_started", 0.0), _worker("worker_started", 0.0), *_steps(1, 10, 0.0, 1.0),
        _worker("rolled_back", 10.2, step=6, tier="memory", seconds=0.2, reason="loss_spike"),
        *_steps(7, 12, 10.5, 1.0), _agent("launcher_exit", 16.5),
    ]  # fmt: skip
    g = account(events)
    (r,) = g.recoveries
    assert (r.kind, r.steps_lost) == ("rollback", 4)
    assert g.productive_s == pytest.approx(6.0 + 6.0)
    assert g.badput["wasted_progress"] == pytest.approx(4.0)
    assert _total(g) == pytest.approx(g.wall_s)
    assert set(g.badput) == set(CATEGORIES)


def test_stalwart_report_on_a_run_with_a_kill(launch: Any) -> None:
    job = launch(
        tiny_args("--steps", "40", "--step-sleep", "0.03"), env=child_env(STALWART_FAULTS="kill@rank=1,step=20")
    )
    assert job.wait(180) == 0, job.output()
    out = subprocess.run([sys.executable, "-m", "stalwart", "report", str(job.event_log), "--json"],
                         capture_output=True, text=True, timeout=60, env=child_env())  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert 0.2 < report["goodput"] < 1 and report["final_step"] == 40
    (r,) = report["recoveries"]
    assert r["kind"] == "kill" and r["steps_lost"] <= 1 and r["tier"] in ("memory", "peer")
    assert r["detection_s"] is not None and 0 <= r["detection_s"] < 5
    assert report["productive_s"] + sum(report["badput"].values()) == pytest.approx(report["wall_s"])
    table = subprocess.run([sys.executable, "-m", "stalwart", "report", str(job.workdir)],
                           capture_output=True, text=True, timeout=60, env=child_env())  # fmt: skip
    assert table.returncode == 0 and "goodput" in table.stdout and "kill" in table.stdout


def test_a_bad_path_is_one_clear_error(tmp_path: Path) -> None:
    for path, message in ((tmp_path / "nope", "does not exist"), (tmp_path, "holds no event log")):
        out = subprocess.run([sys.executable, "-m", "stalwart", "report", str(path)], capture_output=True, text=True,
                             timeout=60, env=child_env())  # fmt: skip
        assert out.returncode == 2 and message in out.stderr and out.stderr.count("\n") == 1
    foreign = tmp_path / "other.jsonl"
    foreign.write_text('{"a": 1}\n')
    out = subprocess.run([sys.executable, "-m", "stalwart", "report", str(foreign)], capture_output=True, text=True,
                         timeout=60, env=child_env())  # fmt: skip
    assert out.returncode == 2 and "not a stalwart event log" in out.stderr


def test_prometheus_metrics_of_a_running_job(launch: Any) -> None:
    """--metrics-port 0: the launcher serves the run's metrics on 127.0.0.1 while it runs, under conventional names."""
    import urllib.request

    faults = child_env(STALWART_FAULTS="kill@rank=1,step=10;nan@rank=0,step=30,restart=1")
    job = launch(["--metrics-port", "0", *tiny_args("--steps", "400", "--step-sleep", "0.02")], env=faults)
    listening = job.wait_for(lambda: job.events("metrics_listening"), 60, "the metrics server")[0]
    assert listening["addr"] == "127.0.0.1"
    url = f"http://127.0.0.1:{listening['port']}/metrics"

    def scrape() -> dict[str, float]:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line and not line.startswith("#")}  # fmt: skip

    metrics = job.wait_for(lambda: (m := scrape()).get("stalwart_step", 0) >= 60 and m, 120, "step 60 in the metrics")
    assert metrics['stalwart_restarts_total{reason="killed"}'] == 1
    assert metrics['stalwart_detector_events_total{event="nonfinite_gradients"}'] >= 1
    assert metrics["stalwart_checkpoint_stall_seconds_total"] > 0
    assert metrics["stalwart_checkpoint_persist_seconds_count"] >= 1
    assert 0 < metrics["stalwart_step_seconds"] < 5
    job.wait_for(lambda: 0 < scrape()["stalwart_goodput_ratio"] <= 1, 30, "a goodput figure")
    assert job.wait(180) == 0, job.output()
