"""checkpoint_every="auto" (policy/auto_checkpoint.py): the durable checkpoint interval from Daly's optimum, with the
measured stall and the failure rate this launch has seen."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

import stalwart
from stalwart.errors import ConfigError
from stalwart.policy.auto_checkpoint import FIRST_EVERY, MAX_INTERVAL_S, CheckpointInterval
from stalwart.policy.interval import daly
from stalwart.runtime.env import EVENT_LOG_ENV


def test_the_interval_is_dalys_optimum_in_steps_and_follows_the_failures() -> None:
    policy = CheckpointInterval(prior_mtbf_s=3600.0)
    assert policy.every == FIRST_EVERY and not policy.due(FIRST_EVERY - 1) and policy.due(FIRST_EVERY)
    d = policy.decide(100, stall_s=0.5, step_s=0.1, failures=0, elapsed_s=0.0)
    assert d is not None and d.every == int(-(-daly(0.5, 3600.0) // 0.1)) and d.mtbf_s == 3600.0
    assert policy.next_step == 100 + d.every
    assert policy.decide(200, 0.52, 0.1, 0, 60.0) is None, "within the hysteresis: kept, no event"
    worse = policy.decide(300, 0.5, 0.1, failures=3, elapsed_s=3600.0)  # 4 failures' worth in 2 h: M = 30 min
    assert worse is not None and worse.every < d.every and worse.mtbf_s == pytest.approx(1800.0)
    capped = CheckpointInterval(prior_mtbf_s=1e9).decide(0, 1.0, 1.0, 0, 0.0)
    assert capped is not None and capped.interval_s == MAX_INTERVAL_S and capped.every == 3600
    with pytest.raises(ValueError, match="positive"):
        CheckpointInterval(prior_mtbf_s=0)


def test_bad_settings_are_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match='checkpoint_every must be "auto" or a positive integer'):
        stalwart.Job(tmp_path, checkpoint_every="sometimes")
    with pytest.raises(ConfigError, match="expected_mtbf_s must be a positive number"):
        stalwart.Job(tmp_path, checkpoint_every="auto", expected_mtbf_s=-1)


def test_a_job_under_auto_checkpoints_at_the_decided_rhythm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job told to expect a failure every few seconds: after the first checkpoint (step 100) it measures the
    stall and step time and checkpoints every Daly-optimal number of steps from then on, with an event."""
    log = tmp_path / "events.jsonl"
    monkeypatch.setenv(EVENT_LOG_ENV, str(log))
    job = stalwart.Job(
        tmp_path / "ckpt", checkpoint_every="auto", expected_mtbf_s=5.0, log_every=1000, when_busy="wait"
    )  # every due save happens, even when the previous one still persists
    model = torch.nn.Linear(64, 64)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    job.track(model=model, optim=optim)
    for _ in job.steps(max_steps=260):
        time.sleep(0.004)
        loss = model(torch.randn(8, 64)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
    job.close()
    events = [json.loads(line) for line in log.read_text().splitlines()]
    (first, *_) = [e for e in events if e["event"] == "checkpoint_interval"]
    # Decided at the first checkpoint whose stall and step time were both measured: step 100 as a rule; a
    # checkpoint with either not measured yet keeps the interval (job/step_end.plan_checkpoints), which put the
    # decision at step 200 once in a fresh-clone suite (fc106, 2026-11-30). Every save before it keeps the rhythm.
    assert first["step"] % FIRST_EVERY == 0 and first["previous"] == FIRST_EVERY
    assert first["every"] < FIRST_EVERY and first["mtbf_s"] >= 5.0 and first["stall_s"] > 0 and first["step_s"] > 0
    assert first["interval_s"] == pytest.approx(daly(first["stall_s"], first["mtbf_s"]), abs=1e-3)  # rounded
    saved = [e["step"] for e in events if e["event"] == "checkpoint_snapshot"]
    before = [s for s in saved if s <= first["step"]]
    assert before == list(range(FIRST_EVERY, first["step"] + 1, FIRST_EVERY)), saved
    assert saved[len(before)] == first["step"] + first["every"], saved
    assert saved[-1] == 260, "and the last step, as always"
