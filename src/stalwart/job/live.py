"""What a survivor of a failure keeps for its next run, read at every step's end under light snapshots.

Under re-forming (recovery/reform.py) a survivor keeps its replicated tensors (parameters, optimizer state) in
memory and hands them to the replacement together with its replicated objects' skeleton (their non-tensor
state: an optimizer's learning rate, a scheduler's epoch). Both must be those of the last completed step, so
both are read at every step's end: the tensors' version counters (any in-place write bumps one, so versions
equal to those read at the step's end prove at a failure that the tensors still hold that step) and the
skeleton. That is on the training thread every step, so each is read the cheap way, measured inside the 2-rank
bench job (docs/benchmarks.md), where a step's matrix products leave Python's data cold in the caches:

- the live tensors are listed once and listed again when an optimizer's state grows (its first step) or a
  fresh read is asked for (at a failure and after a restore): walking a model's modules for its parameters
  was most of the versions' cost per step;
- the skeleton is walked without its tensors (serialize.FlattenCache), a module whose state_dict() can only
  hold its parameters (no buffers, no extra state, no state-dict hooks) is not asked for it at all (its
  skeleton depends only on which tensors it holds, which the live tensors' data pointers say), and a plain
  torch optimizer's is rebuilt from its param groups (the figures: docs/benchmarks.md).

A parameter replaced since the list was made is caught by the fresh read at a failure: its versions then differ
from those of the step's end, and the survivor keeps nothing (the replacement falls back to a full copy).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from stalwart.checkpoint.format.serialize import PLAIN_VALUES, FlattenCache
from stalwart.runtime.torch_compat import module_state_dict_extended, optimizer_state_dict_hooked, tensor_versions


class LiveState:
    """The versions of a rank's live replicated tensors and its replicated objects' skeleton, at a step's end."""

    def __init__(self, rank: int) -> None:
        watch_cuda_graphs()
        self._rank = rank
        self.key: frozenset[int] = frozenset()
        """The live tensors' data pointers, the same object while the list of live tensors does not change."""
        self.skeleton: tuple[int, dict[str, Any]] | None = None
        """(step, the replicated objects' skeletons by name) at the last `remember`."""
        self._sizes: tuple[int, ...] | None = None  # the optimizers' state entries when the tensors were listed
        self._tensors: list[torch.Tensor] = []
        self._ptrs: tuple[int, ...] = ()
        self._counts: list[int] | None = None  # the tensors' versions at the last read
        self._skeletons: dict[str, FlattenCache] = {}
        self._modules: dict[str, tuple[frozenset[int], Any]] = {}  # plain modules: (key, skeleton)
        self._optimizers: dict[str, _OptimizerSkeleton] = {}
        self.void: str | None = None
        """Why the last read must not be handed on (a check judged its step's state); the next read clears it."""

    @property
    def held(self) -> bool:
        """Whether the last read found live tensors."""
        return self._counts is not None and bool(self._ptrs)

    @property
    def versions(self) -> dict[int, int] | None:
        """Data pointer -> version counter of every live tensor at the last read (None: never read)."""
        return None if self._counts is None else dict(zip(self._ptrs, self._counts, strict=True))

    def read(self, objects: Mapping[str, Any], replicated: frozenset[str], *, fresh: bool = False) -> None:
        """Read the live tensors' versions now (see the module docstring)."""
        sizes = tuple(
            sum(map(len, o.state.values()))
            for n, o in objects.items()
            if n in replicated and isinstance(o, torch.optim.Optimizer)
        )
        if fresh or sizes != self._sizes:
            self._sizes, self._tensors = sizes, live_tensors(objects, replicated)
            ptrs = tuple(t.data_ptr() for t in self._tensors)
            if ptrs != self._ptrs:
                self._ptrs, self.key = ptrs, frozenset(ptrs)
        self._counts = tensor_versions(self._tensors)
        self.void = None

    def forbid(self, why: str) -> None:
        """The state this read saw must not go to a replacement: a check has judged the step (replicas differ, a
        loss spike calls for a rollback, non-finite parameters), and a peer dying in the collectives that follow
        (the verdict's vote, a repair, the rollback) must not leave a survivor that resumes from it. The first
        reason stays."""
        if self.void is None:
            self.void = why

    def unchanged(self, objects: Mapping[str, Any], replicated: frozenset[str]) -> bool:
        """Whether the live tensors, walked afresh, are still those of the last read, at the same versions."""
        if not self.held:
            return False
        tensors = live_tensors(objects, replicated)
        versions = dict(zip((t.data_ptr() for t in tensors), tensor_versions(tensors), strict=True))
        return versions == self.versions

    def remember(self, step: int, objects: Mapping[str, Any], replicated: frozenset[str]) -> None:
        """The replicated objects' skeleton at the end of `step`."""
        skeletons: dict[str, Any] = {}
        for name in replicated:
            obj = objects[name]
            if isinstance(obj, torch.nn.Module):
                known = self._modules.get(name)
                if known is not None and known[0] is self.key:
                    skeletons[name] = known[1]
                    continue
            elif isinstance(obj, torch.optim.Optimizer) and name in self._optimizers:
                fast = self._optimizers[name].skeleton(obj, self.key)
                if fast is not None:
                    skeletons[name] = fast
                    continue
            state = obj.state_dict()
            cache = self._skeletons.get(name)
            if cache is None:
                cache = self._skeletons[name] = FlattenCache(self._rank, frozenset({name}), same_tensors=True)
            skeletons[name] = skeleton = cache.skeleton({"objects": {name: state}})["objects"][name]
            if isinstance(obj, torch.nn.Module):
                if plain_module(obj):
                    self._modules[name] = (self.key, skeleton)
                else:
                    self._modules.pop(name, None)
            elif isinstance(obj, torch.optim.Optimizer):
                self._optimizers[name] = _OptimizerSkeleton.of(obj, state, skeleton, self.key)
        self.skeleton = (step, skeletons)


