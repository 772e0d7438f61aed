"""Two ranks train a DDP model over stalwart's re-formable group (runtime/group.py) with no Job: the group alone.

argv: rank, the first round's store port, the second round's, and "newcomer" for the replacement. With KILL_AT
set, the last rank of the first round dies after that step; the survivors absorb the failed all-reduce, drop the step's
update, re-form with the replacement (which joins quietly and gets the state from rank 0) and redo the step.
Each rank prints one JSON line at the end: its pid, how often its set-up ran and a hash of its parameters.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from stalwart.recovery import ddp_layout
from stalwart.runtime import group as reformable
from stalwart.runtime.store import tcp_store

SIZE, STEPS = 2, 12
TIMEOUT = timedelta(seconds=30)


def form(rank: int, port: int) -> dist.ProcessGroup:
    store = tcp_store("127.0.0.1", port, is_server=rank == 0, timeout=TIMEOUT, world_size=SIZE)
    prefixed = dist.PrefixStore("default_pg", store)
    dist.init_process_group(backend=reformable.BACKEND, store=prefixed, rank=rank, world_size=SIZE, timeout=TIMEOUT)
    return dist.new_group(backend="gloo")  # the state's own group, as stalwart's Comm makes it


def send_state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, comm: dist.ProcessGroup) -> int:
    """Rank 0's step, parameters and optimizer state to every rank."""
    state: list[Any] = [step, opt.state_dict()]
    dist.broadcast_object_list(state, 0, group=comm)
    for p in model.parameters():
        dist.broadcast(p.data, 0, group=comm)
    opt.load_state_dict(state[1])
    return int(state[0])


def main() -> None:
    rank, port, port2, newcomer = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:] == ["newcomer"]
    kill_at = int(os.environ.get("KILL_AT", "-1"))
    reformable.register()
    comm = form(rank, port2 if newcomer else port)
    group = reformable.current()
    assert group is not None
    assert dist.group.WORLD is reformable.current(), "the default group is the re-formable one"
    group.join(newcomer)  # (stalwart.Job learns it from its peers)
    group.absorb_failures(True)  # (stalwart.Job: inside its training loop)
    setups = 1  # the set-up: everything before the loop
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    step = 0
    if newcomer:
        step = send_state(model, opt, step, comm)
        group.join(False)
    while step < STEPS:
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
        ddp(x).pow(2).mean().backward()
        whole = group.failed is None  # (the newest formation's, whichever object asks)
        if whole:
            opt.step()
        opt.zero_grad()
        if rank == SIZE - 1 and step == kill_at and not newcomer:
            os._exit(1)
        if not whole:  # the step is redone in the new round
            dist.destroy_process_group()
            comm = form(rank, port2)
            now = reformable.current()
            assert now is not None and now is not group and group.latest() is now and now.generation == 2
            ddp_layout.reset_ddp(ddp, now)
            now.absorb_failures(True)
            step = send_state(model, opt, step, comm)
            continue
        step += 1
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print(json.dumps({"rank": rank, "pid": os.getpid(), "setups": setups, "sha256": digest}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
