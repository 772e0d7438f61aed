"""The bench job of `stalwart bench recovery` under torchft: one replica group of one process, the same MLP,
the same batches, the same AdamW as recovery_job.py, with torchft's Manager, optimizer wrapper and its
PureDistributedDataParallel. Not its DistributedDataParallel: with torch 2.13 that wrapper's comm hook fails an
assertion (`assert fut._fut`, torchft/ddp.py) when the allreduce meets a dead peer, so the survivor died with the
victim at every kill tried here (3 of 3, and both then restarted from step 0: torchft keeps no checkpoint).

Two of these run as two replica groups coordinated by a lighthouse (torchft_driver.py). A replica that dies is
restarted by the driver; on joining, torchft heals it with a live peer's state, while the survivor keeps
training on its own (min_replica_size=1). Steps are logged as `step_done` events in the bench's event log,
with `step` = torchft's committed step count and `participants` = how many replicas took part.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.distributed import TCPStore

from stalwart.bench.common import params_sha256
from stalwart.telemetry.events import EventLog

TIMEOUT_S = 10.0
"""torchft's collective and quorum timeout in its own examples (train_ddp.py)."""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--restart", type=int, default=0)
    p.add_argument("--width", type=int, default=1152)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--setup-s", type=float, default=0.0, help="as recovery_job.py's")
    args = p.parse_args()
    time.sleep(args.setup_s)
    from torchft import Manager, Optimizer, ProcessGroupGloo
    from torchft.ddp import PureDistributedDataParallel

    torch.use_deterministic_algorithms(True)
    events = EventLog(args.out / "events.jsonl", role="worker", rank=args.replica, restart=args.restart)
    torch.manual_seed(0)
    w = args.width
    model = torch.nn.Sequential(
        torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w)
    )
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=TIMEOUT_S)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"bench_{args.replica}",
        timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
    )
    ddp = PureDistributedDataParallel(manager, model)
    optim = Optimizer(manager, inner)
    events.emit("worker_started", world_size=2, local_rank=0)
    while manager.current_step() < args.steps:
        started = time.monotonic()
        optim.zero_grad()  # starts the quorum; a joining replica is healed from a peer during this step
        step = manager.current_step()
        g = torch.Generator().manual_seed(step * 1009 + args.replica)
        x = torch.randn(args.batch, w, generator=g)
        loss = (ddp(x) - x).pow(2).mean()
        loss.backward()
        optim.step()  # applied only if every participant agrees to commit
        if manager.current_step() > step:
            events.emit(
                "step_done",
                step=manager.current_step(),
                step_s=time.monotonic() - started,
                participants=manager.num_participants(),
                loss=float(loss.detach()),
            )
    result = {"sha256": params_sha256(model), "step": manager.current_step()}
    (args.out / f"result-rank{args.replica}.json").write_text(json.dumps(result))
    manager.shutdown(wait=False)
    os._exit(0)  # torchft's server threads can keep a plain exit waiting


if __name__ == "__main__":
    main()
