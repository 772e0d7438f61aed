"""L0 rollback (recovery/rollback.py): back to the last good state in-process, the offending batch skipped, and the
run ends bitwise where a run that never saw that batch ends."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import stalwart
from conftest import child_env, tiny_args
from stalwart.checkpoint.storage import open_storage
from stalwart.errors import CheckpointCorruptError, ConfigError, NumericError
from stalwart.recovery.rollback import SKIP_FILE, RollbackCap, RollbackRequest, read_skips, write_skips
from stalwart.telemetry.events import read_events


class _Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 4, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


def _run(
    ckpt: Path,
    log: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    steps: int = 40,
    scale_at: int = -1,
    nan_param_at: int = -1,
    skip: int = -1,
    **options: Any,
) -> tuple[list[torch.Tensor], stalwart.Job]:
    """A one-process job; `scale_at`: that step's batch is 1000x (a loss spike), `nan_param_at`: after that
    step's update one weight element is NaN (a corruption the guard's sample cannot see), `skip`: the loop
    drops that step's batch itself (the reference run)."""
    monkeypatch.setenv("STALWART_EVENT_LOG", str(log))
    options = {"checkpoint_every": 5, "when_busy": "wait", "loss_spike": "rollback", **options}
    job = stalwart.Job(ckpt, **options)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = stalwart.ResumableLoader(_Rows(64), global_batch_size=8, seed=2)
    job.track(model=model, optim=optim, data=loader)
    for step, x in job.steps(loader, max_steps=steps):
        if step == skip:
            continue
        if step == scale_at:
            x = x * 1000.0
        noise = torch.rand(len(x), 1)  # the global RNG: its restore matters
        loss = (model(x) - x.sum(dim=1, keepdim=True) - noise).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        if step == nan_param_at:
            with torch.no_grad():
                model[0].weight.view(-1)[7] = float("nan")
        job.report(loss=loss.detach())
    job.close()
    return [p.detach().clone() for p in model.parameters()], job


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("policy", ["rollback", "skip"])  # "skip" of a loss spike is the same: its update is in
def test_a_loss_spike_rolls_back_and_ends_as_a_run_that_never_saw_the_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    log = tmp_path / "events.jsonl"
    params, job = _run(tmp_path / "ck", log, monkeypatch, scale_at=33, loss_spike=policy)
    reference, _ = _run(tmp_path / "ref", tmp_path / "ref.jsonl", monkeypatch, skip=33)
    assert _equal(params, reference), "bitwise the run that dropped batch 33 itself"
    events = list(read_events(log))
    spikes = [e for e in events if e["event"] == "loss_spike"]
    assert [(e["step"], e["action"]) for e in spikes] == [(34, "rollback")]  # found in the same step
    (rolled,) = [e for e in events if e["event"] == "rolled_back"]
    assert (rolled["reason"], rolled["trigger"], rolled["step"], rolled["skip"], rolled["tier"]) == (
        "loss_spike", 34, 30, 33, "durable"
    )  # fmt: skip
    assert [e["step"] for e in events if e["event"] == "batch_skipped"] == [33]
    record = json.loads((tmp_path / "ck" / SKIP_FILE).read_text())
    assert record["skipped"] == [33] and record["rollbacks"][0]["to"] == 30
    assert job.step == 40


