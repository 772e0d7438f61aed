"""Two `stalwart run` agents form one job through the c10d rendezvous, as two nodes would, and recover together."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from conftest import TINY, child_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_nodes_recover_from_a_killed_worker(launch: Any, tmp_path: Path) -> None:
    port = _free_port()
    job_args = [str(TINY), "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--steps", "20"]
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    common += ["--max-restarts", "3"]  # the default --rdzv-id, as torchrun users leave it
    env = child_env(STALWART_FAULTS="kill@rank=1,step=9")
    nodes = [launch([*common, *job_args], name=f"node{i}", env=env) for i in range(2)]
    for node in nodes:
        assert node.wait(180) == 0, node.output()
    for node in nodes:
        assert node.events("restarting"), "each node's agent restarted its worker"
        assert [e["step"] for e in node.events("resumed")] == [8]
    ranks = sorted(e["rank"] for node in nodes for e in node.events("worker_spawned") if e["restart"] == 0)
    assert ranks == [0, 1], "one global rank per node"

    single = launch(["--nproc-per-node", "2", str(TINY), "--ckpt", "ckpt1", "--out", "out1", "--steps", "20"])
    assert single.wait(120) == 0, single.output()
    two_nodes = json.loads((tmp_path / "out" / "rank0.json").read_text())
    one_node = json.loads((single.workdir / "out1" / "rank0.json").read_text())
    assert two_nodes["sha256"] == one_node["sha256"], "two nodes with a failure end where one clean node does"
