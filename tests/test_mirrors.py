"""A job's mirrors (issue 46): each committed checkpoint copied in the background to other locations, verified
there, `keep_last` applied there; a mirror that is down never stalls a save and is caught up when it answers; a
job pointed at a mirror resumes from it. Local directories here; tests/test_s3.py copies to and from a real S3
server with `stalwart ckpt sync`, which copies the same way (checkpoint/save/step_copy.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import stalwart
from conftest import open_checkpointer, tiny_args, wait_for
from stalwart.checkpoint.format import layout
from stalwart.checkpoint.storage import open_storage
from stalwart.cli import main
from stalwart.errors import ConfigError
from stalwart.job.config import CheckpointOptions
from stalwart.telemetry.events import read_events


def _events(log: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(log) if e["event"] == kind]


def _state(step: int) -> dict[str, Any]:
    return {"step": step, "world_size": 1, "objects": {"w": {"weight": torch.full((64, 64), float(step))}}}


def _committed(root: Path) -> list[int]:
    return layout.committed_steps(open_storage(root))


def test_each_commit_is_copied_to_every_mirror_verified_with_keep_last_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log, mirrors = tmp_path / "events.jsonl", [tmp_path / "m1", tmp_path / "m2"]
    ck = open_checkpointer(tmp_path / "ck", log, keep_last=2, mirrors=[{"url": str(m)} for m in mirrors])
    for step in (1, 2, 3, 4):
        assert ck.save(step, _state(step), wait=True)
    ck.close()  # the persister gives the pending copies their time before it ends
    for mirror in mirrors:
        # The newest commit reaches every mirror; an older one may have been replaced by a newer commit before its
        # turn (each mirror has one step pending), so which older one is there depends on the pace: at most
        # keep_last in all, applied at the mirror too.
        steps = _committed(mirror)
        assert steps[0] == 4 and len(steps) <= 2, steps
        assert main(["ckpt", "verify", str(mirror), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["checkpoints"] == {str(s): [] for s in steps}
    mirrored = _events(log, "mirrored")
    assert {(e["location"], e["step"]) for e in mirrored} >= {(str(m), 4) for m in mirrors}
    assert all(e["lag_s"] >= e["seconds"] >= 0 and e["bytes"] > 0 for e in mirrored), mirrored
    assert not _events(log, "mirror_unreachable")


def test_a_mirror_that_is_down_stalls_nothing_and_is_caught_up(tmp_path: Path) -> None:
    """The mirror's parent is a file at first (every copy fails, as for a store that does not answer); the saves
    commit on the primary all the same. Once the path can be made, the next try copies the newest commit."""
    log, blocker = tmp_path / "events.jsonl", tmp_path / "blocker"
    blocker.write_text("not a directory")
    mirror = blocker / "mirror"
    ck = open_checkpointer(tmp_path / "ck", log, keep_last=3, mirrors=[{"url": str(mirror)}])
    for step in (1, 2):
        assert ck.save(step, _state(step), wait=True)
    assert _committed(tmp_path / "ck") == [2, 1], "the primary's saves go on"
    [down] = wait_for(lambda: _events(log, "mirror_unreachable"), 60, "the mirror to be found down")
    assert down["location"] == str(mirror) and down["error"], down
    blocker.unlink()  # the store answers again
    assert ck.save(3, _state(3), wait=True)
    [back] = wait_for(lambda: _events(log, "mirror_caught_up"), 60, "the mirror to be caught up")
    assert back["step"] in (2, 3) and back["outage_s"] > 0  # 2 if its retry came before step 3's commit
    ck.close()
    # The newest commit, not every one it missed: step 1 never reaches it (step 2 replaced it while it was down).
    assert _committed(mirror)[0] == 3 and 1 not in _committed(mirror), _committed(mirror)
    assert len(_events(log, "mirror_unreachable")) == 1, "once per outage"


def test_a_job_with_a_mirror_resumes_from_it_alone(tmp_path: Path) -> None:
    """The region's loss: the primary is gone, a new launch points at the mirror and resumes there bitwise."""

    def train(ckpt: Path, steps: int, **options: Any) -> torch.Tensor:
        job = stalwart.Job(ckpt, checkpoint_every=2, **options)
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        job.track(model=model, optim=optim)
        for step, _ in job.steps(None, max_steps=steps):
            loss = model(torch.full((2, 3), float(step))).pow(2).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
        job.close()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    straight = train(tmp_path / "straight", 8)
    train(tmp_path / "primary", 6, mirrors=[str(tmp_path / "mirror")])
    assert _committed(tmp_path / "mirror")[0] == 6
    resumed = train(tmp_path / "mirror", 8)
    assert torch.equal(straight, resumed)


def test_stalwart_run_mirror_keeps_a_scripts_checkpoints_there(launch: Any) -> None:
    """A script that cannot change: `stalwart run --mirror DIR` gives its Job the mirror (the tiny job passes no
    mirrors=); the run's last checkpoint is there, verified, once the run ended."""
    job = launch(["--mirror", "mirror", *tiny_args("--steps", "8")])
    assert job.wait(180) == 0, job.output()
    assert _committed(job.workdir / "mirror")[0] == 8
    assert {e["step"] for e in job.events("mirrored")} >= {8}


@pytest.mark.parametrize(
    ("mirrors", "message"),
    [
        ("s3://one/run", "must be a list of locations"),
        ([""], "each of mirrors must be a path"),
        ([{"url": "/m", "opts": {}}], "each of mirrors must be a path"),
        ([{"url": "/m", "options": "x"}], "options must be a dict"),
        (["/ck"], "is checkpoint_dir itself"),
    ],
)
def test_bad_mirrors_are_one_clear_error(mirrors: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CheckpointOptions(dir="/ck", mirrors=mirrors)
