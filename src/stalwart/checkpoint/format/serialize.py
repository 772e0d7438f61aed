"""Turn training state into a skeleton plus raw tensors and back, without ever executing code from a checkpoint.

A state is split in two: its tensors, whose bytes are copied into the staging area and written raw (each with its
own xxh3 checksum in the manifest), and a skeleton, the same structure with every tensor replaced by a reference
`{"__stalwart_tensor__": id}`. The skeleton is small and is stored with `torch.save`; loading it uses
`torch.load(weights_only=True)`, which only rebuilds plain containers. Saving checks that rule first (also at
resume, before any step runs), so a state that could not be loaded back is refused with the path of the
offending value, not discovered on the day of the restart.

Tensor ids say who writes a tensor: `R/<object>/<key path>` for a replicated object (identical on every rank,
written once by the rank that owns it), `r<rank>/<object>/<key path>` for per-rank state, and
`D/<object>/<key path>@<shard>` for a shard of a DTensor, written by one of the ranks holding it (sharded.py).
"""

from __future__ import annotations

import _codecs
import hashlib
import io
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.checkpoint.format import sharded
from stalwart.errors import CheckpointCorruptError, UnsavableStateError
from stalwart.runtime.torch_compat import WEIGHTS_ONLY_REFUSES_BYTES

# Exact types: weights_only loading rebuilds these and nothing else. isinstance would let subclasses through
# (numpy.float64 is a float, defaultdict is a dict) that save fine and then can never be loaded.
_LEAVES = frozenset({int, float, bool, str, bytes, type(None), torch.Size, torch.dtype, torch.device})
_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
_MAPPINGS = frozenset({dict, OrderedDict})
PLAIN_VALUES = frozenset({int, float, bool, str, type(None)})
"""The leaves a memory slot writes beside its pickled skeleton, as JSON (checkpoint/tiers/toc.py)."""
_SEQUENCES = frozenset({list, tuple})


def check_loadable(value: Any, path: str = "state") -> None:
    """Raise UnsavableStateError if `value` holds anything `weights_only` loading would refuse."""
    kind = type(value)
    if kind in _LEAVES or kind in _TENSORS or sharded.is_dtensor(value):
        return
    if kind in _MAPPINGS:
        for key, item in value.items():
            if type(key) not in (int, str):
                raise UnsavableStateError(f"{path} has a key of type {type(key).__name__}; use str or int keys")
            check_loadable(item, f"{path}[{key!r}]")
        return
    if kind in _SEQUENCES:
        for i, item in enumerate(value):
            check_loadable(item, f"{path}[{i}]")
        return
    raise UnsavableStateError(
        f"{path} is a {kind.__module__}.{kind.__qualname__}, which a checkpoint cannot hold safely; return "
        "tensors, python numbers, strings, lists or plain dicts from state_dict()"
    )


def load_skeleton(data: bytes) -> Any:
    """A skeleton saved with `torch.save`, loaded with `weights_only=True`: no code from a checkpoint runs.

    torch.save (pickle protocol 2) stores a `bytes` value as a call of `_codecs.encode`, which torch >= 2.5
    allows in weights_only loading and torch 2.4 refuses: there it is allowed once, here, so a state holding
    bytes (which check_loadable accepts) loads back on every torch the package accepts."""
    _allow_bytes()
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _allow_bytes() -> None:
    """On torch 2.4 only: later releases allow it themselves, and the list of safe globals is the user's too."""
    if WEIGHTS_ONLY_REFUSES_BYTES and _codecs.encode not in torch.serialization.get_safe_globals():
        torch.serialization.add_safe_globals([_codecs.encode])


REF_KEY = "__stalwart_tensor__"

_FROZEN_ATTR = "_stalwart_frozen"


def frozen(tensor: torch.Tensor) -> torch.Tensor:
    """Mark `tensor` as never written in place again (a captured RNG state, a detector's window), so a copy of
    it made earlier is still a copy of it: memory snapshots skip copying it again into the place they last put
    it (checkpoint/tiers/memory.py). Only for tensors stalwart itself made; a user's tensor can change without
    its version counter moving (through `.data` or numpy), so it is always copied."""
    setattr(tensor, _FROZEN_ATTR, True)
    return tensor


def is_frozen(tensor: torch.Tensor) -> bool:
    return getattr(tensor, _FROZEN_ATTR, False) is True


@dataclass(frozen=True, slots=True)
class TensorItem:
    """One tensor of a state: its id (see the module docstring), the tensor, its size in bytes, and whether this
    rank writes it (None: decided by `assign_owners`, for replicated objects)."""

    id: str
    tensor: torch.Tensor
    nbytes: int
    mine: bool | None = None


