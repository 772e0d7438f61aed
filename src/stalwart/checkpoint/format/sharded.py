"""Sharded tensors (DTensor, as FSDP2 and tensor parallelism make them): written by their owners, rebuilt on load.

A DTensor is saved as its local shard plus a description: the global shape, the placements, the device mesh
(its rank list and shape) and this rank's coordinate in it. The shard's id names the shard, not the rank:
`D/<object>/<key path>@<coordinate>`, where the coordinate keeps the mesh dimensions the tensor is sharded on and
writes `*` for those it is replicated on. Ranks that hold the same shard (replicated mesh dimensions, as in HSDP)
therefore share an id, and exactly one of them writes it: the one whose coordinate on every replicated
dimension equals a hash of the id modulo that dimension's size. That choice is a pure function, so no rank has to
ask another, and different tensors spread over different replicas.

Loading rebuilds a DTensor with `DTensor.from_local` on a device mesh of the running job that has the same rank
list and shape, found on the tracked modules' parameters and the optimizers' parameter groups. A checkpoint of
another mesh (another world size, FSDP2 on 4 ranks loaded on 3) is resharded when the loader can read every
rank's shards (`ShardSource`): the tensor keeps its placements on this job's mesh of as many dimensions, and each
rank builds its new local shard from the saved shards that overlap it (`reshard`), so no rank materialises a
full tensor. Without a source, or with no single mesh to put it on, it is refused with one error naming the
tensor; `stalwart ckpt export` assembles full tensors for other tools.

Only `Shard(dim)` and `Replicate()` placements are supported; a `Partial` (pending reduction) or strided shard is
refused at save with the tensor's path.
"""

from __future__ import annotations

import math
import sys
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from stalwart.errors import CheckpointCorruptError, CheckpointMismatchError, UnsavableStateError
from stalwart.runtime import torch_compat  # DTensor, Replicate and Shard where this torch has them, imported late

if TYPE_CHECKING:
    from stalwart.runtime.torch_compat import Replicate, Shard

KEY = "__stalwart_dtensor__"
"""The skeleton key of a sharded tensor's description."""


_DTENSOR_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")


def is_dtensor(value: object) -> bool:
    """Whether `value` is a DTensor. No value can be one before torch has imported its DTensor module, so until
    then the answer is no without importing it: that import (sympy among it) costs about 1.2 s of CPU in every
    process that loads a checkpoint module, and most jobs never shard (2-core VM, torch 2.13.0)."""
    global _dtensor_class
    if _dtensor_class is None:  # asked of every leaf of a state at every snapshot: the class once found is kept
        if _DTENSOR_MODULES[0] not in sys.modules and _DTENSOR_MODULES[1] not in sys.modules:
            return False
        _dtensor_class = torch_compat.DTensor
    return isinstance(value, _dtensor_class)


_dtensor_class: type | None = None


@dataclass(frozen=True, slots=True)
class SavedShard:
    """A sharded tensor as read from a checkpoint: this rank's local shard and its description (see `describe`)."""

    local: torch.Tensor
    info: dict[str, Any]

    @property
    def shape(self) -> torch.Size:
        """The global shape, so shape checks work as for a plain tensor."""
        return torch.Size(self.info["shape"])


def checked_info(info: Any) -> dict[str, Any]:
    """A description read from a skeleton, checked field by field, so a forged one is refused, not crashed on."""
    ints = ("shape", "stride", "mesh", "mesh_shape", "coord")
    ok = (
        isinstance(info, dict)
        and isinstance(info.get("ref"), str)
        and all(isinstance(info.get(k), list) and all(type(v) is int for v in info[k]) for k in ints)
        and isinstance(info.get("placements"), list)
        and all(p == "R" or (isinstance(p, str) and p[:1] == "S" and p[1:].isdigit()) for p in info["placements"])
        and len(info["placements"]) == len(info["mesh_shape"]) == len(info["coord"])
        and len(info["shape"]) == len(info["stride"])
        and all(int(p[1:]) < len(info["shape"]) for p in info["placements"] if p != "R")
    )
    if not ok:
        raise CheckpointCorruptError("a sharded tensor's description in a skeleton is malformed")
    return dict(info)


def _placement_name(p: object, where: str) -> str:
    if type(p) is torch_compat.Shard:
        return f"S{p.dim}"
    if type(p) is torch_compat.Replicate:
        return "R"
    raise UnsavableStateError(
        f"{where} is a DTensor with placement {p!r}; only Shard(dim) and Replicate() can be checkpointed "
        "(reduce a Partial tensor first)"
    )


