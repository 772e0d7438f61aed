"""`srun stalwart run ...` under Slurm: the node count, the rendezvous endpoint and id, and the processes per node
taken from the job step's SLURM_* variables, so a batch script needs no address or count of its own.

Why: on Slurm a user would otherwise compute the first node's address and the node count in the batch script
and pass them to every node (`--nnodes $SLURM_NNODES --rdzv-endpoint $(scontrol show hostnames ... | head -1)`),
and a mistake there hangs the rendezvous. The step's own variables say it all:

- `--nnodes`: the step's node count (SLURM_STEP_NUM_NODES, else SLURM_JOB_NUM_NODES / SLURM_NNODES);
- `--rdzv-endpoint`: the step's first node (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST, in Slurm's compressed
  hostlist form, expanded here) on port 29400 + job id mod 1000, so two jobs sharing a node do not collide;
- `--rdzv-id`: `slurm-<job id>.<step id>`, so two steps of one job never join each other's rendezvous;
- `--nproc-per-node`: SLURM_GPUS_ON_NODE when Slurm gave the step GPUs.

What the user passes (a flag, or torchrun's PET_* variable) wins; `--no-slurm` or `--standalone` turns all of
it off. One `stalwart run` must run on each node: several tasks on a node (`srun --ntasks-per-node=8`), or a
batch script calling `stalwart run` without srun on an allocation of several nodes, is one clear error.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from stalwart.errors import ConfigError

RDZV_BASE_PORT = 29400
"""torch's c10d rendezvous default; a job's endpoint is this plus its job id mod 1000."""

_FLAGS = {  # option -> its spellings and torchrun's environment variable
    "--nnodes": (("--nnodes",), "PET_NNODES"),
    "--rdzv-endpoint": (("--rdzv-endpoint", "--rdzv_endpoint"), "PET_RDZV_ENDPOINT"),
    "--rdzv-id": (("--rdzv-id", "--rdzv_id"), "PET_RDZV_ID"),
    "--nproc-per-node": (("--nproc-per-node", "--nproc_per_node"), "PET_NPROC_PER_NODE"),
}
_OFF = ("--no-slurm", "--standalone")


@dataclass(frozen=True, slots=True)
class SlurmStep:
    """The part of a Slurm job step that `stalwart run` needs, from its environment."""

    job_id: str
    step_id: str | None
    """None outside srun (the batch script itself)."""
    nodes: list[str]
    tasks_per_node: int
    gpus_on_node: int | None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SlurmStep | None:
        """The step this process runs in, or None when it is not under Slurm (no SLURM_JOB_ID)."""
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job_id:
            return None
        step_id = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
        listed = env.get("SLURM_STEP_NODELIST") if step_id is not None else None
        listed = listed or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        nodes = expand_hostlist(listed)
        count = env.get("SLURM_STEP_NUM_NODES") if step_id is not None else None
        count = count or env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
        if count and count.isdigit() and nodes and int(count) != len(nodes):
            raise ConfigError(f"Slurm says {count} nodes but its node list {listed!r} names {len(nodes)}")
        if not nodes:
            raise ConfigError(
                f"Slurm job {job_id} has no node list (SLURM_JOB_NODELIST); pass --nnodes and "
                "--rdzv-endpoint, or --no-slurm"
            )
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") if step_id is not None else None
        per_node = per_node or env.get("SLURM_NTASKS_PER_NODE") or "1"
        gpus = env.get("SLURM_GPUS_ON_NODE", "")
        return cls(job_id, step_id, nodes, _most_tasks(per_node), int(gpus) if gpus.isdigit() else None)

    @property
    def endpoint(self) -> str:
        port = RDZV_BASE_PORT + (int(self.job_id) % 1000 if self.job_id.isdigit() else 0)
        return f"{self.nodes[0]}:{port}"


def launch_defaults(step: SlurmStep, given: set[str]) -> list[str]:
    """The flags Slurm's step supplies that the user did not (`given`: the options set by flag or PET_*)."""
    if step.tasks_per_node > 1:
        raise ConfigError(
            f"Slurm runs {step.tasks_per_node} tasks of this step on a node; stalwart run starts "
            "the node's workers itself: run one per node (srun --ntasks-per-node=1)"
        )
    if step.step_id is None and len(step.nodes) > 1:
        raise ConfigError(
            f"this Slurm job has {len(step.nodes)} nodes but stalwart run was not started by srun: "
            "run `srun --ntasks-per-node=1 stalwart run ...` so that every node starts one"
        )
    wanted = {
        "--nnodes": str(len(step.nodes)),
        "--rdzv-endpoint": step.endpoint,
        "--rdzv-id": f"slurm-{step.job_id}.{step.step_id or 'batch'}",
        "--nproc-per-node": str(step.gpus_on_node) if step.gpus_on_node else "",
    }
    return [f"{flag}={value}" for flag, value in wanted.items() if value and flag not in given]


def given_options(argv: list[str], env: Mapping[str, str]) -> set[str]:
    """Which of the options Slurm could supply the user set, by flag (before the script) or PET_* variable."""
    used = {a.split("=")[0] for a in argv}
    return {flag for flag, (spellings, pet) in _FLAGS.items() if used & set(spellings) or pet in env}


def applies(argv: list[str]) -> bool:
    """Whether Slurm's defaults are wanted: not turned off by --no-slurm or --standalone (before the script)."""
    return not any(a.split("=")[0] in _OFF for a in argv)


def note(step: SlurmStep, added: list[str]) -> str:
    """One line for the launcher's output: what was taken from Slurm."""
    taken = " ".join(added) if added else "nothing (every option was given)"
    return f"Slurm job {step.job_id} step {step.step_id or 'batch'}, {len(step.nodes)} node(s): took {taken}"


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list (`node[01-03,07],gpu-a1`, `rack[1-2]-n[1-2]`) as names, in order."""
    names: list[str] = []
    for item in _top_level_split(text.strip()):
        names += _expand_one(item)
    return names


def _top_level_split(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if depth < 0:
            raise ConfigError(f"malformed Slurm host list {text!r}")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"malformed Slurm host list {text!r}")
    items.append(text[start:])
    return [item for item in items if item]


def _expand_one(item: str) -> list[str]:
    if "[" not in item:
        return [item]
    head, _, rest = item.partition("[")
    ranges, _, tail = rest.partition("]")
    values: list[str] = []
    for part in ranges.split(","):
        found = _RANGE.match(part)
        if found is None:
            raise ConfigError(f"malformed Slurm host list range {part!r} in {item!r}")
        low, high = found.group(1), found.group(2) or found.group(1)
        if int(high) < int(low):
            raise ConfigError(f"malformed Slurm host list range {part!r} in {item!r}")
        values += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return [name for value in values for name in _expand_one(head + value + tail)]


def _most_tasks(text: str) -> int:
    """The largest count in Slurm's tasks-per-node form (`2`, `2(x3),1`)."""
    counts = [int(m) for m in re.findall(r"(\d+)(?:\(x\d+\))?", text)]
    return max(counts, default=1)
