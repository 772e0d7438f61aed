"""A chaos scenario: which faults a run of the user's job meets, when, and how the run is launched.

    # stalwart chaos scenario (TOML)
    [run]
    nproc_per_node = 2        # stalwart run's --nproc-per-node
    max_restarts = 20
    checkpoint_dir = "ckpt"   # the job's checkpoint directory, relative to each run's directory: verified after
                              # the run, and its final checkpoint compared with the reference run's
    timeout_s = 600           # a run that takes longer fails the scenario
    seed = 0                  # the Poisson faults' draws
    require_events = []       # events the run must write, e.g. ["risk_checkpoint"]
    job_args = []             # appended to the job's command line, e.g. ["--steps", "300"]
    hosts = 1                 # 2: two hosts in network namespaces (root), nproc_per_node workers each

    [[faults]]
    kind = "kill"             # see KINDS
    rank = 1
    step = 30                 # when: at a step (the job's own injector, exact), or
    # at_s = 12.5             # at seconds after the launch (the harness signals the process), or
    # mtbf_s = 20             # as a Poisson process with this mean time between faults, for the whole run

    [[faults]]
    kind = "gpu_warning"      # scripted GPU telemetry (GPU_KINDS)
    gpu = 1
    step = 15                 # once rank 0 has logged step 15 (the harness adds it to the script), or
    # at_s = 2.5              # at seconds after the launcher's start (in the script from the start)

Step faults go to the job through STALWART_FAULTS (chaos/faults.py, exact and reproducible); time faults are sent
by the harness to the process (chaos/harness.py). GPU faults go to the agent through its scripted telemetry: at
a step, the harness adds them to the script once rank 0 has logged that step, which under any load comes after
the workers have started (a warning raised before a worker started is not news to it, detect/risk.py); at_s
counts from the launcher's start, which a slow start can overtake. The scenario is checked whole before anything
runs: one error line names the first problem.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.errors import ConfigError

STEP_KINDS = ("kill", "hang", "slow", "nan", "spike", "flip", "storage_error", "kill_in_save", "stop")
"""Faults the job's injector fires at a step (`stop` is a hang by SIGSTOP)."""
HARNESS_KINDS = (
    "kill_node",
    "corrupt_checkpoint",
    "preempt",
    "partition",
    "lose_node",
    "add_node",
    "store_outage",
    "region_loss",
)
"""Faults only the harness can send; at a step, it sends them once rank 0 has logged that step."""
TIME_KINDS = ("kill", "stop", *HARNESS_KINDS)
"""Faults the harness sends at a time or as a Poisson process: SIGKILL or SIGSTOP to a rank's worker, SIGKILL to
the launcher and every worker (a node lost; the harness launches it again, as a scheduler would), and damage to
the newest committed checkpoint followed by a node loss (the restart must fall back to the one before), and
a preemption: SIGTERM to the launcher, which must end with a last checkpoint; the harness launches it again; and a
network partition: on a run over two hosts (`hosts = 2`), host `host`'s link taken down for `duration_s` seconds.
On two hosts the node-level faults hit host `host` (default 1: host 0 holds the rendezvous store, and a job
outlives the loss of any node but that one, as under torchrun). `lose_node` kills host `host` for good (no new
launch: the job must go on shrunk, `stalwart run --nnodes 1:2`), `add_node` launches it again later (the job
grows back; at a step, once rank 0 has logged it at fewer ranks); a scenario with either runs the hosts
elastically, with `--replace-wait-s 2`. `store_outage`: the checkpoint directory unreachable for `duration_s`
seconds (or until rank 0 has logged step `until_step`), its data kept; `region_loss`: every host and the
checkpoint directory lost, the job launched again with the same flags, once a checkpoint has reached a mirror
(chaos/store_faults.py; both want `--mirror` among the scenario's launcher_args)."""
ELASTIC_KINDS = ("lose_node", "add_node")
GPU_KINDS = ("gpu_warning", "gpu_xid")
"""Scripted GPU telemetry (detect/gpu_providers.py's scripted provider): a thermal slowdown on GPU `gpu` (a
warning sign: the job must take a risk checkpoint), or XID `xid` on it (the playbook's action: restart the worker
on that GPU, or exclude the node, kept in the run's own exclusion file). At a step (the harness adds it to the
script once rank 0 has logged that step) or at `at_s` after the launcher starts."""
EXPECTS = ("identical", "completes")
KINDS = tuple(dict.fromkeys((*STEP_KINDS, *TIME_KINDS, *GPU_KINDS)))
_OPTIONS = {
    "how",
    "ms",
    "errno",
    "times",
    "phase",
    "factor",
    "signal",
    "restart",
    "gpu",
    "xid",
    "host",
    "duration_s",
    "until_step",
}
PARTITION_S = 10.0
"""How long a partition lasts unless `duration_s` says."""


