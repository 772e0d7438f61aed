"""A memory slot's table of contents: what is pickled once, and what is written every snapshot.

A slot (checkpoint/tiers/memory.py) holds a header, this table of contents (JSON), then the tensors' bytes. The
table holds the state's skeleton (flatten's: the structure, with references in place of tensors), pickled with
`torch.save` so that it loads back with `weights_only=True`, plus each tensor's offset, size, dtype and shape.

Why the split: a light snapshot every step is taken at every optimizer step, and any value in the skeleton that
changes from step to step (the step itself, a data loader's batch counter, an epoch) made every snapshot
pickle its skeleton again: torch.save, base64 and JSON, more than half of a light snapshot's cost inside the
2-rank bench job with a tracked loader (docs/benchmarks.md). So the step goes to the slot's
header, and every other plain value (int, float, bool, str, None) is taken out of the pickled skeleton into a
JSON list, `values`, written each time; the pickled part, the tensor table and their JSON are made once per
layout and reused while it does not change.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable, Sequence
from typing import Any

import torch

from stalwart.checkpoint.format import sharded
from stalwart.checkpoint.format.serialize import PLAIN_VALUES, REF_KEY, TensorItem, dtype_name, load_skeleton

STEP_IN_HEADER = "in the header"
"""The skeleton's step as written: the header holds it."""
VALUE_KEY = "__stalwart_value__"
"""A plain value's place in the pickled skeleton: {VALUE_KEY: index into `values`}."""


def split_values(skeleton: Any, values: list[Any]) -> Any:
    """The skeleton with each plain value replaced by its place in `values` (appended to, in walk order).
    References to tensors and sharded tensors are kept whole."""
    kind = type(skeleton)
    if kind in PLAIN_VALUES:
        values.append(skeleton)
        return {VALUE_KEY: len(values) - 1}
    # A container's plain values are placed here, without a call each (asked of the whole state every snapshot).
    if isinstance(skeleton, dict):
        if len(skeleton) == 1 and (REF_KEY in skeleton or sharded.KEY in skeleton):
            return skeleton
        mapping = kind()
        for k, v in skeleton.items():
            if type(v) in PLAIN_VALUES:
                values.append(v)
                mapping[k] = {VALUE_KEY: len(values) - 1}
            else:
                mapping[k] = split_values(v, values)
        return mapping
    if kind in (list, tuple):
        items = []
        for v in skeleton:
            if type(v) in PLAIN_VALUES:
                values.append(v)
                items.append({VALUE_KEY: len(values) - 1})
            else:
                items.append(split_values(v, values))
        return items if kind is list else tuple(items)
    return skeleton


def fill_values(shape: Any, values: Sequence[Any]) -> Any:
    """split_values undone: each place replaced by its value."""
    if isinstance(shape, dict):
        if len(shape) == 1 and VALUE_KEY in shape:
            return values[shape[VALUE_KEY]]
        return type(shape)((k, fill_values(v, values)) for k, v in shape.items())
    if type(shape) in (list, tuple):
        return type(shape)(fill_values(v, values) for v in shape)
    return shape


