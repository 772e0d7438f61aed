"""Sharded state (DTensor, FSDP2): written shard by shard by one owner, restored bitwise, exported whole."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.fsdp

from conftest import Launch, child_env, served_python, stalwart, tiny_args
from stalwart.checkpoint.format.sharded import checked_info, shard_extent
from stalwart.errors import CheckpointCorruptError

STEPS = 12
fsdp2 = pytest.mark.skipif(
    not hasattr(torch.distributed.fsdp, "fully_shard"),
    reason="this torch's FSDP2 is private (fully_shard is public from torch 2.6) and makes CUDA streams on a CPU",
)
MESH = Path(__file__).parent / "scripts" / "dtensor_mesh.py"


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    job = Launch(tmp_path_factory.mktemp("fsdp-reference"), tiny_args("--steps", str(STEPS), "--fsdp"), child_env())
    try:
        assert job.wait(120) == 0, job.output()
        return job.results()
    finally:
        job.reap()


@fsdp2
def test_fsdp2_kill_resumes_bitwise_identical(launch: Any, fsdp_reference: dict[int, dict[str, Any]]) -> None:
    job = launch(tiny_args("--steps", str(STEPS), "--fsdp"), env=child_env(STALWART_FAULTS="kill@rank=1,step=9"))
    assert job.wait(120) == 0, job.output()
    assert len(job.events("restarting")) == 1
    results = job.results()
    for rank in (0, 1):
        assert results[rank]["sha256"] == fsdp_reference[rank]["sha256"], "parameters differ from the fault-free run"
        assert results[rank]["seen"] == fsdp_reference[rank]["seen"]
    manifest = json.loads((job.workdir / "ckpt" / "step_00000012" / "manifest.json").read_text())
    shards = sorted(t for t in manifest["tensors"] if t.startswith("D/"))
    # Linear(8,32) and Linear(32,1) under FSDP2: 4 parameters and their exp_avg/exp_avg_sq, 2 shards each.
    assert len(shards) == 12 * 2 and {s.rsplit("@", 1)[1] for s in shards} == {"0", "1"}
    assert not any(t.startswith("R/") for t in manifest["tensors"]), "FSDP2 state is not replicated state"


@fsdp2
def test_fsdp2_export_is_the_whole_model(launch: Any, fsdp_reference: dict[int, dict[str, Any]]) -> None:
    job = launch(tiny_args("--steps", str(STEPS), "--fsdp"))
    assert job.wait(120) == 0, job.output()
    out = job.workdir / "exported"
    done = stalwart("ckpt", "export", str(job.workdir / "ckpt"), "--to", str(out), env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(out))
    model.load_state_dict(state["model"])
    digest = hashlib.sha256()
    for name, t in model.state_dict().items():
        digest.update(name.encode() + t.contiguous().view(torch.uint8).numpy().tobytes())
    assert digest.hexdigest() == fsdp_reference[0]["sha256"], "the exported weights are not the trained ones"


@fsdp2
def test_fsdp2_checkpoint_at_another_world_size_is_refused_unless_allowed(launch: Any) -> None:
    first = launch(tiny_args("--steps", "4", "--every", "4", "--fsdp"))
    assert first.wait(120) == 0, first.output()
    second = launch(tiny_args("--steps", "8", "--fsdp", nproc=1))  # same directory, one rank, no resizing allowed
    assert second.wait(120) != 0
    assert "was written by 2 ranks and this job has 1" in second.output()
    assert "Traceback" not in second.output()
    assert (first.workdir / "ckpt" / "step_00000004" / "manifest.json").exists(), "nothing is moved or deleted"
    third = launch(tiny_args("--steps", "8", "--fsdp", "--allow-resize", nproc=1))  # resharded onto one rank
    assert third.wait(120) == 0, third.output()
    assert [e["step"] for e in third.events("resumed")] == [4]


def test_dtensor_placements_on_a_2x2_mesh_round_trip(launch: Any) -> None:
    save = launch(["--nproc-per-node", "4", str(MESH), "--phase", "save"], name="mesh")
    assert save.wait(180) == 0, save.output()
    saved = save.results()
    assert all(r["extents_ok"] for r in saved.values()), "shard arithmetic differs from DTensor's"
    load = Launch(save.workdir, ["--nproc-per-node", "4", str(MESH), "--phase", "load"], child_env())
    try:
        assert load.wait(180) == 0, load.output()
        results = load.results()
    finally:
        load.reap()
    assert sorted(results) == [0, 1, 2, 3]
    assert all(r["resumed_from"] == 3 and r["same"] for r in results.values()), results
    manifest = json.loads((save.workdir / "ckpt" / "step_00000003" / "manifest.json").read_text())
    shards = [t for t in manifest["tensors"] if t.startswith("D/")]
    # Each distinct shard once: 2+1+2+4+2+4+2 (see SHAPES in the script, plus the parameter).
    assert len(shards) == len(set(shards)) == 17


def test_a_2x2_mesh_that_loses_a_row_reshards_onto_the_rest(launch: Any) -> None:
    """HSDP's 2x2 mesh (replicas x shards) saved, loaded on 2 ranks as 1x2 (a replica group lost) and as 2x1 (a
    shard group lost): every tensor, of every placement, whole as it was saved."""
    save = launch(["--nproc-per-node", "4", str(MESH), "--phase", "save"], name="mesh")
    assert save.wait(180) == 0, save.output()
    for mesh in ("1,2", "2,1"):
        load = Launch(save.workdir, ["--nproc-per-node", "2", str(MESH), "--phase", "load", "--mesh", mesh,
                                     "--allow-resize"], child_env())  # fmt: skip
        try:
            assert load.wait(180) == 0, load.output()
            results = load.results()
        finally:
            load.reap()
        loaded = [results[rank] for rank in (0, 1)]
        assert all(r["resumed_from"] == 3 and r["same"] and r["extents_ok"] for r in loaded), (mesh, loaded)


def test_shard_extent_matches_dtensor_rules() -> None:
    # 7 rows cut in two (4, 3), then each part in two again: (2, 2) and (2, 1).
    assert shard_extent([7, 2], [2, 2], [1, 1], ["S0", "S0"]) == ([1, 2], [6, 0])
    assert shard_extent([1, 5], [2, 2], [1, 0], ["S0", "R"]) == ([0, 5], [1, 0])
    assert shard_extent([6, 8], [2, 2], [1, 0], ["S0", "S1"]) == ([3, 4], [3, 0])


def _info(**change: Any) -> dict[str, Any]:
    info = {"ref": "D/x@0", "shape": [4], "stride": [1], "mesh": [0], "mesh_shape": [1], "coord": [0]}
    return {**info, "placements": ["S0"], **change}


def test_a_well_formed_shard_description_passes() -> None:
    assert checked_info(_info()) == _info()


@pytest.mark.parametrize(
    "info",
    [None, {"ref": "D/x@0"}, _info(placements=["S3"]), _info(placements=["P"]), _info(shape=["4"]), _info(coord=[])],
)
def test_forged_shard_descriptions_are_corrupt(info: Any) -> None:
    with pytest.raises(CheckpointCorruptError):
        checked_info(info)


PARTIAL = """
import sys, torch, torch.distributed as dist, os
from torch.distributed.device_mesh import init_device_mesh
try:
    from torch.distributed.tensor import DTensor, Partial
