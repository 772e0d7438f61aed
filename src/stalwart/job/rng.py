"""Capture and restore every random number generator a training step may draw from.

States are stored as tensors and plain numbers only, so a checkpoint loads with `torch.load(weights_only=True)`:
python's `random`, numpy's legacy global generator (when numpy is installed), torch's CPU generator and every
CUDA device's generator (when CUDA has been initialised).
"""

from __future__ import annotations

import ctypes
import random
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional for torch and for us
    np = None  # type: ignore[assignment]


def capture_rng() -> dict[str, Any]:
    """Every generator's state. Called at every step's commit point and end under light snapshots, so the
    generators that have not moved since the last call cost a comparison, not a conversion (_PythonState,
    _NumpyState)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": _PYTHON.tensor(internal), "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    if np is not None:
        state["numpy"] = _NUMPY.capture()
    if torch.cuda.is_initialized() and torch.cuda.is_available():  # the cheap test first: this runs every step
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


class _PythonState:
    """Python's 625-word state as an int64 tensor, the previous tensor again when the words are the same (a
    tuple comparison, 3 us, against 20 us to convert; 63 us through torch.tensor). Captured tensors are never
    written in place, so sharing one is safe."""

    def __init__(self) -> None:
        self._words: tuple[int, ...] | None = None
        self._tensor: torch.Tensor | None = None

    def tensor(self, words: tuple[int, ...]) -> torch.Tensor:
        if self._tensor is None or words != self._words:
            if np is None:
                self._tensor = torch.tensor(words, dtype=torch.int64)
            else:
                self._tensor = torch.from_numpy(np.fromiter(words, dtype=np.int64, count=len(words)))
            self._words = words
        return self._tensor


MT_BYTES = 624 * 4 + 4
"""numpy's mt19937_state: 624 uint32 words, then the int position."""


class _NumpyState:
    """numpy's legacy global generator. `np.random.get_state()` takes about 53 us (it copies the 624 words one
    at a time); reading the bit generator's raw words through its ctypes interface takes 0.5 us. When they are
    what the last capture saw and that capture held no cached Gaussian, the state is the same and the last
    capture is returned. (A cached Gaussian can be used up without the words moving, so then the full read is
    taken.) The raw layout is checked against get_state() once; if it differs, every capture is a full read.
    Only a set_state can put a cached Gaussian back without moving the words: `restore_rng` forgets the last
    capture, and a script that calls np.random.set_state itself between two captures is not covered."""

    def __init__(self) -> None:
        self._watched = False
        self._bit_generator: Any = None
        self._address = 0
        self._raw = b""
        self._state: dict[str, Any] | None = None

    def _watch(self, bit_generator: Any) -> None:
        self._address, self._raw, self._state = 0, b"", None
        self._watched, self._bit_generator = True, bit_generator
        try:
            address = int(bit_generator.ctypes.state_address)
            raw = ctypes.string_at(address, MT_BYTES)
            kind, keys, pos, _, _ = np.random.get_state(legacy=True)
            words = np.frombuffer(raw[: 624 * 4], dtype=np.uint32)
            if kind == "MT19937" and np.array_equal(words, keys) and int.from_bytes(raw[-4:], "little") == pos:
                self._address = address
        except Exception:  # another numpy: full reads only
            pass

    def forget(self) -> None:
        """After a set_state: the next capture is a full read."""
        self._raw, self._state = b"", None

    def capture(self) -> dict[str, Any]:
        current = getattr(getattr(getattr(np.random, "mtrand", None), "_rand", None), "_bit_generator", None)
        if not self._watched or current is not self._bit_generator:
            self._watch(current)  # the first capture, or the global generator was replaced
        raw = ctypes.string_at(self._address, MT_BYTES) if self._address else b""
        if raw and raw == self._raw and self._state is not None and not self._state["has_gauss"]:
            return self._state
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        self._raw = raw
        self._state = {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        }
        return self._state


_PYTHON = _PythonState()
_NUMPY = _NumpyState()


def restore_rng(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        n = state["numpy"]
        keys = n["keys"].numpy().astype(np.uint32)
        np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached"]))
        _NUMPY.forget()  # set_state can bring back a cached Gaussian without moving the words
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