@dataclass(frozen=True, slots=True)
class FaultSpec:
    kind: str
    rank: int = 0
    step: int | None = None
    at_s: float | None = None
    mtbf_s: float | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        when = (
            f"step {self.step}"
            if self.step is not None
            else f"{self.at_s:g} s"
            if self.at_s is not None
            else f"every ~{self.mtbf_s:g} s"
        )
        who = (
            ""
            if self.kind in HARNESS_KINDS
            else f" GPU {self.options.get('gpu', 0)}"
            if self.kind in GPU_KINDS
            else f" rank {self.rank}"
        )
        if self.kind in ("partition", "store_outage"):
            who = f" host {self.host}" if self.kind == "partition" else ""
            until = self.options.get("until_step")
            who += f" until step {until}" if until is not None else f" for {self.duration_s:g} s"
        elif self.kind in HARNESS_KINDS and "host" in self.options:
            who = f" host {self.host}"
        return f"{self.kind}{who} at {when}"

    @property
    def host(self) -> int:
        """The host a node-level fault hits on a run over two hosts."""
        return int(self.options.get("host", 1))

    @property
    def duration_s(self) -> float:
        return float(self.options.get("duration_s", PARTITION_S))


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    faults: tuple[FaultSpec, ...]
    nproc_per_node: int = 2
    max_restarts: int = 20
    checkpoint_dir: str = "ckpt"
    timeout_s: float = 600.0
    seed: int = 0
    launcher_args: tuple[str, ...] = ()
    job_args: tuple[str, ...] = ()
    """Appended to the job's command line for this scenario (a longer run of the built-in job, `--steps 300`)."""
    """More `stalwart run` flags, e.g. ("--spares", "1")."""
    require_events: tuple[str, ...] = ()
    """Events the faulty run must have written (e.g. "risk_checkpoint" after a GPU warning)."""
    expect: str = "identical"
    """"identical": the final checkpoint must be bitwise the fault-free reference's; "completes": the run must end
    well with valid checkpoints (faults that change the result on purpose: a skipped NaN batch, a rollback)."""
    hosts: int = 1
    """2: the job runs on two hosts built from network namespaces (chaos/netns.py), `nproc_per_node` ranks on each;
    the reference runs on one host with as many ranks."""

    @property
    def world_size(self) -> int:
        return self.hosts * self.nproc_per_node

    @property
    def elastic(self) -> bool:
        """Whether the job may change its node count (a node lost for good, or one added)."""
        return any(f.kind in ELASTIC_KINDS for f in self.faults)

    def step_faults(self) -> str:
        """The STALWART_FAULTS value for the faults fired by the job at a step."""
        parts = []
        for f in self.faults:
            if f.step is None or f.kind in (*HARNESS_KINDS, *GPU_KINDS):
                continue
            kind, options = f.kind, dict(f.options)
            if kind == "stop":
                kind, options = "hang", {"how": "sigstop"}
            fields = [f"rank={f.rank}", f"step={f.step}", *(f"{k}={v}" for k, v in sorted(options.items()))]
            parts.append(f"{kind}@{','.join(fields)}")
        return ";".join(parts)


def load(path: Path) -> Scenario:
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"scenario {path} does not exist") from exc
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"scenario {path} cannot be read: {exc}") from exc
    return parse(raw, path.stem)