except ImportError:  # torch 2.4
    from torch.distributed._tensor import DTensor, Partial
from stalwart.checkpoint.format.serialize import flatten
from stalwart.errors import UnsavableStateError
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(sys.argv[1], "s"), 1), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
t = DTensor.from_local(torch.ones(3), mesh, [Partial()])
try:
    flatten({"objects": {"m": {"w": t}}}, 0, frozenset())
except UnsavableStateError as exc:
    print("refused:", exc)
dist.destroy_process_group()
"""


def test_partial_dtensor_is_refused_at_save_with_its_path(tmp_path: Path) -> None:
    done = served_python(PARTIAL, str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "refused: m/w is a DTensor with placement Partial" in done.stdout


class _Mesh:
    """A 1-D device mesh of `size` ranks as reshard sees it (its shape and this rank's coordinate)."""

    def __init__(self, size: int, rank: int) -> None:
        self.mesh, self._rank = torch.arange(size), rank

    def get_coordinate(self) -> list[int]:
        return [self._rank]


class _Shards:
    """A checkpoint's saved shards of one 1-D tensor of 8 values over 4 ranks, but for those in `lost`."""

    def __init__(self, lost: tuple[int, ...] = ()) -> None:
        self.values = torch.arange(8, dtype=torch.float32)
        self.lost = lost
        self.recording = None  # not a dry run (sharded.ShardSource)

    def shard_ids(self, tensor: str) -> list[str]:
        return [f"{tensor}@{r}" for r in range(4) if r not in self.lost]

    def read(self, tid: str) -> torch.Tensor:
        r = int(tid.rsplit("@", 1)[1])
        return self.values[2 * r : 2 * r + 2].clone()

    def read_into(self, tid: str, out: torch.Tensor) -> None:
        out.copy_(self.read(tid))


def test_a_missing_shard_makes_the_reshard_fail_as_corrupt_not_zeros() -> None:
    from stalwart.checkpoint.format.sharded import SavedShard, reshard

    info = {"ref": "D/m/w@0", "shape": [8], "stride": [1], "placements": ["S0"], "mesh": [0, 1, 2, 3],
            "mesh_shape": [4], "coord": [0]}  # fmt: skip
    saved = SavedShard(torch.zeros(2), info)
    with pytest.raises(CheckpointCorruptError, match="cover 2 of the 4 values"):
        reshard(saved, _Mesh(2, 1), _Shards(lost=(3,)), "step 8")  # rank 1 of 2 needs old shards 2 and 3
    with pytest.raises(CheckpointCorruptError, match="malformed"):
        reshard(saved, _Mesh(2, 0), type("Bad", (_Shards,), {"shard_ids": lambda self, t: [f"{t}@x"]})(), "s")
