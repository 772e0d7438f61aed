"""The cheap reads behind light snapshots give what the full reads give: RNG captures that skip unmoved
generators, flatten() with a template, the survivor's live tensors and skeleton, slot writes that skip frozen
tensors. Each test compares against the plain, slow way, including the cases that must fall back to it."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stalwart.checkpoint.format.serialize import FlattenCache, flatten, frozen
from stalwart.checkpoint.tiers.memory import MemoryTier
from stalwart.job.live import LiveState, plain_module
from stalwart.job.rng import capture_rng, restore_rng


def _python_matches(state: dict[str, Any]) -> bool:
    version, words, gauss = random.getstate()
    py = state["python"]
    return py["version"] == version and tuple(py["state"].tolist()) == words and py["gauss"] == gauss


def test_python_capture_sees_a_regeneration_that_leaves_the_position_where_it_was() -> None:
    """Drawing exactly 624 words puts the position back where it was, but regenerates every word: the sampled
    words must tell the capture that the generator moved."""
    random.seed(5)
    random.random()  # somewhere inside the 624 words
    first = capture_rng()
    assert _python_matches(first)
    for _ in range(624):
        random.getrandbits(32)  # one word each
    again = capture_rng()
    assert random.getstate()[1][-1] == first["python"]["state"][-1].item(), "the position is where it was"
    assert again["python"]["state"] is not first["python"]["state"]
    assert _python_matches(again)
    assert capture_rng()["python"]["state"] is again["python"]["state"], "not moved: the same tensor"
    random.gauss(0, 1)  # leaves a cached Gaussian
    assert _python_matches(capture_rng())
    restore_rng(first)
    assert _python_matches(capture_rng())


def test_torch_and_numpy_captures_are_shared_while_unmoved_and_fresh_after() -> None:
    torch.manual_seed(3)
    np.random.seed(3)
    a, b = capture_rng(), capture_rng()
    assert a["torch"] is b["torch"] and a["numpy"]["keys"] is b["numpy"]["keys"]
    torch.rand(3)
    np.random.randint(0, 10, size=700)  # past a regeneration
    c = capture_rng()
    assert c["torch"] is not a["torch"] and torch.equal(c["torch"], torch.get_rng_state())
    _, keys, pos, _, _ = np.random.get_state(legacy=True)
    assert c["numpy"]["pos"] == pos and np.array_equal(c["numpy"]["keys"].numpy(), keys.astype(np.int64))


def test_every_capture_between_draws_of_every_size_is_exact() -> None:
    """Draws of 1 to 7 words at a time, past several regenerations (some ending exactly where the position was):
    each capture equals the generators' full state, read the slow way."""
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    for k in range(1, 700):
        n = k % 7 + 1
        if k % 3 == 0:
            [random.getrandbits(32) for _ in range(n)]
        elif k % 3 == 1:
            torch.randint(0, 1000, (n,))
        else:
            np.random.randint(0, 1000, size=n)
        got = capture_rng()
        assert _python_matches(got), k
        assert torch.equal(got["torch"], torch.get_rng_state()), k
        _, keys, pos, _, _ = np.random.get_state(legacy=True)
        assert got["numpy"]["pos"] == pos and np.array_equal(got["numpy"]["keys"].numpy(), keys.astype(np.int64))
    assert capture_rng() is capture_rng(), "nothing moved: the same capture"


def test_a_flatten_template_gives_what_flatten_gives_and_falls_back_when_the_shape_changes() -> None:
    cache = FlattenCache(rank=1, replicated=frozenset({"m"}))

    def check(state: dict[str, Any]) -> None:
        skeleton, items = cache.flatten(state)
        want_skeleton, want_items = flatten(state, 1, frozenset({"m"}))
        assert skeleton == want_skeleton
        assert [(i.id, i.tensor.data_ptr(), i.nbytes) for i in items] == [
            (i.id, i.tensor.data_ptr(), i.nbytes) for i in want_items
        ]

    state: dict[str, Any] = {"step": 1, "objects": {"m": {"w": torch.ones(3), "lr": 0.1}, "p": [torch.zeros(2)]}}
    check(state)
    state["objects"]["m"]["lr"] = 0.2  # a plain value changes
    state["objects"]["p"] = [torch.ones(2)]  # another tensor of the same shape
    check(state)
    state["objects"]["p"] = [torch.ones(5)]  # another shape
    check(state)
    state["objects"]["m"]["extra"] = torch.zeros(1)  # a new key
    check(state)
    shared = torch.arange(4.0)
    state["objects"]["p"] = [shared, shared]  # two places, one memory: flatten writes it once
    check(state)
    check(state)


def test_a_replicated_skeleton_names_the_same_tensors_or_is_walked_again() -> None:
    cache = FlattenCache(rank=0, replicated=frozenset({"m"}), same_tensors=True)
    w = torch.ones(3)
    state = {"objects": {"m": {"w": w}}}
    assert cache.skeleton(state) == flatten(state, 0, frozenset({"m"}))[0]
    state["objects"]["m"]["w"] = torch.ones(3)  # same shape, another tensor: still right
    assert cache.skeleton(state) == flatten(state, 0, frozenset({"m"}))[0]


