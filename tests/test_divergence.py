"""Replica divergence (detect/divergence.py): a flipped bit on one replica is found and repaired from the others."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import child_env, tiny_args
from stalwart.detect.divergence import DivergenceCheck, fingerprint, odd_ranks
from stalwart.errors import ReplicaDivergenceError, is_user_error
from stalwart.telemetry.events import EventLog, read_events


def test_a_single_flipped_bit_changes_the_fingerprint_of_every_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8):
        t = (torch.arange(37) % 7).to(dtype)
        before = fingerprint([t, torch.ones(3)])
        raw = t.view(torch.uint8)
        for at in (5, raw.numel() - 1):  # in a whole 64-bit word, and in the bytes past the last one
            raw[at] ^= 1 << 7
            assert fingerprint([t, torch.ones(3)]) != before, (dtype, at)
            raw[at] ^= 1 << 7
        assert fingerprint([t, torch.ones(3)]) == before
    a, b = torch.ones(4), torch.zeros(4)
    assert fingerprint([a, b]) != fingerprint([b, a]), "the tensors' order counts"
    assert fingerprint([torch.arange(6.0).reshape(2, 3).t()]) == fingerprint([torch.arange(6.0).reshape(2, 3).t()])


def test_a_view_fingerprints_as_its_own_bytes_wherever_it_starts() -> None:
    # A slice starting mid-word of its storage (4 bytes in) sums the same words as a copy of it: replicas whose
    # tensors are views at different offsets still agree.
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        storage = torch.arange(40).to(dtype)
        view = storage[1:30]
        assert fingerprint([view]) == fingerprint([view.clone()]), dtype


def test_the_majority_decides_and_a_tie_decides_nothing() -> None:
    assert odd_ranks([7, 7, 9]) == ([2], 0)
    assert odd_ranks([9, 7, 7, 7]) == ([0], 1)
    assert odd_ranks([7, 9]) == ([0, 1], None)
    assert odd_ranks([7, 7, 9, 9]) == ([0, 1, 2, 3], None)


def _check(tmp_path: Path, prints: list[int], tensors: list[torch.Tensor]) -> tuple[DivergenceCheck, Path, list]:
    log = tmp_path / "events.jsonl"
    sent: list[tuple[int, int]] = []

    def broadcast(t: torch.Tensor, src: int) -> None:
        sent.append((t.data_ptr(), src))
        t.fill_(float(src))  # what the source rank's tensor would bring

    check = DivergenceCheck(0, len(prints), EventLog(log), lambda: tensors, lambda mine: [[p] for p in prints],
                            broadcast, every=10)  # fmt: skip
    return check, log, sent


def test_a_majority_repairs_the_odd_replica_in_place(tmp_path: Path) -> None:
    tensors = [torch.zeros(3), torch.zeros(2, 2).t()]  # one not contiguous
    check, log, sent = _check(tmp_path, [5, 5, 6], tensors)
    assert check.due(20) and not check.due(25)
    assert check.check(20) is False
    assert [src for _, src in sent] == [0, 0] and check.repairs == 1
    events = [(e["event"], e.get("odd")) for e in read_events(log)]
    assert events == [("replica_divergence", [2]), ("replicas_repaired", [2])]
    assert check.last_agreed == 20


def test_the_job_hears_of_a_divergence_before_any_repair_or_error(tmp_path: Path) -> None:
    # The Job voids its survivor's live state there (a peer dying in the repair's broadcasts must not leave a
    # half-repaired replica to hand on): the callback comes before the first broadcast and before the error.
    order: list[str] = []
    check, _, sent = _check(tmp_path, [5, 5, 6], [torch.zeros(3)])
    assert check.check(20, on_odd=lambda: order.append(f"odd after {len(sent)} broadcasts")) is False
    assert order == ["odd after 0 broadcasts"] and len(sent) == 1
    check, _, _ = _check(tmp_path, [5, 6], [torch.zeros(3)])
    with pytest.raises(ReplicaDivergenceError):
        check.check(30, on_odd=lambda: order.append("odd, no majority"))
    assert order[-1] == "odd, no majority"
    check, _, _ = _check(tmp_path, [5, 5], [torch.zeros(3)])
    assert check.check(40, on_odd=lambda: order.append("never")) and "never" not in order


def test_without_a_majority_the_job_stops_with_the_last_step_they_agreed_on(tmp_path: Path) -> None:
    prints = [5, 5]
    check, _, _ = _check(tmp_path, prints, [torch.zeros(3)])
    assert check.check(10)
    prints[1] = 6
    with pytest.raises(ReplicaDivergenceError, match="last agreed at step 10") as info:
        check.check(20)
    assert is_user_error(info.value)


def _job(launch: Any, name: str, every: int, faults: str) -> Any:
    args = ("--steps", "40", "--divergence-every", str(every))
    job = launch(tiny_args(*args, nproc=3, max_restarts=0), name=name, env=child_env(STALWART_FAULTS=faults))
    assert job.wait(240) == 0, job.output()
    return job


def test_a_flipped_bit_on_one_of_three_replicas_is_repaired_without_a_restart(launch: Any) -> None:
    job = _job(launch, "checked", 10, "flip@rank=1,step=23")
    found = {(e["rank"], e["step"], tuple(e["odd"])) for e in job.events("replica_divergence") if e["rank"] == 0}
    assert found == {(0, 30, (1,))}, "found at the first check after the flip, rank 1 the odd one"
    assert len(job.events("replicas_repaired")) == 3, "every rank took part in the repair"
    results = job.results()
    assert len({results[r]["sha256"] for r in range(3)}) == 1, "the replicas agree again"
    assert {e["restart"] for e in job.events("worker_spawned")} == {0}, "no restart"
    # Without the check the flip stays: rank 1 ends with other parameters than its peers.
    unchecked = _job(launch, "unchecked", 0, "flip@rank=1,step=23").results()
    assert unchecked[0]["sha256"] == unchecked[2]["sha256"] != unchecked[1]["sha256"]


def test_module_buffers_are_not_compared(tmp_path: Path) -> None:
    """BatchNorm's running statistics differ between DDP ranks at the end of a step (each rank's own batch; DDP
    broadcasts rank 0's at the next forward): comparing them would stop every 2-rank BatchNorm job."""
    import stalwart

    job = stalwart.Job(tmp_path / "ck", replicated=("model", "optim"))
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    job.track(model=model, optim=optim)
    for _ in job.steps(max_steps=1):
        model(torch.randn(5, 3)).sum().backward()
        optim.step()
    compared = {t.data_ptr() for t in job.tracked.replicated_tensors()}
    job.close()
    assert all(p.data_ptr() in compared for p in model.parameters())
    assert not any(b.data_ptr() in compared for b in model.buffers())
    assert all(s["momentum_buffer"].data_ptr() in compared for s in optim.state.values()), "optimizer state is"
