"""A job's options, in sections: what to checkpoint and when, the memory snapshots, the numeric guard, the other
detectors, and recovery.

`stalwart.Job(checkpoint_dir, **options)` takes the flat names documented in docs/configuration.md (`keep_last=5`,
`snapshot_every="auto"`, ...); `JobConfig` routes each to its section (`FLAT`), and every section checks its own
fields with the shared validators below, so a bad value ends in one line that names the option as the user
wrote it. Figures behind the defaults are in docs/benchmarks.md, not here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from stalwart.checkpoint.save.request import DEFAULT_FAILOVER_S
from stalwart.checkpoint.tiers.replicas import MAX_REPLICAS
from stalwart.detect.numeric import LOSS_SPIKE_POLICIES, NONFINITE_POLICIES, SPIKE_POLICIES
from stalwart.detect.straggler import STRAGGLER_POLICIES
from stalwart.errors import ConfigError
from stalwart.policy.auto_checkpoint import DEFAULT_PRIOR_MTBF_S
from stalwart.runtime.env import FAILOVER_ENV, MIRRORS_ENV

# -- shared validators: each raises ConfigError naming the option as the user wrote it -----------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def positive_int(name: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not _is_int(value) or value < 1:
        raise ConfigError(f"{name} must be {'None or ' if optional else ''}a positive integer, got {value!r}")


def auto_or_int(name: str, value: Any, *, minimum: int = 1) -> None:
    if value != "auto" and (not _is_int(value) or value < minimum):
        wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f'{name} must be "auto" or {wanted}, got {value!r}')


def _env_seconds(name: str, default: float) -> float:
    """A default from the launcher's environment (a flag of `stalwart run`), checked where the option is."""
    text = os.environ.get(name, "")
    try:
        return float(text) if text else default
    except ValueError as exc:
        raise ConfigError(f"{name} must be a number of seconds, got {text!r}") from exc


