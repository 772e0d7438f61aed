"""The memory tier: double-buffered snapshot slots in shared memory that outlive the writing process."""

from __future__ import annotations

import struct
import threading
from pathlib import Path

import pytest
import torch

from conftest import served_python
from stalwart.checkpoint.tiers.memory import HEADER, HEADER_BYTES, MemoryTier, _Pending
from stalwart.checkpoint.tiers.slot import SlotHeader
from stalwart.errors import CheckpointCorruptError


def _state(step: int) -> dict:
    return {
        "step": step,
        "objects": {
            "m": {"w": torch.full((8, 16), float(step)), "t": torch.arange(12.0).reshape(3, 4).t() * step},
            "o": {"half": torch.ones(5, dtype=torch.float16) * step, "n": step, "lr": [0.1, {"k": "v"}]},
        },
    }


def test_round_trip_and_the_two_newest_steps_are_kept(tmp_path: Path) -> None:
    tier = MemoryTier(tmp_path, rank=1, world_size=2)
    for step in (1, 2, 3):
        seconds, nbytes = tier.snapshot(step, _state(step))
        assert seconds >= 0 and nbytes > 0
    assert tier.steps() == [3, 2]
    for step in (3, 2):
        got = tier.load(step)
        want = _state(step)
        assert got.step == step and got.state["step"] == step
        for key in ("w", "t"):
            assert torch.equal(got.state["objects"]["m"][key], want["objects"]["m"][key])
        assert torch.equal(got.state["objects"]["o"]["half"], want["objects"]["o"]["half"])
        assert got.state["objects"]["o"]["lr"] == [0.1, {"k": "v"}]
    with pytest.raises(CheckpointCorruptError):
        tier.load(1)
    tier.close()


def test_images_left_for_a_grow_are_seen_only_by_the_grow(tmp_path: Path) -> None:
    """FSDP2 survivors leave their shards of the step reached as "stretch" images (recovery/in_loop/sharded_stretch):
    a restore of the job (its own slots, or another world size's) never takes them, so one left behind by a grow
    that failed cannot pass for a snapshot of the job; the grow reads them as one of 1 rank's images."""
    from stalwart.checkpoint.tiers.memory_shards import MemoryImages, holdings

    MemoryTier(tmp_path, rank=0, world_size=2, local_rank=0).snapshot(5, _state(5))
    MemoryTier(tmp_path, rank=0, world_size=1, local_rank=0, kind="stretch").snapshot(9, _state(9))
    assert holdings(tmp_path, -1) == {(2, 5): {0: tmp_path / "local00000.slot0"}}
    assert set(holdings(tmp_path, 2, "stretch")) == {(1, 9)}
    assert MemoryTier(tmp_path, rank=0, world_size=1, local_rank=0).steps() == [], "not a snapshot of the job's"
    assert MemoryTier(tmp_path, rank=0, world_size=2, local_rank=0).steps() == [5]
    images = MemoryImages(tmp_path, 1, 9, kind="stretch")
    assert torch.equal(images.state(0)["objects"]["m"]["w"], _state(9)["objects"]["m"]["w"])
    with pytest.raises(CheckpointCorruptError):
        MemoryImages(tmp_path, 1, 9)


def test_another_rank_or_world_size_sees_nothing(tmp_path: Path) -> None:
    MemoryTier(tmp_path, rank=0, world_size=2).snapshot(5, _state(5))
    assert MemoryTier(tmp_path, rank=1, world_size=2).steps() == []
    assert MemoryTier(tmp_path, rank=0, world_size=3).steps() == []
    assert MemoryTier(tmp_path, rank=0, world_size=2).steps() == [5]


