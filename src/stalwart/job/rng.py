"""Capture and restore every random number generator a training step may draw from.

States are stored as tensors and plain numbers only, so a checkpoint loads with `torch.load(weights_only=True)`:
python's `random`, numpy's legacy global generator (when numpy is installed), torch's CPU generator and every
CUDA device's generator (when CUDA has been initialised).
"""

from __future__ import annotations

import random
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional for torch and for us
    np = None  # type: ignore[assignment]


def capture_rng() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": _int64s(internal), "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        }
    if torch.cuda.is_initialized() and torch.cuda.is_available():  # the cheap test first: this runs every step
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _int64s(values: tuple[int, ...]) -> torch.Tensor:
    """Python's 625-word state as an int64 tensor; through numpy it takes a third of torch.tensor's 63 us."""
    if np is None:
        return torch.tensor(values, dtype=torch.int64)
    return torch.from_numpy(np.fromiter(values, dtype=np.int64, count=len(values)))


def restore_rng(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        n = state["numpy"]
        keys = n["keys"].numpy().astype(np.uint32)
        np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
