"""The agent's side of GPU health: poll the node's GPUs every few seconds and act on what the playbook says.

The agent calls `GpuWatch.due_actions()` from its monitor loop (no thread of its own). Telemetry and XIDs
become events (detect/gpu.py); an action comes back to the agent as (local rank, action, reason):

- restart_process: the worker on that GPU (local rank = GPU index, the usual one process per GPU) is killed,
  and the group re-forms or restarts as after any death;
- reset_gpu, drain_node, replace_hardware: the node is written to the exclusion list (supervisor/exclusion.py)
  and its workers are stopped without a restart, so the job goes on without this node (elastic runs) or
  stops with one line saying why.
Warning signs (`warnings()`: slowdown, rising ECC errors, rows pending remapping) are risks, not failures: the
agent raises the risk counter on its heartbeat board, and the workers agree on a checkpoint (detect/risk.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from stalwart.detect.gpu import ACTIONS, REPORT, RESTART_PROCESS, GpuMonitor
from stalwart.detect.gpu_providers import GpuProvider, ScriptedProvider, provider_from_env
from stalwart.errors import ConfigError
from stalwart.runtime.env import GPU_POLL_ENV
from stalwart.telemetry.events import EventLog

DEFAULT_POLL_S = 5.0


class GpuWatch:
    def __init__(self, provider: GpuProvider, events: EventLog, poll_s: float = DEFAULT_POLL_S) -> None:
        self._actions: list[tuple[int, str, str]] = []
        self._warnings: list[tuple[int, str]] = []
        self._monitor = GpuMonitor(
            provider,
            events,
            act=lambda i, action, why: self._actions.append((i, action, why)),
            warn=lambda i, why: self._warnings.append((i, why)),
        )
        self._provider = provider
        self._poll_s = poll_s
        self._next = 0.0
        events.emit("gpu_telemetry", provider=type(provider).__name__, devices=provider.device_count(), poll_s=poll_s)

    @classmethod
    def from_env(cls, events: EventLog) -> GpuWatch | None:
        """None when no provider is asked for or none can load (no GPU, no driver)."""
        try:
            poll_s = float(os.environ.get(GPU_POLL_ENV, DEFAULT_POLL_S))
        except ValueError as exc:
            raise ConfigError(f"{GPU_POLL_ENV} must be a number of seconds: {exc}") from exc
        if not 0 < poll_s < float("inf"):
            raise ConfigError(f"{GPU_POLL_ENV} must be a positive number of seconds, got {poll_s}")
        provider = provider_from_env()
        return cls(provider, events, poll_s) if provider is not None else None

    def due_actions(self) -> list[tuple[int, str, str]]:
        """Poll if a poll is due; the (GPU index, action, reason) the playbook asks for since the last call,
        the most severe first."""
        now = time.monotonic()
        if now < self._next:
            return []
        self._next = now + self._poll_s
        self._monitor.poll()
        actions, self._actions = self._actions, []
        return sorted((a for a in actions if a[1] != REPORT), key=lambda a: -ACTIONS.index(a[1]))

    def warnings(self) -> list[tuple[int, str]]:
        """The (GPU index, reason) warning signs of the polls since the last call (due_actions polls)."""
        warnings, self._warnings = self._warnings, []
        return warnings

    def close(self) -> None:
        self._provider.close()


def is_restart(action: str) -> bool:
    return action == RESTART_PROCESS


def visible_gpus(dev: Path = Path("/dev")) -> int:
    """The GPUs this node's workers can use: as a scripted telemetry provider says (the tests'); none with
    CUDA_VISIBLE_DEVICES set empty or to -1 (a CPU job on a GPU machine); else as NVML counts them, or where it does
    not load or telemetry is off, the NVIDIA device files in `dev` (so that turning telemetry off does not hide
    them)."""
    provider = provider_from_env()
    try:
        if isinstance(provider, ScriptedProvider):
            return provider.device_count()
        if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
            return 0
        if provider is not None:
            return provider.device_count()
    finally:
        if provider is not None:
            provider.close()
    return len([p for p in dev.glob("nvidia[0-9]*") if p.name[len("nvidia") :].isdigit()])


def warm_spares_off_for_gpus(events: EventLog, say: Callable[[str], object]) -> bool:
    """Whether `--warm-spares` is turned off because the node has GPUs: a warm spare runs the script's set-up as the
    node's last local rank, so its model would sit on that training rank's GPU (its memory), and given another rank
    it would train there (NCCL refuses two ranks on one GPU). Said in one line; the spares stay hot."""
    gpus = visible_gpus()
    if gpus == 0:
        return False
    events.emit("warm_spares_off", failures=0, why=f"{gpus} GPU(s) on this node")
    say(
        f"--warm-spares is off on this node's {gpus} GPU(s): a warm spare would run the set-up on a training rank's "
        "GPU; spares stay hot (a CPU job on a GPU machine: set CUDA_VISIBLE_DEVICES= to keep them warm)"
    )
    return True
