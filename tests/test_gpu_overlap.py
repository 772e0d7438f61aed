"""The overlapped checkpoint copy on a real GPU (checkpoint/save/overlap.py): a checkpoint of step s holds step s
bit for bit although the next step's optimizer step and forward ran while its copy was still going.

Skipped without CUDA (CI has no GPU); run on a lent device with `bash scripts/gpu_checks.sh overlap`. The CPU half
of the logic (which tensors are deferred, the fence's hooks, the option) is in test_overlap.py.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import open_checkpointer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _clone(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_clone(v) for v in state)
    return state


def _same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert torch.equal(a.cpu(), b.cpu()), f"{where} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}/{i}")
    else:
        assert a == b, where


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optim.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    optim.step()


def _trained_mlp(depth: int, with_batchnorm: bool) -> tuple[torch.nn.Sequential, torch.optim.Optimizer, torch.Tensor]:
    """`depth` layers of 4096x4096 (with BatchNorm buffers, which the forward pass changes, or ReLU) on the GPU,
    AdamW, one step taken so that the optimizer's state exists; and the batch."""
    torch.manual_seed(0)
    width = 4096
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width)]
        layers += [torch.nn.BatchNorm1d(width)] if with_batchnorm else [torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).cuda()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, width, device="cuda")
    _train(model, optim, x)
    return model, optim, x


@pytest.mark.parametrize("with_batchnorm", [False, True])
def test_checkpoint_holds_the_saved_step_while_the_next_steps_run(tmp_path: Path, with_batchnorm: bool) -> None:
    from stalwart.checkpoint.save.overlap import UpdateFence

    # 16 layers of 4096x4096: 1.07 GB of parameters, 3.2 GB with AdamW: a copy of ~60 ms
    model, optim, x = _trained_mlp(16, with_batchnorm)
    ck = open_checkpointer(tmp_path / "ck")
    fence = UpdateFence([optim])
    ck.overlap = fence
    try:
        for step in (1, 2):
            state = {"step": step, "objects": {"model": model.state_dict(), "optim": optim.state_dict()}}
            torch.cuda.synchronize()
            expected = _clone(state)
            assert ck.save(step, state)
            assert fence.pending, "the optimizer's tensors were not left to the side stream"
            for _ in range(3):  # forward (BatchNorm buffers change), backward, optimizer step: all in place
                _train(model, optim, x)
            assert ck.wait_durable()
            restored = ck.load_latest()
            assert restored is not None and restored.step == step
            _same(expected["objects"], restored.state["objects"], "objects")
            torch.cuda.synchronize()
            assert not torch.equal(expected["objects"]["model"]["0.weight"], model[0].weight.cpu()), "did not train"
    finally:
        fence.close()


def test_without_overlap_the_copy_ends_inside_save(tmp_path: Path) -> None:
    model = torch.nn.Linear(1024, 1024).cuda()
    optim = torch.optim.AdamW(model.parameters())
    _train(model, optim, torch.randn(8, 1024, device="cuda"))
    ck = open_checkpointer(tmp_path / "ck")
    state = {"step": 1, "objects": {"model": model.state_dict(), "optim": optim.state_dict()}}
    expected = _clone(state)
    assert ck.save(1, state)
    with torch.no_grad():
        model.weight.add_(1.0)  # outside any optimizer: safe only because nothing was deferred
    assert ck.wait_durable()
    restored = ck.load_latest()
    assert restored is not None
    _same(expected["objects"], restored.state["objects"], "objects")


