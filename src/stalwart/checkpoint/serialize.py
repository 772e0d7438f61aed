"""Turn training state into shard bytes and back, without ever executing code from a checkpoint.

Loading uses `torch.load(weights_only=True)`, which only rebuilds tensors and plain containers. Saving checks the
same rule first (also at resume, before any step runs), so a state that could not be loaded back is refused with
the path of the offending value, not discovered on the day of the restart.
"""

from __future__ import annotations

import io
import zlib
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from stalwart.errors import CheckpointCorruptError, UnsavableStateError

# Exact types: weights_only loading rebuilds these and nothing else. isinstance would let subclasses through
# (numpy.float64 is a float, defaultdict is a dict) that save fine and then can never be loaded.
_LEAVES = frozenset({int, float, bool, str, bytes, type(None), torch.Size, torch.dtype, torch.device})
_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
_MAPPINGS = frozenset({dict, OrderedDict})
_SEQUENCES = frozenset({list, tuple})


def check_loadable(value: Any, path: str = "state") -> None:
    """Raise UnsavableStateError if `value` holds anything `weights_only` loading would refuse."""
    kind = type(value)
    if kind in _LEAVES or kind in _TENSORS:
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


def dumps(state: Mapping[str, Any]) -> bytes:
    check_loadable(state)
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    return buf.getvalue()


def loads(data: bytes, where: str) -> dict[str, Any]:
    """Rebuild a shard; any failure to parse is reported as corruption of `where`."""
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle and zip errors come in many types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointCorruptError(f"{where} cannot be read safely: {first}") from exc
    if not isinstance(obj, dict):
        raise CheckpointCorruptError(f"{where} does not hold a stalwart shard")
    return obj


def checksum(data: bytes) -> int:
    """CRC-32 of the shard bytes (a faster hash comes with the checkpoint engine)."""
    return zlib.crc32(data) & 0xFFFFFFFF
