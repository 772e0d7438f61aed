"""GPU check of the re-formable group (runtime/group.py), run by `bash scripts/gpu_checks.sh group` on a lent GPU.

1. One rank with NCCL through init/abort/re-init cycles: the group's CUDA backend is made at the first CUDA
   collective, aborted at each re-formation (as a survivor's is) and made again, the same group object throughout;
   the all-reduce's result and each cycle's seconds are printed.
2. Two ranks sharing the GPU over the group's gloo backend with CUDA tensors (`cuda_backend` "gloo", as
   runtime/dist.init_process_group chooses for more ranks than GPUs on a node): one killed, the
   survivor's all-reduce absorbed, then re-formed with a replacement; the survivor's tensor kept its value.
Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from stalwart.runtime import group as reformable
from stalwart.runtime.store import tcp_store

TIMEOUT = timedelta(seconds=60)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU only the two-rank part runs (a dry run)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _form(rank: int, size: int, port: int) -> reformable.ReformableGroup:
    store = tcp_store("127.0.0.1", port, is_server=rank == 0, timeout=TIMEOUT, world_size=size)
    dist.init_process_group(backend=reformable.BACKEND, store=dist.PrefixStore("default_pg", store), rank=rank,
                            world_size=size, timeout=TIMEOUT)  # fmt: skip
    group = reformable.current()
    assert group is not None and dist.group.WORLD is group
    return group


def nccl_cycles(cycles: int = 5) -> dict[str, object]:
    reformable.register()
    group = None
    seconds, values = [], []
    for _ in range(cycles):
        started = time.perf_counter()
        formed = _form(0, 1, _port())
        assert group is None or group.latest() is formed, "an older formation's group forwards to the newest"
        group = formed
        t = torch.full((1 << 20,), 2.0, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        values.append(float(t[0]))
        group.abort_backends()
        dist.distributed_c10d._abort_process_group()
        seconds.append(round(time.perf_counter() - started, 4))
    return {"cycles": cycles, "seconds": seconds, "values": values, "generation": group.generation if group else 0}


def gloo_rank(rank: int, port: int, port2: int, newcomer: bool) -> None:
    """A rank of the two-rank check (run as a child process)."""
    reformable.register()
    reformable.ReformableGroup.cuda_backend = "gloo"  # two ranks on one GPU
    group = _form(rank, 2, port2 if newcomer else port)
    group.absorb_failures(True)
    t = torch.full((4,), float(rank + 1), device=DEVICE)
    if newcomer:  # its one all-reduce meets the survivor's first after re-forming
        dist.all_reduce(t)
        print(json.dumps({"rank": rank, "newcomer": True, "after": float(t[0])}), flush=True)
        return
    dist.all_reduce(t)  # both ranks: 3.0
    if rank == 1:
        os._exit(1)
    time.sleep(1.0)  # the peer is gone
    before = t.clone()
    dist.all_reduce(t)  # meets the death: absorbed, the tensor left as it was
    absorbed, kept = group.failed is not None, bool(torch.equal(t, before))
    group.abort_backends()
    dist.distributed_c10d._abort_process_group()
    again = _form(rank, 2, port2)
    again.absorb_failures(True)
    dist.all_reduce(t)  # with the replacement: 3.0 + 2.0
    print(json.dumps({"rank": rank, "absorbed": absorbed, "kept": kept, "forwards": group.latest() is again,
                      "after": float(t[0])}), flush=True)  # fmt: skip


def gloo_on_cuda() -> dict[str, object]:
    port, port2 = _port(), _port()
    env = dict(os.environ)
    me = [sys.executable, __file__]
    procs = [subprocess.Popen([*me, "rank", str(r), str(port), str(port2)], env=env, stdout=subprocess.PIPE,
                              text=True) for r in (0, 1)]  # fmt: skip
    procs[1].wait(120)
    newcomer = subprocess.Popen([*me, "rank", "1", str(port), str(port2), "newcomer"], env=env,
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
    outs = [procs[0].communicate(timeout=120)[0], newcomer.communicate(timeout=120)[0]]
    return {"codes": [procs[0].returncode, newcomer.returncode], "lines": [o.strip() for o in outs]}


if __name__ == "__main__":
    if sys.argv[1:2] == ["rank"]:
        gloo_rank(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:] == ["newcomer"])
    else:
        cycles = nccl_cycles() if DEVICE == "cuda" else None
        print(json.dumps({"device": DEVICE, "nccl_cycles": cycles, "gloo_on_cuda": gloo_on_cuda()}), flush=True)