def _escape(key: object) -> str:
    return str(key).replace("%", "%25").replace("/", "%2F")


def flatten(state: Mapping[str, Any], rank: int, replicated: frozenset[str]) -> tuple[dict[str, Any], list[TensorItem]]:
    """(skeleton, tensors). `state["objects"][name]` is replicated when `name` is in `replicated`.

    Tensors that are the same view of the same memory (tied weights) get one id and are written once.
    """
    tensors: list[TensorItem] = []
    seen: dict[tuple[Any, ...], str] = {}
    described: set[str] = set()  # DTensor shards already listed (tied sharded weights)

    def walk(value: Any, path: str) -> Any:
        kind = type(value)
        if kind in _TENSORS:  # copied later under no_grad, so a tensor that requires grad needs no detach here
            alias = (value.data_ptr(), value.dtype, value.shape, value.stride(), value.device)
            if alias in seen and value.numel():
                return {REF_KEY: seen[alias]}
            seen[alias] = path
            tensors.append(TensorItem(path, value, value.nbytes))
            return {REF_KEY: path}
        # A leaf inside a container is kept as it is, without a call or a path (most of a state's nodes are).
        if kind in _MAPPINGS:
            if any(type(k) not in (int, str) for k in value):
                unsavable()
            return kind((k, v if type(v) in _LEAVES else walk(v, f"{path}/{_escape(k)}")) for k, v in value.items())
        if kind in _SEQUENCES:
            if all(type(v) in _LEAVES for v in value):  # a list of numbers (a data position, a history)
                return kind(value)
            return kind(v if type(v) in _LEAVES else walk(v, f"{path}/{i}") for i, v in enumerate(value))
        if kind in _LEAVES:  # most of a state's leaves: no DTensor check for them
            return value
        if sharded.is_dtensor(value):
            local, info, mine = sharded.describe(value, path.split("/", 1)[1])
            if info["ref"] not in described:
                described.add(info["ref"])
                tensors.append(TensorItem(info["ref"], local, local.nbytes, mine))
            return {sharded.KEY: info}
        unsavable()
        return value

    def unsavable() -> None:
        """The state breaks the weights-only rule: raise check_loadable's error, which names the value's path
        (one pass checks and flattens; the path is worked out only on this rare path)."""
        check_loadable(state)
        raise AssertionError("check_loadable passed a value that flatten refuses")

    skeleton: dict[str, Any] = {}
    for key, value in state.items():
        if key == "objects":
            skeleton[key] = {
                name: walk(obj, f"{'R' if name in replicated else f'r{rank}'}/{_escape(name)}")
                for name, obj in value.items()
            }
        else:
            skeleton[key] = walk(value, f"r{rank}/{_escape(key)}")
    return skeleton, tensors


def unflatten(skeleton: Any, fetch: Callable[[str], torch.Tensor]) -> Any:
    """The state, with every reference replaced by `fetch(id)`."""
    kind = type(skeleton)
    if kind in _MAPPINGS:
        if len(skeleton) == 1 and REF_KEY in skeleton:
            return fetch(str(skeleton[REF_KEY]))
        if len(skeleton) == 1 and sharded.KEY in skeleton:
            info = sharded.checked_info(skeleton[sharded.KEY])
            return sharded.SavedShard(fetch(info["ref"]), info)
        return kind((k, unflatten(v, fetch)) for k, v in skeleton.items())
    if kind in _SEQUENCES:
        return kind(unflatten(v, fetch) for v in skeleton)
    return skeleton


def assign_owners(sizes: list[tuple[str, int]], world_size: int) -> dict[str, int]:
    """Which rank writes each replicated tensor: largest first, each to the rank with the fewest bytes so far.

    A pure function of (ids, sizes, world size), so every rank computes the same assignment without talking.
    """
    load = [0] * world_size
    owners: dict[str, int] = {}
    for tid, nbytes in sorted(sizes, key=lambda item: (-item[1], item[0])):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[tid] = rank
        load[rank] += nbytes
    return owners