def test_a_snapshot_torn_by_a_dying_writer_is_never_listed(tmp_path: Path) -> None:
    tier = MemoryTier(tmp_path, rank=0, world_size=1)
    tier.snapshot(7, _state(7))
    tier.snapshot(8, _state(8))
    path = next(p for p in tmp_path.glob("local00000.slot*") if HEADER.unpack_from(p.read_bytes())[2] == 8)
    with open(path, "r+b") as f:  # what a writer killed mid-copy leaves: the valid word cleared
        f.seek(8)
        f.write(struct.pack("<q", 0))
    assert MemoryTier(tmp_path, 0, 1).steps() == [7], "the torn slot is skipped, the older one is whole"
    with open(path, "r+b") as f:
        f.write(b"\0" * HEADER_BYTES)
    assert MemoryTier(tmp_path, 0, 1).steps() == [7]


WRITER = """
import sys, torch
from stalwart.checkpoint.tiers.memory import MemoryTier
MemoryTier(sys.argv[1], 0, 1).snapshot(4, {"step": 4, "objects": {"m": {"w": torch.full((3,), 4.0)}}})
"""


def test_snapshots_outlive_the_process_that_wrote_them(tmp_path: Path) -> None:
    done = served_python(WRITER, str(tmp_path), timeout=60)
    assert done.returncode == 0, done.stderr
    got = MemoryTier(tmp_path, 0, 1).load(4)
    assert torch.equal(got.state["objects"]["m"]["w"], torch.full((3,), 4.0))


def test_replicated_objects_are_split_between_local_ranks(tmp_path: Path) -> None:
    """Each of two local ranks copies half of a replicated object; each restores all of it from both slots."""
    replicated = frozenset({"m"})
    tiers = [MemoryTier(tmp_path, rank=r, world_size=2, local_rank=r, local_world_size=2) for r in (0, 1)]
    full = MemoryTier(tmp_path / "alone", rank=0, world_size=1)
    (tmp_path / "alone").mkdir()

    def state(rank: int) -> dict:
        s = _state(3)
        s["objects"]["mine"] = {"r": torch.full((4,), float(rank))}  # per-rank state stays per rank
        return s

    _, whole = full.snapshot(3, state(0), replicated)
    copied = [tier.snapshot(3, state(tier.rank), replicated)[1] for tier in tiers]
    assert all(0 < c < whole for c in copied), "each local rank copies only its share of the replicated object"
    for tier in tiers:
        got = tier.load(3).state["objects"]
        for key in ("w", "t"):
            assert torch.equal(got["m"][key], _state(3)["objects"]["m"][key])
        assert torch.equal(got["mine"]["r"], torch.full((4,), float(tier.rank)))
    (tmp_path / "local00001.slot0").unlink()  # a peer's slot gone: the replicated half is missing, loudly
    (tmp_path / "local00001.slot1").unlink(missing_ok=True)
    with pytest.raises(CheckpointCorruptError):
        tiers[0].load(3)


def test_a_light_snapshot_leaves_the_live_tensors_out_and_takes_them_back_on_load(tmp_path: Path) -> None:
    state = _state(4)
    weight = state["objects"]["m"]["w"]
    tier = MemoryTier(tmp_path, rank=0, world_size=2)
    _, nbytes = tier.snapshot(4, state, frozenset({"m"}), live={weight.data_ptr()})
    assert tier.steps(light=True) == [4] and tier.steps() == [], "light and full slots are apart"
    assert nbytes < weight.nbytes + 256, "the live weight was not copied"
    wanted, content = tier.light(4)
    assert wanted == {"R/m/w": (torch.float32, [8, 16])}
    got = tier.load_light(4, content, {"R/m/w": weight.clone()}).state
    assert torch.equal(got["objects"]["m"]["w"], weight)
    assert torch.equal(got["objects"]["m"]["t"], state["objects"]["m"]["t"]), "the rest comes from the slot"
    with pytest.raises(CheckpointCorruptError):
        tier.load_light(4, content, {})  # nobody supplies the live tensor
    with pytest.raises(CheckpointCorruptError):
        tier.light(3)
    tier.close()


