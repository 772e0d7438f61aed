"""Preemption: SIGTERM to `stalwart run` gets a last durable checkpoint at a step every rank agrees on and a clean
exit (143); the next launch resumes from it and the run ends bitwise as one never preempted."""

from __future__ import annotations

import signal
from typing import Any

from conftest import tiny_args

ARGS = ("--steps", "300", "--step-sleep", "0.02", "--every", "1000")  # no regular checkpoint before the end


def test_sigterm_saves_at_an_agreed_step_and_the_next_launch_resumes_there(launch: Any) -> None:
    job = launch(tiny_args(*ARGS))
    job.wait_for(lambda: any(e["step"] >= 40 for e in job.events("step_done")), 120, "step 40")
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(60) == 143, job.output()
    preempted = job.events("preempted")
    assert {e["rank"] for e in preempted} == {0, 1} and len({e["step"] for e in preempted}) == 1
    step = preempted[0]["step"]
    assert step % 10 == 0 and step >= 40, "at a window's end"
    assert step in {e["step"] for e in job.events("checkpoint_committed")}, "durable before the exit"
    assert {e["restart"] for e in job.events("worker_spawned")} == {0}, "no restart"
    assert "preempted: the workers took a last checkpoint" in job.output() and "Traceback" not in job.output()
    (exit_event,) = job.events("launcher_exit")
    assert exit_event["reason"] == "preempted"

    again = launch(tiny_args(*ARGS), name="job")  # the same directory, as a scheduler would relaunch it
    assert again.wait(180) == 0, again.output()
    resumed = [e for e in again.events("resumed") if e["rank"] == 0]
    assert [(e["step"], e["tier"]) for e in resumed] == [(step, "durable")], "nothing redone"
    reference = launch(tiny_args(*ARGS), name="reference")
    assert reference.wait(180) == 0, reference.output()
    results, expected = again.results(), reference.results()
    for rank in (0, 1):
        assert results[rank]["sha256"] == expected[rank]["sha256"]


def test_with_no_grace_sigterm_stops_at_once(launch: Any) -> None:
    job = launch(["--preempt-grace-s", "0", *tiny_args(*ARGS)])
    job.wait_for(lambda: job.events("step_done"), 120, "a step")
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(60) == 143
    assert not job.events("preempted") and "received SIGTERM; workers stopped" in job.output()
    bad = launch(["--preempt-grace-s", "-1", *tiny_args(*ARGS)], name="bad")
    assert bad.wait(60) == 2 and "--preempt-grace-s must be a number of seconds >= 0" in bad.output()
