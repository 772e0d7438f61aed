"""`srun stalwart run` under Slurm (supervisor/slurm.py): what is taken from the job step's SLURM_* variables, what
the user's flags keep, the launches that cannot work, and a real run on this machine as a one-node step."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any

import pytest

from conftest import child_env, tiny_args
from stalwart.errors import ConfigError
from stalwart.supervisor import run_args, slurm

STEP = {  # what srun sets for a step of 4 nodes, one task each, 8 GPUs a node
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_NODELIST": "gpu[001-004]",
    "SLURM_STEP_NODELIST": "gpu[001-004]",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_STEP_NUM_NODES": "4",
    "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
    "SLURM_GPUS_ON_NODE": "8",
}


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("node01", ["node01"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("a[9-11],b1", ["a9", "a10", "a11", "b1"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("gpu[001-002]-ib,login", ["gpu001-ib", "gpu002-ib", "login"]),
    ],
)
def test_slurm_host_lists_expand_as_scontrol_does(text: str, names: list[str]) -> None:
    assert slurm.expand_hostlist(text) == names


@pytest.mark.parametrize("text", ["node[01-", "node[3-1]", "node[a-b]", "node]"])
def test_a_malformed_host_list_is_one_clear_error(text: str) -> None:
    with pytest.raises(ConfigError, match="malformed Slurm host list"):
        slurm.expand_hostlist(text)


def _parsed(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], *argv: str) -> Any:
    for key in [k for k in list(os.environ) if k.startswith(("SLURM_", "PET_"))]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return run_args.parse([*argv, __file__])


def test_a_step_supplies_nodes_rendezvous_and_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _parsed(monkeypatch, STEP)
    assert (args.nnodes, args.rdzv_endpoint, args.rdzv_id, args.nproc_per_node) == (
        "4", "gpu001:29856", "slurm-123456.0", "8",
    )  # fmt: skip
    assert args.rdzv_backend == "c10d"
    assert "Slurm job 123456 step 0, 4 node(s): took --nnodes=4" in args.scheduler_note


def test_what_the_user_gives_wins_over_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _parsed(monkeypatch, {**STEP, "PET_RDZV_ID": "mine"}, "--nnodes", "2:4", "--nproc_per_node=2")
    assert (args.nnodes, args.rdzv_id, args.nproc_per_node, args.rdzv_endpoint) == ("2:4", "mine", "2", "gpu001:29856")
    off = _parsed(monkeypatch, STEP, "--no-slurm", "--standalone")
    assert (off.nnodes, off.scheduler_note) == ("1:1", "")


def test_outside_slurm_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _parsed(monkeypatch, {})
    assert (args.nnodes, args.rdzv_endpoint, args.scheduler_note) == ("1:1", "", "")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"SLURM_STEP_TASKS_PER_NODE": "8(x4)"}, "run one per node"),
        ({"SLURM_STEP_ID": ""}, "was not started by srun"),  # the batch script itself, 4 nodes
        ({"SLURM_STEP_NUM_NODES": "3"}, "Slurm says 3 nodes"),
    ],
)
def test_launches_that_cannot_work_are_one_clear_error(
    monkeypatch: pytest.MonkeyPatch, change: dict[str, str], message: str
) -> None:
    env = {k: v for k, v in {**STEP, **change}.items() if v}
    with pytest.raises(ConfigError, match=message):
        _parsed(monkeypatch, env)


def test_a_one_node_step_runs_the_tiny_job_under_stalwart_run(launch: Any) -> None:
    """The whole launcher under a one-node step's variables, on this host (the endpoint's port given, so that
    the test uses a free one: the job id's port is checked above)."""
    host = socket.gethostname()
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    env = child_env(SLURM_JOB_ID="4242", SLURM_STEP_ID="3", SLURM_STEP_NODELIST=host, SLURM_JOB_NODELIST=host,
                    SLURM_STEP_NUM_NODES="1", SLURM_STEP_TASKS_PER_NODE="1",
                    PET_RDZV_ENDPOINT=f"{host}:{port}")  # fmt: skip
    job = launch(tiny_args("--steps", "4"), env=env)
    assert job.wait(120) == 0, job.output()
    assert "Slurm job 4242 step 3, 1 node(s): took --nnodes=1 --rdzv-id=slurm-4242.3" in job.output()
    assert sorted(job.results()) == [0, 1]
    bad = subprocess.run(
        [sys.executable, "-m", "stalwart", "run", *tiny_args("--steps", "4")],
        env={**env, "SLURM_STEP_TASKS_PER_NODE": "2"}, capture_output=True, text=True, timeout=60,
        cwd=job.workdir,
    )  # fmt: skip
    assert bad.returncode != 0 and "run one per node (srun --ntasks-per-node=1)" in bad.stderr
    assert "Traceback" not in bad.stderr