def seconds(name: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not _is_number(value) or not 0 < value < float("inf"):
        raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")


def fraction(name: str, value: Any) -> None:
    if not _is_number(value) or not 0 < value < 1:
        raise ConfigError(f"{name} must be a fraction between 0 and 1, got {value!r}")


def above_one(name: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not _is_number(value) or not 1 < value < float("inf"):
        raise ConfigError(f"{name} must be {'None or ' if optional else ''}a number above 1, got {value!r}")


def one_of(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


# -- the sections ----------------------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class CheckpointOptions:
    dir: str | os.PathLike[str]
    """`checkpoint_dir`: the job's checkpoints; created on first use. Must be empty or made by stalwart."""
    every: int | str = 100
    """`checkpoint_every`: a checkpoint after every this many steps (and after the last step). "auto": as often as
    Daly's optimum for the measured stall of a checkpoint and the failure rate this launch has seen (from
    `expected_mtbf_s` before any), re-decided after every checkpoint, at most an hour of training apart
    (policy/auto_checkpoint.py); a `checkpoint_interval` event records each change and its inputs."""
    expected_mtbf_s: float = DEFAULT_PRIOR_MTBF_S
    """With checkpoint_every="auto": the job's mean time between interruptions assumed before any is seen (weight:
    one failure). The default, 24 h, suits a few nodes; docs/simulation.md cites what large jobs see."""
    keep_last: int = 3
    """Committed checkpoints kept on disk; older ones are removed after each commit."""
    full_every: int = 1
    """1: every checkpoint is full. N > 1: after a full checkpoint, the next N - 1 are deltas that store only the
    tensors that changed since it, zstd-compressed (worth it when most tensors do not change, e.g. fine-tuning)."""
    when_busy: str = "skip"
    """What a save does when the previous one is still persisting (at most one is in flight per rank). "skip":
    it is skipped on every rank with a `checkpoint_skipped` event and training goes on (a slow or failing store
    never stalls training). "wait": it waits for the previous one (a `checkpoint_waited` event says how long), so
    every `checkpoint_every` step gets its checkpoint."""
    overlap: bool = True
    """`checkpoint_overlap`: on a GPU, a checkpoint's copy of the tracked optimizers' parameters and state to host
    memory runs under the next step's forward and backward, and that step's optimizer step waits for it (on the
    GPU), so training stalls only for starting the copy (checkpoint/save/overlap.py). Needs what every ordinary
    loop does: those tensors change only in the optimizer's step(). False: save() returns after the whole copy.
    No effect on CPU."""
    persist_timeout_s: float = 600.0
    """How long a background persist keeps retrying a failing store before that save is given up."""
    storage_options: dict[str, Any] | None = None
    """Passed to fsspec for a checkpoint_dir URL (e.g. {"endpoint_url": ...} for s3://)."""
    mirrors: Sequence[str | os.PathLike[str] | dict[str, Any]] = ()
    """Other locations each committed checkpoint is copied to, in the background, verified there, `keep_last` kept
    (checkpoint/save/mirroring.py): paths or fsspec URLs (another region's bucket, another provider), each a string
    or {"url": ..., "options": {...}} with its own fsspec options. A start resumes from the newest checkpoint that
    verifies in any of them or in `checkpoint_dir` (docs/disaster-recovery.md)."""
    failover_s: float = field(default_factory=lambda: _env_seconds(FAILOVER_ENV, DEFAULT_FAILOVER_S))
    """With mirrors: how long a save tries `checkpoint_dir` before it writes to the first mirror instead, while that
    store does not answer (checkpoint/save/failover.py). Default: `stalwart run --failover-s`, else 20 s."""
    durable_in: str = "one"
    """With mirrors: when a save counts as committed (what `save(wait=True)` returns, the newest durable step):
    "one" once one location committed it, "all" once every location has it (the persister then waits for the
    mirrors' copies, bounded by `persist_timeout_s`, and a save requested meanwhile meets `when_busy`)."""

    def __post_init__(self) -> None:
        auto_or_int("checkpoint_every", self.every)
        if not isinstance(self.overlap, bool):
            raise ConfigError(f"checkpoint_overlap must be True or False, got {self.overlap!r}")
        seconds("expected_mtbf_s", self.expected_mtbf_s)
        positive_int("keep_last", self.keep_last)
        positive_int("full_every", self.full_every)
        seconds("persist_timeout_s", self.persist_timeout_s)
        seconds("failover_s", self.failover_s)
        one_of("when_busy", self.when_busy, ("skip", "wait"))
        one_of("durable_in", self.durable_in, ("one", "all"))
        if not str(self.dir):
            raise ConfigError("checkpoint_dir must not be empty")
        self.mirror_specs()

    def mirror_specs(self) -> list[dict[str, Any]]:
        """`mirrors` as the persister takes them: [{"url", "options"}], each checked; without any, those of
        `stalwart run --mirror` (MIRRORS_ENV)."""
        if isinstance(self.mirrors, str | os.PathLike | dict):
            raise ConfigError(f"mirrors must be a list of locations, got {self.mirrors!r}")
        launched = [line.strip() for line in os.environ.get(MIRRORS_ENV, "").splitlines() if line.strip()]
        specs = []
        for m in self.mirrors or launched:
            spec = dict(m) if isinstance(m, dict) else {"url": os.fspath(m), "options": None}
            url, options = spec.get("url"), spec.get("options")
            if not isinstance(url, str | os.PathLike) or not os.fspath(url) or set(spec) - {"url", "options"}:
                raise ConfigError(f"each of mirrors must be a path, a URL or {{'url': ..., 'options': ...}}, got {m!r}")
            if options is not None and not isinstance(options, dict):
                raise ConfigError(f"a mirror's options must be a dict, got {options!r}")
            if os.fspath(url) == os.fspath(self.dir):
                raise ConfigError(f"mirror {os.fspath(url)} is checkpoint_dir itself")
            specs.append({"url": os.fspath(url), "options": options})
        return specs


@dataclass(kw_only=True, slots=True)
class SnapshotOptions:
    every: int | str = "auto"
    """`snapshot_every`: under `stalwart run`, copy the training state into node shared memory every this many
    steps (0: never). Those snapshots outlive a dead worker, so a restart resumes from the newest one held by
    every rank instead of the durable checkpoint: nothing is read from storage, and only the steps since that
    snapshot are redone. The cost is one memory copy of this rank's state per snapshot (`snapshot_s` in step_done
    events). "auto" (the default): as often as `snapshot_budget` allows, from the measured step time and snapshot
    cost (policy/snapshot.py), so the copy costs about that fraction of training time whatever the model size; a
    `snapshot_interval` event records each choice and its inputs. 1: every step, whatever it costs."""
    budget: float = 0.01
    """`snapshot_budget`: with snapshot_every="auto", the fraction of training time memory snapshots may take on
    the training thread (0 < b < 1). Their whole cost is larger (the copy competes for memory bandwidth and
    caches), so 1% keeps the whole, with the durable checkpoints' stall, within a few percent (`stalwart bench
    overhead`; the figures are in docs/benchmarks.md)."""
    light_budget: float = 0.02
    """`light_snapshot_budget`: under light snapshots (`replicated_snapshot_every="auto"`), the fraction of step time
    a light snapshot every step may take before they are turned off for the run (0 < b < 1). Light snapshots have
    their own budget, apart from `snapshot_budget`, because they buy what full copies cannot at any interval: a
    failure that leaves a survivor redoes at most the interrupted step. Judged against the 1% snapshot budget,
    their measured cost sat close enough to it that they were kept at one judgment and turned off at a later one
    (docs/benchmarks.md); at 2% the memory tier takes at most 2.25% of the training thread (light snapshots plus
    the full copies' floor, a quarter of `snapshot_budget`)."""
    replicated_every: int | str = "auto"
    """`replicated_snapshot_every`, light snapshots: under re-forming (`stalwart run`'s default), the survivors of
    a failure keep the replicated parameters and optimizer state in their own memory, so a snapshot need copy
    only the small per-rank rest (a light snapshot, taken at the optimizer step behind a barrier, see
    job/step_commit.py) and a restart takes the replicated state from a survivor: at most the interrupted step is
    redone. The whole state is still copied now and then, for a failure that leaves no survivor. "auto" (the
    default, with snapshot_every="auto" and more than one rank): a light snapshot every step while it costs at
    most `light_snapshot_budget`, and full copies within what it leaves of the budget, at least a quarter of it
    (policy/snapshot.py). N > 1: light snapshots, full copies every N snapshots. 1: every snapshot is full. CPU
    tensors only (on GPUs every snapshot is full); see docs/architecture.md (L1)."""
    peer_replicas: int = 1
    """Under `stalwart run` on several nodes, keep each rank's memory snapshot also in the memory of this many
    ranks on other nodes (L3, 0 to 3; 0: off), so that the ranks of a lost node resume from memory instead of the
    durable checkpoint. Each snapshot is then also sent over the network: with full snapshots the rank's share of
    the whole state, with light ones (`replicated_snapshot_every` > 1) only the small per-rank rest. Off on a
    single node."""

    def __post_init__(self) -> None:
        auto_or_int("snapshot_every", self.every, minimum=0)
        fraction("snapshot_budget", self.budget)
        fraction("light_snapshot_budget", self.light_budget)
        auto_or_int("replicated_snapshot_every", self.replicated_every)
        if not _is_int(self.peer_replicas) or not 0 <= self.peer_replicas <= MAX_REPLICAS:
            raise ConfigError(f"peer_replicas must be an integer from 0 to {MAX_REPLICAS}, got {self.peer_replicas!r}")


@dataclass(kw_only=True, slots=True)
class GuardOptions:
    nonfinite_grads: str = "skip"
    """The numeric guard (detect/numeric.py): at each step's optimizer step the tracked optimizers' gradient norm
    is taken, and if it is NaN or infinite, "skip" (the default) drops the update on every rank (parameters and
    optimizer state stay as they were, a `nonfinite_gradients` event says so) and training goes on with the
    next batch; "off" applies it. Costs a read of a sample of each gradient per step (`grad_check_sample`), and
    the step's one read of a value to the host (detect/host_reads.py)."""
    grad_spike: str = "warn"
    """A finite gradient norm over `grad_spike_factor` times the mean of the last 100: "warn" (the default) writes a
    `grad_norm_spike` event and applies the update, "skip" drops it like a non-finite one ("rollback" is the same:
    the update was not applied, so there is nothing to go back from), "off" ignores it. It judges the same norm:
    with nonfinite_grads="off" the guard still reads it unless this is "off" too."""
    grad_spike_factor: float = 10.0
    grad_check_sample: int | None = 4096
    """Gradient elements the numeric guard reads per tensor (the first this many; a smaller tensor whole): a NaN or
    Inf from the data or the loss reaches every gradient upstream of it, so a sample sees it. None reads every
    element (exact; one read of all gradients per step, its cost in docs/benchmarks.md)."""
    max_skipped_steps: int = 5
    """After this many skipped updates in a row the job stops with one line and exit status 78 (training has
    diverged; `stalwart run` does not restart it)."""

    @property
    def on(self) -> bool:
        return self.nonfinite_grads != "off" or self.grad_spike != "off"

    def __post_init__(self) -> None:
        one_of("nonfinite_grads", self.nonfinite_grads, NONFINITE_POLICIES)
        one_of("grad_spike", self.grad_spike, SPIKE_POLICIES)
        above_one("grad_spike_factor", self.grad_spike_factor)
        positive_int("grad_check_sample", self.grad_check_sample, optional=True)
        positive_int("max_skipped_steps", self.max_skipped_steps)


@dataclass(kw_only=True, slots=True)
class DetectOptions:
    hang_timeout_s: float | None = None
    """Seconds this worker may go without a heartbeat inside `steps()` before `stalwart run` kills it as hung.
    None (the default): `stalwart run --hang-timeout`, whose default calibrates it from the step times
    (detect/hang.py). The first steps after a start and the saves it waits on always get a grace period."""
    loss_spike_factor: float | None = 5.0
    """A loss given to `job.report(loss=...)` over this many times the median of the last 100 is a `loss_spike`
    event; `loss_spike` says what follows. None: off."""
    loss_spike: str = "warn"
    """What a loss spike does (its update is already applied when the loss is reported): "warn" (the default) only
    the event, one step late (the loss is read with the next step's gradient norm, detect/host_reads.py);
    "rollback": every rank goes back to the newest snapshot or checkpoint from before that step and skips its
    batch (L0, recovery/rollback.py; costs one small all-gather and one read of the loss per step, to agree);
    "skip" is the same (the update is applied before the loss is known, so skipping the batch means going back);
    "off": not checked."""
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

    @property
    def loss_watched(self) -> bool:
        return self.loss_spike_factor is not None and self.loss_spike != "off"

    def __post_init__(self) -> None:
        seconds("hang_timeout_s", self.hang_timeout_s, optional=True)
        above_one("loss_spike_factor", self.loss_spike_factor, optional=True)
        one_of("loss_spike", self.loss_spike, LOSS_SPIKE_POLICIES)
        above_one("straggler_threshold", self.straggler_threshold, optional=True)
        one_of("straggler_policy", self.straggler_policy, STRAGGLER_POLICIES)
        positive_int("divergence_every", self.divergence_every, optional=True)


@dataclass(kw_only=True, slots=True)
class RecoveryOptions:
    max_rollbacks: int = 3
    """Rollbacks in a row (each within 100 steps of the previous one's trigger) before the job stops with one line
    and exit status 78. Rollbacks also follow non-finite parameters (a NaN the guard's sample missed) and replica
    divergence without a majority; 0 turns every rollback off (those stop the job instead)."""
    replicated: tuple[str, ...] | None = None
    """Tracked objects that are identical on every rank (a DDP model, its optimizer): each of their tensors is
    written once, by one rank, instead of once per rank, and a survivor hands them to a replacement. None (the
    default) picks tracked DistributedDataParallel modules and tracked modules a live DistributedDataParallel
    wraps (job/replicated.py), the optimizers over their parameters and those optimizers' LR schedulers.
    Per-rank objects are written by every rank."""
    allow_world_size_change: bool | None = None
    """Resume a checkpoint written at another world size: replicated objects load from their one copy, per-rank
    objects of rank r from rank r mod the old world size (right only if they are equal on every rank); the data
    position is global, so no sample is lost or repeated. None (the default) allows it when launched
    elastically (`stalwart run --nnodes MIN:MAX` with MIN < MAX)."""
    lr_scaling: str = "linear"
    """When the world size changes and the global batch scales with it (a ResumableLoader with
    `batch_size_per_rank`), multiply the tracked optimizers' learning rates (and their LR schedulers' base rates)
    by new/old world size ("linear": Goyal et al.'s rule for SGD), by its square root ("sqrt": the rule usually
    taken for Adam) or not at all ("none"). A fixed global batch (the default loader) changes no learning rate."""

    def __post_init__(self) -> None:
        if self.lr_scaling not in LR_RULES:
            raise ConfigError(f"lr_scaling must be one of {', '.join(LR_RULES)}, got {self.lr_scaling!r}")
        if not _is_int(self.max_rollbacks) or self.max_rollbacks < 0:
            raise ConfigError(f"max_rollbacks must be an integer >= 0, got {self.max_rollbacks!r}")
        if self.replicated is not None and (
            isinstance(self.replicated, str) or not all(isinstance(n, str) for n in self.replicated)
        ):
            raise ConfigError(f"replicated must be a tuple of tracked names, got {self.replicated!r}")


LR_RULES = {"linear": 1.0, "sqrt": 0.5, "none": 0.0}
"""RecoveryOptions.lr_scaling -> the power of new/old world size the learning rates are multiplied by."""


SECTIONS: dict[str, type[Any]] = {
    "checkpoint": CheckpointOptions,
    "snapshot": SnapshotOptions,
    "guard": GuardOptions,
    "detect": DetectOptions,
    "recovery": RecoveryOptions,
}
"""JobConfig's sections by name, as FLAT names them."""

FLAT: dict[str, tuple[str, str]] = {
    "checkpoint_dir": ("checkpoint", "dir"),
    "checkpoint_every": ("checkpoint", "every"),
    "expected_mtbf_s": ("checkpoint", "expected_mtbf_s"),
    "keep_last": ("checkpoint", "keep_last"),
    "full_every": ("checkpoint", "full_every"),
    "when_busy": ("checkpoint", "when_busy"),
    "checkpoint_overlap": ("checkpoint", "overlap"),
    "persist_timeout_s": ("checkpoint", "persist_timeout_s"),
    "storage_options": ("checkpoint", "storage_options"),
    "mirrors": ("checkpoint", "mirrors"),
    "failover_s": ("checkpoint", "failover_s"),
    "durable_in": ("checkpoint", "durable_in"),
    "snapshot_every": ("snapshot", "every"),
    "snapshot_budget": ("snapshot", "budget"),
    "light_snapshot_budget": ("snapshot", "light_budget"),
    "replicated_snapshot_every": ("snapshot", "replicated_every"),
    "peer_replicas": ("snapshot", "peer_replicas"),
    "nonfinite_grads": ("guard", "nonfinite_grads"),
    "grad_spike": ("guard", "grad_spike"),
    "grad_spike_factor": ("guard", "grad_spike_factor"),
    "grad_check_sample": ("guard", "grad_check_sample"),
    "max_skipped_steps": ("guard", "max_skipped_steps"),
    "hang_timeout_s": ("detect", "hang_timeout_s"),
    "loss_spike_factor": ("detect", "loss_spike_factor"),
    "loss_spike": ("detect", "loss_spike"),
    "straggler_threshold": ("detect", "straggler_threshold"),
    "straggler_policy": ("detect", "straggler_policy"),
    "divergence_every": ("detect", "divergence_every"),
    "max_rollbacks": ("recovery", "max_rollbacks"),
    "replicated": ("recovery", "replicated"),
    "allow_world_size_change": ("recovery", "allow_world_size_change"),
    "lr_scaling": ("recovery", "lr_scaling"),
    "log_every": ("", "log_every"),
    "collective_timeout_s": ("", "collective_timeout_s"),
}
"""Each option of `stalwart.Job(...)` as documented -> (its section, the field there; "" for JobConfig's own)."""


@dataclass(kw_only=True, slots=True)
class JobConfig:
    """A job's options in sections. Built from the flat options of `stalwart.Job` with `JobConfig.of(...)`."""

    checkpoint: CheckpointOptions
    snapshot: SnapshotOptions = field(default_factory=SnapshotOptions)
    guard: GuardOptions = field(default_factory=GuardOptions)
    detect: DetectOptions = field(default_factory=DetectOptions)
    recovery: RecoveryOptions = field(default_factory=RecoveryOptions)
    log_every: int = 50
    """Write a `step_done` event every this many steps (the first step after a start is always logged)."""
    collective_timeout_s: float = 300.0
    """Timeout of stalwart's own collectives and of a process group the job creates."""

    def __post_init__(self) -> None:
        positive_int("log_every", self.log_every)
        seconds("collective_timeout_s", self.collective_timeout_s)

    @classmethod
    def of(cls, checkpoint_dir: str | os.PathLike[str], **options: Any) -> JobConfig:
        """From `stalwart.Job`'s flat options (FLAT); ConfigError for a name it does not know."""
        sections: dict[str, dict[str, Any]] = {name: {} for name in (*SECTIONS, "")}
        sections["checkpoint"]["dir"] = checkpoint_dir
        for name, value in options.items():
            if name not in FLAT or name == "checkpoint_dir":
                raise ConfigError(f"stalwart.Job: unexpected keyword argument {name!r}")
            section, key = FLAT[name]
            sections[section][key] = value
        top = sections.pop("")
        return cls(**{name: SECTIONS[name](**fields) for name, fields in sections.items()}, **top)