def _placement(name: str) -> Shard | Replicate:
    return torch_compat.Replicate() if name == "R" else torch_compat.Shard(int(name[1:]))


def mesh_key(mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What identifies a device mesh across runs: its flattened rank list and its shape."""
    return tuple(int(r) for r in mesh.mesh.flatten().tolist()), tuple(int(s) for s in mesh.mesh.shape)


def shard_extent(
    shape: list[int], mesh_shape: list[int], coord: list[int], placements: list[str]
) -> tuple[list[int], list[int]]:
    """(local shape, global offsets) of the shard at `coord`: DTensor's rule, applied mesh dimension by mesh
    dimension, each `Shard(d)` cutting the current extent of tensor dimension d into ceil-sized chunks."""
    size, offset = list(shape), [0] * len(shape)
    for mesh_dim, name in enumerate(placements):
        if name == "R":
            continue
        d, n = int(name[1:]), mesh_shape[mesh_dim]
        chunk = -(-size[d] // n)
        start = min(coord[mesh_dim] * chunk, size[d])
        offset[d] += start
        size[d] = max(0, min(chunk, size[d] - start))
    return size, offset


def describe(value: Any, path: str) -> tuple[torch.Tensor, dict[str, Any], bool]:
    """(local shard, description, whether this rank writes it) for a DTensor at `path` (`<object>/<key path>`);
    the description's `ref` is the shard's tensor id."""
    mesh = value.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:  # pragma: no cover - a DTensor of a mesh this rank is not in has no local data
        raise UnsavableStateError(f"{path} is a DTensor on a device mesh this rank is not part of")
    placements = [_placement_name(p, path) for p in value.placements]
    ranks, mesh_shape = mesh_key(mesh)
    info: dict[str, Any] = {
        "shape": list(value.shape),
        "stride": list(value.stride()),
        "placements": placements,
        "mesh": list(ranks),
        "mesh_shape": list(mesh_shape),
        "coord": [int(c) for c in coord],
    }
    where = ".".join(str(c) if p != "R" else "*" for c, p in zip(coord, placements, strict=True))
    info["ref"] = f"D/{path}@{where}"
    h = zlib.crc32(info["ref"].encode())
    mine = all(c == h % n for c, n, p in zip(coord, mesh_shape, placements, strict=True) if p == "R")
    return value.to_local().detach(), info, mine


def meshes_of(objects: Iterable[Any]) -> dict[tuple[tuple[int, ...], tuple[int, ...]], Any]:
    """The device meshes of the DTensors the tracked objects hold (module parameters and buffers, optimizer
    parameter groups), by `mesh_key`: where loaded shards are put back."""
    found: dict[tuple[tuple[int, ...], tuple[int, ...]], Any] = {}

    def note(tensors: Iterable[Any]) -> None:
        for t in tensors:
            if is_dtensor(t):
                found.setdefault(mesh_key(t.device_mesh), t.device_mesh)

    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            note(obj.parameters())
            note(obj.buffers())
        elif isinstance(obj, torch.optim.Optimizer):
            note(p for group in obj.param_groups for p in group["params"])
    return found


class ShardSource(Protocol):
    """Every saved shard of a checkpoint, read on demand (checkpoint/load/shards.py): what resharding reads."""

    recording: list[Any] | None
    """Not None: a dry run that only notes what it would read (tiers/memory_shards.py, for the parts of another
    node's images to fetch); `reshard` then builds on the meta device and returns the local shards."""

    def shard_ids(self, tensor: str) -> list[str]:
        """The ids of the saved shards of `tensor` (`D/<object>/<key path>`), one per distinct shard."""
        ...

    def read(self, tid: str) -> torch.Tensor:
        """Shard `tid`'s local tensor, verified."""
        ...

    def read_into(self, tid: str, out: torch.Tensor) -> None:
        """Shard `tid` into `out` (its shape and dtype), verified: where the whole shard lands in a new one."""
        ...

    def read_region(self, tid: str, shape: list[int], region: tuple[slice, ...], out: torch.Tensor) -> bool:
        """The part `region` of shard `tid` (of `shape`) into `out` without reading the rest of the shard; False
        where the source cannot (a durable shard is read whole to check its xxh3): the caller reads the whole."""
        ...


def row_range(
    shape: list[int], region: tuple[slice, ...], dtype: torch.dtype, out: torch.Tensor
) -> tuple[int, int] | None:
    """(first byte, bytes) of the part `region` of a row-major tensor of `shape` and `dtype`, when that part is one
    byte range (whole rows from the first dimension cut on, as where Shard(0) shards overlap) and `out` can take it
    as it is (contiguous, its dtype and size); None otherwise: a source then reads the whole shard."""
    lengths = [r.stop - r.start for r in region]
    first = next((d for d, n in enumerate(lengths) if n != 1), len(lengths) - 1)  # the first dimension cut
    if not shape or any(lengths[d] != shape[d] for d in range(first + 1, len(shape))):
        return None
    if not out.is_contiguous() or out.dtype != dtype or out.numel() != math.prod(lengths):
        return None
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    start = sum(r.start * stride for r, stride in zip(region, strides, strict=True)) * dtype.itemsize
    return start, out.numel() * dtype.itemsize


def rebuild(
    value: Any,
    meshes: dict[tuple[tuple[int, ...], tuple[int, ...]], Any],
    where: str,
    source: ShardSource | None = None,
    into: Any = None,
) -> Any:
    """`value` with every SavedShard turned back into a DTensor on the matching mesh of this job; with `source`,
    one saved on another mesh is resharded onto this job's (see the module's docstring). `into`: the object's
    current state of the same structure (a module's `state_dict(keep_vars=True)`): a resharded tensor is written
    straight into the CPU DTensor there that it will be loaded into, which is then returned, so the module's
    `load_state_dict` copies nothing (it was a second pass over every byte)."""
    if isinstance(value, SavedShard):
        info = value.info
        mesh = meshes.get((tuple(info["mesh"]), tuple(info["mesh_shape"])))
        moved = mesh is None or [int(c) for c in mesh.get_coordinate()] != info["coord"]
        if moved and source is not None:
            return reshard(value, mesh if mesh is not None else _target(meshes, info, where), source, where, into)
        if mesh is None:
            raise CheckpointMismatchError(
                f"checkpoint {where} holds {_name(info)} sharded over ranks {info['mesh']} "
                f"(mesh shape {tuple(info['mesh_shape'])}) and no tracked object of this job uses that device "
                "mesh; to reshard it, allow a world-size change (docs/checkpoints.md), or use `stalwart ckpt export`"
            )
        coord = [int(c) for c in mesh.get_coordinate()]
        if coord != info["coord"]:
            raise CheckpointMismatchError(
                f"checkpoint {where}: this rank sits at {coord} of the device mesh and loaded the shard of "
                f"{info['coord']}; relaunch with the same rank order"
            )
        return _dtensor(value.local, mesh, info)
    if isinstance(value, dict):
        inside = into if isinstance(into, dict) else {}
        return type(value)((k, rebuild(v, meshes, where, source, inside.get(k))) for k, v in value.items())
    if isinstance(value, list | tuple):
        inner = list(into) if isinstance(into, list | tuple) and len(into) == len(value) else [None] * len(value)
        return type(value)(rebuild(v, meshes, where, source, i) for v, i in zip(value, inner, strict=True))
    return value


def _name(info: dict[str, Any]) -> str:
    return str(info["ref"]).split("@")[0][2:]


def _dtensor(local: torch.Tensor, mesh: Any, info: dict[str, Any]) -> Any:
    return torch_compat.DTensor.from_local(
        local.to(mesh.device_type),
        mesh,
        [_placement(p) for p in info["placements"]],
        run_check=False,
        shape=torch.Size(info["shape"]),
        stride=tuple(info["stride"]),
    )


def _target(meshes: dict[tuple[tuple[int, ...], tuple[int, ...]], Any], info: dict[str, Any], where: str) -> Any:
    """The one mesh of this job with as many dimensions as the saved one: where a resharded tensor goes."""
    alike = [m for m in meshes.values() if m.mesh.dim() == len(info["mesh_shape"])]
    if len(alike) != 1:
        raise CheckpointMismatchError(
            f"checkpoint {where} holds {_name(info)} sharded over a {len(info['mesh_shape'])}-dimensional device "
            f"mesh of shape {tuple(info['mesh_shape'])}; this job's tracked objects use {len(alike)} meshes of "
            "that many dimensions, so it cannot tell which to reshard it onto"
        )
    return alike[0]


def _coord(tid: str, placements: list[str]) -> list[int]:
    """A saved shard's mesh coordinate from its id (`...@1.*`): a replicated dimension's `*` reads as 0."""
    parts = tid.rsplit("@", 1)[1].split(".")
    if len(parts) != len(placements) or not all(p == "*" or p.isdigit() for p in parts):
        raise CheckpointCorruptError(f"sharded tensor id {tid!r} is malformed")
    return [0 if p == "*" else int(p) for p in parts]


def reshard(saved: SavedShard, mesh: Any, source: ShardSource, where: str, into: Any = None) -> Any:
    """`saved` (a tensor saved on another mesh) as a DTensor on `mesh` with the same placements: this rank's new
    local shard filled from the region of every saved shard that overlaps it, read through `source`; into `into`'s
    local shard when `into` is that same DTensor already (see `rebuild`)."""
    info = saved.info
    shape, placements = [int(v) for v in info["shape"]], list(info["placements"])
    size, offset = shard_extent(
        shape, [int(v) for v in mesh.mesh.shape], [int(c) for c in mesh.get_coordinate()], placements
    )
    planning = source.recording is not None  # a dry run: which parts to fetch (ShardSource.recording)
    reuse = not planning and _fits(into, mesh, info, size, saved.local.dtype)
    device = "meta" if planning else "cpu"
    local = into.to_local().detach() if reuse else torch.empty(size, dtype=saved.local.dtype, device=device)
    covered = 0
    for tid in source.shard_ids(str(info["ref"]).split("@")[0]):
        old_size, old_offset = shard_extent(shape, info["mesh_shape"], _coord(tid, placements), placements)
        low = [max(a, b) for a, b in zip(offset, old_offset, strict=True)]
        high = [min(a + n, b + m) for a, n, b, m in zip(offset, size, old_offset, old_size, strict=True)]
        if any(lo >= hi for lo, hi in zip(low, high, strict=True)) or 0 in size:
            continue
        region = tuple(slice(lo - b, hi - b) for lo, hi, b in zip(low, high, old_offset, strict=True))
        place = tuple(slice(lo - a, hi - a) for lo, hi, a in zip(low, high, offset, strict=True))
        target = local[place]
        if [hi - lo for lo, hi in zip(low, high, strict=True)] == old_size and target.is_contiguous():
            source.read_into(tid, target)  # the whole saved shard lands in one block of the new one (a shrink)
        elif not source.read_region(tid, old_size, region, target):  # only the overlap, where the source can
            target.copy_(source.read(tid).reshape(old_size)[region])
        covered += math.prod(hi - lo for lo, hi in zip(low, high, strict=True))
    if covered != math.prod(size):
        raise CheckpointCorruptError(
            f"checkpoint {where}: the saved shards of {_name(info)} cover {covered} of the {math.prod(size)} "
            "values this rank's new shard needs"
        )
    if planning:
        return local
    return into if reuse else _dtensor(local, mesh, info)


def _fits(into: Any, mesh: Any, info: dict[str, Any], size: list[int], dtype: torch.dtype) -> bool:
    """Whether `into` is a CPU DTensor on `mesh` exactly as the resharded tensor will be: its local shard can be
    written in place."""
    if not is_dtensor(into) or into.device_mesh != mesh or into.dtype != dtype:
        return False
    local = into.to_local()
    return (
        local.device.type == "cpu"
        and local.is_contiguous()
        and list(local.shape) == size
        and list(into.shape) == [int(v) for v in info["shape"]]
        and list(into.placements) == [_placement(p) for p in info["placements"]]
    )


def assemble(shards: list[SavedShard]) -> torch.Tensor:
    """The full tensor from the shards of every rank (replicated shards are simply written twice)."""
    info = shards[0].info
    full = torch.zeros(info["shape"], dtype=shards[0].local.dtype)
    for shard in shards:
        size, offset = shard_extent(info["shape"], info["mesh_shape"], shard.info["coord"], info["placements"])
        if 0 in size:
            continue
        region = full[tuple(slice(o, o + s) for o, s in zip(offset, size, strict=True))]
        region.copy_(shard.local.reshape(size))
    return full


def assemble_all(states: list[Any]) -> Any:
    """Rank 0's structure with every SavedShard replaced by the full tensor built from all ranks' shards."""
    first = states[0]
    if isinstance(first, SavedShard):
        return assemble([s for s in states if isinstance(s, SavedShard)])
    if isinstance(first, dict):
        return type(first)(
            (k, assemble_all([s.get(k) if isinstance(s, dict) else None for s in states])) for k in first
        )
    if isinstance(first, list | tuple):
        return type(first)(
            assemble_all([s[i] if isinstance(s, list | tuple) and i < len(s) else None for s in states])
            for i in range(len(first))
        )
    return first


def contains_shards(value: Any) -> bool:
    if isinstance(value, SavedShard):
        return True
    if isinstance(value, dict):
        return any(contains_shards(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(contains_shards(v) for v in value)
    return False
