"""The CPU-visible half of the overlapped checkpoint copy (checkpoint/save/overlap.py); the GPU half, where copies
really run while the next step does, is tests/test_gpu_overlap.py (run on a lent GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.conftest import open_checkpointer

from conftest import served_python
from stalwart.checkpoint.save.overlap import UpdateFence, storage_key
from stalwart.checkpoint.save.staging import Staging
from stalwart.errors import ConfigError
from stalwart.job.job import JobConfig


def test_the_fence_hooks_every_optimizer_and_removes_its_hooks() -> None:
    model = torch.nn.Linear(4, 4)
    optims = [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.AdamW(model.parameters())]
    before = [len(o._optimizer_step_pre_hooks) for o in optims]
    fence = UpdateFence(optims)
    assert [len(o._optimizer_step_pre_hooks) for o in optims] == [b + 1 for b in before]
    assert fence.stable() == set(), "CPU tensors are never left to a side stream"
    assert not fence.pending
    fence.fence()  # nothing pending: a no-op, also without CUDA
    optims[0].step()  # the hook runs and does nothing
    fence.close()
    assert [len(o._optimizer_step_pre_hooks) for o in optims] == before


def test_views_of_one_tensor_share_a_storage_key() -> None:
    t = torch.zeros(8, 8)
    assert storage_key(t[2:]) == storage_key(t) == storage_key(t.view(-1))
    assert storage_key(t.clone()) != storage_key(t)


def test_cpu_tensors_are_copied_before_copy_in_returns_whatever_stable_says() -> None:
    staging = Staging()
    try:
        a, b = torch.arange(16, dtype=torch.float32), torch.arange(8, dtype=torch.int64)
        staging.ensure(1024, pin=False)
        assert staging.copy_in([a, b], [0, 128], stable={storage_key(a), storage_key(b)}) is None
        assert staging._buf is not None
        assert torch.equal(staging._buf[: a.nbytes].view(torch.float32), a)
        assert torch.equal(staging._buf[128 : 128 + b.nbytes].view(torch.int64), b)
    finally:
        staging.close()


def test_checkpoint_overlap_must_be_a_bool(tmp_path: object) -> None:
    assert JobConfig.of("x").checkpoint.overlap is True
    with pytest.raises(ConfigError, match="checkpoint_overlap must be True or False"):
        JobConfig.of("x", checkpoint_overlap="yes")  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where there is no GPU")
def test_bench_checkpoint_on_cuda_without_a_gpu_is_one_clear_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "stalwart", "bench", "checkpoint", "--device", "cuda", "--size", "1MB"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "torch sees no CUDA device" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_prepare_allocates_staging_off_the_training_thread_and_the_save_uses_it(tmp_path: Path) -> None:
    state = {"step": 1, "objects": {"m": {"w": torch.randn(1000, 100), "b": torch.arange(7)}}}
    ck = open_checkpointer(tmp_path / "ck")
    assert ck._staging.size == 0
    ck.prepare(state)
    ck._settle_prepare()
    size = ck._staging.size
    assert size >= 1000 * 100 * 4 + 7 * 8
    assert ck.save(1, state, wait=True)
    assert ck._staging.size == size, "the save allocated again"
    restored = ck.load_latest()
    assert restored is not None
    assert torch.equal(restored.state["objects"]["m"]["w"], state["objects"]["m"]["w"])
    ck.prepare(state)  # once staging exists: nothing to do
    assert ck._preparing is None


SHARDED_STABLE = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
try:
    from torch.distributed.tensor import Shard, distribute_tensor
except ImportError:  # torch 2.4
    from torch.distributed._tensor import Shard, distribute_tensor
from stalwart.checkpoint.save.overlap import UpdateFence, storage_key
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(sys.argv[1], "s"), 1), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
w = torch.nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]))
optim = torch.optim.AdamW([w])
w.grad = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
optim.step()
fence = UpdateFence([optim], host=True)
locals_ = [w.to_local(), *(v.to_local() for v in optim.state[w].values() if v.dim() > 0)]
print("stable", {storage_key(t) for t in locals_} <= fence.stable())
fence.close()
dist.destroy_process_group()
"""


def test_sharded_parameters_and_state_are_stable_by_their_local_shard(tmp_path: Path) -> None:
    """A checkpoint copies a DTensor's local shard (format/sharded.py), so the fence names the shards' storages."""
    done = served_python(SHARDED_STABLE, str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "stable True" in done.stdout, done.stdout