def fingerprint(items: list[tuple[str, str, tuple[int, ...]]]) -> int:
    """A 62-bit digest of (id, dtype, shape) triples, for checking that ranks agree on replicated state."""
    digest = hashlib.blake2b(repr(sorted(items)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointCorruptError(f"unknown tensor dtype {name!r} in a manifest")
    return dtype


@dataclass(frozen=True, slots=True)
class _Ref:
    """A tensor's place in a flatten template: the reference flatten gave it, and what the tensor was."""

    ref: dict[str, str]
    id: str
    ptr: int
    dtype: torch.dtype
    shape: torch.Size
    nbytes: int


class _Mismatch(Exception):
    """The state no longer has the template's shape: flatten it again."""


class FlattenCache:
    """flatten() of a state that keeps its shape from call to call, with the previous call as the template.

    Why: light memory snapshots flatten the per-rank state at every step's optimizer step, and a survivor needs
    its replicated objects' skeleton at every step's end. flatten spends most of its time on the tensors
    (aliases, ids, sizes; docs/benchmarks.md), the more so inside a training step, where the caches are cold.
    With a template,
    a tensor at the same place with the same dtype and shape gets the same id and size, and only containers
    and plain values are walked. `same_tensors` asks for the same tensors too (the same data pointers: a
    replicated skeleton must name the tensors the survivor holds). Anything else (a new key, another shape, a
    DTensor, two places sharing memory, which flatten writes once) flattens the state again, so the result
    is always what flatten() would return."""

    def __init__(self, rank: int, replicated: frozenset[str], *, same_tensors: bool = False) -> None:
        self._rank = rank
        self._replicated = replicated
        self._same_tensors = same_tensors
        self._template: Any = None
        self.values: list[Any] = []
        """The last state's plain values (PLAIN_VALUES), in the order a walk of its skeleton meets them."""
        self.template: object | None = None
        """The same object while the last states had the same template (None: flattened without one): what
        besides `values` could differ between their skeletons is then nothing."""

    def flatten(self, state: Mapping[str, Any]) -> tuple[dict[str, Any], list[TensorItem]]:
        if self._template is not None:
            items: list[TensorItem] = []
            values: list[Any] = []
            try:
                refilled: dict[str, Any] = _refill(state, self._template, items, values, self._same_tensors)
            except _Mismatch:
                pass
            else:
                if self._same_tensors or _distinct(items):  # memory shared between two: flatten writes it once
                    self.values = values
                    return refilled, items
        skeleton, items = flatten(state, self._rank, self._replicated)
        self.values = []
        try:
            self._template = _template(skeleton, {i.id: i for i in items}, set(), self.values)
        except _Mismatch:  # sharded or shared tensors: flattened every time
            self._template = None
        self.template = self._template
        return skeleton, items

    def skeleton(self, state: Mapping[str, Any]) -> dict[str, Any]:
        return self.flatten(state)[0]


def _distinct(items: list[TensorItem]) -> bool:
    sized = [i.tensor.data_ptr() for i in items if i.nbytes]
    return len(set(sized)) == len(sized)


_VALUE = object()
"""A plain value's place in a template: any plain value may be there."""


def _template(skeleton: Any, items: dict[str, TensorItem], seen: set[str], values: list[Any]) -> Any:
    kind = type(skeleton)
    if kind in PLAIN_VALUES:
        values.append(skeleton)
        return _VALUE
    if kind in _MAPPINGS:
        if len(skeleton) == 1 and REF_KEY in skeleton:
            tid = skeleton[REF_KEY]
            if tid in seen or items[tid].mine is not None:  # a second reference to a tensor: shared memory
                raise _Mismatch
            seen.add(tid)
            t = items[tid].tensor
            return _Ref(skeleton, tid, t.data_ptr(), t.dtype, t.shape, items[tid].nbytes)
        if sharded.KEY in skeleton:
            raise _Mismatch
        return kind((k, _template(v, items, seen, values)) for k, v in skeleton.items())
    if kind in _SEQUENCES:
        return kind(_template(v, items, seen, values) for v in skeleton)
    return skeleton


def _refill(value: Any, template: Any, items: list[TensorItem], values: list[Any], same_tensors: bool) -> Any:
    kind = type(value)
    if kind in PLAIN_VALUES:
        if template is not _VALUE:
            raise _Mismatch
        values.append(value)
        return value
    if kind in _LEAVES:  # bytes, torch.Size, dtype, device: part of the template
        if type(template) is not kind or template != value:
            raise _Mismatch
        return value
    if kind in _TENSORS:
        if (
            type(template) is not _Ref
            or value.dtype != template.dtype
            or value.shape != template.shape
            or (same_tensors and value.data_ptr() != template.ptr)
        ):
            raise _Mismatch
        items.append(TensorItem(template.id, value, template.nbytes))
        return template.ref
    if kind in _MAPPINGS:
        if type(template) is not kind or len(template) != len(value):
            raise _Mismatch
        out = kind()
        for key, item in value.items():
            if key not in template:
                raise _Mismatch
            out[key] = _refill(item, template[key], items, values, same_tensors)
        return out
    if kind in _SEQUENCES:
        if type(template) is not kind or len(template) != len(value):
            raise _Mismatch
        return kind(_refill(v, t, items, values, same_tensors) for v, t in zip(value, template, strict=True))
    raise _Mismatch
