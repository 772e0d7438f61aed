"""Which tracked objects count as replicated (job/replicated.py): DDP wrappers and the modules they wrap."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from stalwart.job.replicated import ddp_modules, replicated_names


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo group over a file store (no port): DDP needs a process group."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _trio(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    return optim, torch.optim.lr_scheduler.StepLR(optim, step_size=3)


def test_the_module_a_live_ddp_wraps_counts_with_its_optimizer_and_scheduler(group: None) -> None:
    model = torch.nn.Linear(4, 2)
    ddp = DistributedDataParallel(model)
    optim, sched = _trio(model)
    other = torch.nn.Linear(3, 3)  # trained per rank: not wrapped
    objects = {"model": model, "optim": optim, "sched": sched, "other": other, "other_optim": _trio(other)[0]}
    assert replicated_names(objects, world_size=2) == {"model", "optim", "sched"}
    assert ddp_modules(objects)["model"] is model
    assert replicated_names(objects, world_size=1) == frozenset(), "one rank: nothing to look for"
    del ddp


def test_a_tracked_wrapper_counts_as_before(group: None) -> None:
    model = torch.nn.Linear(4, 2)
    ddp = DistributedDataParallel(model)
    optim, sched = _trio(model)
    assert replicated_names({"model": ddp, "optim": optim, "sched": sched}, world_size=2) == {"model", "optim", "sched"}
    assert replicated_names({"model": ddp, "optim": optim}, world_size=1) == {"model", "optim"}


def test_a_module_whose_wrapper_is_gone_is_not_replicated(group: None) -> None:
    model = torch.nn.Linear(4, 2)
    DistributedDataParallel(model)  # dropped at once: nothing keeps this module's replicas equal any more
    import gc

    gc.collect()
    optim = torch.optim.SGD([*model.parameters(), torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert replicated_names({"model": model, "optim": optim}, world_size=2) == frozenset()


def test_the_walk_passes_dead_weak_proxies(group: None) -> None:
    class Target:
        pass

    target = Target()
    holder = [weakref.proxy(target)]  # a container the collector tracks, holding a proxy that will be dead
    del target
    with pytest.raises(ReferenceError):
        _ = holder[0].__class__
    model = torch.nn.Linear(4, 2)
    ddp = DistributedDataParallel(model)
    assert replicated_names({"model": model}, world_size=2) == {"model"}
    del ddp, holder