def _job_objects() -> tuple[dict[str, Any], torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    sched.step()
    return {"model": model, "optim": optim, "sched": sched}, optim


def _full_skeleton(objects: dict[str, Any], replicated: frozenset[str]) -> dict[str, Any]:
    states = {n: objects[n].state_dict() for n in replicated}
    return flatten({"objects": states}, 0, replicated)[0]["objects"]


def test_the_survivor_skeleton_read_cheaply_equals_the_full_walk_step_after_step() -> None:
    objects, optim = _job_objects()
    replicated = frozenset(objects)
    live = LiveState(rank=0)
    live.read(objects, replicated, fresh=True)
    for step in range(4):
        live.remember(step, objects, replicated)
        assert live.skeleton == (step, _full_skeleton(objects, replicated))
        objects["model"](torch.randn(3, 4)).sum().backward()
        optim.step()
        objects["sched"].step()  # the learning rate in the optimizer's groups moves every step
        live.read(objects, replicated)
    optim.param_groups[0]["lr"] = torch.tensor(0.5)  # a tensor learning rate: the optimizer's state_dict() again
    live.remember(9, objects, replicated)
    assert live.skeleton == (9, _full_skeleton(objects, replicated))


def test_live_tensors_are_unchanged_until_an_in_place_write_or_a_replacement() -> None:
    objects, _ = _job_objects()
    replicated = frozenset({"model", "optim"})
    live = LiveState(rank=0)
    live.read(objects, replicated, fresh=True)
    assert live.held and live.unchanged(objects, replicated)
    with torch.no_grad():
        objects["model"][0].weight.add_(1.0)
    assert not live.unchanged(objects, replicated)
    live.read(objects, replicated)
    assert live.unchanged(objects, replicated)
    objects["model"][0].weight = torch.nn.Parameter(torch.zeros(8, 4))  # replaced: the cached list misses it
    live.read(objects, replicated)
    assert not live.unchanged(objects, replicated), "the fresh walk at a failure sees the replacement"


def test_plain_modules_are_those_whose_state_dict_can_only_hold_parameters() -> None:
    assert plain_module(torch.nn.Linear(2, 2))
    assert not plain_module(torch.nn.BatchNorm1d(2))  # buffers
    hooked = torch.nn.Linear(2, 2)
    hooked._register_state_dict_hook(lambda *args: None)
    assert not plain_module(hooked)


def test_slot_writes_skip_frozen_tensors_already_there_and_copy_everything_else(tmp_path: Path) -> None:
    tier = MemoryTier(tmp_path, rank=0, world_size=1)
    steady = frozen(torch.arange(6.0))
    user = torch.zeros(3)
    for step in range(1, 6):
        user.fill_(float(step))  # a user's tensor, written in place: always copied
        moving = frozen(torch.full((2,), float(step)))  # a new capture each step
        tier.snapshot(step, {"step": step, "objects": {"u": {"t": user}}, "rng": {"a": steady, "b": moving}})
        got = tier.load(step).state
        assert torch.equal(got["rng"]["a"], steady) and torch.equal(got["rng"]["b"], moving)
        assert torch.equal(got["objects"]["u"]["t"], user)
    assert tier.steps() == [5, 4]
    assert tier.forget_after(4) == [5]
    tier.snapshot(5, {"step": 5, "objects": {"u": {"t": user}}, "rng": {"a": steady, "b": moving}})
    assert tier.steps() == [5, 4], "after a forget the invalid slot is written, not the one holding step 4"
    tier.close()


def test_plain_values_travel_beside_the_pickled_skeleton_and_come_back_as_they_were() -> None:
    from collections import OrderedDict

    from stalwart.checkpoint.tiers.toc import TocCache, fill_values, parse_toc, split_values

    skeleton = {
        "step": 7,
        "objects": {"d": OrderedDict(a=1, b=True, c=1.0, n=None, s="x", t=(2, 3.5), nan=float("nan"))},
        "ref": {"__stalwart_tensor__": "r0/x"},
        "size": torch.Size([2]),
    }
    values: list[Any] = []
    shape = split_values(skeleton, values)
    assert shape["ref"] == skeleton["ref"] and shape["size"] == torch.Size([2]), "references and other leaves stay"
    back = fill_values(shape, values)
    assert type(back["objects"]["d"]) is OrderedDict and back["objects"]["d"]["t"] == (2, 3.5)
    assert [type(v) for v in back["objects"]["d"].values()] == [int, bool, float, type(None), str, tuple, float]
    tocs = TocCache()
    first, layout = tocs.toc("light", skeleton, [], {})
    skeleton["objects"]["d"]["a"] = 2  # a value: the same layout
    second, again = tocs.toc("light", skeleton, [], {})
    assert again is layout and second != first
    assert tocs.toc("light", skeleton, [], {})[0] is second, "nothing changed: the same bytes"
    skeleton["objects"]["d"]["a"] = 2.0  # equal, but written otherwise: a new table of contents
    third, _ = tocs.toc("light", skeleton, [], {})
    assert third != second
    got, _, _, _ = parse_toc(third, step=9)
    assert got["step"] == 9 and got["objects"]["d"]["a"] == 2.0 and type(got["objects"]["d"]["a"]) is float
    assert got["objects"]["d"]["b"] is True and got["objects"]["d"]["nan"] != got["objects"]["d"]["nan"]
    skeleton["objects"]["d"]["z"] = 0  # a new key: a new layout
    assert tocs.toc("light", skeleton, [], {})[1] is not layout


def test_a_table_of_contents_that_grows_past_a_page_moves_the_tensors_and_they_are_copied_again(
    tmp_path: Path,
) -> None:
    tier = MemoryTier(tmp_path, rank=0, world_size=1)
    steady = frozen(torch.arange(8.0))
    for step, text in enumerate(["a", "b", "c" * 5000, "d", "e", "f"], start=1):  # slots: 1, 3, 5 and 2, 4, 6
        state = {"step": step, "objects": {"u": {"text": text}}, "rng": {"a": steady}}
        tier.snapshot(step, state)
        got = tier.load(step).state
        assert got["objects"]["u"]["text"] == text and torch.equal(got["rng"]["a"], steady), step
    tier.close()


class _LightTier:
    """A rank's memory tier with one live replicated tensor, light snapshots written and read back through it."""

    def __init__(self, path: Path, rank: int) -> None:
        self.tier = MemoryTier(path, rank=rank, world_size=2)
        self.w = torch.ones(4)
        self.replicated = {"m": {"w": self.w, "lr": 0.1}}

    def write(self, step: int, per_rank: dict[str, Any]) -> None:
        live = frozenset({self.w.data_ptr()})
        assert self.tier.snapshot_light(step, per_rank, lambda: self.replicated, live) is not None

    def read(self, step: int) -> dict[str, Any]:
        _, content = self.tier.light(step)
        survivor = {"m": {"w": {"__stalwart_tensor__": "R/m/w"}, "lr": 0.1}}
        return self.tier.load_light(step, content, {"R/m/w": self.w}, survivor).state


def test_a_light_snapshot_whose_per_rank_state_shares_memory_is_still_read_back_whole(tmp_path: Path) -> None:
    """Two per-rank tensors sharing memory leave FlattenCache without a template: the general way is taken."""
    light = _LightTier(tmp_path, rank=0)
    for step in (1, 2, 3):
        shared = torch.full((3,), float(step))
        light.write(step, {"step": step, "objects": {"p": {"a": shared, "b": shared, "n": step}}, "world_size": 2})
        got = light.read(step)
        assert got["step"] == step and got["objects"]["p"]["n"] == step
        assert torch.equal(got["objects"]["p"]["a"], shared) and torch.equal(got["objects"]["p"]["b"], shared)
    light.tier.close()


def test_light_snapshots_with_a_counter_that_moves_every_step_read_back_every_step(tmp_path: Path) -> None:
    light = _LightTier(tmp_path, rank=1)
    window = frozen(torch.zeros(5, dtype=torch.float64))
    for step in range(1, 8):
        data = {"epoch": step // 3, "batch": step, "name": "x" * step, "flag": step % 2 == 0, "none": None}
        light.write(step, {"step": step, "objects": {"data": data}, "rng": {"t": window}, "world_size": 2})
        for back in {step, max(1, step - 1)}:  # both slots
            got = light.read(back)
            want = {"epoch": back // 3, "batch": back, "name": "x" * back, "flag": back % 2 == 0, "none": None}
            assert got["step"] == back and got["objects"]["data"] == want, (step, back)
            assert type(got["objects"]["data"]["flag"]) is bool
    light.tier.close()


def test_a_tensor_that_grows_in_place_in_the_table_is_read_back_at_its_new_size(tmp_path: Path) -> None:
    """A per-rank history that grows by a few elements a step keeps every offset (the last tensor, aligned):
    the table of contents must still change, or the snapshot reads back the old size."""
    tier = MemoryTier(tmp_path, rank=0, world_size=1)
    for step in range(1, 6):
        history = torch.arange(step, dtype=torch.int64)
        tier.snapshot(step, {"step": step, "objects": {"seen": {"ids": history}}})
        assert torch.equal(tier.load(step).state["objects"]["seen"]["ids"], history), step
    tier.close()


def test_a_cuda_graph_replay_is_noticed() -> None:
    """A CUDA graph's replay writes without bumping version counters: once one replayed, the live state leaves CUDA
    tensors out (job/live.py). Here no GPU: the watched replay is called on something that is not a graph."""
    from stalwart.job import live

    live.LiveState(0)  # installs the watch
    assert getattr(torch.cuda.CUDAGraph.replay, "_stalwart_watched", False)
    before = live._graphs_replayed[0]
    try:
        live._graphs_replayed[0] = False
        with pytest.raises((TypeError, AttributeError)):  # no graph: torch's replay fails, after the watch saw it
            torch.cuda.CUDAGraph.replay(object())  # type: ignore[arg-type]
        assert live.graphs_replayed()
    finally:
        live._graphs_replayed[0] = before
