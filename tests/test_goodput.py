"""Goodput accounting (telemetry/goodput.py) and `stalwart report`: where a run's wall time went."""

from __future__ import annotations

import json
import shutil
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
    assert r.phases == pytest.approx({"detection": 0.5, "reformation": 1.0, "restore": 0.4, "other": 0.6})
    assert sum(r.phases.values()) == pytest.approx(r.recovery_s) and r.wasted_s == pytest.approx(2.5)
    assert [a.ended_by for a in g.attempts] == ["kill", "finished"]
    assert g.attempts[1].points[0] == (14.0, 8) and g.attempts[1].points[-1] == (26.0, 20)


def test_survivors_training_on_shrunk_keep_their_steps() -> None:
    """recovery/shrink.py: the survivor goes on at once from its own snapshot (`shrunk`), and the job grows back
    later inside the same segment (`resumed` of the grow): every step after the kill is productive."""
    events = [
        _agent("launcher_started", 0.0), _worker("worker_started", 0.5), _worker("fresh_start", 0.6),
        *_steps(1, 10, 1.0, 1.0),  # step 10 done at 11.0
        {"event": "fault_injected", "mono": 11.5, "rank": 1, "restart": 0, "fault": "kill", "step": 10},
        _agent("worker_failed", 11.6, rank=1), _agent("restarting", 11.6),
        _worker("reforming", 11.65, 0, step=10), _worker("shrunk", 11.7, 1, step=10, world_size=1, seconds=0.05),
        *_steps(11, 15, 11.7, 1.0, 1),  # shrunk: 11-15, done at 12.7..16.7
        _worker("resumed", 16.8, 1, step=15, tier="peer", seconds=0.1),  # grown back
        *_steps(16, 20, 16.8, 1.0, 1),
        _worker("job_finished", 21.8, 1), _agent("launcher_exit", 21.8),
    ]  # fmt: skip
    g = account(events)
    (r,) = g.recoveries
    assert r.steps_lost == 0 and r.wasted_s == pytest.approx(0.5)  # only the step running at the kill
    assert g.badput["reformation"] + g.badput["detection"] + g.badput["other"] == pytest.approx(0.2)
    assert g.productive_s == pytest.approx(20.1)  # 20 steps; the grow's 0.1 s falls inside step 16's time
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


def test_a_gpu_xid_the_agent_acted_on_is_the_failures_cause() -> None:
    events = [
        _agent("launcher_started", 0.0), _worker("worker_started", 0.0), *_steps(1, 5, 0.0, 1.0),
        _agent("gpu_action", 5.2, gpu=1, action="restart_process", reason="XID 13"),
        _agent("worker_failed", 5.3, rank=1), _worker("worker_started", 5.6, 1),
        _worker("resumed", 5.7, 1, step=5, tier="memory", seconds=0.1), *_steps(6, 8, 6.0, 1.0, 1),
        _agent("launcher_exit", 9.0),
    ]  # fmt: skip
    (r,) = account(events).recoveries
    assert r.kind == "gpu_xid" and r.detection_s == pytest.approx(0.1) and r.steps_lost == 0


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
    assert report["html"] is None, "--json alone writes no page"
    table = subprocess.run([sys.executable, "-m", "stalwart", "report", str(job.workdir)],
                           capture_output=True, text=True, timeout=60, env=child_env())  # fmt: skip
    assert table.returncode == 0 and "goodput" in table.stdout and "kill" in table.stdout
    page = job.event_log.parent / "report.html"
    assert f"report: {page}" in " ".join(table.stdout.split()) and page.read_text().count("<svg") == 3


def _kill_run_log(tmp_path: Path) -> Path:
    events = [
        _agent("launcher_started", 0.0), _worker("worker_started", 0.5), _worker("fresh_start", 0.6),
        *_steps(1, 10, 1.0, 1.0), _worker("checkpoint_committed", 6.2, step=5),
        {"event": "fault_injected", "mono": 11.5, "rank": 1, "restart": 0, "fault": "kill", "step": 10},
        _agent("worker_failed", 12.0, rank=1), _worker("worker_started", 13.0, 1),
        _worker("resumed", 13.5, 1, step=8, tier="durable", seconds=0.4), *_steps(9, 20, 14.0, 1.0, 1),
        _worker("job_finished", 26.0, 1), _agent("launcher_exit", 26.0, reason="succeeded", exitcode=0),
    ]  # fmt: skip
    log = tmp_path / "run" / "events.jsonl"
    log.parent.mkdir()
    log.write_text("".join(json.dumps(e) + "\n" for e in events))
    return log


def _report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stalwart", "report", *args], capture_output=True, text=True,
                          timeout=120, env=child_env())  # fmt: skip


def test_the_html_page_is_one_self_contained_file(tmp_path: Path) -> None:
    """Figures inline as SVG, no scripts, nothing fetched from anywhere: the file alone is the report."""
    from html.parser import HTMLParser

    log = _kill_run_log(tmp_path)
    out = _report(str(log.parent))
    assert out.returncode == 0, out.stderr
    text = (log.parent / "report.html").read_text()
    tags: list[tuple[str, dict[str, str | None]]] = []

    class Tags(HTMLParser):
        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            tags.append((tag, dict(attrs)))

    Tags().feed(text)
    names = [t for t, _ in tags]
    assert names.count("svg") == 3 and "script" not in names and "img" not in names and "link" not in names
    assert not [a for _, attrs in tags for k, a in attrs.items() if k in ("src", "href")], "nothing external"
    assert ">kill<" in text and "durable" in text and "26.0 s" in text  # the recovery row and the wall time
    assert "succeeded (exit status 0)" in text
    again = _report(str(log.parent), "--html", str(tmp_path / "elsewhere.html"))
    assert again.returncode == 0 and (tmp_path / "elsewhere.html").read_text().count("<svg") == 3
    none = _report(str(log), "--no-html", "--json")
    assert none.returncode == 0 and json.loads(none.stdout)["html"] is None
    for bad, message in ((["--html", str(tmp_path)], "is a directory"), (["--html", "x", "--no-html"], "not both")):
        out = _report(str(log), *bad)
        assert out.returncode == 2 and message in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert sorted(p.name for p in log.parent.iterdir()) == ["events.jsonl", "report.html"], "no partial file left"


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (apt install chromium)")
def test_the_page_renders_in_headless_chromium(tmp_path: Path) -> None:
    """The page as a browser draws it: the timeline's progress line and the breakdown's productive bar are there."""
    from matplotlib.image import imread

    log = _kill_run_log(tmp_path)
    assert _report(str(log.parent)).returncode == 0
    shot = tmp_path / "shot.png"
    subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1200,1600", f"--screenshot={shot}", (log.parent / "report.html").as_uri()],
                   capture_output=True, timeout=120, cwd=tmp_path, check=True)  # fmt: skip
    pixels = imread(shot)[:, :, :3]
    assert pixels.shape[:2] == (1600, 1200)
    green = ((abs(pixels - [0x2E / 255, 0x7D / 255, 0x32 / 255]) < 0.02).all(axis=2)).sum()
    assert green > 2000, "the productive bar (and the finished attempt's line) are drawn"
    dark_rows = (pixels.mean(axis=2) < 0.5).any(axis=1).sum()
    assert dark_rows > 300, "text and axes over much of the page, not a blank or error page"


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
