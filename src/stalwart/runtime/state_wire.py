"""Sending a job's state (nested containers holding tensors) to one peer, with the tensors' bytes going straight
from the sender's tensors into the receiver's new ones.

Why: when a job grows back, the survivor hands its whole state to the replacement while every rank waits
(recovery/restore.py `Restorer.hand_over`). Serialising it with torch.save into bytes and back copies every byte
about six times (pickle buffer, bytes, bytearray, received tensor, bytes, unpickled tensor); here the structure is
pickled on its own, small, with each plain CPU tensor standing in as a reference (pickle's persistent ids), and
each tensor is then sent as its own bytes: the sender copies nothing, the receiver only receives.

Anything that is not a plain strided CPU tensor (a Parameter, a DTensor, a CUDA tensor) is pickled inside the
structure as torch.save would, so any state still arrives whole, only slower.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from stalwart.runtime.dist import Comm


class _Pickler(pickle.Pickler):
    """Pickles a state with each plain CPU tensor replaced by its index in `tensors` (sent after it)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._seen: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> int | None:
        if type(obj) is not torch.Tensor or obj.device.type != "cpu" or obj.layout != torch.strided:
            return None
        if id(obj) not in self._seen:  # the same tensor twice (tied weights): sent once, one object on arrival
            self._seen[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return self._seen[id(obj)]


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> torch.Tensor:
        return self._tensors[pid]


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s bytes as a 1-D uint8 tensor sharing its memory (contiguous tensors only)."""
    return tensor.reshape(-1).view(torch.uint8)


def send_state(comm: Comm, state: Any, dst: int) -> int:
    """Send `state` to rank `dst`, which calls `recv_state`; returns the bytes sent. Blocking, point to point; the
    state's tensors must not change until it returns (it sends from them)."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(state)
    skeleton = buffer.getvalue()
    layout = pickle.dumps([(t.dtype, tuple(t.shape), t.requires_grad) for t in pickler.tensors])
    comm.send_bytes(skeleton, dst)
    comm.send_bytes(layout, dst)
    sent = len(skeleton) + len(layout)
    for tensor in pickler.tensors:
        data = _wire(tensor.detach().contiguous())
        if data.numel():
            comm.send_tensor(data, dst)
        sent += data.numel()
    return sent


def recv_state(comm: Comm, src: int) -> tuple[Any, int]:
    """What rank `src` sends with `send_state`, and its size in bytes."""
    skeleton = comm.recv_bytes(src)
    layout = comm.recv_bytes(src)
    tensors: list[torch.Tensor] = []
    received = len(skeleton) + len(layout)
    for dtype, shape, requires_grad in pickle.loads(layout):
        tensor = torch.empty(shape, dtype=dtype)
        data = _wire(tensor)
        if data.numel():
            comm.recv_tensor(data, src)
        received += data.numel()
        tensors.append(tensor.requires_grad_(requires_grad))
    return _Unpickler(io.BytesIO(skeleton), tensors).load(), received
