"""Handing a state to a peer without pickling its tensors (runtime/state_wire.py), between two real processes over
gloo: what arrives equals what was sent, whatever the tensors' kinds."""

from __future__ import annotations

from collections import OrderedDict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from conftest import run_forked_ranks
from stalwart.runtime.dist import Comm, Placement
from stalwart.runtime.state_wire import recv_state, send_state


def _state() -> dict[str, Any]:
    """The same state on both sides: every kind of tensor a job's state holds, and objects that are not tensors."""
    torch.manual_seed(0)
    tied = torch.randn(3, 4)
    grid = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "model": OrderedDict(weight=tied, head=tied, bias=torch.randn(4).requires_grad_()),
        "optim": {
            "state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(3, 4, dtype=torch.bfloat16)}},
            "param_groups": [{"lr": 1e-3, "params": [0]}],
        },
        "strided": grid.t(),  # not contiguous
        "empty": torch.empty(0, 5),
        "mask": torch.tensor([True, False, True]),
        "ids": torch.tensor([2**40, -3], dtype=torch.int64),
        "parameter": torch.nn.Parameter(torch.ones(2, 2)),
        "loader": {"position": 1234, "seed": 1, "name": "train"},
    }


def _rank(rank: int, store_path: str) -> None:
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    comm = Comm(Placement(rank, 2, rank, 0), timedelta(seconds=30))
    sent = _state()
    if rank == 0:
        size = send_state(comm, sent, 1)
        comm.send_bytes(str(size).encode(), 1)
    else:
        got, size = recv_state(comm, 0)
        assert int(comm.recv_bytes(0)) == size, "both sides count the same bytes"
        assert size >= sum(t.numel() * t.element_size() for t in (sent["model"]["weight"], sent["strided"]))
        _same(got, sent)
        assert got["model"]["weight"] is got["model"]["head"], "a tensor held twice arrives as one object"
        assert got["model"]["bias"].requires_grad and not got["model"]["weight"].requires_grad
        assert type(got["parameter"]) is torch.nn.Parameter and type(got["model"]) is OrderedDict
    comm.close()
    dist.destroy_process_group()


def _same(got: Any, want: Any) -> None:
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            _same(got[key], want[key])
    elif isinstance(want, list):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            _same(a, b)
    else:
        assert got == want


def test_a_state_arrives_equal_with_its_tensors_sent_as_bytes(tmp_path: Path) -> None:
    run_forked_ranks(_rank, tmp_path)
