"""What a failure costs a job under each system: detection, restart, restore, checkpoint stalls (seconds).

Why profiles: the simulator's answer is only as good as these numbers, so each says where it comes from.
`stalwart` takes this project's own measurements (docs/benchmarks.md, docs/chaos.md; the dates there), made on a
2-core VM with 2 ranks and, for the checkpoint stall, on a lent H100; they do not include what a 2,000-node
rendezvous adds, which nobody here could measure: give `--costs` with your own figures for that. `torchrun` is
the usual stack without stalwart: every interruption restarts the whole job from its last durable checkpoint,
hangs are found by the NCCL watchdog (PyTorch's default timeout, 10 minutes), checkpoints block training for the
whole torch.save. Numbers marked "assumed" are this module's choices, the same for both systems.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from stalwart.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    detect_crash_s: float
    """From a process dying to the job noticing."""
    detect_hang_s: float
    """From collectives blocking (a dead GPU, a cut link) to the job noticing."""
    process_restart_s: float
    """From noticing to training again, when the same hardware carries on (re-form or restart; no restore)."""
    node_swap_s: float
    """The same when a node is lost and a spare node takes its place."""
    node_wait_s: float
    """Extra wait for a replacement node when no spare is free (the scheduler finds one)."""
    repair_s: float
    """How long a failed node is away before it can serve as a spare again."""
    restore_memory_s: float
    """Loading the state from node memory or a peer's copy (used when `memory_tier`)."""
    restore_durable_s: float
    """Loading the state from durable storage."""
    memory_tier: bool
    """Whether process and node failures restore from memory (own node or a peer's copy) instead of storage."""
    snapshot_stall_s: float
    """The training stall of one memory snapshot."""
    checkpoint_stall_s: float
    """The training stall of one durable checkpoint (its blocking part)."""
    persist_s: float
    """From a durable checkpoint's stall to it being usable (written in the background)."""
    sdc_detect_s: float
    """From silent corruption to it being found (then the job rolls back past it)."""
    rendezvous_per_node_s: float = 0.0
    """Added to every restart per node in the job (a large job's rendezvous and process-group set-up)."""


STALWART = Profile(
    "stalwart",
    detect_crash_s=0.1,  # measured (docs/benchmarks.md, "The simulator's inputs"): a SIGKILLed rank noticed
    detect_hang_s=2.0,  # measured: a SIGSTOPped rank and a network partition
    process_restart_s=0.5,  # measured: kill to next step, bench recovery
    node_swap_s=4.0,  # measured: a lost node relaunched, to the next step (chaos kill_node)
    node_wait_s=600.0,  # assumed
    repair_s=2 * 24 * 3600.0,  # assumed: two days away for diagnosis and repair
    restore_memory_s=0.05,  # restore from node memory or the peer copy: 0.03-0.07 s (2 ranks)
    restore_durable_s=60.0,  # assumed (reading a 16k-GPU checkpoint back)
    memory_tier=True,
    snapshot_stall_s=0.112,  # measured on an H100, 5.8 GB state: the pinned device-to-host copy
    checkpoint_stall_s=0.112,  # the same copy; persisting runs in the background
    persist_s=60.0,  # assumed
    sdc_detect_s=60.0,  # the replica fingerprint check runs every 100 steps (about a minute of steps assumed)
)
TORCHRUN = Profile(
    "torchrun",
    detect_crash_s=5.0,  # the elastic agent's monitor interval and NCCL's abort of the survivors (assumed)
    detect_hang_s=600.0,  # the NCCL watchdog's default timeout in PyTorch: 10 minutes
    process_restart_s=300.0,  # assumed: a whole-job restart at scale (scheduling, imports, NCCL init)
    node_swap_s=300.0,  # the same restart; the replacement node joins it
    node_wait_s=600.0,  # assumed, as for stalwart
    repair_s=2 * 24 * 3600.0,
    restore_memory_s=0.0,
    restore_durable_s=60.0,
    memory_tier=False,
    snapshot_stall_s=0.0,
    checkpoint_stall_s=12.3,  # measured: torch.save of the same 5.8 GB on the H100
    persist_s=0.0,  # synchronous: usable when the stall ends
    sdc_detect_s=3600.0,  # assumed: found by a person looking at a loss curve
)
PROFILES = {p.name: p for p in (STALWART, TORCHRUN)}


def load_costs(base: Profile, path: Path) -> Profile:
    """`base` with the fields a JSON file gives replaced (`stalwart sim --costs FILE`). The file is an object of
    Profile fields, or what `stalwart bench recovery --json` printed on this machine: then stalwart's measured
    kill-to-next-step median (less the detection) becomes `process_restart_s` and its hang detection
    `detect_hang_s`."""
    try:
        given = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"--costs {path} does not exist") from exc
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--costs {path} is not a JSON object of seconds: {exc}") from exc
    if isinstance(given, dict) and isinstance(given.get("systems"), dict):
        given = _from_bench(given["systems"], base, path)
    known = {f.name for f in fields(Profile)} - {"name"}
    if not isinstance(given, dict) or set(given) - known:
        extra = sorted(set(given) - known) if isinstance(given, dict) else given
        raise ConfigError(f"--costs {path}: unknown fields {extra} (known: {', '.join(sorted(known))})")
    for key, value in given.items():
        ok = isinstance(value, bool) if key == "memory_tier" else isinstance(value, int | float) and value >= 0
        if not ok:
            wanted = "true or false" if key == "memory_tier" else "seconds >= 0"
            raise ConfigError(f"--costs {path}: {key} must be {wanted}")
    return replace(base, **given)


def _from_bench(systems: dict[str, object], base: Profile, path: Path) -> dict[str, float]:
    measured = systems.get("stalwart")
    if not isinstance(measured, dict) or not isinstance(measured.get("kill_to_step_s_median"), int | float):
        raise ConfigError(f"--costs {path}: a `stalwart bench recovery --json` report without stalwart's figures")
    costs = {"process_restart_s": max(float(measured["kill_to_step_s_median"]) - base.detect_crash_s, 0.0)}
    if isinstance(measured.get("hang_detect_s"), int | float):
        costs["detect_hang_s"] = float(measured["hang_detect_s"])
    return costs


def as_dict(profile: Profile) -> dict[str, object]:
    return asdict(profile)
