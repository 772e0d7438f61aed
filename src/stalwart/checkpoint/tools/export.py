"""Export a stalwart checkpoint to torch.distributed.checkpoint (DCP), so weights go on to other tools.

The DCP checkpoint holds each tracked object's state_dict under its tracked name (`model`, `optim`, ...) plus a
`stalwart` entry with the step and the source. Sharded tensors (DTensor, e.g. FSDP2) are assembled from every
rank's shard and exported whole, so the export loads into an unsharded model. Load it the DCP way, into
state_dicts of the same shape:

    state = {"model": model.state_dict()}
    torch.distributed.checkpoint.load(state, checkpoint_id="exported/")
    model.load_state_dict(state["model"])

Or turn it into one torch.save file with `torch.distributed.checkpoint.format_utils.dcp_to_torch_save`.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from stalwart.checkpoint.format import layout, sharded
from stalwart.checkpoint.storage import Storage
from stalwart.checkpoint.tools.inspect import read_shard
from stalwart.errors import ConfigError

META_KEY = "stalwart"


def export_dcp(storage: Storage, step: int, rank: int, out: Path) -> dict[str, Any]:
    """Write rank `rank`'s shard of `step` to a new DCP checkpoint at `out`; returns what was written."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists and is not an empty directory; nothing is overwritten")
    manifest, state = read_shard(storage, step, rank)
    objects: dict[str, Any] = dict(state.get("objects", {}))
    if sharded.contains_shards(objects):  # sharded tensors are exported whole, from every rank's shards
        others = [state if r == rank else read_shard(storage, step, r)[1] for r in range(manifest.world_size)]
        objects = sharded.assemble_all([objects, *(dict(o.get("objects", {})) for o in others)])
    if META_KEY in objects:
        raise ConfigError(f"a tracked object is named {META_KEY!r}, which the export uses for its own entry")
    payload = {**objects, META_KEY: {"step": step, "world_size": manifest.world_size, "rank": rank}}

    import torch.distributed.checkpoint as dcp

    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it saves without a process group: that is the intent
        dcp.save(payload, checkpoint_id=str(out))
    return {
        "path": str(out),
        "step": step,
        "rank": rank,
        "objects": sorted(objects),
        "source": storage.display(layout.step_dir_name(step)),
    }
