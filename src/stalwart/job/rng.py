"""Capture and restore every random number generator a training step may draw from.

States are stored as tensors and plain numbers only, so a checkpoint loads with `torch.load(weights_only=True)`:
python's `random`, numpy's legacy global generator (when numpy is installed), torch's CPU generator and every
CUDA device's generator (when CUDA has been initialised).
"""

from __future__ import annotations

import contextlib
import ctypes
import random
from typing import Any

import torch

from stalwart.checkpoint.format.serialize import frozen

try:
    import numpy as np
except ImportError:  # numpy is optional for torch and for us
    np = None  # type: ignore[assignment]


def capture_rng() -> dict[str, Any]:
    """Every generator's state. Called at every step's commit point and end under light snapshots, so the
    generators that have not moved since the last call cost a comparison, not a conversion (_PythonState,
    _TorchState, _NumpyState), and return the very objects of the last capture, the whole dict too when none
    moved: later comparisons and copies of an unchanged state then see the same object and skip the work. The
    returned dict and what it holds are never changed in place, by this module or its callers."""
    python = _PYTHON.capture()
    cpu = _TORCH.capture()
    numpy = _NUMPY.capture() if np is not None else None
    cuda = torch.cuda.is_initialized() and torch.cuda.is_available()  # the cheap test first: this runs every step
    last = _LAST[0]
    same = last is not None and last["python"] is python and last["torch"] is cpu and last.get("numpy") is numpy
    if same and not cuda:
        assert last is not None
        return last
    state: dict[str, Any] = {"python": python, "torch": cpu}
    if numpy is not None:
        state["numpy"] = numpy
    if cuda:  # the CUDA generators are read every time: their states are new tensors
        state["cuda"] = torch.cuda.get_rng_state_all()
    else:
        _LAST[0] = state
    return state


_LAST: list[dict[str, Any] | None] = [None]
"""capture_rng's last capture without CUDA generators."""


MT_WORDS = 624
PY_STATE_OFFSET = 16
"""Where CPython's `_random.Random` keeps `int index; uint32_t state[624]`: right after the object header."""
SAMPLE_WORDS = 32
"""Words of a Mersenne Twister read to tell whether it moved (see `_PythonState`)."""


class _PythonState:
    """Python's generator state, its 625 words as an int64 tensor, the previous tensor again when it has not
    moved. `random.getstate()` builds a tuple of 625 ints, slow with the cold caches a training step's matrix
    products leave (docs/benchmarks.md). Whether the generator moved is read
    from its C struct instead: its position and first 32 words (132 bytes). A Mersenne Twister that moves
    either advances its position or, at the end of its 624 words, regenerates all of them: that 32 regenerated
    words all come out as before has a chance of 2**-1024. Only when it moved is the whole state read (2.5 KB).
    The layout (index, then the 624 words) is checked against getstate() once, and the global generator's
    identity every call; where either differs, every capture uses getstate(). Captured tensors are never
    written in place, so sharing one is safe."""

    def __init__(self) -> None:
        self._inst: Any = None
        self._address = 0  # of the struct's index; 0: the layout is not the one checked, getstate() every time
        self._sample = b""
        self._last: dict[str, Any] | None = None

    def _watch(self, inst: Any) -> None:
        self._inst, self._sample, self._last, self._address = inst, b"", None, 0
        with contextlib.suppress(Exception):
            address = id(inst) + PY_STATE_OFFSET
            _, internal, _ = inst.getstate()
            if tuple(_words(ctypes.string_at(address, 4 + 4 * MT_WORDS))) == tuple(internal):
                self._address = address

    def forget(self) -> None:
        """After a setstate: the next capture reads the whole state."""
        self._sample, self._last = b"", None

    def capture(self) -> dict[str, Any]:
        inst: Any = random._inst  # the generator behind random.random() and friends
        if inst is not self._inst:
            self._watch(inst)
        if not self._address:
            version, internal, gauss = inst.getstate()
            return {"version": version, "state": _tensor(internal), "gauss": gauss}
        sample = ctypes.string_at(self._address, 4 + 4 * SAMPLE_WORDS)
        gauss = inst.gauss_next
        last = self._last
        if last is not None and sample == self._sample and gauss is last["gauss"]:
            return last
        raw = ctypes.string_at(self._address, 4 + 4 * MT_WORDS)
        self._sample = raw[: len(sample)]
        self._last = {"version": inst.VERSION, "state": _tensor(_words(raw)), "gauss": gauss}
        return self._last