def test_a_light_snapshot_from_the_per_rank_part_reuses_the_replicated_part_and_needs_the_survivors(
    tmp_path: Path,
) -> None:
    replicated = {"m": {"w": torch.full((8, 16), 4.0), "lr": 0.5}}
    live = {replicated["m"]["w"].data_ptr()}
    calls = []

    def replicated_of() -> dict:
        calls.append(1)
        return replicated

    tier = MemoryTier(tmp_path, rank=1, world_size=2)
    for step in (4, 5):
        per_rank = {"step": step, "objects": {"mine": {"r": torch.full((4,), float(step))}}, "world_size": 2}
        assert tier.snapshot_light(step, per_rank, replicated_of, live) is not None
    assert len(calls) == 1, "the replicated part is walked once per set of live tensors"
    replicated["m"]["lr"] = 0.25  # changed since: the snapshot's copy of it is stale, the survivor's is not
    wanted, content = tier.light(5)
    assert wanted == {"R/m/w": (torch.float32, [8, 16])}
    with pytest.raises(CheckpointCorruptError, match="survivor"):
        tier.load_light(5, content, {"R/m/w": replicated["m"]["w"]})  # no skeleton from the survivor
    with pytest.raises(CheckpointCorruptError, match="lacks replicated objects"):
        tier.load_light(5, content, {"R/m/w": replicated["m"]["w"]}, {"x": {}})  # a skeleton without "m"
    survivor = {"m": {"w": {"__stalwart_tensor__": "R/m/w"}, "lr": 0.25}}
    got = tier.load_light(5, content, {"R/m/w": replicated["m"]["w"]}, survivor).state
    assert got["objects"]["m"]["lr"] == 0.25 and torch.equal(got["objects"]["m"]["w"], replicated["m"]["w"])
    assert torch.equal(got["objects"]["mine"]["r"], torch.full((4,), 5.0)) and got["step"] == 5
    # A replicated tensor that is not live (a module's buffer) must be copied: the caller takes `snapshot`.
    assert tier.snapshot_light(6, per_rank, lambda: {"m": {"w": torch.zeros(2)}}, {12345}) is None
    assert tier.steps(light=True) == [5, 4], "nothing was written"
    tier.close()


