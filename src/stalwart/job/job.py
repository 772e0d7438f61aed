"""The training-loop integration: what the user's loop calls, and what "full training state" is.

    job = stalwart.Job(checkpoint_dir="runs/gpt/ckpt")
    job.track(model=model, optim=optim, sched=sched, data=loader)
    for step, batch in job.steps(loader, max_steps=10_000):
        loss = train_step(model, optim, batch)
        job.report(loss=loss)

Full training state = every tracked object's state_dict, the step, and every RNG (python, numpy, torch CPU,
CUDA). `steps()` resumes from the newest checkpoint that verifies on every rank, checkpoints every
`checkpoint_every` steps and at the end, and logs events. The same loop runs as one process, under
`stalwart run` and under `torchrun`.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import secrets
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from stalwart.checkpoint.format import sharded
from stalwart.checkpoint.format.serialize import check_loadable, flatten
from stalwart.checkpoint.load.rank_state import Restored
from stalwart.checkpoint.manager import Checkpointer
from stalwart.checkpoint.save.overlap import UpdateFence
from stalwart.checkpoint.tiers.memory import MemoryTier
from stalwart.checkpoint.tiers.replicas import MAX_REPLICAS, PeerReplicas
from stalwart.detect.divergence import DivergenceCheck, broadcast_on_default_group
from stalwart.detect.hang import HANG_TIMEOUT_ENV, HangTimer, parse_timeout
from stalwart.detect.heartbeat import PHASE_DONE, PHASE_RESUME, PHASE_SAVE, PHASE_STEP, Heartbeat
from stalwart.detect.host_reads import HostReads
from stalwart.detect.numeric import (
    LOSS_SPIKE_POLICIES,
    NONFINITE_POLICIES,
    SPIKE_POLICIES,
    GuardConfig,
    LossWatch,
    NumericGuard,
)
from stalwart.detect.risk import RiskWatch
from stalwart.detect.straggler import STRAGGLER_POLICIES, StragglerDetector
from stalwart.errors import (
    EXIT_EVICTED,
    CheckpointError,
    CheckpointMismatchError,
    ConfigError,
    NumericError,
    PeerError,
    ReplicaDivergenceError,
)
from stalwart.job import lifecycle
from stalwart.job.commit import StepCommit
from stalwart.job.hooks import StepHooks, step_hooks
from stalwart.job.live import LiveState
from stalwart.job.replicated import replicated_names
from stalwart.job.rng import capture_rng, restore_rng
from stalwart.policy.checkpoint import DEFAULT_PRIOR_MTBF_S, CheckpointInterval
from stalwart.policy.snapshot import LightCost, SnapshotSchedule, full_copy_budget
from stalwart.recovery import reform
from stalwart.recovery.restore import Restorer
from stalwart.recovery.rollback import RollbackCap, RollbackRequest, all_finite, read_skips, write_skips
from stalwart.runtime.dist import Comm, GatherBatch, Placement, init_process_group
from stalwart.runtime.env import LAUNCH_TIME_ENV
from stalwart.runtime.local_barrier import LocalBarrier
from stalwart.runtime.process import first_line
from stalwart.telemetry.events import EventLog


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any, /) -> Any: ...


class JobState(Enum):
    CREATED = "created"  # tracking objects; nothing loaded yet
    RUNNING = "running"  # resumed (or started fresh) and iterating steps
    FINISHED = "finished"  # reached max_steps (or the end of the data) and wrote the final checkpoint


@dataclass(kw_only=True, slots=True)
class JobConfig:
    checkpoint_dir: str | os.PathLike[str]
    """Directory of the job's checkpoints; created on first use. Must be empty or made by stalwart."""
    checkpoint_every: int | str = 100
    """Save a checkpoint after every this many steps (and after the last step). "auto": as often as Daly's optimum
    for the measured stall of a checkpoint and the failure rate this launch has seen (from `expected_mtbf_s`
    before any), re-decided after every checkpoint, at most an hour of training apart (policy/checkpoint.py); a
    `checkpoint_interval` event records each change and its inputs."""
    expected_mtbf_s: float = DEFAULT_PRIOR_MTBF_S
    """With checkpoint_every="auto": the job's mean time between interruptions assumed before any is seen (weight:
    one failure). A 16,384-GPU job saw one every 3.1 hours (Llama 3); the default, 24 h, suits a few nodes."""
    keep_last: int = 3
    """Committed checkpoints kept on disk; older ones are removed after each commit."""
    log_every: int = 50
    """Write a `step_done` event every this many steps (the first step after a start is always logged)."""
    collective_timeout_s: float = 300.0
    """Timeout of stalwart's own collectives and of a process group the job creates."""
    replicated: tuple[str, ...] | None = None
    """Tracked objects that are identical on every rank (a DDP model, its optimizer): each of their tensors is
    written once, by one rank, instead of once per rank. None (the default) picks tracked DistributedDataParallel
    modules and tracked modules a live DistributedDataParallel wraps (job/replicated.py), the optimizers over their
    parameters and those optimizers' LR schedulers. Per-rank objects are written by every rank."""
    full_every: int = 1
    """1: every checkpoint is full. N > 1: after a full checkpoint, the next N - 1 are deltas that store only the
    tensors that changed since it, zstd-compressed (worth it when most tensors do not change, e.g. fine-tuning)."""
    when_busy: str = "skip"
    """What a save does when the previous one is still persisting (at most one is in flight per rank). "skip":
    it is skipped on every rank with a `checkpoint_skipped` event and training goes on (a slow or failing store
    never stalls training). "wait": it waits for the previous one (a `checkpoint_waited` event says how long), so
    every `checkpoint_every` step gets its checkpoint."""
    checkpoint_overlap: bool = True
    """On a GPU: a checkpoint's copy of the tracked optimizers' parameters and state to host memory runs under
    the next step's forward and backward, and that step's optimizer step waits for it (on the GPU), so training
    stalls only for starting the copy (checkpoint/save/overlap.py). Needs what every ordinary loop does: those
    tensors change only in the optimizer's step(). False: save() returns after the whole copy. No effect on CPU."""
    persist_timeout_s: float = 600.0
    """How long a background persist keeps retrying a failing store before that save is given up."""
    storage_options: dict[str, Any] | None = None
    """Passed to fsspec for a checkpoint_dir URL (e.g. {"endpoint_url": ...} for s3://)."""
    snapshot_every: int | str = "auto"
    """Under `stalwart run`, copy the training state into node shared memory every this many steps (0: never).
    Those snapshots outlive a dead worker, so a restart resumes from the newest one held by every rank instead
    of the durable checkpoint: nothing is read from storage, and only the steps since that snapshot are redone.
    The cost is one memory copy of this rank's state per snapshot (`snapshot_s` in step_done events). "auto"
    (the default): as often as `snapshot_budget` allows, from the measured step time and snapshot cost
    (policy/snapshot.py), so the copy costs about that fraction of training time whatever the model size; a
    `snapshot_interval` event records each choice and its inputs. 1: every step, whatever it costs."""
    snapshot_budget: float = 0.01
    """With snapshot_every="auto": the fraction of training time memory snapshots may take on the training thread
    (0 < b < 1). Their whole cost is larger: on 2 ranks sharing 2 cores the steps slowed by about 2.7x the
    snapshot's own time (the copy competes for memory bandwidth and caches), so 1% keeps the whole, with the
    durable checkpoints' stall, near 3% (`stalwart bench overhead`, docs/benchmarks.md)."""
    light_snapshot_budget: float = 0.02
    """Under light snapshots (`replicated_snapshot_every="auto"`): the fraction of step time a light snapshot every
    step may take before they are turned off for the run (0 < b < 1). Light snapshots have their own budget,
    apart from `snapshot_budget`, because they buy what full copies cannot at any interval: a failure that leaves
    a survivor redoes at most the interrupted step. On the 2-core bench jobs they cost 0.9-1.2% of a step
    (2026-11-25); judged against the 1% snapshot budget they were kept at one judgment and turned off at a later
    one as the measurements moved, so how many steps a kill lost was a coin toss. At 2% the memory tier takes at
    most 2.25% of the training thread (light snapshots plus the full copies' floor, a quarter of
    `snapshot_budget`)."""
    replicated_snapshot_every: int | str = "auto"
    """Light snapshots: under re-forming (`stalwart run`'s default), the survivors of a failure keep the replicated
    parameters and optimizer state in their own memory, so a snapshot need copy only the small per-rank rest (a
    light snapshot, taken at the optimizer step behind a barrier, see job/commit.py) and a restart takes the
    replicated state from a survivor: at most the interrupted step is redone. The whole state is still copied now
    and then, for a failure that leaves no survivor. "auto" (the default, with snapshot_every="auto" and more
    than one rank): a light snapshot every step while it costs at most `light_snapshot_budget`, and full copies
    within what it leaves of the budget, at least a quarter of it (policy/snapshot.py). N > 1: light
    snapshots, full copies every N snapshots. 1: every snapshot is full. CPU tensors only (on GPUs every
    snapshot is full); see docs/architecture.md (L1)."""
    peer_replicas: int = 1
    """Under `stalwart run` on several nodes, keep each rank's memory snapshot also in the memory of this many
    ranks on other nodes (L3, 0 to 3; 0: off), so that the ranks of a lost node resume from memory instead of the
    durable checkpoint. Each snapshot is then also sent over the network: with full snapshots the rank's share of
    the whole state (about 80 ms per 100 MB at 10 Gbit/s, per replica), with light ones
    (`replicated_snapshot_every` > 1) only the small per-rank rest. Off on a single node."""
    hang_timeout_s: float | None = None
    """Seconds this worker may go without a heartbeat inside `steps()` before `stalwart run` kills it as hung.
    None (the default): `stalwart run --hang-timeout`, whose default calibrates it from the step times
    (detect/hang.py). The first steps after a start and the saves it waits on always get a grace period."""
    nonfinite_grads: str = "skip"
    """The numeric guard (detect/numeric.py): at each step's optimizer step the tracked optimizers' gradient norm
    is taken, and if it is NaN or infinite, "skip" (the default) drops the update on every rank (parameters and
    optimizer state stay as they were, a `nonfinite_gradients` event says so) and training goes on with the
    next batch; "off" applies it. Costs a read of a sample of each gradient per step (`grad_check_sample`)."""
    grad_spike: str = "warn"
    """A finite gradient norm over `grad_spike_factor` times the mean of the last 100: "warn" (the default) writes a
    `grad_norm_spike` event and applies the update, "skip" drops it like a non-finite one ("rollback" is the same:
    the update was not applied, so there is nothing to go back from), "off" ignores it."""
    grad_spike_factor: float = 10.0
    loss_spike_factor: float | None = 5.0
    """A loss given to `job.report(loss=...)` over this many times the median of the last 100 is a `loss_spike`
    event; `loss_spike` says what follows. None: off."""
    loss_spike: str = "warn"
    """What a loss spike does (its update is already applied when the loss is reported): "warn" (the default) only
    the event; "rollback": every rank goes back to the newest snapshot or checkpoint from before that step and
    skips its batch (L0, recovery/rollback.py; costs one small all-gather per step, to agree); "skip" is the same
    (the update is applied before the loss is known, so skipping the batch means going back); "off": not
    checked."""
    max_rollbacks: int = 3
    """Rollbacks in a row (each within 100 steps of the previous one's trigger) before the job stops with one line
    and exit status 78. Rollbacks also follow non-finite parameters (a NaN the guard's sample missed) and replica
    divergence without a majority; 0 turns every rollback off (those stop the job instead)."""
    grad_check_sample: int | None = 4096
    """Gradient elements the numeric guard reads per tensor (the first this many; a smaller tensor whole): a NaN or
    Inf from the data or the loss reaches every gradient upstream of it, so a sample sees it. None reads every
    element (exact; one read of all gradients per step, 2.2% of the step on the 4M-parameter CPU bench job)."""
    straggler_threshold: float | None = 1.1
    """Straggler detection (detect/straggler.py): a rank whose own work per step (from the step's start to its
    last local gradient, before waiting for the others) takes at least this many times the other ranks' in 3
    windows of 10 steps in a row gets a `straggler_detected` event and one line from rank 0. None: off. Costs
    a timestamp per step and one small all-gather per 10 steps."""
    straggler_policy: str = "report"
    """What a flagged straggler gets: "report" (the default: the event, one line and a risk checkpoint); "evict":
    after that checkpoint is durable, the straggler's process leaves (exit status 76) and `stalwart run` replaces
    it as after a death (a spare, re-forming in place), so a slow process or device stops setting every step's
    pace. Each eviction uses a restart; a replacement that is slow again is evicted again."""
    divergence_every: int | None = 100
    """Replica divergence (detect/divergence.py): every this many steps the ranks compare a fingerprint of their
    replicated objects' tensors (one read of them, one all-gather); replicas outside a majority are repaired from
    it in place, and without a majority the job stops. None: off."""
    max_skipped_steps: int = 5
    """After this many skipped updates in a row the job stops with one line and exit status 78 (training has
    diverged; `stalwart run` does not restart it)."""
    allow_world_size_change: bool | None = None
    """Resume a checkpoint written at another world size: replicated objects load from their one copy, per-rank
    objects of rank r from rank r mod the old world size (right only if they are equal on every rank); the data
    position is global, so no sample is lost or repeated. None (the default) allows it when launched
    elastically (`stalwart run --nnodes MIN:MAX` with MIN < MAX)."""

    def __post_init__(self) -> None:
        if self.replicated_snapshot_every != "auto" and (
            not isinstance(self.replicated_snapshot_every, int)
            or isinstance(self.replicated_snapshot_every, bool)
            or self.replicated_snapshot_every < 1
        ):
            got = self.replicated_snapshot_every
            raise ConfigError(f'replicated_snapshot_every must be "auto" or a positive integer, got {got!r}')
        if self.checkpoint_every != "auto" and (
            not isinstance(self.checkpoint_every, int) or isinstance(self.checkpoint_every, bool)
            or self.checkpoint_every < 1
        ):  # fmt: skip
            raise ConfigError(f'checkpoint_every must be "auto" or a positive integer, got {self.checkpoint_every!r}')
        if not isinstance(self.checkpoint_overlap, bool):
            raise ConfigError(f"checkpoint_overlap must be True or False, got {self.checkpoint_overlap!r}")
        if not isinstance(self.expected_mtbf_s, int | float) or not 0 < self.expected_mtbf_s < float("inf"):
            raise ConfigError(f"expected_mtbf_s must be a positive number of seconds, got {self.expected_mtbf_s!r}")
        for name in ("keep_last", "log_every", "full_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("collective_timeout_s", "persist_timeout_s"):
            if not isinstance(getattr(self, name), int | float) or getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {getattr(self, name)!r}")
        if not isinstance(self.peer_replicas, int) or not 0 <= self.peer_replicas <= MAX_REPLICAS:
            raise ConfigError(f"peer_replicas must be an integer from 0 to {MAX_REPLICAS}, got {self.peer_replicas!r}")
        if self.snapshot_every != "auto" and (
            not isinstance(self.snapshot_every, int) or isinstance(self.snapshot_every, bool) or self.snapshot_every < 0
        ):
            raise ConfigError(f'snapshot_every must be "auto" or an integer >= 0, got {self.snapshot_every!r}')
        if not isinstance(self.snapshot_budget, int | float) or not 0 < self.snapshot_budget < 1:
            raise ConfigError(f"snapshot_budget must be a fraction between 0 and 1, got {self.snapshot_budget!r}")
        if not isinstance(self.light_snapshot_budget, int | float) or not 0 < self.light_snapshot_budget < 1:
            raise ConfigError(
                f"light_snapshot_budget must be a fraction between 0 and 1, got {self.light_snapshot_budget!r}"
            )
        if self.hang_timeout_s is not None and (
            not isinstance(self.hang_timeout_s, int | float) or not 0 < self.hang_timeout_s < float("inf")
        ):
            raise ConfigError(f"hang_timeout_s must be a positive number of seconds, got {self.hang_timeout_s!r}")
        if self.nonfinite_grads not in NONFINITE_POLICIES:
            raise ConfigError(
                f"nonfinite_grads must be one of {', '.join(NONFINITE_POLICIES)}, got {self.nonfinite_grads!r}"
            )
        if self.grad_spike not in SPIKE_POLICIES:
            raise ConfigError(f"grad_spike must be one of {', '.join(SPIKE_POLICIES)}, got {self.grad_spike!r}")
        if not isinstance(self.grad_spike_factor, int | float) or not 1 < self.grad_spike_factor < float("inf"):
            raise ConfigError(f"grad_spike_factor must be a number above 1, got {self.grad_spike_factor!r}")
        if self.loss_spike_factor is not None and (
            not isinstance(self.loss_spike_factor, int | float) or not 1 < self.loss_spike_factor < float("inf")
        ):
            raise ConfigError(f"loss_spike_factor must be None or a number above 1, got {self.loss_spike_factor!r}")
        if self.loss_spike not in LOSS_SPIKE_POLICIES:
            raise ConfigError(f"loss_spike must be one of {', '.join(LOSS_SPIKE_POLICIES)}, got {self.loss_spike!r}")
        if not isinstance(self.max_rollbacks, int) or isinstance(self.max_rollbacks, bool) or self.max_rollbacks < 0:
            raise ConfigError(f"max_rollbacks must be an integer >= 0, got {self.max_rollbacks!r}")
        if self.grad_check_sample is not None and (
            not isinstance(self.grad_check_sample, int)
            or isinstance(self.grad_check_sample, bool)
            or self.grad_check_sample < 1
        ):
            raise ConfigError(f"grad_check_sample must be None or a positive integer, got {self.grad_check_sample!r}")
        if (
            not isinstance(self.max_skipped_steps, int)
            or isinstance(self.max_skipped_steps, bool)
            or self.max_skipped_steps < 1
        ):
            raise ConfigError(f"max_skipped_steps must be a positive integer, got {self.max_skipped_steps!r}")
        if self.straggler_threshold is not None and (
            not isinstance(self.straggler_threshold, int | float) or not 1 < self.straggler_threshold < float("inf")
        ):
            raise ConfigError(f"straggler_threshold must be None or a number above 1, got {self.straggler_threshold!r}")
        if self.straggler_policy not in STRAGGLER_POLICIES:
            raise ConfigError(
                f"straggler_policy must be one of {', '.join(STRAGGLER_POLICIES)}, got {self.straggler_policy!r}"
            )
        if self.divergence_every is not None and (
            not isinstance(self.divergence_every, int)
            or isinstance(self.divergence_every, bool)
            or self.divergence_every < 1
        ):
            raise ConfigError(f"divergence_every must be None or a positive integer, got {self.divergence_every!r}")
        if self.when_busy not in ("skip", "wait"):
            raise ConfigError(f"when_busy must be 'skip' or 'wait', got {self.when_busy!r}")
        if self.replicated is not None and (
            isinstance(self.replicated, str) or not all(isinstance(n, str) for n in self.replicated)
        ):
            raise ConfigError(f"replicated must be a tuple of tracked names, got {self.replicated!r}")
        if not str(self.checkpoint_dir):
            raise ConfigError("checkpoint_dir must not be empty")


_END = object()
"""What `steps()` draws from an exhausted loader."""


def _defer_reform(optimizer: Any, args: Any, kwargs: Any) -> None:
    reform.defer_requests()


class Job:
    """A training job that checkpoints, resumes and reports; see the module docstring for the loop."""

    def __init__(
        self, checkpoint_dir: str | os.PathLike[str], *, hooks: StepHooks | None = None, **options: Any
    ) -> None:
        """`options` are JobConfig's fields. `hooks`: what runs at fixed instants of each step (job/hooks.py;
        fault injection's seam), by default what is installed for this process, in production nothing."""
        lifecycle.install_worker_safety_nets()
        try:
            self.config = JobConfig(checkpoint_dir=checkpoint_dir, **options)
        except TypeError as exc:
            raise ConfigError(f"stalwart.Job: {exc}") from exc
        self.placement = Placement.from_env()
        timeout = timedelta(seconds=self.config.collective_timeout_s)
        self._owns_process_group = init_process_group(self.placement, timeout)
        try:
            self._set_up(hooks)
        except BaseException:
            self._close_partial()
            raise
        # Only now: an exit handler of a half-made Job met missing attributes, and its group was never destroyed.
        atexit.register(self.close)
        reform.register(self)
        self.events.emit("worker_started", world_size=self.world_size, local_rank=self.placement.local_rank)

    def _set_up(self, hooks: StepHooks | None) -> None:
        """Everything after joining the process group; `__init__` undoes what it made if any of it fails."""
        timeout = timedelta(seconds=self.config.collective_timeout_s)
        self.comm = Comm(self.placement, timeout)
        self.events = EventLog.from_env(rank=self.placement.rank, restart=self.placement.restart_count)
        # Rank 0's restart count and random bits name this run's files. Agreed, not local: a node that replaced a
        # lost one has a fresh agent whose restart count differs from the survivors'.
        restart, token = self.comm.broadcast_ints(
            [self.placement.restart_count, secrets.randbits(48)] if self.rank == 0 else [0, 0]
        )
        self._token = f"{restart}x{token:012x}"
        self._hooks = hooks or step_hooks(self.rank, self.placement.restart_count, self._announce)
        self._heartbeat = Heartbeat.from_env(self.placement.local_rank)
        fixed = self.config.hang_timeout_s
        if fixed is None:
            try:
                fixed = parse_timeout(os.environ.get(HANG_TIMEOUT_ENV))
            except ValueError as exc:
                raise ConfigError(f"{HANG_TIMEOUT_ENV}: {exc}") from exc
        self._hang = HangTimer(fixed)
        self._memory = (
            MemoryTier.from_env(
                self.placement.rank,
                self.placement.world_size,
                self.placement.local_rank,
                _local_world_size(),
            )
            if self.config.snapshot_every != 0
            else None
        )
        self._replicas = PeerReplicas(
            self._memory, self.comm, self.events, self.config.peer_replicas, _local_world_size()
        )
        self._snapshot_s = 0.0
        self._snapshot_late_s = 0.0  # what publishing an overlapped snapshot cost at the next step's end
        self._push_at_publish: int | None = None  # the full snapshot the peers get at the next step's end
        self._full_copy_step: int | None = None  # the newest full copy in node memory (step_done reports it)
        self._reform = self._memory is not None and reform.enabled()
        self._live = LiveState(self.placement.rank)  # what a survivor keeps: live tensors' versions, skeleton
        self._commit: StepCommit | None = None  # light snapshots' commit point at the optimizer step
        self._guard: NumericGuard | None = None  # the numeric guard's pre-hooks on the tracked optimizers
        self._deferral_hooks: list[Any] = []  # pre-hooks that defer re-forming requests to the step's end
        self._fence: UpdateFence | None = None  # on a GPU: optimizer steps wait for a checkpoint's overlapped copy
        self._stragglers: StragglerDetector | None = None  # per-rank compute times, compared every window
        self._divergence: DivergenceCheck | None = None  # the replicas' fingerprints, compared now and then
        self._risk: RiskWatch | None = None  # the agent's warning signs (its GPU watch), agreed by the ranks
        # Time each detector took on the training thread at steps' ends (Job.detector_seconds).
        self._exchange = GatherBatch(self.comm.all_gather_ints_later)  # the detectors' all-gathers per window
        self._detect_s = {"divergence": 0.0, "loss": 0.0, "nonfinite_params": 0.0, "straggler": 0.0, "risk": 0.0}
        factor = self.config.loss_spike_factor
        watch = factor is not None and self.config.loss_spike != "off"
        self._reads = HostReads()  # every value read to the host on the training thread, at most one read a step
        self._loss_watch = LossWatch(self.events, float(factor), self._reads) if watch and factor is not None else None
        self._guard_agreed = False  # whether every rank's guard decides alike (replicated or sharded optimizers)
        self._diverged: ReplicaDivergenceError | None = None  # what a divergence without majority raises
        self._skips: set[int] = set()  # batches skipped after rollbacks (recovery/rollback.py), read at the start
        self._rollback_cap = RollbackCap(self.config.max_rollbacks, quiet=self.placement.rank != 0)
        self._local_barrier: LocalBarrier | None = None  # its barrier when every rank is on this node
        self._commits = 0  # commit points started (each names its own barrier)
        self._schedule = SnapshotSchedule(self._fixed_snapshot_every(), self.config.snapshot_budget, 0)
        self._light_cost = LightCost(self.config.light_snapshot_budget)
        self._light_kept = False  # whether light snapshots were judged and kept (one event says so)
        self._interval = CheckpointInterval(self.config.expected_mtbf_s) if self.config.checkpoint_every == "auto" \
            else None  # fmt: skip
        self._created_wall = time.time()  # this launch's age, when the launcher does not say (plain torchrun)
        self._busy_step = False
        self._saved_once = False
        self.checkpointer = Checkpointer(
            self.config.checkpoint_dir,
            self.comm,
            self.events,
            keep_last=self.config.keep_last,
            token=self._token,
            full_every=self.config.full_every,
            when_busy=self.config.when_busy,
            persist_timeout_s=self.config.persist_timeout_s,
            storage_options=self.config.storage_options,
            save_faults=self._hooks.save_faults,
        )
        self._restorer = Restorer(self.comm, self.events, self.checkpointer, self._memory, self._replicas)
        self.state = JobState.CREATED
        self.step = 0
        self.resumed_from: int | None = None
        self._objects: dict[str, Stateful] = {}
        self._metrics: dict[str, Any] = {}
        self._fresh_loss: Any = None  # the loss given to report() in this step, for the loss-spike check
        self._last_saved: int | None = None

    def _close_partial(self) -> None:
        """After a failed `_set_up`: close what it made (a Job the caller never got), then leave the group."""
        for name in ("checkpointer", "_heartbeat", "comm", "events"):
            part = self.__dict__.get(name)
            if part is not None:
                with contextlib.suppress(Exception):
                    part.close()
        if self._owns_process_group and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            self._owns_process_group = False

    @property
    def rank(self) -> int:
        return self.placement.rank

    @property
    def world_size(self) -> int:
        return self.placement.world_size

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that prints and writes shared outputs."""
        return self.rank == 0

    def track(self, **objects: Any) -> None:
        """Register objects with state_dict/load_state_dict (model, optimizer, scheduler, loader, your own)."""
        if self.state is not JobState.CREATED:
            raise ConfigError("track() must be called before steps() or resume()")
        for name, obj in objects.items():
            if not isinstance(obj, Stateful):
                raise ConfigError(f"track({name}=...) needs an object with state_dict() and load_state_dict()")
            if name in self._objects:
                raise ConfigError(f"track(): {name!r} is already tracked")
            self._objects[name] = obj

    def resume(self) -> int:
        """Load the newest valid checkpoint into the tracked objects; returns the step to continue from."""
        if self.state is not JobState.CREATED:
            return self.step
        started = time.monotonic()
        for name, obj in self._objects.items():
            # Fail now, not at the first save many steps later. Modules are left to the save: their state is
            # tensors, and an early state_dict() would gather FSDP state or meet lazy, unmaterialised parameters.
            if not isinstance(obj, torch.nn.Module):
                check_loadable(obj.state_dict(), f"{name}.state_dict()")
        self.checkpointer.replicated = self._replicated_names()
        allow = self.config.allow_world_size_change
        if allow is None:
            allow = os.environ.get(lifecycle.ELASTIC_ENV) == "1"
        self._skips = self._read_skips()
        restored = self._restorer.restore(allow_world_size_change=allow)
        self.state = JobState.RUNNING
        if restored is None:
            self.events.emit("fresh_start")
            return 0
        self._load(restored)
        self.step = self.resumed_from = restored.step
        self._last_saved = restored.step if restored.tier == "durable" else None
        reform.drop_stash()  # the tracked objects hold their own copy now
        seconds = time.monotonic() - started
        self.events.emit(
            "resumed",
            step=restored.step,
            source=restored.source,
            tier=restored.tier,
            bytes=restored.bytes,
            seconds=seconds,
        )
        return self.step

    def _load(self, restored: Restored) -> None:
        """Load a restored state into the tracked objects and the RNG (at a new world size, the RNG stays)."""
        if self._fence is not None:
            self._fence.fence()  # a rollback writes the parameters in place: after a checkpoint's copy of them
        objects = sharded.rebuild(restored.state["objects"], sharded.meshes_of(self._objects.values()), restored.source)
        missing = sorted(set(self._objects) - set(objects))
        extra = sorted(set(objects) - set(self._objects))
        if missing or extra:
            raise CheckpointMismatchError(
                f"checkpoint {restored.source} holds state for {sorted(objects)} but this job tracks "
                f"{sorted(self._objects)}; track the same names or use a new checkpoint_dir"
            )
        for name, obj in self._objects.items():
            _check_shapes(name, obj, objects[name], restored.source)
        for name, obj in self._objects.items():
            try:
                obj.load_state_dict(objects[name])
            except (RuntimeError, ValueError, KeyError) as exc:
                raise CheckpointMismatchError(
                    f"checkpoint {restored.source} does not fit tracked object {name!r}: {first_line(exc)}"
                ) from exc
        if restored.world_size == self.world_size:
            restore_rng(restored.state["rng"])
            detectors = restored.state.get("detectors")
            if self._loss_watch is not None and isinstance(detectors, dict):
                self._loss_watch.load(detectors)
        else:
            self.events.emit("world_size_changed", old=restored.world_size, new=self.world_size, step=restored.step)
            if self.is_main:
                per_rank = sorted(set(self._objects) - self.checkpointer.replicated)
                warnings.warn(
                    f"stalwart: resuming a checkpoint of {restored.world_size} ranks on {self.world_size}: "
                    f"per-rank objects ({', '.join(per_rank) or 'none'}) are loaded from rank r mod "
                    f"{restored.world_size}, which is right only if they are the same on every rank",
                    stacklevel=3,
                )

    def _read_skips(self) -> set[int]:
        """The batches earlier rollbacks of this run skipped (rank 0 reads the record, every rank gets it)."""
        problem: Exception | None = None
        skips: list[int] = []
        if self.is_main:
            try:
                skips = read_skips(self.checkpointer.storage)
            except CheckpointError as exc:
                problem = exc
            except Exception as exc:  # the store cannot be read now: maybe passing, so a restart may try again
                problem = CheckpointError(f"cannot read {self.checkpointer.root}'s skipped-batch record: {exc}")
        ok, *skips = self.comm.broadcast_ints([0] if problem else [1, *skips])
        if not ok:
            raise problem or PeerError("rank 0 cannot read the skipped-batch record; see its error")
        return set(skips)

    def _replicated_names(self) -> frozenset[str]:
        """The tracked objects written once for all ranks (see JobConfig.replicated)."""
        if self.config.replicated is not None:
            unknown = sorted(set(self.config.replicated) - set(self._objects))
            if unknown:
                raise ConfigError(
                    f"replicated= names {unknown}, which are not tracked (tracked: {sorted(self._objects)})"
                )
            return frozenset(self.config.replicated)
        return replicated_names(self._objects, self.world_size)

    def steps(self, loader: Iterable[Any] | None = None, *, max_steps: int) -> Iterator[tuple[int, Any]]:
        """Yield (step, batch) from the resumed step up to `max_steps`, checkpointing as configured.

        `step` counts completed steps before this one, so a fresh job yields 0 first. A step is complete
        when the loop body returns; a failure inside it means the step is redone after recovery.
        """
        if max_steps < 0:
            raise ConfigError(f"max_steps must be >= 0, got {max_steps}")
        self._heartbeat.beat(self.step, PHASE_RESUME, self._hang.grace())
        self.resume()
        self._start_guard()  # before the commit point: its pre-hook decides first whether the update happens
        self._start_overlap()
        self._start_reform_deferral()
        self._start_straggler_detector()
        self._start_divergence_check()
        if self._risk is None and self._heartbeat.active:  # under stalwart run: its agent may warn
            self._risk = RiskWatch(self._heartbeat.risk, self._exchange.gather, self.world_size,
                                   preempted=self._heartbeat.preemption_requested)  # fmt: skip
        if self._divergence is not None:
            self._divergence.last_agreed = self.step  # one copy of the replicated state was loaded, or DDP's own
        if self._light_wanted():
            self._read_live(fresh=True)
            self._start_commit()
        self._schedule = SnapshotSchedule(self._fixed_snapshot_every(), self._full_budget(), self.step)
        self._light_cost = LightCost(self.config.light_snapshot_budget)
        if self._interval is not None:
            self._interval.start(self.step)
        iterator = iter(loader) if loader is not None and self.step < max_steps else None
        if 0 < self.step == max_steps and self._last_saved != self.step:
            # Resumed at the last step from node memory or a survivor (a failure during the run's final save):
            # that save is made now, so the run's last checkpoint is durable before steps() returns all the same.
            self.save(wait=True)
        first = True
        while self.step < max_steps:
            # The heartbeat promises the next one within the step timeout; the agent kills a worker that breaks it.
            self._heartbeat.beat(self.step, PHASE_STEP, self._hang.step_timeout())
            self._hooks.before_step(self.step)
            started = time.monotonic()
            if self._stragglers is not None:
                self._stragglers.step_started(started)
            self._hooks.step_started(self.step, self._tensors_to_flip)
            batch = next(iterator, _END) if iterator is not None else None
            if batch is _END:  # not None: a loader may yield None as a batch
                self.events.emit("data_exhausted", step=self.step)
                if self.step != self._last_saved:
                    self.save(wait=True)
                break
            skipped = self.step in self._skips  # a rollback skipped this batch: drawn, never seen by the loop
            if skipped:
                self.events.emit("batch_skipped", step=self.step)
                self._busy_step = True  # no work: keep it out of the step-time calibrations
            else:
                batch = self._hooks.batch(self.step, batch)
                if self._guard is not None:
                    self._guard.arm(self.step)
                if (
                    self._commit is not None
                    and not first
                    and (self._light_always() or self._schedule.due(self.step + 1))
                ):
                    self._commit.arm(self.step, self._live.key)  # the first step may create optimizer state
                try:
                    yield self.step, batch
                except GeneratorExit:
                    with contextlib.suppress(reform.ReformRequested):
                        reform.allow_requests()  # the loop was left: nothing to finish, nothing to re-form
                    raise
                finally:
                    if self._commit is not None:
                        self._commit.disarm()
                    if self._guard is not None:
                        self._guard.disarm()
            # The loop body is done: the agent's request to re-form (a peer failed) waits for this step's snapshot,
            # so the step is kept wherever the peers hold it too (reform.defer_requests). A collective of the step's
            # end still fails at once if a peer is gone.
            reform.defer_requests()
            if self._fence is not None:
                self._fence.fence()  # a step without an optimizer step must not outrun the checkpoint's copy
            self.step += 1
            step_s = time.monotonic() - started
            if not self._busy_step:
                self._hang.observe(step_s)
                self._schedule.observe_step(step_s)
            live_s = self._live_at_step_end()  # before any collective of this step's end
            self._publish_snapshot()
            rollback = self._rollback_wanted()
            self._reads.step_ended()  # a loss the guard's read of this step did not take is read now
            if rollback is not None and self._roll_back(rollback, loader):
                iterator = iter(loader) if loader is not None else None  # from the restored data position
                self._busy_step = False
                reform.allow_requests()
                continue
            if rollback is not None and self._light_wanted():
                self._read_live()  # nothing to roll back to (a loss spike only reported): this step's state stands
            risk = None
            evict: int | None = None
            detect_started = time.perf_counter()
            if self._stragglers is not None:  # every rank, at the same steps: a window's end is a collective
                self._stragglers.step_done(self.step, measured=not self._busy_step)
                if self._stragglers.newly_flagged:  # the same verdict on every rank, so a save at the same step
                    risk = f"rank {min(self._stragglers.newly_flagged)} is a straggler"
                    if self.config.straggler_policy == "evict":
                        evict = min(self._stragglers.newly_flagged)
            risk_started = time.perf_counter()
            self._detect_s["straggler"] += risk_started - detect_started
            if self._risk is not None:  # the agents' warning signs, agreed at the same step on every rank
                warned = self._risk.step_done(self.step)
                if warned is not None:
                    risk = risk or f"a GPU warning on the node of rank {', '.join(map(str, warned))}"
            self._exchange.flush()  # the window's one all-gather for both (nothing to send between windows)
            self._detect_s["risk"] += time.perf_counter() - risk_started
            self._busy_step = False
            full_due = self._schedule.due(self.step)
            if self._memory is not None and (full_due or self._light_always()):
                snapshot_started = time.perf_counter()
                self._snapshot(full_due, live_s)
                if full_due:  # every rank, at the same steps: the plan is agreed in a collective
                    self._plan_snapshots(time.perf_counter() - snapshot_started)
                elif self._light_agreed() and self._light_cost.first_judgment():  # the same step on every rank
                    self._judge_light()
            reform.allow_requests()  # a re-forming request deferred by the commit point is raised here
            if first:  # the optimizer's state exists now: staging is allocated while the next steps run
                with contextlib.suppress(Exception):
                    self.checkpointer.prepare(self._state())
            if first or self.step % self.config.log_every == 0:
                self._log_step(step_s)
                first = False
            taken = None
            if self.step == max_steps:
                taken = self.save(wait=True)  # the run's last checkpoint is durable before steps() returns
            elif self._checkpoint_due() or risk is not None:
                regular = self._checkpoint_due()
                taken = self.save()  # at a warning sign, a checkpoint now, before it turns into a failure
                if regular and self._interval is not None:
                    self._plan_checkpoints()
                if taken:
                    self._full_copy_served()
            if risk is not None:  # (a regular one due at this step serves)
                self.events.emit("risk_checkpoint", step=self.step, reason=risk, taken=taken)
            if evict is not None:
                self._evict(evict)
            if self._risk is not None and self._risk.preempt and self.step < max_steps:
                self._preempted()
        self._reads.flush()  # the last step's loss is judged before steps() returns
        self._heartbeat.beat(self.step, PHASE_DONE, None)  # after the loop the worker is not watched
        if self.state is not JobState.FINISHED:
            self.state = JobState.FINISHED
            if self.is_main:
                self.events.emit("job_finished", step=self.step)

    @contextlib.contextmanager
    def busy(self, seconds: float | None = None) -> Iterator[None]:
        """Mark a long stretch inside a step (an evaluation, a large all-gather) so that the hang detector
        allows `seconds` (default: the grace period, 300 s) instead of the calibrated step timeout:

            with job.busy():
                evaluate(model)
        """
        self._heartbeat.beat(self.step, PHASE_STEP, seconds if seconds is not None else self._hang.grace())
        self._busy_step = True  # this step's time says nothing about normal steps: keep it out of calibration
        try:
            yield
        finally:
            self._heartbeat.beat(self.step, PHASE_STEP, self._hang.step_timeout())

    def report(self, **metrics: Any) -> None:
        """Record metrics for the current step (e.g. loss). Tensors are read only when logged, which keeps
        the device from synchronising every step."""
        self._metrics = metrics
        self._fresh_loss = metrics.get("loss")

    def save(self, *, wait: bool = False) -> bool:
        """Checkpoint the full training state now. Collective: every rank calls it at the same step.

        Training stalls only while the state is copied to staging memory; it is persisted in the background.
        Returns whether a snapshot was taken (False when the previous save is still persisting, see
        docs/checkpoints.md). With `wait`, returns once the checkpoint is committed, and whether it was.
        """
        # A save that may wait on the store (waited, or the first: staging is allocated) gets the grace period;
        # any other stalls only for a memory copy and keeps the step timeout, so a hang in it is still caught.
        waits = wait or self.config.when_busy == "wait" or not self._saved_once
        self._heartbeat.beat(self.step, PHASE_SAVE, self._hang.grace() if waits else self._hang.step_timeout())
        self._saved_once = True
        self.checkpointer.poll()
        taken = self.checkpointer.save(self.step, self._state(), wait=wait)
        if taken:
            self._last_saved = self.step
        return taken

    def _checkpoint_due(self) -> bool:
        if self._interval is not None:
            return self._interval.due(self.step)
        return self.step % int(self.config.checkpoint_every) == 0

    def _plan_checkpoints(self) -> None:
        """After a regular save under checkpoint_every="auto": the next one's step, from inputs every rank agrees on
        (the largest of each over the ranks: one collective per checkpoint; policy/checkpoint.py)."""
        assert self._interval is not None
        stall = self.checkpointer.last_stall_s
        launched = float(os.environ.get(LAUNCH_TIME_ENV, self._created_wall))
        mine = [round((stall or 0.0) * 1e6), round(self._schedule.step_s() * 1e6), self.placement.restart_count,
                round(max(time.time() - launched, 0.0))]  # fmt: skip
        gathered = self.comm.all_gather_ints(mine)
        stall_s, step_s = max(g[0] for g in gathered) / 1e6, max(g[1] for g in gathered) / 1e6
        failures, elapsed = max(g[2] for g in gathered), float(max(g[3] for g in gathered))
        if stall_s <= 0 or step_s <= 0:
            self._interval.start(self.step)  # nothing measured yet: the same interval again
            return
        decision = self._interval.decide(self.step, stall_s, step_s, failures, elapsed)
        if decision is not None and self.is_main:
            self.events.emit("checkpoint_interval", **dataclasses.asdict(decision))

    def _fixed_snapshot_every(self) -> int | None:
        """The fixed snapshot interval, or None for the budgeted one. Under light snapshots with a fixed
        replicated_snapshot_every, full copies are counted in snapshots, so "auto" means every step; under
        "auto" ones (_light_always), the schedule is that of the full copies."""
        every = self.config.snapshot_every
        if every == "auto":
            return 1 if self.config.replicated_snapshot_every != "auto" and self._light_wanted() else None
        return max(int(every), 1)  # 0: no memory tier, so no snapshot is ever due

    def _full_budget(self) -> float:
        """Under light snapshots every step, full copies only matter when no rank survives: what light snapshots
        leave of the budget, at least a quarter of it (policy/snapshot.full_copy_budget)."""
        if not self._light_always():
            return self.config.snapshot_budget
        return full_copy_budget(self.config.snapshot_budget, None, 0.0)

    def _light_always(self) -> bool:
        """A light snapshot every step, full copies on the budgeted schedule: replicated_snapshot_every="auto"
        where light snapshots work (a commit point exists: CPU replicated state under re-forming)."""
        return self.config.replicated_snapshot_every == "auto" and self._commit is not None and self._light_wanted()

    def _plan_snapshots(self, seconds: float) -> None:
        """After a snapshot that took `seconds` on the training thread (gathering the state, the copy, the
        replicas): the next one's step, from costs every rank agrees on (policy/snapshot.py)."""
        if self._light_agreed() and self._light_cost.judged():
            self._judge_light()
        seconds, self._snapshot_late_s = seconds + self._snapshot_late_s, 0.0  # the last one's publish, if any
        decision = self._schedule.taken(self.step, seconds, self._largest)
        if decision is not None and self.is_main:
            self.events.emit("snapshot_interval", **dataclasses.asdict(decision))

    def _full_copy_served(self) -> None:
        """After a durable checkpoint taken on every rank (a save's vote is agreed), under light snapshots: the
        checkpoint holds all a full copy would, for the one failure full copies are kept for, a failure that
        leaves no rank alive (whenever a rank survives, light snapshots and its live state serve). So the next
        full copy is due an interval after the checkpoint: with checkpoints more frequent than full copies (the
        recovery bench job: every 20 steps against every 20-84), the state is no longer copied twice over in
        the same stretch of steps. Light snapshots' cost is judged here too (a collective at the same step on
        every rank), as it is at a full copy, so it is still measured while full copies wait. Only with a local
        checkpoint_dir: read back from object storage, a checkpoint is far slower than a full copy in node
        memory."""
        if self._memory is None or not self._light_agreed() or self.checkpointer.storage.local_path() is None:
            return
        if self._light_cost.judged():
            self._judge_light()
        if self._light_agreed():
            self._schedule.served(self.step)

    def _largest(self, first_s: float, second_s: float) -> tuple[float, float]:
        """Each of two durations at its largest over the ranks (one collective, microseconds as integers): what
        every rank's decisions are taken from, so that all decide alike."""
        gathered = self.comm.all_gather_ints([round(first_s * 1e6), round(second_s * 1e6)])
        return max(g[0] for g in gathered) / 1e6, max(g[1] for g in gathered) / 1e6

    def _judge_light(self) -> None:
        """Under "auto": keep light snapshots only while they cost at most `light_snapshot_budget`, decided
        alike on every rank from the largest light cost and step time (policy/snapshot.LightCost); full copies
        get what they leave of it."""
        light_s, step_s = self._largest(self._light_cost.mine(), self._schedule.step_s())
        if not self._light_cost.too_dear(light_s, step_s):
            self._schedule.budget = full_copy_budget(self.config.snapshot_budget, light_s, step_s)
            if not self._light_kept and self.is_main:  # once per run: what they cost and what they may
                self.events.emit("light_snapshots_kept", step=self.step, light_s=light_s, step_s=step_s,
                                 budget=self._light_cost.budget, full_copy_budget=self._schedule.budget)  # fmt: skip
            self._light_kept = True
            return
        assert self._commit is not None
        self._commit.agreed_off = True  # every rank decides this at the same step
        self._commit.off = (
            f"light snapshots cost {light_s * 1e3:.2f} ms per step of {step_s * 1e3:.1f} ms, over their budget "
            f"of {100 * self._light_cost.budget:g}%: full copies on the budget instead"
        )
        self._schedule.budget = self.config.snapshot_budget
        self.events.emit(
            "light_snapshots_off", step=self.step, reason=self._commit.off, light_s=light_s, step_s=step_s,
            budget=self._light_cost.budget, full_copy_budget=self._schedule.budget,
        )  # fmt: skip

    def _light_agreed(self) -> bool:
        """_light_always() as every rank knows it, for decisions taken in a collective: a rank whose own check
        turned light snapshots off tells the others only at the next commit point (job/commit.py)."""
        return (
            self.config.replicated_snapshot_every == "auto"
            and self._commit is not None
            and self._light_wanted(agreed=True)
        )

    def _light_wanted(self, *, agreed: bool = False) -> bool:
        """Light snapshots: asked for, under re-forming, and not turned off by the commit point's check (with
        `agreed`: not known to every rank to be off)."""
        commit = self._commit
        off = commit is not None and (commit.agreed_off if agreed else commit.off is not None)
        every = self.config.replicated_snapshot_every
        auto = self.config.snapshot_every == "auto" and self.world_size > 1
        asked = auto if every == "auto" else int(every) > 1
        return self._reform and asked and not off

    def _rollback_wanted(self) -> RollbackRequest | None:
        """At a step's end (every rank, at the same steps): whether the step just done calls for a rollback (L0,
        recovery/rollback.py), agreed by every rank. Also runs the divergence check and the loss-spike check."""
        request = None
        rollbacks = self.config.max_rollbacks > 0
        started = time.perf_counter()
        if self._divergence is not None and self._divergence.due(self.step):  # every rank, same steps
            try:
                odd = f"the replicas differed at step {self.step}"
                if (
                    not self._divergence.check(self.step, on_odd=lambda: self._live.forbid(odd))
                    and self._light_wanted()
                ):
                    self._read_live()  # repaired (in place, versions unmoved): the state of this step again
            except ReplicaDivergenceError as exc:
                if not rollbacks or exc.last_agreed is None:
                    raise
                self._diverged = exc
                request = RollbackRequest("replica_divergence", self.step, exc.last_agreed, None)
        now = time.perf_counter()
        self._detect_s["divergence"] += now - started
        started = now
        loss, self._fresh_loss = self._fresh_loss, None  # only a loss reported in this step
        if self._loss_watch is not None:
            rolls = rollbacks and self.config.loss_spike in ("rollback", "skip")
            action = "rollback" if rolls else "warned"
            # Without a rollback to decide now, a loss tensor waits for the guard's read in the next step.
            now = rolls or self._guard is None
            spiked = loss is not None and self._loss_watch.observe(self.step, loss, action=action, now=now)
            if rolls and spiked:
                self._live.forbid(f"a loss spike at step {self.step} calls for a rollback")
            # The ranks' losses differ: they agree, at one all-gather per step, only when a spike rolls back.
            if rolls and any(v[0] for v in self.comm.all_gather_ints([int(spiked)])):
                request = request or RollbackRequest("loss_spike", self.step, self.step - 1, self.step - 1)
        now = time.perf_counter()
        self._detect_s["loss"] += now - started
        started = now
        guard = self._guard
        if guard is not None and rollbacks and self._guard_agreed and guard.nonfinite_at == self.step - 1:
            # The guard kept this step's update out; if a parameter is already non-finite, the update before it put
            # it there unseen (a lone NaN outside the guard's sample): go back to before that one.
            optimizers = [o for o in self._objects.values() if isinstance(o, torch.optim.Optimizer)]
            finite = all_finite(optimizers)
            if not finite:
                self._live.forbid(f"non-finite parameters at step {self.step}")
            if not all(v[0] for v in self.comm.all_gather_ints([int(finite)])):
                before = self.step - 2
                request = request or RollbackRequest("nonfinite_parameters", self.step, before, before)
        self._detect_s["nonfinite_params"] += time.perf_counter() - started
        if request is not None:
            self._live.forbid(f"step {self.step} is to be rolled back ({request.reason.replace('_', ' ')})")
        return request

    def _roll_back(self, request: RollbackRequest, loader: Iterable[Any] | None) -> bool:
        """Go back to the newest good state and skip the batch (recovery/rollback.py). Collective. False when there
        is nothing to go back to: a loss spike is then only reported; non-finite parameters and diverged
        replicas stop the job."""
        why = None
        if loader is not None and not any(obj is loader for obj in self._objects.values()):
            why = "the loader given to steps() is not tracked, so its position cannot go back"
        elif request.at_most < 0:
            why = "no state from before it exists"
        restored = None
        started = time.monotonic()
        if why is None:
            self._heartbeat.beat(self.step, PHASE_RESUME, self._hang.grace())
            self._rollback_cap.count(request)
            self.checkpointer.wait_durable()  # nothing is set aside while a save of it may still commit
            restored = self._restorer.rollback(request.at_most, lambda: self._abandon_after(request))
            if restored is None:
                why = f"no snapshot or checkpoint from step {request.at_most} or before"
        if restored is None:
            self.events.emit("rollback_impossible", step=self.step, reason=request.reason, why=why)
            if request.reason == "replica_divergence" and self._diverged is not None:
                raise self._diverged
            if request.reason == "nonfinite_parameters":
                raise NumericError(
                    f"parameters became non-finite by step {self.step} and the job cannot roll back: {why}",
                    quiet=not self.is_main,
                )
            if self.is_main:
                print(f"stalwart: cannot roll back for the loss spike at step {self.step}: {why}", file=sys.stderr)
            return False
        if request.skip is not None:
            self._skips.add(request.skip)
            if self.is_main:
                try:
                    write_skips(self.checkpointer.storage, self._skips, request, restored.step)
                except Exception as exc:  # this process still skips it; a restart from before it would not
                    self.events.emit("skip_record_failed", step=request.skip, error=first_line(exc))
        self._load(restored)
        from_step, self.step = self.step, restored.step
        self._last_saved = restored.step if restored.tier == "durable" else None
        if self._guard is not None:
            self._guard.rolled_back()
        if self._commit is not None:
            self._commit.forget()
        if self._divergence is not None:
            self._divergence.last_agreed = self.step  # one copy of the replicated state was loaded
        if self._live.held:
            self._read_live(fresh=True)
        self._schedule.next_step = min(self._schedule.next_step, self.step + 1)
        self.events.emit(
            "rolled_back", step=self.step, reason=request.reason, trigger=request.trigger, from_step=from_step,
            skip=request.skip, tier=restored.tier, source=restored.source, seconds=time.monotonic() - started,
        )  # fmt: skip
        if self.is_main:
            skipping = f"; batch {request.skip} will be skipped" if request.skip is not None else ""
            print(
                f"stalwart: {request.reason.replace('_', ' ')} at step {request.trigger}: rolled back to step "
                f"{self.step} from {restored.source}{skipping}",
                file=sys.stderr,
                flush=True,
            )
        return True

    def _preempted(self) -> None:
        """Every rank, at the step they agreed on: a last durable checkpoint, then a clean exit (status 0), so the
        launcher, which got SIGTERM, ends without a restart and the next launch resumes from this step."""
        if self._last_saved != self.step:
            self.save(wait=True)
        else:
            self.checkpointer.wait_durable()
        self.events.emit("preempted", step=self.step)
        if self.is_main:
            print(f"stalwart: preempted: the checkpoint of step {self.step} is durable; exiting", file=sys.stderr,
                  flush=True)  # fmt: skip
        self._heartbeat.beat(self.step, PHASE_DONE, None)
        raise SystemExit(0)

    def _evict(self, straggler: int) -> None:
        """Every rank, at the step the straggler was flagged: once the checkpoint of this step is durable, the
        straggler's process leaves; the others meet its absence at their next collective and re-form with its
        replacement (JobConfig.straggler_policy)."""
        self._heartbeat.beat(self.step, PHASE_SAVE, self._hang.grace())
        self.checkpointer.wait_durable()  # collective: the state of this step outlives the eviction
        if self.rank != straggler:
            return
        self.events.emit("straggler_evicted", step=self.step, straggler=straggler)
        print(
            f"stalwart: rank {straggler} leaves as a straggler at step {self.step}; a replacement takes its place",
            file=sys.stderr,
            flush=True,
        )
        self._heartbeat.close()
        os._exit(EXIT_EVICTED)  # no clean-up that could wait on the peers: they are about to re-form without it

    def _abandon_after(self, request: RollbackRequest) -> None:
        """Invalidate the snapshots and set aside the checkpoints after `request.at_most` (every rank its own
        memory; rank 0 the durable ones), before the rollback loads anything."""
        if self._memory is not None:
            self._memory.forget_after(request.at_most)
        if self.is_main:
            self.checkpointer.set_aside_after(request.at_most, f"rolled back for {request.reason}")
        self.comm.barrier()

    def _start_guard(self) -> None:
        """The numeric guard on every tracked optimizer (detect/numeric.py), unless both its checks are off."""
        if self._guard is not None or (self.config.nonfinite_grads == "off" and self.config.grad_spike == "off"):
            return
        optimizers = [o for o in self._objects.values() if isinstance(o, torch.optim.Optimizer)]
        if optimizers:
            config = GuardConfig(
                nonfinite=self.config.nonfinite_grads,
                spike=self.config.grad_spike,
                spike_factor=float(self.config.grad_spike_factor),
                max_skips=self.config.max_skipped_steps,
                sample=self.config.grad_check_sample,
            )
            replicated = all(n in self.checkpointer.replicated for n, o in self._objects.items() if o in optimizers)
            self._guard = NumericGuard(
                optimizers, self.events, config, quiet=replicated and not self.is_main, reads=self._reads
            )
            shards = any(sharded.is_dtensor(p) for o in optimizers for g in o.param_groups for p in g["params"])
            self._guard_agreed = replicated or shards or self.world_size == 1

    def _start_overlap(self) -> None:
        """On a GPU, checkpoints and full memory snapshots copy the tracked optimizers' tensors under the next
        step (save/overlap.py). Under the tests' threaded stand-in for a side stream (save/side_copy.py), memory
        snapshots do so on a CPU too."""
        host = self._memory is not None and self._memory.side.on_host
        if self._fence is not None or not self.config.checkpoint_overlap or not (torch.cuda.is_available() or host):
            return
        optimizers = [o for o in self._objects.values() if isinstance(o, torch.optim.Optimizer)]
        if optimizers:
            self._fence = UpdateFence(optimizers, host=host)
            self.checkpointer.overlap = self._fence
            if self._memory is not None:
                self._memory.overlap = self._fence

    def _close_overlap(self) -> None:
        if self._fence is not None:
            self.checkpointer.overlap = None
            if self._memory is not None:
                self._memory.overlap = None
            self._fence.close()
            self._fence = None

    def _publish_snapshot(self) -> None:
        """At the step's end after a full snapshot under overlap (on a GPU), on every rank alike: the snapshot is
        valid from now on if its copy was left running (it ran under this step, whose optimizer step waited for
        it), and only now does it go to the peer replicas, whether or not this rank's copy was left running (the
        push is a collective; a rank's slots start overlapping once its own thread has registered them). What
        this costs counts towards the snapshot's cost at the next plan: the wait here, the push, and how long
        this step's optimizer step waited for the copy on the GPU (timed by the fence; a checkpoint's copy
        running at the same time is counted in with it)."""
        memory = self._memory
        push, self._push_at_publish = self._push_at_publish, None
        if memory is None or (memory.running is None and push is None):
            return
        started = time.perf_counter()
        step = push if push is not None else -1  # a snapshot whose copy ended inside snapshot()
        if memory.running is not None:
            published = memory.publish()
            if published is not None:
                self._full_copy_step = published
            step = published if published is not None else -1  # given up: an empty image
        if push is not None:
            self._replicas.push(step, light=False)
        stalled = self._fence.take_stall_s() if self._fence is not None else 0.0  # the optimizer step's wait
        self._snapshot_late_s += time.perf_counter() - started + stalled

    def _start_straggler_detector(self) -> None:
        """Straggler detection over the tracked modules (detect/straggler.py), with more than one rank."""
        threshold = self.config.straggler_threshold
        if self._stragglers is not None or threshold is None or self.world_size < 2:
            return
        modules = [o for o in self._objects.values() if isinstance(o, torch.nn.Module)]
        if not modules:
            return
        self._stragglers = StragglerDetector(
            self.rank, self.world_size, self.events, self._exchange.gather, threshold=threshold,
            announce=self.is_main,
        )  # fmt: skip
        self._stragglers.watch(modules)
        self._stragglers.watch_optimizers(o for o in self._objects.values() if isinstance(o, torch.optim.Optimizer))

    def _start_divergence_check(self) -> None:
        """The replicas' fingerprint check (detect/divergence.py), with more than one rank and replicated objects."""
        every = self.config.divergence_every
        if self._divergence is not None or every is None or self.world_size < 2 or not self.checkpointer.replicated:
            return
        self._divergence = DivergenceCheck(
            self.rank, self.world_size, self.events, self._replicated_tensors, self.comm.all_gather_ints,
            broadcast_on_default_group, every,
        )  # fmt: skip

    def _tensors_to_flip(self) -> list[torch.Tensor]:
        """A bit flip's targets (the step hooks' `tensors`), once the copies still reading them have ended: the last
        snapshot or checkpoint must hold the state before the flip, as it would without overlap."""
        if self._fence is not None:
            self._fence.fence()
        return self._replicated_tensors()

    def _replicated_tensors(self) -> list[torch.Tensor]:
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

        for name, obj in self._objects.items():
            if name not in self.checkpointer.replicated:
                continue
            if isinstance(obj, torch.nn.Module):
                walk(list(obj.parameters()))
            else:
                walk(obj.state_dict())
        return found

    @property
    def detector_seconds(self) -> float:
        """Time the guard and the detectors took on the training thread in this process: the guard's judging at
        the optimizer step and, at each step's end, the divergence, loss-spike, straggler and risk checks (not
        the straggler hooks' timestamps inside backward, about a microsecond each). `stalwart bench overhead`
        reports it per step."""
        return sum(self.detector_breakdown.values())

    @property
    def detector_breakdown(self) -> dict[str, float]:
        """`detector_seconds` by detector: guard, divergence, loss, nonfinite_params, straggler, risk."""
        return {"guard": self._guard.seconds if self._guard is not None else 0.0, **self._detect_s}

    @property
    def skipped_steps(self) -> list[int]:
        """Steps of this process whose update the numeric guard skipped (completed steps before each)."""
        return list(self._guard.skipped) if self._guard is not None else []

    def _start_commit(self) -> None:
        """The commit point at the replicated optimizers' step (job/commit.py); without live tensors (CUDA
        parameters, which are not version-checked) there is nothing for a survivor to keep and no light mode."""
        optimizers = [o for n, o in self._objects.items()
                      if n in self.checkpointer.replicated and isinstance(o, torch.optim.Optimizer)]  # fmt: skip
        if self._memory is None or not self._live.held or not optimizers:
            return
        self._commit = StepCommit(
            self._memory,
            self._commit_barrier(),
            self.events,
            self._hooks,
            self._state,
            self._per_rank_state,
            self._replicated_states,
            self.checkpointer.replicated,
            optimizers,
            lambda step: self._replicas.push(step, light=True),
        )

    def _snapshot(self, full_due: bool, versions_s: float = 0.0) -> None:
        """Copy the state into node memory: light every time under re-forming (the live tensors stay with the
        survivors) with a full copy when one is due (`full_due` under "auto" light snapshots, else every
        `replicated_snapshot_every` snapshots), or full every time without re-forming.

        A light snapshot's cost, as the budget judges it, is all that light snapshots add to a step: the commit
        point's part, and at the step's end reading the live tensors' versions (`versions_s`), the state, the
        check and the survivor's skeleton. Before, only the commit point and the check were counted: about
        half of it (2-rank bench job, 2-core VM)."""
        assert self._memory is not None
        began = time.perf_counter()
        replicated = self.checkpointer.replicated
        if self._light_always():
            light = self._live.held
            full = not light or full_due
        else:
            fixed = self.config.replicated_snapshot_every
            snapshot_every = self._schedule.interval  # fixed under light snapshots (see _fixed_snapshot_every)
            every = (fixed if isinstance(fixed, int) else 1) * snapshot_every
            light = self._light_wanted() and every > snapshot_every and self._live.held
            full = not light or self.step % every == 0
        # The whole state only when something copies it; a light step's end reads the per-rank part and the
        # replicated objects' skeleton alone (job/live.py).
        state = self._state() if full or not light else None
        seconds = 0.0
        push = "full" if full else ""  # which image goes to the peer replicas (L3): the one this step relies on
        if light:
            live = self._live.key
            commit = self._commit
            if commit is not None and commit.committed(self.step):
                # Taken (and sent to the replicas) at the optimizer step; it stands if the per-rank state has not
                # changed since.
                push = ""
                if not commit.check(state if state is not None else self._per_rank_state(self.step)):
                    state = state if state is not None else self._state()
                    for _ in range(2):  # it changed: overwrite both light slots, and copy in full
                        self._memory.snapshot(self.step, state, replicated, live=live)
                    full, push = True, "full"
                seconds = commit.seconds
            else:
                state = state if state is not None else self._state()
                self._memory.snapshot(self.step, state, replicated, live=live)
                push = "light"
            seconds += versions_s + time.perf_counter() - began
            self._light_cost.observe(seconds)
        if full:
            assert state is not None
            if self._fence is not None:
                self._fence.take_stall_s()  # what it timed so far belongs to checkpoints, not to this snapshot
            seconds += self._memory.snapshot(self.step, state, replicated)[0]
            if self._memory.running is None:
                self._full_copy_step = self.step
            if push == "full" and self._fence is not None:
                # Sent at the step's end once published, on every rank: whether its copy still runs differs
                # between ranks (each registers its slots with CUDA on its own thread), the push is a collective.
                push, self._push_at_publish = "", self.step
        if push:
            self._replicas.push(self.step, light=push == "light")
            seconds += self._replicas.seconds
        self._snapshot_s = seconds

    def _live_at_step_end(self) -> float:
        """Under light snapshots, read the live tensors' versions and the replicated objects' skeleton of the step
        just completed (job/live.py); returns the seconds it took (part of a light snapshot's cost).

        Read first thing after the loop body, before any collective of the step's end (the replica divergence
        check, the loss-spike vote, the save's vote): a survivor whose peer died after the step's commit point
        fails in the first of those with its parameters already at the new step, and keeps them for the
        replacement only if their versions were read at that step. Read after those collectives, as before, a
        kill landing there (1 in 4 kills of one 2-minute `stalwart bench recovery` goodput run, at a divergence
        check every 100 steps) found the versions of the step before, kept nothing and resumed from the durable
        checkpoint, 19 steps back."""
        if not self._light_wanted():
            return 0.0
        started = time.perf_counter()
        self._read_live()
        return time.perf_counter() - started

    def _read_live(self, *, fresh: bool = False) -> None:
        """The live tensors' versions and the replicated objects' skeleton (their non-tensor state: a
        scheduler's epoch, the optimizer's hyperparameters) at the completed step: a survivor hands both over
        with its live tensors (see job/commit.py)."""
        replicated = self.checkpointer.replicated
        self._live.read(self._objects, replicated, fresh=fresh)
        self._live.remember(self.step, self._objects, replicated)

    def _state(self, step: int | None = None, *, replicated: bool = True) -> dict[str, Any]:
        """The full training state of this rank, as checkpoints and memory snapshots hold it (labelled `step`,
        by default the completed steps); without the replicated objects if not `replicated` (what a light
        snapshot copies, memory.snapshot_light)."""
        names = self.checkpointer.replicated
        state = {
            "step": self.step if step is None else step,
            "objects": {n: obj.state_dict() for n, obj in self._objects.items() if replicated or n not in names},
            "rng": capture_rng(),
            "world_size": self.world_size,
        }
        if self._loss_watch is not None:  # per rank; not compared by the commit point's check (it moves at report)
            state["detectors"] = self._loss_watch.state()
        return state

    def _per_rank_state(self, step: int) -> dict[str, Any]:
        return self._state(step, replicated=False)

    def _replicated_states(self) -> dict[str, Any]:
        """The replicated objects' state_dicts, by name: local, no collective."""
        replicated = self.checkpointer.replicated
        return {name: obj.state_dict() for name, obj in self._objects.items() if name in replicated}

    def close(self) -> None:
        """Stop the persister and release the process groups this job created (also run at interpreter exit).
        A persist still in flight is abandoned; the final checkpoint of steps() is durable before it returns."""
        self._close_commit()
        self._close_guard()
        self._close_overlap()
        self._heartbeat.close()
        if self._memory is not None:
            self._memory.close()
        self.checkpointer.close()
        self.comm.close()
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_process_group = False
        self.events.close()

    def abandon(self) -> None:
        """Drop this job after its group failed, without a collective (supervisor/worker_host.py re-forms the worker in
        place, see recovery/reform.py): the persister is killed, so a save in flight never commits, and nothing
        runs at interpreter exit. The process groups are aborted by the caller, all at once."""
        atexit.unregister(self.close)
        with contextlib.suppress(Exception):
            self.checkpointer.abandon()  # first: the persister dies before anything else can go wrong
        lost = self._keep_live_state()
        closers = (self._close_commit, self._close_guard, self._close_overlap, self._heartbeat.close, self.comm.forget)
        for step in closers:
            with contextlib.suppress(Exception):
                step()
        if self._memory is not None:
            with contextlib.suppress(Exception):
                self._memory.close(wait_s=0.0)  # a snapshot's copy on a GPU that may hang: only if already done
        self._owns_process_group = False
        with contextlib.suppress(Exception):
            why = {} if lost is None else {"why": lost}
            self.events.emit("reforming", step=self.step, kept_live_state=lost is None, **why)
        self.events.close()

    def _commit_barrier(self) -> Callable[[int], tuple[float | None, int]]:
        """The commit point's barrier, carrying a flag (the largest any rank brought comes back to all): through
        a shared page when every rank is on this node (a gloo barrier costs milliseconds of thread hand-offs,
        runtime/local_barrier.py), else a gather on stalwart's gloo group (its cost unknown: None)."""
        memory = self._memory
        if memory is None or memory.local_world_size != self.world_size:
            return lambda flag: (None, max(v[0] for v in self.comm.all_gather_ints([flag])))
        self._commits += 1
        self._local_barrier = LocalBarrier(
            memory.directory,
            f"{self._token}-{self._commits}",
            memory.local_rank,
            memory.local_world_size,
            self.config.collective_timeout_s,
        )
        return self._local_barrier.wait

    def _start_reform_deferral(self) -> None:
        """Under in-place re-forming: from a tracked optimizer's step on, the agent's request to re-form (a peer
        died) waits for the step's snapshot (reform.defer_requests; allowed again at the step's end). A survivor
        that got that far has passed the step's all-reduce, so its peers computed the step too; interrupted, it
        would redo a step that every rank may hold. The agent sees a death within milliseconds
        (supervisor/exit_watch.py), often while a survivor is still in that step's optimizer step."""
        if not self._reform or self._deferral_hooks:
            return
        optimizers = [o for o in self._objects.values() if isinstance(o, torch.optim.Optimizer)]
        self._deferral_hooks = [o.register_step_pre_hook(_defer_reform) for o in optimizers]

    def _close_guard(self) -> None:
        for handle in self._deferral_hooks:
            handle.remove()
        self._deferral_hooks = []
        if self._guard is not None:
            self._guard.close()
        if self._stragglers is not None:
            self._stragglers.close()

    def _close_commit(self) -> None:
        if self._commit is not None:
            self._commit.close()
        if self._local_barrier is not None:
            self._local_barrier.close()
            self._local_barrier = None

    def _keep_live_state(self) -> str | None:
        """Keep references to the live tensors for the next run if they still hold step `self.step`; returns
        None when kept, else why not (for the `reforming` event)."""
        if self.state is not JobState.RUNNING:
            return f"the job was {self.state.value}, not inside its training loop"
        if not self._light_wanted():
            return "light snapshots are off"
        if self._live.void is not None:
            return self._live.void
        versions = self._live.versions
        if not versions:
            return "no live tensors were read"
        with contextlib.suppress(Exception):
            if self._live.unchanged(self._objects, self.checkpointer.replicated):
                # Only the replicated objects: their state_dict() is local (no collective with the lost peer).
                _, items = flatten({"objects": self._replicated_states()}, self.rank, self.checkpointer.replicated)
                live = {i.id: i.tensor for i in items if i.id.startswith("R/") and i.tensor.data_ptr() in versions}
                got = self._live.skeleton
                skeleton = got[1] if got is not None and got[0] == self.step else None
                reform.keep(reform.Stash(self.step, self.world_size, live, skeleton))
                return None
        if self._commit is not None and self._commit.committed(self.step + 1):
            # The next step's commit point ran and its optimizer step too: the step's tail (a scheduler, a
            # logging all-reduce) did not finish, so the replicated state is neither step's.
            return (
                f"the failure surfaced inside the loop body after the optimizer step of step {self.step + 1} (a "
                "collective after optimizer.step()): the live tensors hold neither that step nor the one before"
            )
        return f"the live tensors were written after the end of step {self.step}"

    def _log_step(self, step_s: float) -> None:
        """A `step_done` event; the reported tensors are read in one read, with whatever waits for one."""
        tensors = {k: v.detach() for k, v in self._metrics.items() if isinstance(v, torch.Tensor)}
        values = self._reads.read([v.reshape(1) for v in tensors.values()]) if tensors else []
        read = {k: _as_item(tensors[k], v) for k, v in zip(tensors, values, strict=True)}
        metrics = {k: read.get(k, v) for k, v in self._metrics.items()}
        if self._memory is not None:
            metrics["snapshot_s"] = self._snapshot_s
            metrics["snapshot_every"] = self._schedule.interval
            metrics["full_copy_step"] = self._full_copy_step
        self.events.emit("step_done", step=self.step, step_s=step_s, **metrics)

    def _announce(self, kind: str, details: dict[str, Any]) -> None:
        """A fault of the step hooks is about to fire: the event log says which, at which step."""
        self.events.emit("fault_injected", fault=kind, step=self.step, **details)


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


def _as_item(tensor: torch.Tensor, value: float) -> Any:
    """`value` read from `tensor` as its `.item()` would give it (an int or bool stays one)."""
    if tensor.dtype == torch.bool:
        return bool(value)
    return value if tensor.is_floating_point() else int(value)


def _local_world_size() -> int:
    """LOCAL_WORLD_SIZE as torchrun and `stalwart run` set it; 1 when launched otherwise."""
    text = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return int(text) if text.isdigit() and int(text) > 0 else 1