def _words(raw: bytes) -> list[int]:
    """The 625 words of getstate(): the 624 state words, then the index (stored first in the struct)."""
    index = int.from_bytes(raw[:4], "little", signed=True)
    words = list(memoryview(raw)[4:].cast("I"))
    words.append(index)
    return words


def _tensor(words: Any) -> torch.Tensor:
    if np is None:
        return frozen(torch.tensor(list(words), dtype=torch.int64))
    return frozen(torch.from_numpy(np.fromiter(words, dtype=np.int64, count=len(words))))


class _TorchState:
    """torch's CPU generator: get_rng_state() is a fresh 5 KB tensor each call; when it equals the last one,
    the last one is returned (never written in place, so sharing it is safe). Comparing only its head and
    normal caches through ctypes measured no faster than torch.equal with cold caches."""

    def __init__(self) -> None:
        self._last: torch.Tensor | None = None

    def capture(self) -> torch.Tensor:
        state = torch.get_rng_state()
        if self._last is not None and torch.equal(state, self._last):
            return self._last
        self._last = frozen(state)
        return state


MT_BYTES = 624 * 4 + 4
"""numpy's mt19937_state: 624 uint32 words, then the int position."""


class _NumpyState:
    """numpy's legacy global generator. `np.random.get_state()` copies the 624 words one at a time. Whether it
    moved is read as for Python's generator (`_PythonState`): its position and first 32 words, through the bit
    generator's ctypes interface. When they are what the last capture saw and that
    capture held no cached Gaussian, the state is the same and the last capture is returned. (A cached Gaussian
    can be used up without the words moving, so then the full read is taken.) The raw layout is checked against
    get_state() once; if it differs, every capture is a full read. Only a set_state can put a cached Gaussian
    back without moving the words: `restore_rng` forgets the last capture, and a script that calls
    np.random.set_state itself between two captures is not covered."""

    def __init__(self) -> None:
        self._mtrand: Any = None
        self._rand: Any = None
        self._address = 0
        self._sample = b""
        self._state: dict[str, Any] | None = None

    def _watch(self, mtrand: Any) -> None:
        self._address, self._sample, self._state = 0, b"", None
        self._mtrand, self._rand = mtrand, getattr(mtrand, "_rand", None)
        try:
            address = int(self._rand._bit_generator.ctypes.state_address)
            raw = ctypes.string_at(address, MT_BYTES)
            kind, keys, pos, _, _ = np.random.get_state(legacy=True)
            words = np.frombuffer(raw[: 624 * 4], dtype=np.uint32)
            if kind == "MT19937" and np.array_equal(words, keys) and int.from_bytes(raw[-4:], "little") == pos:
                self._address = address
        except Exception:  # another numpy: full reads only
            pass

    def forget(self) -> None:
        """After a set_state: the next capture is a full read."""
        self._sample, self._state = b"", None

    def capture(self) -> dict[str, Any]:
        mtrand = self._mtrand
        if mtrand is None or mtrand._rand is not self._rand:
            self._watch(getattr(np.random, "mtrand", None))  # the first capture, or the global generator was replaced
        address = self._address
        sample = (
            ctypes.string_at(address, 4 * SAMPLE_WORDS) + ctypes.string_at(address + MT_BYTES - 4, 4)
            if address
            else b""
        )
        state = self._state
        if sample and sample == self._sample and state is not None and not state["has_gauss"]:
            return state
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        self._sample = sample
        self._state = {
            "kind": kind,
            "keys": frozen(torch.from_numpy(np.asarray(keys, dtype=np.int64))),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        }
        return self._state


_PYTHON = _PythonState()
_TORCH = _TorchState()
_NUMPY = _NumpyState()


def restore_rng(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    _PYTHON.forget()
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
