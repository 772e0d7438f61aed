"""`stalwart bench overhead`: one small run end to end, its JSON shape, and one-line errors on bad input.

No timing thresholds: the step times depend on the machine (and on this VM they drift by 20% between runs); the
test checks that each figure is measured and that the configurations really differ where they must.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import stalwart
from stalwart.bench import overhead
from stalwart.cli import main


def test_a_small_run_reports_plain_and_each_configuration(tmp_path: Path) -> None:
    """Two ranks: the plain job runs under torchrun (DDP over gloo), and the defaults take light snapshots. Served
    (one thread): each launcher is a fork of the bench, as where a user's bench runs one thread."""
    args = ["bench", "overhead", "--nproc", "2", "--params", "20k", "--steps", "60", "--warmup", "5",
            "--rounds", "1", "--configs", "default,durable_only,memory_every_step", "--json",
            "--dir", str(tmp_path)]  # fmt: skip
    done = stalwart(*args, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out, err = done.stdout, done.stderr
    report = json.loads(out)  # stdout is exactly one JSON object
    assert report["nproc"] == 2
    assert set(report["configs"]) == {"default", "durable_only", "memory_every_step"}
    assert report["plain_step_s"] > 0 and report["plain_optimizer_step_s"] > 0 and 15_000 < report["params"] < 25_000
    for name, c in report["configs"].items():
        for key in ("step_s", "ratio", "mean_step_s", "mean_ratio", "optimizer_step_s"):
            assert math.isfinite(c[key]) and c[key] > 0, (name, key)
        assert math.isfinite(c["inline_overhead"]), name
        assert c["ratio"] == pytest.approx(c["step_s"] / report["plain_step_s"])
    assert report["configs"]["durable_only"]["snapshot_every"] is None
    assert report["configs"]["memory_every_step"]["snapshot_every"] == 1
    default = report["configs"]["default"]
    assert default["snapshot_every"] >= 1  # the full copies' budgeted interval, beside a light snapshot every step
    # Light snapshots are judged after 32 steps: kept, with full copies in what they leave of the 1% budget (at
    # least a quarter), or off, with full copies in all of it.
    (light,) = default["light"]
    assert light is not None and light["light_s"] > 0, default
    if light["kept"]:
        assert 0.0025 <= default["full_copy_budget"] <= 0.01
    else:
        assert default["full_copy_budget"] == 0.01
    assert report["floor"]["memcpy_s"] > 0 and report["floor"]["every_step_ratio"] > 1
    for label in ("plain", "default", "durable_only", "memory_every_step"):
        assert f"{label}, round 1 of 1: done" in err
    assert list(tmp_path.iterdir()) == []  # the bench removed its own directory, and nothing else


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--params", "lots"], "--params"),
        (["--params", "10"], "--params"),
        (["--configs", "default,fast"], "unknown configuration 'fast'"),
        (["--device", "tpu"], "--device"),
        (["--steps", "10", "--warmup", "9"], "--warmup"),
        (["--rounds", "0"], "--rounds"),
        (["--nproc", "0"], "--nproc"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "overhead", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_parked_spare_is_charged_the_cpu_it_used_while_parked_and_nothing_after_the_jobs_end(tmp_path: Path) -> None:
    """The bench's measure of what a parked warm spare costs (its CPU time while parked, from /proc): two real
    processes logged as parked, one asleep and one spinning, watched while a third (the "job") runs; the spinner is
    charged more than the sleeper, and neither is sampled once the job wrote its result (the spares' exit is not
    parking). No threshold on the figures: the machine's load decides what the spinner gets."""
    log, result = tmp_path / "events.jsonl", tmp_path / "result.json"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    ends = (  # the result appears whole (a rename); the time just after it, in `written`
        f"import os, time; time.sleep(2.5); open({str(result)!r} + '.tmp', 'w').close(); "
        f"os.rename({str(result)!r} + '.tmp', {str(result)!r}); t = time.monotonic(); "
        f"open({str(tmp_path / 'written')!r}, 'w').write(repr(t)); time.sleep(1.5)"
    )
    job = subprocess.Popen([sys.executable, "-c", ends])
    try:
        with log.open("w") as f:
            for proc in (sleeper, spinner):
                parked = {"event": "spare_parked", "pid": proc.pid, "rss_mb": 40.0, "private_mb": 4.0}
                f.write(json.dumps(parked) + "\n")
            f.write('{"event": "spare_par')  # a line still being written: read once whole
        watched = overhead._ParkedSpares(log, result)
        assert watched.watch(job, 60) == 0
        spares = {s["pid"]: s for s in watched.spares()}
        assert set(spares) == {sleeper.pid, spinner.pid}
        written = float((tmp_path / "written").read_text())
        # Sampled while the job ran, and never after its result was there (CLOCK_MONOTONIC is the machine's).
        assert all(s["seconds"] > 0 and watched._last[pid][0] < written for pid, s in spares.items())
        assert spares[spinner.pid]["cpu_s"] > spares[sleeper.pid]["cpu_s"] >= 0
    finally:
        for proc in (sleeper, spinner, job):
            proc.kill()
            proc.wait()
    assert all(s["rss_mb"] == 40.0 and s["private_mb"] == 4.0 for s in spares.values())  # from their events
    assert overhead._parked_share([{"parked": list(spares.values())}]) is not None
    assert overhead._mean_of([{"parked": list(spares.values())}], "private_mb") == 4.0
    assert overhead._parked_share([{"parked": []}]) is None
