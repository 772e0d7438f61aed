"""Hang detection: heartbeats on a shared-memory board, calibrated timeouts, and the agent killing a hung rank."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import stalwart
from conftest import Launch, alive, child_env, tiny_args
from stalwart.detect import hang
from stalwart.detect.hang import HangTimer, parse_timeout
from stalwart.detect.heartbeat import PHASE_DONE, PHASE_RESUME, PHASE_SAVE, PHASE_STEP, SLOT_BYTES, Board, Heartbeat
from stalwart.runtime.env import HEARTBEAT_ENV
from stalwart.runtime.process import process_state

HANG_ARGS = tiny_args("--steps", "24", "--step-sleep", "0.05")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """The fault-free run every hang test compares with (one per module and xdist worker)."""
    job = Launch(tmp_path_factory.mktemp("reference"), HANG_ARGS, child_env())
    try:
        assert job.wait(120) == 0, job.output()
        return job.results()
    finally:
        job.reap()


def test_timer_gives_grace_until_it_has_seen_a_few_steps() -> None:
    timer = HangTimer()
    for _ in range(hang.WARMUP_STEPS - 1):
        timer.observe(0.05)
        assert timer.step_timeout() == hang.GRACE_S
    timer.observe(0.05)
    assert timer.step_timeout() == hang.FLOOR_S, "fast steps get the floor"
    timer.restart()
    assert timer.step_timeout() == hang.GRACE_S, "after a resume the first steps are slow again"


def test_timer_follows_a_high_percentile_of_step_times() -> None:
    timer = HangTimer()
    for i in range(100):
        timer.observe(10.0 if i in (30, 60) else 1.0)  # two slow steps in a hundred: the 99th percentile
    assert timer.step_timeout() == pytest.approx(hang.MULTIPLE * 10.0)
    for _ in range(hang.WINDOW):
        timer.observe(1.0)
    assert timer.step_timeout() == pytest.approx(hang.MULTIPLE * 1.0), "old steps leave the window"
    for _ in range(hang.WINDOW):
        timer.observe(5000.0)
    assert timer.step_timeout() == hang.CEILING_S


def test_a_fixed_timeout_replaces_calibration_but_not_grace() -> None:
    timer = HangTimer(fixed_s=7.5)
    assert timer.step_timeout() == hang.GRACE_S
    for _ in range(hang.WARMUP_STEPS):
        timer.observe(0.01)
    assert timer.step_timeout() == 7.5
    assert HangTimer(fixed_s=1000.0).grace() == 1000.0


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "soon"])
def test_bad_timeouts_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_timeout(text)
    assert parse_timeout("auto") is None and parse_timeout("2.5") == 2.5


WRITER = """
import sys, time
from stalwart.detect.heartbeat import Heartbeat
hb = Heartbeat(sys.argv[1], 1)
assert hb.active
hb.beat(41, 2, 5.0)
hb.beat(42, 2, 5.0)
print(time.monotonic_ns())
"""


def test_beats_cross_processes_and_torn_slots_are_not_read(tmp_path: Path) -> None:
    board = Board(2, str(tmp_path))
    try:
        done = subprocess.run(
            [sys.executable, "-c", WRITER, str(board.path)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        after = int(done.stdout)
        beat = board.read(1)
        assert beat is not None and beat.step == 42 and beat.phase == PHASE_STEP and beat.pid > 0
        assert beat.beat_ns <= after and beat.deadline_ns - beat.beat_ns == 5_000_000_000
        assert board.read(0) is None, "a slot never written is not a beat"
        with open(board.path, "r+b") as f:  # a writer caught half-way: odd sequence number
            f.seek(SLOT_BYTES)
            f.write(struct.pack("<q", 5))
        assert board.read(1) is None
        board.clear()
        assert board.read(1) is None
    finally:
        board.close()
    assert not board.path.exists(), "the board file is removed"
    assert not Heartbeat(None, 0).active and not Heartbeat(str(tmp_path / "missing"), 0).active


@pytest.mark.parametrize(
    ("phase", "counted"), [(PHASE_STEP, True), (PHASE_SAVE, True), (PHASE_RESUME, False), (PHASE_DONE, False)]
)
def test_a_workers_progress_counts_from_its_last_beat_in_a_step_or_a_save(
    tmp_path: Path, phase: int, counted: bool
) -> None:
    """The steps a failed worker completed, for `worker_failed`: its beat at a step's start or at a save after one
    (a worker killed while saving reported none, and `stalwart report` counted from its last logged step)."""
    board = Board(1, str(tmp_path))
    try:
        Heartbeat(str(board.path), 0).beat(60, phase, 5.0)
        progress = board.progress(0, os.getpid())
        assert (progress.get("last_step") == 60) == counted and bool(progress) == counted, progress
        assert board.progress(0, os.getpid() + 1) == {}, "another pid's beat is not this worker's"
    finally:
        board.close()


@pytest.mark.parametrize("when_busy", ["skip", "wait"])
def test_a_save_is_watched_with_the_step_timeout_and_only_a_wait_for_the_store_gets_the_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when_busy: str
) -> None:
    """A save after the first stalls for its agreement and a memory copy: a hang there (a network partition inside
    its gather) must be caught like a hang in a step. With when_busy="wait" every save got the 300-s grace, and a
    6-s partition inside one went undetected (the chaos quick suite, 2026-11-30); now only the wait for a previous
    save still persisting (the store's pace) gets it, and the ranks agree again after it."""
    board = Board(1, str(tmp_path))
    monkeypatch.setenv(HEARTBEAT_ENV, str(board.path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    seen: list[tuple[str, int, float]] = []  # (what, step, the watched timeout then)

    def timeout() -> float:
        beat = board.read(0)
        assert beat is not None and beat.phase == PHASE_SAVE
        return (beat.deadline_ns - beat.beat_ns) / 1e9

    try:
        job = stalwart.Job(tmp_path / "ckpt", checkpoint_every=1, log_every=1000, when_busy=when_busy)
        model = torch.nn.Linear(64, 64)
        optim = torch.optim.SGD(model.parameters(), lr=0.01)
        job.track(model=model, optim=optim)
        ck = job.checkpointer
        save, settled = ck.save, ck._bg.settled

        def watched_save(step: int, state: Any, *, wait: bool = False, on_store_wait: Any = None, **more: Any) -> bool:
            seen.append(("save", step, timeout()))

            def hook(waiting: bool) -> None:
                on_store_wait(waiting)
                seen.append(("waiting" if waiting else "waited", step, timeout()))

            return save(step, state, wait=wait, on_store_wait=hook if on_store_wait else None, **more)

        faked: list[int] = []

        def in_flight_at_step_7() -> Any:
            busy, finished = settled()
            if job.step != 7 or busy is not None or faked:
                return busy, finished
            faked.append(7)  # a persist still running when step 7 saves, whatever the machine's pace
            return 6, finished

        monkeypatch.setattr(ck, "save", watched_save)
        monkeypatch.setattr(ck._bg, "settled", in_flight_at_step_7)
        for _ in job.steps(max_steps=10):
            loss = model(torch.randn(8, 64)).pow(2).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
        job.close()
    finally:
        board.close()
    saves = {step: t for what, step, t in seen if what == "save"}
    assert sorted(saves) == list(range(1, 11)), seen
    assert saves[1] == hang.GRACE_S, "the first save allocates staging: the grace"
    assert saves[10] == hang.GRACE_S, "the run's last save waits for its commit: the grace"
    calibrated = [t for what, step, t in seen if what == "save" and hang.WARMUP_STEPS + 2 <= step < 10]
    assert calibrated and all(t == hang.FLOOR_S for t in calibrated), seen
    waits = [(what, step, t) for what, step, t in seen if what in ("waiting", "waited")]
    if when_busy == "wait":
        assert ("waiting", 7, hang.GRACE_S) in waits and ("waited", 7, hang.FLOOR_S) in waits, seen
        assert [step for what, step, _ in seen if what == "save"].count(7) >= 2, "agreed again after the wait"
    else:
        assert not waits, seen


@pytest.mark.parametrize("how", ["sigstop", "sleep", "deadlock"])
def test_hung_rank_is_detected_killed_and_the_job_ends_bitwise_identical(launch: Any, reference: Any, how: str) -> None:
    job = launch(HANG_ARGS, name="hang", env=child_env(STALWART_FAULTS=f"hang@rank=1,step=12,how={how}"))
    assert job.wait(180) == 0, job.output()
    detected = job.events("hang_detected")
    assert detected and {e["step"] for e in detected} == {12}
    if how == "sigstop":  # a stopped process is the cause for certain: only it is killed
        assert [(e["rank"], e["cause"]) for e in detected] == [(1, "stopped by a signal")]
    else:  # a sleep in C code or a deadlock looks like waiting in a collective from outside: the ranks seen overdue
        # go, either one first (rank 0 waits for rank 1 in the step's all-reduce, both silent since the step began;
        # once in a loaded suite rank 0's deadline passed first and the group restarted before rank 1 was judged)
        assert {e["cause"] for e in detected} == {"no progress"}, detected
    # A stopped rank is killed as soon as it is seen stopped; any other only after its deadline.
    assert all(e["silent_s"] >= e["timeout_s"] for e in detected if e["cause"] == "no progress")
    assert "hung at step 12" in job.output()
    assert len(job.events("restarting")) == 1
    results, expected = job.results(), reference
    assert [results[r]["sha256"] for r in (0, 1)] == [expected[r]["sha256"] for r in (0, 1)]
    assert [results[r]["seen"] for r in (0, 1)] == [expected[r]["seen"] for r in (0, 1)]
    assert not [pid for pid in job.worker_pids(restart=0).values() if alive(pid)], "no orphaned worker"


@pytest.mark.parametrize(
    "faults",
    [
        "hang@rank=1,step=12",  # a stop and a kill at once
        # right after a restart, in the start's grace period: the stop is not waited for until a deadline
        "kill@rank=0,step=8;hang@rank=1,step=10,restart=1",
    ],
)
def test_a_stopped_survivor_is_killed_at_once_in_any_phase(launch: Any, reference: Any, faults: str) -> None:
    """Rank 0 is SIGKILLed from outside as soon as rank 1 is seen stopped, within the agent's STOP_CONFIRM_S.
    Not by a `kill` fault at the same step: rank 0 then often died before rank 1 reached its stop, and the
    survivor, asked to re-form, never stopped (seen once in a loaded suite; the scenario did not happen)."""
    from stalwart.supervisor.host_pool import REARM_TIMEOUT_S

    job = launch(HANG_ARGS, name="compound", env=child_env(STALWART_FAULTS=faults))

    def stopped_rank_1() -> bool:
        return any(process_state(e["pid"]) == "T" for e in job.events("worker_started") if e.get("rank") == 1)

    job.wait_for(stopped_rank_1, 120, "rank 1 to stop itself")
    rank_0 = [e["pid"] for e in job.events("worker_started") if e.get("rank") == 0][-1]
    os.kill(rank_0, signal.SIGKILL)
    assert job.wait(180) == 0, job.output()
    stops = [e for e in job.events("hang_detected") if e["cause"] == "stopped by a signal"]
    assert [e["rank"] for e in stops] == [1], job.events("hang_detected")
    # Killed before its heartbeat deadline (the 300 s grace after a start, or the calibrated step timeout):
    # the stop itself is the proof.
    assert stops[0]["timeout_s"] is None or stops[0]["silent_s"] < stops[0]["timeout_s"], stops
    # No survivor was waited for until the re-arm timeout: a stopped one cannot re-arm.
    assert all(e["seconds"] < REARM_TIMEOUT_S for e in job.events("survivors_rearmed")), job.events("survivors_rearmed")
    results, expected = job.results(), reference
    assert [results[r]["sha256"] for r in (0, 1)] == [expected[r]["sha256"] for r in (0, 1)]
    assert [results[r]["seen"] for r in (0, 1)] == [expected[r]["seen"] for r in (0, 1)]
    assert not [pid for restart in (0, 1) for pid in job.worker_pids(restart=restart).values() if alive(pid)]


def test_a_long_stretch_marked_busy_is_not_a_hang(launch: Any) -> None:
    job = launch(tiny_args("--steps", "12", "--step-sleep", "0.02", "--busy-at", "8", "--busy-s", "3.0"))
    assert job.wait(120) == 0, job.output()
    assert job.events("hang_detected") == [], "job.busy() raises the deadline for its stretch"
    assert job.events("restarting") == []


def test_bad_hang_timeout_is_one_line(launch: Any) -> None:
    job = launch(["--hang-timeout", "soon", *tiny_args()])
    assert job.wait(60) == 2
    out = job.output().strip().splitlines()
    assert len(out) == 1 and "--hang-timeout" in out[0], out