def test_snapshots_that_differ_only_in_their_step_or_plain_values_pickle_their_skeleton_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step lives in the slot's header and plain values beside the pickled skeleton: a light snapshot every
    step would otherwise pickle its skeleton again each time (half its cost inside a training step)."""
    pickled = []
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda *a, **k: (pickled.append(1), real_save(*a, **k))[1])
    replicated = {"m": {"w": torch.full((8, 16), 4.0)}}
    live = {replicated["m"]["w"].data_ptr()}
    tier = MemoryTier(tmp_path, rank=0, world_size=1)
    for step in (4, 5, 6):
        per_rank = {"step": step, "objects": {"mine": {"r": torch.full((4,), float(step))}}, "rng": {"n": 1}}
        assert tier.snapshot_light(step, per_rank, lambda: replicated, live) is not None
    assert len(pickled) == 1
    survivor = {"m": {"w": {"__stalwart_tensor__": "R/m/w"}}}
    for step in (6, 5):
        _, content = tier.light(step)
        got = tier.load_light(step, content, {"R/m/w": replicated["m"]["w"]}, survivor).state
        assert got["step"] == step and torch.equal(got["objects"]["mine"]["r"], torch.full((4,), float(step)))
    per_rank["rng"] = {"n": 2}  # a plain value: written beside the pickled skeleton, not pickled
    assert tier.snapshot_light(7, per_rank, lambda: replicated, live) is not None and len(pickled) == 1
    per_rank["rng"] = {"n": 2, "m": 1.5}  # another structure: pickled
    assert tier.snapshot_light(8, per_rank, lambda: replicated, live) is not None and len(pickled) == 2
    for step, n in ((7, {"n": 2}), (8, {"n": 2, "m": 1.5})):
        _, content = tier.light(step)
        got = tier.load_light(step, content, {"R/m/w": replicated["m"]["w"]}, survivor).state
        assert got["rng"] == n and type(got["rng"]["n"]) is int
    tier.close()


def test_a_snapshot_image_kept_on_another_node_comes_back_whole_and_only_to_its_own_rank(tmp_path: Path) -> None:
    lost, keeper = tmp_path / "lost", tmp_path / "keeper"
    lost.mkdir(), keeper.mkdir()
    mine = MemoryTier(lost, rank=1, world_size=2)
    for step in (4, 5):
        mine.snapshot(step, _state(step))
    image = mine.image(5, light=False)
    assert image and mine.image(3, light=False) == b"" and mine.image(5, light=True) == b""
    ward = MemoryTier(keeper, rank=0, world_size=2)
    assert not ward.store_ward(0, image[:-1], light=False), "a truncated image is refused"
    assert not MemoryTier(keeper, rank=0, world_size=3).store_ward(0, image, light=False), "another world size"
    assert ward.store_ward(0, image, light=False)
    held = [h for h in ward.held(1) if h[2] == 1]
    assert [(light, step) for _, light, _, step in held] == [(False, 5)]
    back = ward.held_image(1, held[0][0])
    assert back == image
    (tmp_path / "new").mkdir()
    fresh = MemoryTier(tmp_path / "new", rank=1, world_size=2)
    assert not MemoryTier(tmp_path / "new", rank=0, world_size=2).install(back, light=False), "not rank 0's"
    assert fresh.steps() == [] and fresh.install(back, light=False) and fresh.steps() == [5]
    got = fresh.load(5).state["objects"]["m"]
    assert torch.equal(got["w"], _state(5)["objects"]["m"]["w"])


def test_a_snapshot_of_another_world_size_is_never_loaded_whole_or_light(tmp_path: Path) -> None:
    """A run of 2 ranks leaves slot files that a run of 3 ranks finds under the same names: rank 0 of the new
    world must load neither its full nor its light snapshots, as `steps()` already lists none of them."""
    old = MemoryTier(tmp_path, rank=0, world_size=2)
    old.snapshot(5, _state(5))
    replicated = {"m": {"w": torch.full((8, 16), 4.0)}}
    per_rank = {"step": 5, "objects": {"mine": {"r": torch.zeros(4)}}, "rng": {"n": 1}}
    assert old.snapshot_light(5, per_rank, lambda: replicated, {replicated["m"]["w"].data_ptr()}) is not None
    old.close()
    new = MemoryTier(tmp_path, rank=0, world_size=3)
    assert new.steps() == [] and new.steps(light=True) == []
    with pytest.raises(CheckpointCorruptError):
        new.load(5)
    with pytest.raises(CheckpointCorruptError):
        new.light(5)
    assert new.image(5, light=False) == b"" and new.image(5, light=True) == b""


class _NeverDone:
    """A snapshot's copy queued behind a hung GPU stream: it never ends, and waiting for it never returns."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        threading.Event().wait()


@pytest.mark.parametrize("drop", ["forget_after", "install"])
def test_a_hung_copy_is_given_up_by_a_rollback_and_an_install_not_waited_for(tmp_path: Path, drop: str) -> None:
    tier = MemoryTier(tmp_path, rank=0, world_size=1, copy_wait_s=0.05)
    tier.snapshot(3, _state(3))
    image = tier.image(3, light=False)
    tier.snapshot(4, _state(4))
    slot = next(s for s in tier._slots if (h := s.header()) is not None and h.step == 4)
    tier._pending = _Pending(4, _NeverDone(), slot, SlotHeader.writing(0, 1))  # type: ignore[arg-type]
    call = (lambda: tier.forget_after(3)) if drop == "forget_after" else (lambda: tier.install(image, light=False))
    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), f"{drop} waited without limit for a copy that never ends"
    assert tier.running is None
