"""Page-locking host memory for CUDA (cudaHostRegister) without touching the caller's CUDA state.

Staging memory and the memory tier's slots are registered with CUDA so that copies into them run at PCIe
bandwidth and can be left running (save/side_copy.py). Each call here runs on a short-lived thread of its own:
- with the caller's device current: a new thread's current device is 0, so on a node of 8 GPUs every rank's
  registering thread would otherwise create a context on GPU 0 and register the memory in it;
- so that a failed call's error stays with that thread: torch's binding leaves the runtime's per-thread "last
  error" set, and the next kernel launched on the training thread would report it as its own failure.
The memory is registered as portable (usable from every context), and the return code is the answer: True when
CUDA accepted the call. A region whose unregistering failed must stay mapped (CUDA still treats it as pinned).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


def register(ptr: int, nbytes: int, device: torch.device | int | None) -> bool:
    """Page-lock `nbytes` at `ptr` for CUDA with `device` current (None: the caller's current device)."""
    return _on_own_thread(device, lambda cudart: cudart.cudaHostRegister(ptr, nbytes, HOST_REGISTER_PORTABLE))


def unregister(ptr: int, device: torch.device | int | None) -> bool:
    """Undo `register` of the region at `ptr`."""
    return _on_own_thread(device, lambda cudart: cudart.cudaHostUnregister(ptr))


def _on_own_thread(device: torch.device | int | None, call: Callable[[Any], object]) -> bool:
    if not torch.cuda.is_available():
        return False
    index = _index(device)
    ok: list[bool] = []

    def run() -> None:
        try:
            torch.cuda.set_device(index)
            ok.append(int(call(torch.cuda.cudart())) == 0)  # type: ignore[call-overload]
        except Exception:
            ok.append(False)

    thread = threading.Thread(target=run, daemon=True, name="cuda-host-register")
    try:
        thread.start()
        thread.join()
    except RuntimeError:  # no new threads at interpreter shutdown (Python >= 3.12: a Job closed by atexit)
        try:
            with torch.cuda.device(index):
                ok.append(int(call(torch.cuda.cudart())) == 0)  # type: ignore[call-overload]
        except Exception:
            ok.append(False)
    return bool(ok and ok[0])


def _index(device: torch.device | int | None) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    return device.index if device.index is not None else torch.cuda.current_device()
