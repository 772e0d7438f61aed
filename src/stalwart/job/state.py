"""What "full training state" is: the tracked objects, the step, every RNG and the detectors' history; assembling
it for a checkpoint or a snapshot, loading a restored one back, and the record of batches skipped by rollbacks.

Full training state = every tracked object's state_dict, the step, every RNG (python, numpy, torch CPU, CUDA),
the world size, and the loss-spike window (a restarted rank must judge the next losses against the history a
run without the failure had). Replicated objects (identical on every rank) are written once for all ranks;
per-rank ones by every rank (job/replicated.py picks which are which).
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Protocol, runtime_checkable

import torch

from stalwart.checkpoint.format import sharded
from stalwart.checkpoint.format.serialize import check_loadable, flatten
from stalwart.checkpoint.load.rank_state import Restored
from stalwart.checkpoint.manager import Checkpointer
from stalwart.errors import CheckpointError, CheckpointMismatchError, ConfigError, PeerError
from stalwart.job.batch_scaling import scale_learning_rates
from stalwart.job.replicated import replicated_names
from stalwart.job.rng import capture_rng, restore_rng
from stalwart.recovery.rollback import read_skips
from stalwart.runtime.dist import Comm, StepList
from stalwart.runtime.process import first_line
from stalwart.telemetry.events import EventLog


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any, /) -> Any: ...


class DetectorState(Protocol):
    """A detector whose history is part of the state (detect/numeric.LossWatch)."""

    def state(self) -> dict[str, Any]: ...
    def load(self, state: dict[str, Any]) -> None: ...


class TrackedState:
    """The tracked objects and how this rank's state is assembled from them and loaded back into them."""

    def __init__(
        self, rank: int, world_size: int, events: EventLog, detectors: DetectorState | None, lr_scaling: str = "linear"
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.lr_scaling = lr_scaling
        """The learning-rate rule at a change of world size (RecoveryOptions.lr_scaling, job/batch_scaling.py)."""
        self._events = events
        self._detectors = detectors
        self.objects: dict[str, Stateful] = {}
        self.replicated: frozenset[str] = frozenset()
        """The tracked objects written once for all ranks (chosen at the start, `choose_replicated`)."""

    def track(self, **objects: Any) -> None:
        for name, obj in objects.items():
            if not isinstance(obj, Stateful):
                raise ConfigError(f"track({name}=...) needs an object with state_dict() and load_state_dict()")
            if name in self.objects:
                raise ConfigError(f"track(): {name!r} is already tracked")
            self.objects[name] = obj

    def check_loadable(self) -> None:
        """Fail now, not at the first save many steps later. Modules are left to the save: their state is tensors,
        and an early state_dict() would gather FSDP state or meet lazy, unmaterialised parameters. Optimizers too:
        their state is tensors and numbers, and some make it by stepping when asked before their first step
        (torchtitan's OptimizersContainer: a zero-lr step, which counts in Adam's bias correction)."""
        for name, obj in self.objects.items():
            if not isinstance(obj, torch.nn.Module | torch.optim.Optimizer):
                check_loadable(obj.state_dict(), f"{name}.state_dict()")

    def choose_replicated(self, configured: tuple[str, ...] | None) -> frozenset[str]:
        """The tracked objects written once for all ranks (JobConfig's `replicated`, else job/replicated.py's)."""
        if configured is not None:
            unknown = sorted(set(configured) - set(self.objects))
            if unknown:
                raise ConfigError(
                    f"replicated= names {unknown}, which are not tracked (tracked: {sorted(self.objects)})"
                )
            self.replicated = frozenset(configured)
        else:
            self.replicated = replicated_names(self.objects, self.world_size)
        return self.replicated

    def optimizers(self, *, replicated_only: bool = False) -> list[torch.optim.Optimizer]:
        """The tracked optimizers whose `step` runs the update: a framework's wrapper is a torch Optimizer without
        an optimizer's own state (Accelerate's AcceleratedOptimizer has no step hooks) that holds the real one as
        `.optimizer` and calls its `step`, so stalwart's hooks go on the real one. Its state_dict is still the
        wrapper's, as tracked."""
        return [
            _stepping(o)
            for n, o in self.objects.items()
            if isinstance(o, torch.optim.Optimizer) and (not replicated_only or n in self.replicated)
        ]

    def modules(self) -> list[torch.nn.Module]:
        return [o for o in self.objects.values() if isinstance(o, torch.nn.Module)]

    def state(self, step: int, *, replicated: bool = True) -> dict[str, Any]:
        """The full training state of this rank, as checkpoints and memory snapshots hold it, labelled `step`;
        without the replicated objects if not `replicated` (what a light snapshot copies)."""
        state = {
            "step": step,
            "objects": {n: o.state_dict() for n, o in self.objects.items() if replicated or n not in self.replicated},
            "rng": capture_rng(),
            "world_size": self.world_size,
        }
        if self._detectors is not None:  # per rank; not compared by the commit point's check (it moves at report)
            state["detectors"] = self._detectors.state()
        return state

    def per_rank(self, step: int) -> dict[str, Any]:
        return self.state(step, replicated=False)

    def replicated_states(self) -> dict[str, Any]:
        """The replicated objects' state_dicts, by name: local, no collective."""
        return {name: obj.state_dict() for name, obj in self.objects.items() if name in self.replicated}

    def live_tensors(self, rank: int) -> dict[str, torch.Tensor]:
        """The replicated objects' tensors by checkpoint id, as the objects hold them now (a state_dict's tensors
        share their memory): a survivor's live state on the same node is read straight into those of a replacement
        (recovery/restore.py). Modules and optimizers only: their `load_state_dict` copies or adopts what it is
        given, where another object's might clear its tensor before copying from it. Local, no collective."""
        kinds = (torch.nn.Module, torch.optim.Optimizer)
        states = {n: o.state_dict() for n, o in self.objects.items() if n in self.replicated and isinstance(o, kinds)}
        _, items = flatten({"objects": states}, rank, self.replicated)
        return {i.id: i.tensor for i in items if i.id.startswith("R/")}

    def replicated_tensors(self) -> list[torch.Tensor]:
        """The replicated objects' tensors in a fixed order (the same on every rank): a module's parameters (not
        its buffers: BatchNorm's running statistics under DDP are each rank's own until the next forward pass
        broadcasts rank 0's), an optimizer's or other object's state_dict tensors. Sharded ones (DTensor) are
        left out: they are not replicas of one another."""
        found: list[torch.Tensor] = []

        def walk(value: Any) -> None:
            if isinstance(value, torch.Tensor):
                if not sharded.is_dtensor(value):
                    found.append(value)
            elif isinstance(value, dict):
                for v in value.values():
                    walk(v)
            elif isinstance(value, list | tuple):
                for v in value:
                    walk(v)

        for name, obj in self.objects.items():
            if name not in self.replicated:
                continue
            walk(list(obj.parameters()) if isinstance(obj, torch.nn.Module) else obj.state_dict())
        return found

    def meshes(self) -> dict[tuple[tuple[int, ...], tuple[int, ...]], Any]:
        """The device meshes of the tracked objects' DTensors (what sharded state is rebuilt on)."""
        return sharded.meshes_of(self.objects.values())

    def load(self, restored: Restored) -> None:
        """Load a restored state into the tracked objects and the RNG (at a new world size, the RNG stays)."""
        started = time.monotonic()
        meshes = sharded.meshes_of(self.objects.values())
        into = None
        if restored.shards is not None:  # resharded: written straight into the modules' own shards
            into = {n: o.state_dict(keep_vars=True) for n, o in self.objects.items() if isinstance(o, torch.nn.Module)}
        objects = sharded.rebuild(restored.state["objects"], meshes, restored.source, restored.shards, into)
        missing = sorted(set(self.objects) - set(objects))
        extra = sorted(set(objects) - set(self.objects))
        if missing or extra:
            raise CheckpointMismatchError(
                f"checkpoint {restored.source} holds state for {sorted(objects)} but this job tracks "
                f"{sorted(self.objects)}; track the same names or use a new checkpoint_dir"
            )
        for name, obj in self.objects.items():
            _check_shapes(name, obj, objects[name], restored.source)
        for name, obj in self.objects.items():
            try:
                obj.load_state_dict(objects[name])
            except (RuntimeError, ValueError, KeyError) as exc:
                raise CheckpointMismatchError(
                    f"checkpoint {restored.source} does not fit tracked object {name!r}: {first_line(exc)}"
                ) from exc
        if restored.world_size == self.world_size:
            restore_rng(restored.state["rng"])
            detectors = restored.state.get("detectors")
            if self._detectors is not None and isinstance(detectors, dict):
                self._detectors.load(detectors)
            return
        factor = scale_learning_rates(self.objects.values(), restored.world_size, self.world_size, self.lr_scaling)
        self._events.emit(
            "world_resized",
            **{"from": restored.world_size, "to": self.world_size},
            why=f"resumed {_FROM.get(restored.tier, restored.tier)} of {restored.world_size} ranks",
            tier=restored.tier,
            step=restored.step,
            seconds=round(time.monotonic() - started, 4),
            lr_factor=round(factor, 6),
        )
        if self.rank == 0:
            per_rank = sorted(set(self.objects) - self.replicated)
            warnings.warn(
                f"stalwart: resuming a checkpoint of {restored.world_size} ranks on {self.world_size}: "
                f"per-rank objects ({', '.join(per_rank) or 'none'}) are loaded from rank r mod "
                f"{restored.world_size}, which is right only if they are the same on every rank",
                stacklevel=4,
            )


_FROM = {
    "durable": "a checkpoint",
    "memory": "node memory",
    "replica": "a peer replica",
    "peer": "a survivor's live state and node memory",
}
"""What a `world_resized` event's `why` says the state came from, by tier."""


def read_skip_record(comm: Comm, checkpointer: Checkpointer) -> set[int]:
    """The batches earlier rollbacks of this run skipped (rank 0 reads the record, every rank gets it)."""
    problem: Exception | None = None
    skips: list[int] = []
    if comm.rank == 0:
        try:
            skips = read_skips(checkpointer.storage)
        except CheckpointError as exc:
            problem = exc
        except Exception as exc:  # the store cannot be read now: maybe passing, so a restart may try again
            problem = CheckpointError(f"cannot read {checkpointer.root}'s skipped-batch record: {exc}")
    record = comm.broadcast(StepList(0) if problem else StepList(1, tuple(skips)))
    if not record.ok:
        raise problem or PeerError("rank 0 cannot read the skipped-batch record; see its error")
    return set(record.steps)


def _check_shapes(name: str, obj: Stateful, saved: Any, source: str) -> None:
    """Refuse a checkpoint whose tensors differ in shape from a module's, before loading anything."""
    if not isinstance(obj, torch.nn.Module) or not isinstance(saved, dict):
        return
    for key, current in obj.state_dict().items():
        old = saved.get(key)
        if isinstance(old, torch.Tensor) and old.shape != current.shape:
            raise CheckpointMismatchError(
                f"checkpoint {source} does not fit tracked object {name!r}: {key} has shape "
                f"{tuple(old.shape)} in the checkpoint and {tuple(current.shape)} in the model"
            )


def _stepping(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The innermost torch Optimizer of `optimizer`'s `.optimizer` chain (itself when it wraps none)."""
    seen = {id(optimizer)}
    inner = getattr(optimizer, "optimizer", None)
    while isinstance(inner, torch.optim.Optimizer) and id(inner) not in seen:
        seen.add(id(inner))
        optimizer, inner = inner, getattr(inner, "optimizer", None)
    return optimizer
