"""A memory snapshot whose copy runs under the next step (the GPU path of checkpoint/tiers/memory.py), checked on a
CPU through save/side_copy.ThreadedSideCopy: the same contract as a CUDA side stream (the stable tensors' copies
run later, an event marks their end, the fence orders the next optimizer step after it), with a thread instead
of a DMA engine and a release the test holds. On a lent GPU the real path runs in tests/test_gpu_overlap.py.

What must hold: a snapshot is listed only once it is published, after its copy ended; until then a restart
finds the one before it, whole; the optimizer cannot update what is still being copied; a copy that never ends
is given up without its pages being reused; a rollback drops it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import child_env, fault_free_results, tiny_args
from stalwart.checkpoint.save.overlap import UpdateFence
from stalwart.checkpoint.save.side_copy import ThreadDone, ThreadedSideCopy
from stalwart.checkpoint.tiers.memory import MemoryTier
from stalwart.checkpoint.tiers.slot import _ABANDONED
from stalwart.runtime.env import THREADED_SIDE_COPY_ENV as FAKE_ENV


def _job() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, optim)  # the optimizer's state exists
    return model, optim


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    optim.zero_grad(set_to_none=True)
    model(torch.ones(4, 64)).square().mean().backward()
    optim.step()


def _state(step: int, model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    return {"step": step, "objects": {"model": model.state_dict(), "optim": optim.state_dict()}}


def _weights(step: int, tier: MemoryTier) -> torch.Tensor:
    return tier.load(step).state["objects"]["model"]["weight"]


@dataclass
class Overlapped:
    """A one-rank job whose memory tier copies through a ThreadedSideCopy, with step 1's snapshot published."""

    model: torch.nn.Module
    optim: torch.optim.Optimizer
    tier: MemoryTier
    side: ThreadedSideCopy
    fence: UpdateFence

    def train(self) -> None:
        _train(self.model, self.optim)

    def snapshot(self, step: int) -> None:
        self.tier.snapshot(step, _state(step, self.model, self.optim))

    def weights(self) -> torch.Tensor:
        return self.model.weight.detach().clone()


def _pinned(tier: MemoryTier) -> bool:
    """Whether both full-snapshot slots are registered, once their registering threads have ended."""
    for slot in tier._slots:
        if slot._pinning is not None:
            slot._pinning.join(10)
    return all(slot.pinned for slot in tier._slots)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Overlapped]:
    """Steps 1 and 2 snapshotted, one into each slot: each first copy into a slot is synchronous, as into pageable
    memory on a GPU, and registers the slot on a thread; from step 3 on, copies are left running."""
    model, optim = _job()
    side = ThreadedSideCopy(release=threading.Event())
    side.release.set()
    tier = MemoryTier(tmp_path, rank=0, world_size=1, side_copy=side)
    fence = UpdateFence([optim], host=True)
    tier.overlap = fence
    job = Overlapped(model, optim, tier, side, fence)
    for step in (1, 2):
        job.snapshot(step)
        assert tier.running is None and tier.steps()[0] == step, "a copy into a slot not yet registered ran on"
        job.train()
    assert _pinned(tier) and side.registered == 2
    yield job
    job.side.release.set()  # a copy a failed test still held ends, and its thread with it
    tier.close(wait_s=0.0)
    fence.close()


def test_slots_are_registered_after_their_first_copy_and_unregistered_at_close(job: Overlapped) -> None:
    job.snapshot(3)
    assert job.tier.running == 3, "a copy into a registered slot was not left running"
    assert job.tier.publish() == 3
    job.tier.close()
    assert job.side.registered == 0, "a slot was unmapped while still registered"


def test_a_snapshot_is_listed_only_once_published_and_holds_its_step_though_the_next_step_ran(job: Overlapped) -> None:
    tier, fence = job.tier, job.fence
    job.side.release.clear()
    at_3 = job.weights()
    job.snapshot(3)
    assert tier.running == 3 and fence.pending
    assert tier.steps() == [2], "listed before its copy ended"
    assert tier.image(3, light=False) == b"", "sent to a peer before its copy ended"

    stepping = threading.Thread(target=job.train)  # the next step's optimizer step
    stepping.start()
    stepping.join(0.3)
    assert stepping.is_alive(), "the optimizer updated the parameters while their copy was still running"
    job.side.release.set()
    stepping.join(10)
    assert not stepping.is_alive()
    assert not torch.equal(job.weights(), at_3), "the step did update them once the copy had ended"

    assert tier.publish() == 3
    assert tier.running is None and tier.steps() == [3, 2]
    assert torch.equal(_weights(3, tier), at_3), "the snapshot does not hold its step"


