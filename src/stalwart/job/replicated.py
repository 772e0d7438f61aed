"""Which tracked objects are identical on every rank: DDP models, whether tracked as the wrapper or as the module
it wraps, with their optimizers and those optimizers' LR schedulers, and objects that say they are
(`stalwart_replicated = True`: a framework's progress counters) (JobConfig.replicated's default).

Why the wrapped module too: a script usually tracks the model it built and trains through a DDP wrapper it keeps
beside it (`ddp = DistributedDataParallel(model)`, `job.track(model=model, ...)`; the README's quick start and the
demo did). Only a tracked wrapper used to count, so such a script silently lost what replicated state gives:
written once instead of once per rank, taken from a live survivor after a failure instead of the last full memory
copy (the demo lost 4 steps to a kill at its step 17), compared by the divergence check. A wrapper holds its
module as `.module` but the module has no link back, so the wrappers are looked for among the objects the garbage
collector tracks: once per start, only with several ranks and a tracked module that no tracked wrapper holds.
The zygote froze what the imports made (supervisor/zygote.py), so under `stalwart run` the walk sees only what the
script built since.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from stalwart.checkpoint.format.sharded import is_dtensor
from stalwart.runtime.torch_compat import live_ddp_modules


def replicated_names(objects: Mapping[str, Any], world_size: int) -> frozenset[str]:
    """The names of the tracked `objects` that DDP keeps equal on every rank (see the module docstring)."""
    wrapped = ddp_modules(objects, search=world_size > 1)
    params = {id(p) for m in wrapped.values() for p in m.parameters()}
    names = set(wrapped)
    for name, obj in objects.items():
        if isinstance(obj, torch.optim.Optimizer):
            owned = [id(p) for group in obj.param_groups for p in group["params"]]
            if owned and all(p in params for p in owned):
                names.add(name)
    # An object identical on every rank by construction says so (a framework's progress: integrations/hf.py).
    names |= {name for name, obj in objects.items() if getattr(obj, "stalwart_replicated", False) is True}
    for name, obj in objects.items():  # a scheduler steps a replicated optimizer the same everywhere
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) and any(
            getattr(obj, "optimizer", None) is objects[n] for n in names
        ):
            names.add(name)
    return frozenset(names)


def _sharded(module: torch.nn.Module) -> bool:
    """Whether `module` holds DTensor parameters (FSDP2, tensor parallel): never a DDP wrapper's module, so the
    walk over every live object (a fifth of a second in a big process) is not needed for it."""
    return any(is_dtensor(p) for p in module.parameters())


def ddp_modules(objects: Mapping[str, Any], *, search: bool = True) -> dict[str, torch.nn.Module]:
    """The tracked objects that are DDP wrappers or the module of a live one, by name. Without `search` only
    the tracked wrappers count (one rank: nothing is replicated, and the walk is skipped)."""
    found: dict[str, torch.nn.Module] = {n: o for n, o in objects.items() if isinstance(o, DistributedDataParallel)}
    inner = {id(w.module) for w in found.values()}
    modules = {
        id(o): n
        for n, o in objects.items()
        if isinstance(o, torch.nn.Module) and n not in found and id(o) not in inner and not _sharded(o)
    }
    if not search or not modules:
        return found
    for wrapper in live_ddp_modules():
        if id(wrapper.module) in modules:
            found[modules[id(wrapper.module)]] = wrapper.module
    return found