def test_a_run_resumed_from_before_a_skipped_batch_skips_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The skip record makes the skip deterministic: a restart from step 30 (the newer checkpoints lost) meets
    batch 33 again and drops it without a spike, and ends where the uninterrupted run ended."""
    params, _ = _run(tmp_path / "ck", tmp_path / "a.jsonl", monkeypatch, scale_at=33)
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "ck", resumed)
    for step_dir in resumed.glob("step_*"):
        if step_dir.name.startswith("step_") and int(step_dir.name[5:13]) > 30:
            shutil.rmtree(step_dir)
    log = tmp_path / "b.jsonl"
    again, job = _run(resumed, log, monkeypatch, scale_at=33)
    assert job.resumed_from == 30
    assert _equal(params, again)
    events = list(read_events(log))
    assert [e["step"] for e in events if e["event"] == "batch_skipped"] == [33]
    assert not [e for e in events if e["event"] in ("loss_spike", "rolled_back")]


def test_a_nan_the_guard_sample_missed_rolls_back_to_before_the_update_that_made_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "events.jsonl"
    params, _ = _run(tmp_path / "ck", log, monkeypatch, nan_param_at=27, loss_spike="warn")
    reference, _ = _run(tmp_path / "ref", tmp_path / "ref.jsonl", monkeypatch, skip=27, loss_spike="warn")
    assert all(torch.isfinite(p).all() for p in params)
    assert _equal(params, reference)
    events = list(read_events(log))
    assert [e["step"] for e in events if e["event"] == "nonfinite_gradients"] == [28]
    (rolled,) = [e for e in events if e["event"] == "rolled_back"]
    assert (rolled["reason"], rolled["step"], rolled["skip"]) == ("nonfinite_parameters", 25, 27)


def test_rollbacks_in_a_row_over_the_cap_stop_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STALWART_EVENT_LOG", str(tmp_path / "events.jsonl"))
    job = stalwart.Job(tmp_path / "ck", checkpoint_every=5, when_busy="wait", loss_spike="rollback", max_rollbacks=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = stalwart.ResumableLoader(_Rows(64), global_batch_size=8, seed=2)
    job.track(model=model, optim=optim, data=loader)
    with pytest.raises(NumericError, match="1 rollbacks in a row did not help") as info:
        for step, x in job.steps(loader, max_steps=40):
            loss = model(x * (1000.0 if step in (25, 27) else 1.0)).pow(2).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            job.report(loss=loss.detach())
    job.close()
    assert "loss spike again at step 28" in str(info.value)


def test_without_a_state_from_before_the_spike_it_is_only_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "events.jsonl"
    _, job = _run(tmp_path / "ck", log, monkeypatch, scale_at=33, checkpoint_every=100)
    events = list(read_events(log))
    (impossible,) = [e for e in events if e["event"] == "rollback_impossible"]
    assert impossible["why"] == "no snapshot or checkpoint from step 33 or before"
    assert "cannot roll back for the loss spike at step 34" in capsys.readouterr().err
    assert job.step == 40 and not [e for e in events if e["event"] == "rolled_back"]


def test_the_cap_counts_rollbacks_near_each_other_only() -> None:
    cap = RollbackCap(2, quiet=False)
    cap.count(RollbackRequest("loss_spike", 100, 99, 99))
    cap.count(RollbackRequest("loss_spike", 150, 149, 149))
    assert cap.in_a_row == 2
    cap.count(RollbackRequest("loss_spike", 400, 399, 399))  # far from the last: a new run of rollbacks
    assert cap.in_a_row == 1


def test_the_skip_record_round_trips_and_a_damaged_one_is_one_clear_error(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path / "ck"), None)
    assert read_skips(storage) == []
    write_skips(storage, {7, 3}, RollbackRequest("loss_spike", 8, 7, 7), 5)
    assert read_skips(storage) == [3, 7]
    assert (tmp_path / "ck" / "stalwart-checkpoints.json").exists(), "the directory stays one stalwart owns"
    (tmp_path / "ck" / SKIP_FILE).write_text("{not json")
    with pytest.raises(CheckpointCorruptError, match="move it aside to skip no batch"):
        read_skips(storage)


def test_bad_rollback_options_are_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="loss_spike must be one of warn, skip, rollback, off"):
        stalwart.Job(tmp_path / "ck", loss_spike="restart")
    with pytest.raises(ConfigError, match="max_rollbacks must be an integer >= 0"):
        stalwart.Job(tmp_path / "ck", max_rollbacks=-1)


# -- under stalwart run: a 2-rank DDP job ------------------------------------------------------------------------


def test_a_spike_on_one_rank_rolls_back_every_rank_from_memory(launch: Any) -> None:
    args = ("--steps", "30", "--every", "100")
    job = launch(tiny_args(*args, "--loss-spike", "rollback"), env=child_env(STALWART_FAULTS="spike@rank=1,step=24"))
    reference = launch(tiny_args(*args, "--skip-batch", "24"), name="reference")
    assert job.wait(180) == 0, job.output()
    assert reference.wait(180) == 0, reference.output()
    rolled = job.events("rolled_back")
    assert sorted((e["rank"], e["step"], e["tier"], e["skip"]) for e in rolled) == [
        (0, 24, "memory", 24), (1, 24, "memory", 24)
    ]  # fmt: skip
    assert "loss spike at step 25: rolled back to step 24" in job.output()
    results, expected = job.results(), reference.results()
    for rank in (0, 1):
        assert results[rank]["sha256"] == expected[rank]["sha256"]
        assert results[rank]["seen"] == expected[rank]["seen"], "batch 24 dropped, every other sample seen once"


def test_two_diverged_replicas_roll_back_to_where_they_last_agreed(launch: Any) -> None:
    """No majority among two replicas: the job goes back to the checkpoint of the last step they agreed on and
    replays; it ends bitwise as a run without the flipped bit."""
    args = ("--steps", "32", "--divergence-every", "10")
    job = launch(tiny_args(*args), env=child_env(STALWART_FAULTS="flip@rank=1,step=23"))
    reference = launch(tiny_args(*args), name="reference")
    assert job.wait(180) == 0, job.output()
    assert reference.wait(180) == 0, reference.output()
    assert [e["step"] for e in job.events("replica_divergence") if e["rank"] == 0] == [30]
    rolled = [e for e in job.events("rolled_back") if e["rank"] == 0]
    assert [(e["reason"], e["step"], e["tier"], e["skip"]) for e in rolled] == [
        ("replica_divergence", 20, "durable", None)
    ]
    assert sorted(e["step"] for e in job.events("checkpoint_set_aside")) == [24, 28]
    results, expected = job.results(), reference.results()
    for rank in (0, 1):
        assert results[rank]["sha256"] == expected[rank]["sha256"]


def test_a_survivor_does_not_keep_a_step_that_a_rollback_was_voted_for(launch: Any) -> None:
    """Light snapshots: rank 1's loss spikes in step 25 while rank 0 dies after that step's commit barrier. Rank 1
    finishes step 25, sees the spike and fails in the vote: its parameters hold step 25 with the spike's update,
    which it must not hand to the replacement (it would resume there, the spike's update kept). It keeps nothing
    and the restart goes back to a full copy or checkpoint; the spike fault fires once, so the replayed step 25
    is an ordinary one and the run ends as a fault-free run."""
    args = ("--steps", "30", "--every", "100", "--snapshot-every", "auto", "--replicated-snapshot-every", "auto")
    faults = "spike@rank=1,step=24;kill_in_optimizer@rank=0,step=24,phase=after_barrier"
    job = launch(tiny_args(*args, "--loss-spike", "rollback"), env=child_env(STALWART_FAULTS=faults))
    reference = launch(tiny_args(*args), name="reference")
    assert job.wait(180) == 0, job.output()
    assert reference.wait(180) == 0, reference.output()
    reforming = job.events("reforming")
    assert [(e["rank"], e["step"], e["kept_live_state"]) for e in reforming] == [(1, 25, False)], reforming
    assert "loss spike at step 25" in reforming[0]["why"], reforming
    resumed = [e for e in job.events("resumed") if e["restart"] == 1]
    assert resumed and all(e["step"] <= 24 for e in resumed), resumed
    results, expected = job.results(), reference.results()
    for rank in (0, 1):
        assert results[rank]["sha256"] == expected[rank]["sha256"]
        assert results[rank]["seen"] == expected[rank]["seen"]