def test_a_rank_that_dies_before_publishing_leaves_the_snapshot_before_it_whole(
    job: Overlapped, tmp_path: Path
) -> None:
    tier = job.tier
    at_3 = job.weights()
    job.snapshot(3)
    tier.publish()
    job.train()
    job.side.release.clear()
    job.snapshot(4)  # into step 2's slot, its copy not yet ended
    restarted = MemoryTier(tmp_path, rank=0, world_size=1)  # what a replacement process finds
    try:
        assert restarted.steps() == [3], "step 4 is listed before it was published, or step 3 is gone"
        job.side.release.set()
        job.side.threads[-1].join(10)
        assert restarted.steps() == [3], "a copy that ended is not a published snapshot"
        assert torch.equal(_weights(3, restarted), at_3), "the snapshot before it is not whole"
        tier.close(wait_s=0.0)  # closing publishes one whose copy has ended
        assert restarted.steps() == [4, 3]
    finally:
        restarted.close()


def test_a_copy_that_never_ends_is_given_up_and_its_pages_are_never_reused(job: Overlapped) -> None:
    tier, side = job.tier, job.side
    side.release.clear()
    job.snapshot(3)  # a copy queued behind a hung compute stream, say
    job.fence._pending.clear()  # (the hung step never reaches its optimizer step)
    held = len(_ABANDONED)
    assert tier.publish(wait_s=0.05) is None
    assert len(_ABANDONED) == held + 1, "the mapping the copy still writes was not kept"
    assert tier.steps() == [2]
    for _ in range(3):
        job.train()
    stale = side.release
    side.release = threading.Event()
    side.release.set()
    job.snapshot(6)  # into new pages: not registered yet, so copied at once
    assert tier.running is None and tier.steps() == [6, 2]
    want = job.weights()
    job.train()  # the stale copy reads its sources when it runs at last: they differ from step 6's now
    stale.set()
    side.threads[0].join(10)  # the copy of step 3 lands at last, after step 6 was taken
    assert tier.steps() == [6, 2], "the slot given up was not the one written next"
    assert torch.equal(_weights(6, tier), want), "the given-up copy landed in a newer snapshot"
    assert side.registered == 3, "the given-up mapping was unregistered, or the new one not registered"


def test_a_rollback_drops_a_snapshot_not_yet_published(job: Overlapped) -> None:
    tier = job.tier
    job.snapshot(3)
    assert tier.running == 3
    assert tier.forget_after(2) == [3]
    assert tier.running is None and tier.publish() is None
    assert tier.steps() == [2]


def test_the_fence_waits_for_every_copy_deferred_to_it() -> None:
    model, optim = _job()
    fence = UpdateFence([optim], host=True)
    assert fence.stable() >= {p.untyped_storage().data_ptr() for p in model.parameters()}
    first, second = ThreadDone(), ThreadDone()
    fence.defer(first, None)
    fence.defer(second, None)
    stepping = threading.Thread(target=_train, args=(model, optim))
    stepping.start()
    first.set()
    stepping.join(0.3)
    assert stepping.is_alive(), "the fence let the update run before the second copy ended"
    second.set()
    stepping.join(10)
    assert not stepping.is_alive() and not fence.pending
    assert fence.take_stall_s() > 0, "the update's wait for the copies was not counted"
    assert fence.take_stall_s() == 0, "counted twice"
    fence.close()


STEPS = 20


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return fault_free_results(tmp_path_factory.mktemp("reference"), "--steps", str(STEPS))


@pytest.mark.parametrize("faults", ["kill@rank=1,step=13", "kill@rank=0,step=9;kill@rank=1,step=9"])
def test_a_job_whose_snapshots_overlap_the_next_step_resumes_bitwise_identical(
    launch: object, reference: dict, faults: str
) -> None:
    """Under `stalwart run` with every full snapshot's copy left running until the next step's end: a kill
    loses the snapshot being copied (the step before it is resumed), and the run ends bitwise identical."""
    job = launch(tiny_args("--steps", str(STEPS)), env=child_env(STALWART_FAULTS=faults, **{FAKE_ENV: "1"}))  # type: ignore[operator]
    assert job.wait(180) == 0, job.output()
    resumed = job.events("resumed")
    killed_at = int(faults.split("step=")[1].split(";")[0])
    assert resumed and all(e["tier"] == "memory" for e in resumed), resumed
    assert {e["step"] for e in resumed} == {killed_at - 1}, "the snapshot being copied at the kill was used"
    results = job.results()
    for rank in (0, 1):
        assert results[rank]["step"] == STEPS
        assert results[rank]["sha256"] == reference[rank]["sha256"], "parameters differ from the fault-free run"
        assert results[rank]["seen"] == reference[rank]["seen"], "the sample history differs"