class TocCache:
    """Builds a slot's table of contents, reusing the pickled skeleton and the tensor table while they are
    those of the previous snapshot of the same kind. `layout` says which: the same object while they do not
    change, so a slot can tell that its tensors are where they were (MemoryTier._write). A skeleton whose repr
    is the previous one's (repr tells 1, 1.0 and True apart, which == does not) gets the previous bytes
    without a walk."""

    def __init__(self) -> None:
        # kind -> (repr of the skeleton, key, layout, values, toc)
        self._cache: dict[str, tuple[str, Any, bytes, list[Any], bytes]] = {}
        # kind -> (token, layout, repr of the values, toc), for toc_split
        self._split: dict[str, tuple[tuple[object, ...], bytes, str, bytes]] = {}

    def toc(
        self,
        kind: str,
        skeleton: Any,
        table: list[tuple[TensorItem, int]],
        absent: dict[str, list[Any]],
        survivor_skeleton: tuple[str, ...] = (),
    ) -> tuple[bytes, bytes]:
        """(the table of contents, its layout token)."""
        if isinstance(skeleton, dict) and "step" in skeleton:
            skeleton = {**skeleton, "step": STEP_IN_HEADER}
        seen = repr(skeleton)
        tensors = [(i.id, o, i.tensor.dtype, i.tensor.shape) for i, o in table]  # a tensor that grew: another table
        cached = self._cache.get(kind)
        if cached is not None and cached[0] == seen and cached[1][1:] == (tensors, absent, survivor_skeleton):
            return cached[4], cached[2]
        values: list[Any] = []
        shape = split_values(skeleton, values)
        key = (shape, tensors, absent, survivor_skeleton)
        same = cached is not None and cached[1] == key
        layout = cached[2] if cached is not None and same else _layout(shape, table, absent, survivor_skeleton)
        toc = _with_values(values, layout)
        self._cache[kind] = (seen, key, layout, values, toc)
        return toc, layout

    def toc_split(
        self,
        kind: str,
        token: tuple[object, ...],
        shape_of: Callable[[], Any],
        values: list[Any],
        table: list[tuple[TensorItem, int]],
        absent: dict[str, list[Any]],
        survivor_skeleton: tuple[str, ...] = (),
    ) -> tuple[bytes, bytes]:
        """toc() for a skeleton its maker has split already (a light snapshot's, from FlattenCache): `token`
        holds the same objects (compared by identity) as long as the shape, the tensor table and `absent` are
        the same, `shape_of()` makes the shape (the step as STEP_IN_HEADER) when they are not, and `values`
        are the plain values in the order of the shape's places. No walk of the skeleton: the values' repr is
        compared, and written when it changed."""
        cached = self._split.get(kind)
        if cached is None or len(cached[0]) != len(token) or any(a is not b for a, b in zip(cached[0], token)):  # noqa: B905
            cached = (token, _layout(shape_of(), table, absent, survivor_skeleton), "", b"")
        seen = repr(values)
        if seen == cached[2]:
            return cached[3], cached[1]
        toc = _with_values(values, cached[1])
        self._split[kind] = (token, cached[1], seen, toc)
        return toc, cached[1]


def _layout(
    shape: Any, table: list[tuple[TensorItem, int]], absent: dict[str, list[Any]], survivor_skeleton: tuple[str, ...]
) -> bytes:
    """The part of a table of contents that stays while the layout does: the pickled shape and the tables."""
    buf = io.BytesIO()
    torch.save(shape, buf)
    contents: dict[str, Any] = {
        "skeleton": base64.b64encode(buf.getvalue()).decode("ascii"),
        "tensors": {i.id: [o, i.nbytes, dtype_name(i.tensor.dtype), list(i.tensor.shape)] for i, o in table},
        "live": absent,
    }
    if survivor_skeleton:
        contents["survivor_skeleton"] = sorted(survivor_skeleton)
    return json.dumps(contents).encode()


def _with_values(values: list[Any], layout: bytes) -> bytes:
    return b'{"values": ' + json.dumps(values).encode() + b", " + layout[1:]


def parse_toc(raw: bytes, step: int) -> tuple[Any, dict[str, list[Any]], dict[str, Any], tuple[str, ...]]:
    """(skeleton, tensor table, live tensors, survivor skeleton names) from a slot's table of contents; the
    step from the header. Raises on anything malformed (the caller says which snapshot)."""
    toc = json.loads(raw)
    table: dict[str, list[Any]] = toc["tensors"]
    skeleton = load_skeleton(base64.b64decode(toc["skeleton"]))
    if "values" in toc:
        skeleton = fill_values(skeleton, toc["values"])
    if isinstance(skeleton, dict) and skeleton.get("step") == STEP_IN_HEADER:
        skeleton["step"] = step
    return skeleton, table, toc.get("live", {}), tuple(toc.get("survivor_skeleton", ()))