class _OptimizerSkeleton:
    """An optimizer's skeleton from its param_groups alone, for an optimizer whose state_dict() is torch's own
    (no override, no hooks) and whose state holds nothing but live tensors: the "state" part is then only
    references, fixed while the live tensors are, and the non-tensor state (learning rate, betas) is in the
    param groups. Saves the optimizer's state_dict() and the walk of its state every step (a large share of a
    light snapshot). Anything else in the groups (a tensor learning rate) falls back to state_dict()."""

    def __init__(self, state: Any, params: list[list[int]], key: frozenset[int] | None) -> None:
        self._state = state
        self._params = params
        self._key = key  # None: not eligible

    @classmethod
    def of(cls, opt: torch.optim.Optimizer, state: Any, skeleton: Any, key: frozenset[int]) -> _OptimizerSkeleton:
        eligible = (
            type(opt).state_dict is torch.optim.Optimizer.state_dict
            and not optimizer_state_dict_hooked(opt)
            and all(type(t) in (torch.Tensor, torch.nn.Parameter) for st in opt.state.values() for t in st.values())
            and type(skeleton) is dict
            and list(skeleton) == ["state", "param_groups"]
        )
        if not eligible:
            return cls(None, [], None)
        return cls(skeleton["state"], [list(g["params"]) for g in skeleton["param_groups"]], key)

    def skeleton(self, opt: torch.optim.Optimizer, key: frozenset[int]) -> dict[str, Any] | None:
        if self._key is not key or len(opt.param_groups) != len(self._params):
            return None
        groups = []
        for group, params in zip(opt.param_groups, self._params, strict=True):
            if len(group["params"]) != len(params):
                return None
            packed: dict[str, Any] = {}
            for k, v in group.items():
                if k == "params":
                    continue
                kind = type(v)
                if kind not in PLAIN_VALUES and not (kind is tuple and all(type(x) in PLAIN_VALUES for x in v)):
                    return None
                packed[k] = v
            packed["params"] = list(params)
            groups.append(packed)
        return {"state": self._state, "param_groups": groups}


def live_tensors(objects: Mapping[str, Any], replicated: frozenset[str]) -> list[torch.Tensor]:
    """The tensors a survivor can keep: the parameters of replicated modules and the state of replicated
    optimizers, on the CPU or a GPU. A GPU's in-place writes bump the version counters when they are launched
    (torch's foreach and fused optimizers included), and a survivor's later copy of the tensors runs after them on
    the same stream; the exception is a CUDA graph's replay, which writes without bumping them: once the process
    has replayed one (torch.compile's "reduce-overhead" mode does), CUDA tensors are left out and the restore takes
    a full snapshot instead (`graphs_replayed`)."""
    found: list[torch.Tensor] = []
    for name, obj in objects.items():
        if name not in replicated:
            continue
        if isinstance(obj, torch.nn.Module):
            tensors: Iterable[torch.Tensor] = obj.parameters()
        elif isinstance(obj, torch.optim.Optimizer):
            tensors = (t for st in obj.state.values() for t in st.values() if isinstance(t, torch.Tensor))
        else:
            continue
        cuda = not _graphs_replayed[0]
        found.extend(
            t for t in tensors if type(t) in (torch.Tensor, torch.nn.Parameter) and (t.is_cpu or (cuda and t.is_cuda))
        )
    return found


_graphs_replayed = [False]


def watch_cuda_graphs() -> None:
    """Note the first CUDA graph replay of this process from now on (see `live_tensors`): every LiveState installs
    it, before its job's loop replays any. Costs nothing until a graph replays (no CUDA initialisation)."""
    graph = getattr(torch.cuda, "CUDAGraph", None)
    replay = getattr(graph, "replay", None)
    if graph is None or replay is None or getattr(replay, "_stalwart_watched", False):
        return

    def watched(self: Any, *args: Any, **kwargs: Any) -> Any:
        _graphs_replayed[0] = True
        return replay(self, *args, **kwargs)

    watched._stalwart_watched = True  # type: ignore[attr-defined]
    graph.replay = watched


def graphs_replayed() -> bool:
    return _graphs_replayed[0]


def plain_module(module: torch.nn.Module) -> bool:
    """Whether `module.state_dict()` can hold nothing but its parameters: no buffers, no extra state and no
    state-dict hooks in any submodule. Its skeleton then changes only when its parameters do."""
    for sub in module.modules():
        if module_state_dict_extended(sub):
            return False
        if type(sub).get_extra_state is not torch.nn.Module.get_extra_state:
            return False
    return True
