"""DTensors on a 2x2 device mesh (4 ranks) with every supported kind of placement, saved and loaded back.

`--phase save` fills the tensors from the step number and saves at steps 1..3; `--phase load` (a second launch
on the same checkpoint directory, on the same mesh or with `--allow-resize` on another) resumes and checks every
tensor against what was saved, whole. It also checks
stalwart's shard arithmetic against DTensor's own for each tensor. Writes out/rank<R>.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # torch 2.4
    from torch.distributed._tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed._tensor._utils import compute_local_shape_and_global_offset

import stalwart
from stalwart.checkpoint.format.sharded import shard_extent

SHAPES = {  # name: (global shape, placements on the (2, 2) mesh)
    "hsdp": ((10, 3), (Replicate(), Shard(0))),  # replicated across dim 0 of the mesh, sharded across dim 1
    "tp2d": ((6, 8), (Shard(0), Shard(1))),
    "nested": ((7, 2), (Shard(0), Shard(0))),  # one tensor dim cut twice, unevenly
    "uneven": ((3,), (Replicate(), Shard(0))),
    "tiny": ((1, 5), (Shard(0), Replicate())),  # some ranks hold an empty shard
    "full": ((4,), (Replicate(), Replicate())),
}


class Tensors:
    def __init__(self, mesh: object) -> None:
        self.mesh = mesh
        self.values: dict[str, DTensor] = {}
        self.fill(0)

    def fill(self, step: int) -> None:
        for i, (name, (shape, placements)) in enumerate(SHAPES.items()):
            full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 1000 * step + i
            self.values[name] = distribute_tensor(full, self.mesh, placements)

    def state_dict(self) -> dict[str, DTensor]:
        return dict(self.values)

    def load_state_dict(self, state: dict[str, DTensor]) -> None:
        self.values = dict(state)


class Params(torch.nn.Module):
    """Holds a DTensor parameter so that the loader finds the mesh, as it would on an FSDP2 model."""

    def __init__(self, mesh: object) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 4), mesh, (Replicate(), Shard(0))))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--phase", choices=("save", "load"), required=True)
    p.add_argument("--ckpt", default="ckpt")
    p.add_argument("--mesh", default="2,2", help="the device mesh's shape (its size: the world size)")
    p.add_argument("--allow-resize", action="store_true", help="load a checkpoint of another mesh (resharding)")
    args = p.parse_args()
    job = stalwart.Job(args.ckpt, checkpoint_every=1, when_busy="wait", allow_world_size_change=args.allow_resize)
    mesh_shape = [int(n) for n in args.mesh.split(",")]
    mesh = init_device_mesh("cpu", tuple(mesh_shape))
    tensors = Tensors(mesh)
    job.track(params=Params(mesh), tensors=tensors)
    result: dict[str, object] = {"rank": job.rank}
    extents_ok = True
    for value in tensors.values.values():
        shape, offset = compute_local_shape_and_global_offset(value.shape, mesh, value.placements)
        names = ["R" if isinstance(p, Replicate) else f"S{p.dim}" for p in value.placements]
        mine = shard_extent(list(value.shape), mesh_shape, list(mesh.get_coordinate()), names)
        extents_ok &= mine == (list(shape), list(offset)) and list(value.to_local().shape) == list(shape)
    result["extents_ok"] = extents_ok
    if args.phase == "save":
        for step, _ in job.steps(max_steps=3):
            tensors.fill(step + 1)
    else:
        result["resumed_from"] = job.resume()
        expected = Tensors(mesh)
        expected.fill(3)
        result["same"] = all(
            isinstance(tensors.values[n], DTensor)
            and tensors.values[n].placements == expected.values[n].placements
            and torch.equal(tensors.values[n].full_tensor(), expected.values[n].full_tensor())
            for n in SHAPES
        )
    out = Path("out")
    out.mkdir(exist_ok=True)
    (out / f"rank{job.rank}.json").write_text(json.dumps(result))
    job.close()


if __name__ == "__main__":
    main()
