"""Preemption: SIGTERM to `stalwart run` gets a last durable checkpoint at a step every rank agrees on and a clean
exit (143); the next launch resumes from it and the run ends bitwise as one never preempted."""

from __future__ import annotations

import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from conftest import child_env, tiny_args
from stalwart.supervisor.preempt_notice import NoticeWatch

ARGS = ("--steps", "100", "--step-sleep", "0.02", "--every", "1000")  # no regular checkpoint before the end


def _held_at(step: int) -> tuple[str, ...]:
    """The job waits in step `step` until the launcher has asked for the preemption (`_go_on`): no race with the
    job's end."""
    return ("--hold-at", str(step), "--hold-file", "go")


def _go_on(job: Any) -> None:
    """Once the launcher has asked the workers (its board is set before the event): they see it at their next
    window's end."""
    job.wait_for(lambda: job.events("preemption_requested"), 60, "the launcher to ask for a last checkpoint")
    (job.workdir / "go").touch()


def test_sigterm_saves_at_an_agreed_step_and_the_next_launch_resumes_there(launch: Any) -> None:
    job = launch(tiny_args(*ARGS, *_held_at(41)))
    job.wait_for(lambda: any(e["step"] >= 40 for e in job.events("step_done")), 120, "step 40")
    job.proc.send_signal(signal.SIGTERM)
    _go_on(job)
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


def test_a_preemption_notice_file_is_answered_like_sigterm(launch: Any, tmp_path: Path) -> None:
    notice = tmp_path / "preempt-notice"
    env = child_env(STALWART_PREEMPT_POLL_S="0.2")
    job = launch(["--preempt-notice", f"file:{notice}", *tiny_args(*ARGS, *_held_at(31))], env=env)
    job.wait_for(lambda: any(e["step"] >= 30 for e in job.events("step_done")), 120, "step 30")
    notice.write_text("")
    _go_on(job)
    assert job.wait(60) == 143, job.output()
    (asked,) = job.events("preemption_requested")
    assert asked["why"] == f"preemption notice: {notice} exists"
    (step,) = {e["step"] for e in job.events("preempted")}
    assert step in {e["step"] for e in job.events("checkpoint_committed")}, "durable before the exit"
    assert [e["reason"] for e in job.events("launcher_exit")] == ["preempted"]
    for bad, message in ((["--preempt-notice", "ftp://x"], "must be an http(s):// URL or file:PATH"),
                         (["--preempt-notice", "file:x", "--preempt-grace-s", "0"], "needs a grace")):  # fmt: skip
        out = launch([*bad, *tiny_args(*ARGS)], name="bad")
        assert out.wait(60) == 2 and message in out.output() and "Traceback" not in out.output()


def test_metadata_urls_give_notice_only_when_they_say_so() -> None:
    """GCE answers FALSE until preempted, then TRUE; AWS answers 404 until a stop is scheduled, then JSON."""
    answers = {"/gce": [(200, "FALSE"), (200, "TRUE")], "/aws": [(404, ""), (200, '{"action": "terminate"}')]}
    headers: list[str | None] = []

    class Metadata(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            headers.append(self.headers.get("Metadata-Flavor"))
            code, body = answers[self.path].pop(0)
            self.send_response(code)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    said: list[str] = []
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        for path in ("/gce", "/aws"):
            watch = NoticeWatch(base + path, lambda why: None, said.append)
            assert watch.poll() is None, "not yet"
            assert watch.poll() is not None, "now"
        unreachable = NoticeWatch("http://127.0.0.1:9/none", lambda why: None, said.append)
        assert unreachable.poll() is None and unreachable.poll() is None
        assert len(said) == 1 and "cannot be read" in said[0], "said once"
    finally:
        server.shutdown()
        server.server_close()
    assert headers == ["Google"] * 4
