"""A fresh interpreter for tests/test_torch_compat.py.

`fresh`: prints one JSON line: which of torch_compat.FIRST_STEP_IMPORTS a first optimizer step imported (and
were not imported before it), and what `abort_process_group` did to a default group.
`peer PORT`: rank 1 of a 2-rank gloo group over the TCPStore at PORT: one all-reduce, "ready", then it waits
to be killed.
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


if __name__ == "__main__":
    if sys.argv[1] == "fresh":
        fresh()
    else:
        peer(int(sys.argv[2]))