@pytest.mark.parametrize("with_batchnorm", [False, True])
def test_a_memory_snapshot_holds_its_step_while_the_next_steps_run(tmp_path: Path, with_batchnorm: bool) -> None:
    """The memory tier's full snapshot on a GPU (checkpoint/tiers/memory.py): the first copy into each slot is the
    synchronous pageable one and registers the slot with CUDA on a thread; from then on the optimizer's tensors
    are copied on a side stream under the next step, the snapshot is listed only once published, and it holds
    its step bit for bit."""
    from stalwart.checkpoint.save.overlap import UpdateFence
    from stalwart.checkpoint.tiers.memory import MemoryTier

    model, optim, x = _trained_mlp(8, with_batchnorm)  # 0.54 GB of parameters, 1.6 GB with AdamW
    shm = Path(tempfile.mkdtemp(prefix="stalwart-test-", dir="/dev/shm"))  # where a job's slots live: tmpfs
    tier = MemoryTier(shm, rank=0, world_size=1)
    fence = UpdateFence([optim])
    tier.overlap = fence
    try:
        for step in (1, 2):  # one synchronous copy into each slot; each slot is then registered
            tier.snapshot(step, {"step": step, "objects": {"model": model.state_dict(), "optim": optim.state_dict()}})
            assert tier.running is None, "a copy into pageable memory was left running"
            _train(model, optim, x)
        for slot in tier._slots:
            if slot._pinning is not None:
                slot._pinning.join()
            assert slot.pinned, "a slot was not registered with CUDA"
        for step in (3, 4, 5):
            state = {"step": step, "objects": {"model": model.state_dict(), "optim": optim.state_dict()}}
            torch.cuda.synchronize()
            expected = _clone(state)
            tier.snapshot(step, state)
            assert tier.running == step and fence.pending, "the optimizer's tensors were not left to the side stream"
            assert step not in tier.steps(), "listed before it was published"
            _train(model, optim, x)  # forward (BatchNorm buffers change), backward, optimizer step: all in place
            assert tier.publish() == step
            restored = tier.load(step)
            _same(expected["objects"], restored.state["objects"], "objects")
            torch.cuda.synchronize()
            assert not torch.equal(expected["objects"]["model"]["0.weight"], model[0].weight.cpu()), "did not train"
    finally:
        tier.close()
        fence.close()
        for f in shm.iterdir():
            f.unlink()
        shm.rmdir()


def test_registering_host_memory_leaves_the_callers_cuda_state_alone() -> None:
    """save/host_pin.py: the registration runs on its own thread with the caller's device current, and a
    failed call (the same range registered twice) does not surface as the next kernel's error on this thread."""
    from stalwart.checkpoint.save import host_pin

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    torch.cuda.set_device(device)
    buf = torch.zeros(64 << 20, dtype=torch.uint8)  # pageable, 64 MB
    assert host_pin.register(buf.data_ptr(), buf.numel(), device)
    try:
        assert not host_pin.register(buf.data_ptr(), buf.numel(), device), "registered twice"
        x = torch.ones(1024, device=device)
        assert float((x * 2).sum()) == 2048.0  # a kernel on this thread: no stale error from the failed call
        assert torch.cuda.current_device() == device.index
        src = torch.randn(16 << 20, device=device)
        dst = buf[: src.numel() * 4].view(torch.float32)
        stream = torch.cuda.Stream(device=device)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()
        assert torch.equal(dst, src.cpu())
    finally:
        assert host_pin.unregister(buf.data_ptr(), device)
    assert not host_pin.unregister(buf.data_ptr(), device), "unregistered twice"


def test_a_restore_of_a_gpu_job_reads_node_memory_into_pinned_memory(tmp_path: Path) -> None:
    """With CUDA in use, `MemoryTier.load` reads into page-locked memory, so the copies into the job's CUDA tensors
    run at the link's speed (issue #33; `bash scripts/gpu_checks.sh restore` times it)."""
    from stalwart.checkpoint.tiers.memory import MemoryTier

    torch.cuda.init()
    shm = Path(tempfile.mkdtemp(prefix="stalwart-test-", dir="/dev/shm"))
    tier = MemoryTier(shm, rank=0, world_size=1)
    try:
        weights = torch.randn(1 << 20)
        tier.snapshot(1, {"step": 1, "objects": {"m": {"w": weights}}, "rng": {}})
        got = tier.load(1).state["objects"]["m"]["w"]
        assert got.is_pinned() and torch.equal(got, weights)
        assert torch.equal(got.to("cuda", non_blocking=True).cpu(), weights)
    finally:
        tier.close()
