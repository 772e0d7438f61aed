"""What rank 0 says while training goes well (job/progress.py): the start line, a progress line every `log_every`
steps with the reported loss as logged, quiet under STALWART_QUIET=1, and one warning for a loader peeked at before
the loop on a fresh start."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import stalwart
from stalwart.job import progress
from stalwart.runtime.env import EVENT_LOG_ENV, QUIET_ENV
from stalwart.supervisor.run_args import parse


def _train(ckpt: Path, steps: int, *, peek: bool = False) -> None:
    job = stalwart.Job(ckpt, checkpoint_every=4, log_every=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = stalwart.ResumableLoader(
        torch.randn(64, 3, generator=torch.Generator().manual_seed(1)), global_batch_size=4
    )
    job.track(model=model, optim=optim, data=loader)
    if peek:
        next(iter(loader))  # a look at a batch's shape, as people do
    for _, x in job.steps(loader, max_steps=steps):
        loss = model(x).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        job.report(loss=loss, lr=optim.param_groups[0]["lr"])
    job.close()


@pytest.fixture
def fresh_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """As in a new process: the start line not said yet, and an event log to compare the lines with."""
    monkeypatch.setattr(progress, "_started_said", False)
    monkeypatch.delenv(QUIET_ENV, raising=False)
    log = tmp_path / "events.jsonl"
    monkeypatch.setenv(EVENT_LOG_ENV, str(log))
    return log


def test_rank_0_says_what_protects_the_run_and_its_progress_as_logged(
    fresh_process: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    _train(tmp_path / "ck", 6)
    err = capfd.readouterr().err
    start = [line for line in err.splitlines() if line.startswith("stalwart: protecting")]
    assert len(start) == 1, err
    assert "1 rank:" in start[0] and f"checkpoints every 4 steps to {tmp_path / 'ck'} (last 3 kept)" in start[0]
    assert "no launcher" in start[0] and f"events in {fresh_process}" in start[0], start[0]
    lines = re.findall(r"^stalwart: step (\d+)/6  loss (\S+)  lr (\S+)(  \S+ steps/s)?$", err, re.M)
    logged = [json.loads(line) for line in fresh_process.read_text().splitlines()]
    done = [e for e in logged if e["event"] == "step_done"]
    assert [int(step) for step, *_ in lines] == [e["step"] for e in done] == [1, 2, 4, 6], err
    for (_, loss, lr, _), event in zip(lines, done, strict=True):
        assert float(loss) == pytest.approx(event["loss"], rel=1e-4) and float(lr) == pytest.approx(0.01)
    assert not lines[0][3] and all(pace for *_, pace in lines[1:]), "a pace once there is a line before"
    assert "warning" not in err


def test_quiet_says_nothing_while_training_goes_well(
    fresh_process: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(QUIET_ENV, "1")
    _train(tmp_path / "ck", 4)
    assert "stalwart:" not in capfd.readouterr().err
    assert parse([__file__]).quiet, "STALWART_QUIET=1 is --quiet's default"
    monkeypatch.delenv(QUIET_ENV)
    assert parse(["--quiet", __file__]).quiet and not parse([__file__]).quiet


def test_a_loader_peeked_at_before_the_loop_is_said_once_and_only_on_a_fresh_start(
    fresh_process: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    _train(tmp_path / "ck", 4, peek=True)
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "iterated before job.steps()" in warnings[0] and "batch 1" in warnings[0], err
    monkeypatch.setattr(progress, "_started_said", False)
    _train(tmp_path / "ck", 8, peek=True)  # resumed: the loaded position replaced the peek's, nothing is lost
    err = capfd.readouterr().err
    assert "resumed at step 4" in err and "warning" not in err, err
