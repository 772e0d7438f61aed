"""A fresh interpreter for tests/test_torch_compat.py.

`fresh`: prints one JSON line: which of torch_compat.FIRST_STEP_IMPORTS a first optimizer step imported (and
were not imported before it), and what `abort_process_group` did to a default group.
`peer PORT`: rank 1 of a 2-rank gloo group over the TCPStore at PORT: one all-reduce, "ready", then it waits
to be killed.
`reshard DIR [cuda]`: two processes train an FSDP2 model 3 steps on a gloo group, rank 1 leaves, rank 0 alone
shards its modules again in place (runtime/torch_compat_fsdp.py), loads the full state taken before and trains a
step; one JSON line from rank 0. `cuda`: one process on GPU 0 over NCCL, its group made again at the same size
(scripts/gpu_checks.sh inplace: the CUDA parameters and mesh no CPU test reaches).
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def fresh() -> None:
    from stalwart.runtime.torch_compat import FIRST_STEP_IMPORTS, abort_process_group

    before = [name for name in FIRST_STEP_IMPORTS if name in sys.modules]
    param = torch.nn.Parameter(torch.zeros(2))
    optim = torch.optim.AdamW([param], lr=0.1)
    param.grad = torch.ones(2)
    optim.step()
    imported = [name for name in FIRST_STEP_IMPORTS if name in sys.modules and name not in before]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.new_group([0])
    aborted = abort_process_group()
    print(json.dumps({"before": before, "imported": imported, "aborted": aborted, "left": dist.is_initialized()}))


def peer(port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=30))
    group = dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=30))
    group.allreduce([torch.ones(1)]).wait()
    print("ready", flush=True)
    time.sleep(120)


def _reshard_rank(rank: int, directory: str, cuda: bool, grouped: bool = False) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    from stalwart.runtime import torch_compat_fsdp

    full = StateDictOptions(full_state_dict=True)

    def whole(value: object) -> object:  # DTensors as plain tensors of their own, taken while both ranks are there
        if isinstance(value, dict):
            return {k: whole(v) for k, v in value.items()}
        if isinstance(value, list):
            return [whole(v) for v in value]
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        return value.clone() if isinstance(value, torch.Tensor) else value  # a copy: at one rank, views of the model

    def step(seed: int) -> None:
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(seed)).to(device)
        model(x).pow(2).sum().backward()
        optim.step()
        optim.zero_grad()

    backend, before = ("nccl", 1) if cuda else ("gloo", 2)  # one GPU lent: 1 rank, its group made again
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{directory}/two", rank=rank, world_size=before)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 12), torch.nn.ReLU(), torch.nn.Linear(12, 5)).to(device)
    from torch.distributed.tensor import Shard

    if grouped:  # both linear layers in one call, as torchtitan wraps its last norm and output
        fully_shard([model[0], model[2]])
    else:
        fully_shard(model[0])
        fully_shard(model[2], shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)  # dim 1: 12 / 2 ranks
    fully_shard(model)
    model[0].set_reshard_after_backward(False)  # a setting given after fully_shard, which must survive
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    for seed in range(3):
        step(seed)
    params = whole(get_model_state_dict(model, options=full))
    optim_state = whole(get_optimizer_state_dict(model, optim, options=full))
    assert isinstance(params, dict)
    kept = {name: value.clone() for name, value in params.items()}
    dist.destroy_process_group()
    if rank == 1:
        return
    dist.init_process_group(backend, init_method=f"file://{directory}/one", rank=0, world_size=1)
    why = torch_compat_fsdp.why_not([model, optim], before, 1)
    old = {id(p) for p in model.parameters()}
    count = torch_compat_fsdp.reshard_in_place([model, optim], before)
    new = [id(p) for p in model.parameters()]
    set_model_state_dict(model, params, options=full)
    set_optimizer_state_dict(model, optim, optim_state, options=full)
    loaded = whole(get_model_state_dict(model, options=full))
    assert isinstance(loaded, dict)
    step(3)
    stepped = whole(get_model_state_dict(model, options=full))
    assert isinstance(stepped, dict)
    report = {
        "why_not": why,
        "modules": count,
        "class": type(model).__name__,
        "local_shapes": [list(p.to_local().shape) for p in model.parameters()],
        "new_parameters": not old & set(new),
        "optimizer_follows": [id(p) for p in optim.param_groups[0]["params"]] == new,
        "loaded_equal": all(torch.equal(kept[k], loaded[k]) for k in kept),
        "trained": all(not torch.equal(kept[k], stepped[k]) for k in kept),
        "optimizer_states": len(optim.state),
        "device": str(next(model.parameters()).device),
        "shard_dims": [p.placements[0].dim for p in model.parameters()],
        "reshard_after_backward": model[0]._get_fsdp_state()._fsdp_param_group.reshard_after_backward,
        "wrapped_classes": [type(model[0]).__name__, type(model[2]).__name__],
        "one_state": model[0]._get_fsdp_state() is model[2]._get_fsdp_state(),
    }
    print(json.dumps(report), flush=True)
    dist.destroy_process_group()


def reshard(directory: str, cuda: bool = False, grouped: bool = False) -> None:
    import torch.multiprocessing as mp

    # Forked on the CPU (torch imported once: the test's time), a fresh interpreter for CUDA; either ends both ranks
    # on a failure.
    mp.start_processes(
        _reshard_rank,
        args=(directory, cuda, grouped),
        nprocs=1 if cuda else 2,
        start_method="spawn" if cuda else "fork",
    )


if __name__ == "__main__":
    if sys.argv[1] == "fresh":
        fresh()
    elif sys.argv[1] == "reshard":
        reshard(sys.argv[2], cuda="cuda" in sys.argv[3:], grouped="grouped" in sys.argv[3:])
    else:
        peer(int(sys.argv[2]))
