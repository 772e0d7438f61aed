"""FSDP2 modules built again on another mesh in the same process: torch's internals for it, apart from
runtime/torch_compat.py because they are many and FSDP2's change most between releases.

Why: when the job re-forms at another world size (a lost host, a job shrinking or growing back), a module wrapped
with `fully_shard` holds its parameters sharded for the old mesh, and torch has no public way to shard it again.
Without one the survivors must run the script again (recovery/in_loop/group_side.NewWorldForShards), its whole
set-up included: minutes at scale. `reshard_in_place` undoes each `fully_shard` (its hooks, its state, its class,
its sharded parameters replaced by plain ones of the full size) and applies it again, with the settings it was
applied with, on a mesh of the new default group; the optimizers are pointed at the new parameters and their state
dropped. The values are not moved here: the restore that follows reshards the state from node memory or the
checkpoint onto the new parameters (recovery/memory_reshard.py), as it does for a script run again.

What it supports, checked before anything changes (`why_not`, None when it can): modules wrapped one at a time or
together (`fully_shard([a, b])`, as torchtitan wraps its last norm and output), on a one-dimensional mesh (not HSDP,
not a mesh with tensor parallelism), with one parameter group each and `reshard_after_forward` a bool or left to
FSDP. A script's own references to the old
parameters (a list made once for clipping) or to the old mesh are not updated: the docs say to read them from the
model each step.

The rules of runtime/torch_compat.py hold here: each entry says what it relies on and the torch releases on which
tests/test_torch_compat.py passed ("checked on"); FSDP2 on CPU needs torch 2.6.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from stalwart.runtime.torch_compat_groups import forget_sharding_caches


def _api() -> tuple[Any, Any]:
    """`fully_shard` and `FSDPModule`, public in torch.distributed.fsdp since 2.6 (torch 2.4-2.5: the composable
    module's)."""
    fsdp = torch.distributed.fsdp
    if hasattr(fsdp, "fully_shard"):
        return fsdp.fully_shard, fsdp.FSDPModule
    from torch.distributed._composable import fsdp as composable

    return composable.fully_shard, composable.FSDPModule


def fsdp_modules(objects: Iterable[Any]) -> list[nn.Module]:
    """Every module wrapped with `fully_shard` in the tracked `objects`, each once, children before their parents
    (the order `fully_shard` must be applied in)."""
    _, fsdp_module = _api()
    seen: set[int] = set()
    found: list[nn.Module] = []
    for obj in objects:
        if not isinstance(obj, nn.Module):
            continue
        for module in reversed(list(obj.modules())):  # pre-order reversed: every descendant before its ancestor
            if isinstance(module, fsdp_module) and id(module) not in seen:
                seen.add(id(module))
                found.append(module)
    return found


def sharded_as(objects: Iterable[Any]) -> tuple[int, int] | None:
    """(mesh size, this process's coordinate on it) of the FSDP2 modules among `objects` as they are sharded now (the
    first with parameters), when that mesh is one dimension over ranks 0..size-1 (the whole job's, as `fully_shard`
    makes by default); None otherwise (no FSDP2, HSDP, a sub-mesh: the caller decides by world size alone). What the
    restore's world and rank must match, else they are sharded again: a survivor's rank may change at the same world
    size (torch's rendezvous orders nodes by address)."""
    try:
        for module in fsdp_modules(objects):
            for group in _groups(module._get_fsdp_state()):  # type: ignore[operator]
                mesh = group.mesh_info.mesh
                if mesh.ndim != 1 or mesh.mesh.flatten().tolist() != list(range(mesh.size())):
                    return None
                coordinate = mesh.get_coordinate()  # kept by the mesh: its group may be gone (get_local_rank asks it)
                return (int(mesh.size()), int(coordinate[0])) if coordinate else None
    except (AttributeError, ImportError, RuntimeError):  # another torch's FSDP2
        return None
    return None


def _groups(state: Any) -> list[Any]:
    """A state's parameter groups: torch 2.13 keeps a list (`_fsdp_param_groups`), earlier releases one or None
    (`_fsdp_param_group`)."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


_COPIED = (
    "gradient_divide_factor",
    "force_sum_reduction_for_comms",
    "reshard_after_backward",
    "unshard_in_backward",
    "reduce_scatter_unused_params",
    "unshard_async_op",
    "all_reduce_grads",
    "reduce_grads",
)
"""Settings a script may give a parameter group after `fully_shard` (its FSDPModule setters), copied to the new one
where this torch has them."""


@dataclass
class _Wrapping:
    """How `fully_shard` was applied to one module, read back from its state: what applying it again takes."""

    module: nn.Module
    """The first of `modules`: the one named in messages, whose state is the group's."""
    reshard_after_forward: bool | None
    mp_policy: Any
    offload: tuple[bool, bool]  # (to CPU, pinned)
    device_type: str | None = None  # the mesh's
    settings: dict[str, Any] = field(default_factory=dict)  # _COPIED, as the old parameter group had them
    params: list[tuple[nn.Module, str, Any, list[tuple[nn.Module, str]], Any]] = field(default_factory=list)
    """(owning module, name, the sharded parameter (a DTensor), modules sharing it as (module, name), its shard
    placement)."""
    modules: tuple[nn.Module, ...] = ()
    """Every module `fully_shard` was applied to in the one call (one, or those wrapped together)."""


def _wrapping(module: nn.Module, world_size: int, new_world: int) -> _Wrapping | str:
    """The module's wrapping, or why it cannot be applied again here. Relies on the state's `_modules`, `_mp_policy`,
    `_auto_reshard_after_forward` and its parameter groups' `mesh_info`, `post_forward_mesh_info` and FSDPParams
    (`_module_info`, `sharded_param`, `fsdp_placement`, `offload_to_cpu`, `pin_memory`). Checked on torch 2.11.0 and
    2.13.0. `world_size`: the job's, which the mesh must span (not a sub-mesh of a larger world); `new_world`: the
    size it is sharded again for."""
    from torch.distributed._composable.contract import REGISTRY_KEY

    if "fully_shard" not in module.__dict__.get(REGISTRY_KEY, {}):
        return "a module another composable API made (replicate)"
    state = module._get_fsdp_state()  # type: ignore[operator]
    together = tuple(getattr(state, "_modules", (module,)))
    if getattr(state, "_states_to_forward_prefetch", None) or getattr(state, "_states_to_backward_prefetch", None):
        return "prefetching set by hand (set_modules_to_forward_prefetch)"
    groups = _groups(state)
    if len(groups) > 1:
        return "a module with several parameter groups"
    auto = bool(getattr(state, "_auto_reshard_after_forward", False))
    wrapping = _Wrapping(together[0], None, state._mp_policy, (False, False), modules=together)
    if not groups:
        return wrapping
    group = groups[0]
    if getattr(group, "_all_reduce_hook", None) is not None:
        return "an all-reduce hook (set_all_reduce_hook)"
    for comm in (getattr(group, "_all_gather_comm", None), getattr(group, "_reduce_scatter_comm", None)):
        if comm is not None and not type(comm).__name__.startswith("Default"):
            return f"a custom collective ({type(comm).__name__})"
    if group.mesh_info.mesh.ndim != 1:
        return "a mesh of more than one dimension (HSDP or tensor parallelism)"
    if group.mesh_info.mesh.size() != world_size:
        return f"a mesh of {group.mesh_info.mesh.size()} of the job's {world_size} ranks"
    post = group.post_forward_mesh_info
    if post is not None and post.shard_mesh_size != group.mesh_info.shard_mesh_size:
        return "reshard_after_forward given as a world size"
    wrapping.reshard_after_forward = None if auto else post is not None
    wrapping.device_type = group.mesh_info.mesh.device_type
    wrapping.settings = {name: getattr(group, name) for name in _COPIED if hasattr(group, name)}
    for param in group.fsdp_params:
        info = param._module_info
        shared = list(zip(info.shared_modules, info.shared_param_names, strict=True))
        placement = param.fsdp_placement
        dim = getattr(placement, "dim", 0)
        if dim != 0 and param._orig_size[dim] % new_world:
            return f"{info.param_name} sharded on dim {dim}, which {new_world} ranks do not divide"
        wrapping.params.append((info.module, info.param_name, param.sharded_param, shared, placement))
        wrapping.offload = (bool(param.offload_to_cpu), bool(param.pin_memory))
    return wrapping


def why_not(objects: Iterable[Any], world_size: int, new_world: int) -> str | None:
    """Why the FSDP2 modules among `objects`, sharded over a job of `world_size` ranks, cannot be sharded again in
    place for `new_world` ranks; None when they can (or there are none). Changes nothing."""
    try:
        return _why_not(list(objects), world_size, new_world)
    except (AttributeError, ImportError, KeyError, TypeError) as exc:  # another torch's FSDP2 (torch 2.4-2.5)
        return f"this torch's FSDP2 differs from what stalwart reads ({type(exc).__name__}: {exc})"


def _why_not(objects: list[Any], world_size: int, new_world: int) -> str | None:
    managed: set[int] = set()
    for module in fsdp_modules(objects):
        found = _wrapping(module, world_size, new_world)
        if isinstance(found, str):
            return f"{found}: {type(module).__name__}"
        managed.update(id(p[2]) for p in found.params)
    dtensor = _dtensor_class()
    for obj in objects:
        if not isinstance(obj, torch.optim.Optimizer) and hasattr(obj, "param_groups"):
            return f"an optimizer wrapper ({type(obj).__name__}) whose parameters stalwart cannot point anew"
        tensors = list(obj.named_parameters()) + list(obj.named_buffers()) if isinstance(obj, nn.Module) else []
        if isinstance(obj, torch.optim.Optimizer):
            tensors = [("an optimizer's", p) for group in obj.param_groups for p in group["params"]]
        for name, tensor in tensors:
            if dtensor is not None and isinstance(tensor, dtensor) and id(tensor) not in managed:
                return f"DTensors no fully_shard made (tensor parallelism): {name}"
    return None


def _dtensor_class() -> type | None:
    """DTensor's class where torch has it (public since 2.5, private in 2.4)."""
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
        try:
            return getattr(importlib.import_module(name), "DTensor", None)
        except ImportError:
            continue
    return None


def _undo(wrapping: _Wrapping, fully_shard: Any, fsdp_module: type) -> None:
    """Take `fully_shard` off one module: plain parameters of the full size (zeros: the restore writes them), its
    forward and state-dict hooks, its state in the module and in torch's module-to-state map, and its class. Relies
    on FSDPParam's `_module_info`, `_orig_size`, `_post_load_hook_handle`, the parameter group's
    `_module_to_pre_save_state_dict_hook_handle`/`_module_to_pre_load_state_dict_hook_handle`, the state's
    `_pre_forward_hook_handle`/`_post_forward_hook_handle`, the composable
    API's STATE_KEY/REGISTRY_KEY entries and `_composable_state._module_state_mapping`."""
    from torch.distributed import _composable_state

    contract = importlib.import_module("torch.distributed._composable.contract")  # the module, not its function
    module = wrapping.module
    state = module._get_fsdp_state()  # type: ignore[operator]  # one state for every module wrapped together
    sizes = {id(p.sharded_param): p._orig_size for group in _groups(state) for p in group.fsdp_params}
    for owner, name, sharded, shared, _ in wrapping.params:
        local = sharded.to_local()
        plain = nn.Parameter(
            torch.zeros(sizes[id(sharded)], dtype=local.dtype, device=local.device),
            requires_grad=sharded.requires_grad,
        )
        for holder, holder_name in [(owner, name), *shared]:
            holder._parameters[holder_name] = plain
    found = [state._pre_forward_hook_handle, state._post_forward_hook_handle]
    for group in _groups(state):
        found += [getattr(p, "_post_load_hook_handle", None) for p in group.fsdp_params]
        for attr in ("_module_to_pre_save_state_dict_hook_handle", "_module_to_pre_load_state_dict_hook_handle"):
            found += list(getattr(group, attr, {}).values())
    handles = {id(h): h for h in found if h is not None}
    for handle in handles.values():
        handle.remove()
    for each in wrapping.modules or (module,):
        states = each.__dict__.get(contract.STATE_KEY, {})
        for key in [k for k, v in states.items() if v is state]:  # keyed by the undecorated function
            del states[key]
        each.__dict__.get(contract.REGISTRY_KEY, {}).pop(getattr(fully_shard, "__name__", "fully_shard"), None)
        _composable_state._module_state_mapping.pop(each, None)
        original = next(c for c in type(each).__mro__ if not issubclass(c, fsdp_module))
        each.__class__ = cast(type[nn.Module], original)


def reshard_in_place(objects: Iterable[Any], world_size: int) -> int:
    """Shard every FSDP2 module among `objects` again on a one-dimensional mesh of the current default group, as it
    was sharded before (see the module docstring); point the optimizers among `objects` at the new parameters, their
    state dropped. `world_size`: the job's before (as `why_not`'s). Call `why_not` first: this raises ValueError where
    it would have said why, before changing anything. DTensor's sharding caches are cleared first (a mesh equal to
    an earlier one at another coordinate must not meet its cached specs: torch_compat_groups.forget_sharding_caches).
    One module at a time, children first, so that no more than one module's parameters are whole at once (the model
    may fit only sharded). Returns how many times `fully_shard` was applied again (modules wrapped together: once)."""
    fully_shard, fsdp_module = _api()
    objects = list(objects)
    new_world = dist.get_world_size()
    found_at: list[tuple[int, _Wrapping]] = []
    for module in fsdp_modules(objects):
        found = _wrapping(module, world_size, new_world)
        if isinstance(found, str):
            raise ValueError(found)
        found_at.append((id(module._get_fsdp_state()), found))  # type: ignore[operator]
    # Modules wrapped together share one state: applied again once, where the last of them comes (after every
    # one's children, before any one's parent).
    last = {state: i for i, (state, _) in enumerate(found_at)}
    wrappings = [w for i, (state, w) in enumerate(found_at) if last[state] == i]
    if not wrappings:
        return 0
    forget_sharding_caches()
    device_type = next((w.device_type for w in wrappings if w.device_type is not None), "cpu")
    mesh = _mesh(device_type, new_world)
    old = {id(p[2]): (p[0], p[1]) for w in wrappings for p in w.params}
    optimizers = [obj for obj in objects if isinstance(obj, torch.optim.Optimizer)]
    for optimizer in optimizers:  # before any module is whole: the moments of the old shards go first
        for param in [p for group in optimizer.param_groups for p in group["params"] if id(p) in old]:
            optimizer.state.pop(param, None)
    for wrapping in wrappings:  # children before parents, as the script applied it; a parent's wrapping skips them
        _undo(wrapping, fully_shard, fsdp_module)
        _apply(wrapping, fully_shard, mesh)
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            params = group["params"]
            for i, param in enumerate(params):
                if id(param) in old:
                    owner, name = old[id(param)]
                    params[i] = owner._parameters[name]
    return len(wrappings)


def _mesh(device_type: str, size: int) -> Any:
    """A one-dimensional mesh of `size` ranks over the current default group, on the old mesh's device type."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (size,))


def _apply(wrapping: _Wrapping, fully_shard: Any, mesh: Any) -> None:
    """`fully_shard` again, with the module's settings: the shard placement of each parameter by its name on its
    owning module (the new plain parameters are known by identity only once made: looked up at the call)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    by_param = {id(owner._parameters[name]): placement for owner, name, _, _, placement in wrapping.params}
    to_cpu, pinned = wrapping.offload
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": wrapping.reshard_after_forward,
        "mp_policy": wrapping.mp_policy,
        "offload_policy": CPUOffloadPolicy(pin_memory=pinned) if to_cpu else OffloadPolicy(),
    }
    if any(getattr(p, "dim", 0) != 0 for p in by_param.values()):
        kwargs["shard_placement_fn"] = lambda param: by_param.get(id(param))
    together = list(wrapping.modules) if len(wrapping.modules) > 1 else wrapping.module
    fully_shard(together, **kwargs)
    for group in _groups(wrapping.module._get_fsdp_state()):  # type: ignore[operator]
        for name, value in wrapping.settings.items():
            setattr(group, name, value)
