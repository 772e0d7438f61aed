"""Turn training state into shard bytes and back, without ever executing code from a checkpoint.

Loading uses `torch.load(weights_only=True)`, which only rebuilds tensors and plain containers. Saving checks
the same rule first, so a state that could not be loaded back is refused at save time with the path of the
offending value, not discovered on the day of the restart.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Mapping
from typing import Any

import torch

from stalwart.errors import CheckpointCorruptError, CheckpointError

_LEAVES = (torch.Tensor, int, float, bool, str, bytes, type(None), torch.Size, torch.dtype, torch.device)


def check_loadable(value: Any, path: str = "state") -> None:
    """Raise CheckpointError if `value` holds anything `weights_only` loading would refuse."""
    if isinstance(value, _LEAVES):
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, int | str):
                raise CheckpointError(f"{path} has a key of type {type(key).__name__}; use str or int keys")
            check_loadable(item, f"{path}[{key!r}]")
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_loadable(item, f"{path}[{i}]")
        return
    raise CheckpointError(
        f"{path} is a {type(value).__module__}.{type(value).__name__}, which a checkpoint cannot hold "
        "safely; return tensors, numbers, strings, lists or dicts from state_dict()"
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