def parse(raw: dict[str, Any], name: str) -> Scenario:
    run = raw.get("run", {})
    unknown = sorted(set(raw) - {"run", "faults"})
    if unknown or not isinstance(run, dict):
        raise ConfigError(f"scenario {name}: unknown sections {unknown} (known: run, faults)")
    known = {
        "nproc_per_node",
        "max_restarts",
        "checkpoint_dir",
        "timeout_s",
        "seed",
        "launcher_args",
        "job_args",
        "expect",
        "require_events",
        "hosts",
    }
    if set(run) - known:
        raise ConfigError(f"scenario {name}: unknown [run] keys {sorted(set(run) - known)}")
    faults = tuple(_fault(f, name, i) for i, f in enumerate(raw.get("faults", []), 1))
    if not faults:
        raise ConfigError(f"scenario {name} lists no [[faults]]")
    try:
        scenario = Scenario(
            name,
            faults,
            nproc_per_node=int(run.get("nproc_per_node", 2)),
            max_restarts=int(run.get("max_restarts", 20)),
            checkpoint_dir=str(run.get("checkpoint_dir", "ckpt")),
            timeout_s=float(run.get("timeout_s", 600)),
            seed=int(run.get("seed", 0)),
            launcher_args=tuple(str(a) for a in run.get("launcher_args", ())),
            job_args=tuple(str(a) for a in run.get("job_args", ())),
            expect=str(run.get("expect", "identical")),
            require_events=tuple(str(e) for e in run.get("require_events", ())),
            hosts=int(run.get("hosts", 1)),
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"scenario {name}: bad [run] value ({exc})") from exc
    if scenario.expect not in EXPECTS:
        raise ConfigError(f"scenario {name}: expect must be one of {', '.join(EXPECTS)}, got {scenario.expect!r}")
    if scenario.nproc_per_node < 1 or scenario.timeout_s <= 0 or Path(scenario.checkpoint_dir).is_absolute():
        raise ConfigError(f"scenario {name}: nproc_per_node >= 1, timeout_s > 0 and a relative checkpoint_dir")
    if scenario.hosts not in (1, 2):
        raise ConfigError(f"scenario {name}: hosts must be 1 or 2, got {scenario.hosts}")
    for f in faults:
        if f.rank >= scenario.world_size and f.kind not in HARNESS_KINDS:
            raise ConfigError(f"scenario {name}: {f.label} names a rank outside {scenario.world_size} ranks")
        if f.kind == "partition" and scenario.hosts != 2:
            raise ConfigError(f"scenario {name}: a partition needs a run over two hosts ([run] hosts = 2)")
        if f.kind in ELASTIC_KINDS and (scenario.hosts != 2 or f.host == 0):
            raise ConfigError(
                f"scenario {name}: {f.kind} needs a run over two hosts ([run] hosts = 2) and host 1 "
                "(host 0 holds the rendezvous store)"
            )
        if f.kind in HARNESS_KINDS and not 0 <= f.host < scenario.hosts and "host" in f.options:
            raise ConfigError(f"scenario {name}: {f.label} names a host outside {scenario.hosts}")
        if f.kind == "preempt" and scenario.hosts == 2:
            raise ConfigError(f"scenario {name}: a preemption of one host of two is not supported yet")
        if f.kind in ("partition", "store_outage") and f.duration_s <= 0:
            raise ConfigError(f"scenario {name}: a {f.kind}'s duration_s must be positive")
        if f.kind in ("store_outage", "region_loss") and "--mirror" not in scenario.launcher_args:
            raise ConfigError(f'scenario {name}: {f.kind} wants a mirror ([run] launcher_args = ["--mirror", "DIR"])')
    return scenario


def _fault(raw: Any, name: str, index: int) -> FaultSpec:
    where = f"scenario {name}, fault {index}"
    if not isinstance(raw, dict) or raw.get("kind") not in KINDS:
        kind = raw.get("kind") if isinstance(raw, dict) else raw
        raise ConfigError(f"{where}: unknown kind {kind!r} (known: {', '.join(KINDS)})")
    extra = set(raw) - {"kind", "rank", "step", "at_s", "mtbf_s"} - _OPTIONS
    if extra:
        raise ConfigError(f"{where}: unknown keys {sorted(extra)}")
    whens = [k for k in ("step", "at_s", "mtbf_s") if k in raw]
    if len(whens) != 1:
        raise ConfigError(f"{where}: give exactly one of step, at_s, mtbf_s")
    kind = raw["kind"]
    if "step" in raw and kind not in (*STEP_KINDS, *HARNESS_KINDS, *GPU_KINDS):
        raise ConfigError(f"{where}: {kind} happens at a time (at_s or mtbf_s), not at a step")
    if kind in GPU_KINDS and "mtbf_s" in raw:
        raise ConfigError(f"{where}: {kind} happens once, at a step (step = N) or after the launch (at_s = seconds)")
    if kind == "gpu_xid" and not isinstance(raw.get("xid"), int):
        raise ConfigError(f"{where}: gpu_xid needs xid = an XID code")
    if "step" not in raw and kind not in (*TIME_KINDS, *GPU_KINDS):
        raise ConfigError(f"{where}: {kind} happens at a step (step = N)")
    try:
        spec = FaultSpec(
            kind,
            rank=int(raw.get("rank", 0)),
            step=int(raw["step"]) if "step" in raw else None,
            at_s=float(raw["at_s"]) if "at_s" in raw else None,
            mtbf_s=float(raw["mtbf_s"]) if "mtbf_s" in raw else None,
            options={k: raw[k] for k in _OPTIONS if k in raw},
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: bad value ({exc})") from exc
    if spec.rank < 0 or (spec.step is not None and spec.step < 0) or (spec.at_s is not None and spec.at_s < 0):
        raise ConfigError(f"{where}: rank, step and at_s must not be negative")
    if spec.mtbf_s is not None and spec.mtbf_s <= 0:
        raise ConfigError(f"{where}: mtbf_s must be positive")
    if "host" in raw and (not isinstance(raw["host"], int) or kind not in HARNESS_KINDS):
        raise ConfigError(f"{where}: host = 0 or 1 is for node-level faults ({', '.join(HARNESS_KINDS)})")
    if "duration_s" in raw and (
        not isinstance(raw["duration_s"], int | float) or kind not in ("partition", "store_outage")
    ):
        raise ConfigError(f"{where}: duration_s = seconds is for a partition or a store_outage")
    if "until_step" in raw and (not isinstance(raw["until_step"], int) or kind != "store_outage"):
        raise ConfigError(f"{where}: until_step = a step is for a store_outage")
    return spec
