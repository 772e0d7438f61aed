"""The pre-flight node check (detect/preflight.py, supervisor/preflight_gate.py): measured before a node joins; a node
that fails is excluded and `stalwart run` stops with one line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import child_env, stalwart, tiny_args
from stalwart.detect import preflight


def test_a_healthy_node_passes_with_its_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STALWART_NODE_FAULTS", raising=False)
    report = preflight.check(preflight.Limits(memory_mb=8, collective_mb=4, seconds=0.2), ranks=2)
    (device,) = report.devices
    assert device.device == "cpu" and device.tflops > 0 and device.memory_errors == 0
    assert report.collective_ranks == 2 and report.busbw_gbps is not None and report.busbw_gbps > 0
    assert report.failures == [] and report.action == ""


def test_a_bad_memory_cell_fails_the_node_for_repair(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STALWART_NODE_FAULTS", "bad_memory")
    report = preflight.check(preflight.Limits(memory_mb=8, seconds=0.1), ranks=1)
    assert report.devices[0].memory_errors == len(preflight.PATTERNS), "one flipped word per pattern"
    assert report.failures == ["cpu (cpu): 5 memory words read back wrong"]
    assert report.action == "replace_hardware"


def test_a_device_far_below_its_peers_or_a_floor_fails() -> None:
    def device(name: str, tflops: float) -> preflight.DeviceResult:
        return preflight.DeviceResult(name, "H100", tflops, 1 << 30, 0, 100.0)

    report = preflight.Report(devices=[device("cuda:0", 600), device("cuda:1", 610), device("cuda:2", 400)],
                              collective_ranks=3, busbw_gbps=20.0)  # fmt: skip
    preflight.judge(report, preflight.Limits(min_busbw_gbps=100))
    assert report.failures == [
        "cuda:2: 400 TFLOPS, under 0.8x the node's median (600)",
        "all-reduce among 3 ranks: 20 GB/s bus bandwidth, under the floor of 100",
    ]
    assert report.action == "drain_node"


def _preflight(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return stalwart("preflight", *args, env=child_env(**env))


def test_stalwart_preflight_by_hand(tmp_path: Path) -> None:
    listing = str(tmp_path / "excluded.json")
    ok = _preflight("--memory-mb", "8", "--seconds", "0.2", "--json", STALWART_EXCLUDE_FILE=listing)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["failures"] == []
    bad = _preflight("--memory-mb", "8", "--seconds", "0.2", "--exclude", STALWART_EXCLUDE_FILE=listing,
                     STALWART_NODE_FAULTS="bad_memory")  # fmt: skip
    assert bad.returncode == 1
    assert "pre-flight FAILED" in bad.stdout and "memory BAD" in bad.stdout
    assert json.loads((tmp_path / "excluded.json").read_text())["nodes"]
    wrong = _preflight("--memory-mb", "0", STALWART_EXCLUDE_FILE=listing)
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1 and "Traceback" not in wrong.stderr


def test_stalwart_run_checks_the_node_first_and_a_failing_one_never_joins(launch: Any, tmp_path: Path) -> None:
    env = child_env(STALWART_EXCLUDE_FILE=str(tmp_path / "excluded.json"))
    job = launch(["--preflight", "on", *tiny_args("--steps", "4")], env=env)
    assert job.wait(180) == 0, job.output()
    (checked,) = job.events("preflight")
    assert checked["collective_ranks"] == 2 and checked["failures"] == []
    assert "pre-flight passed" in job.output()

    slow = launch(["--preflight", "on", "--preflight-min-tflops", "1e9", *tiny_args("--steps", "4")], name="slow",
                  env=env)  # fmt: skip
    assert slow.wait(180) == 2, slow.output()
    assert not slow.events("worker_spawned"), "a node that fails never starts a worker"
    lines = [line for line in slow.output().splitlines() if "failed the pre-flight check" in line]
    assert len(lines) == 1 and "under the floor of 1e+09" in lines[0] and "Traceback" not in slow.output()
    (node,) = slow.events("node_excluded")
    assert node["action"] == "drain_node"
    again = launch(tiny_args("--steps", "4"), name="again", env=env)
    assert again.wait(60) == 2 and "is excluded since" in again.output()


def test_preflight_is_off_on_a_node_without_gpus_unless_asked(launch: Any) -> None:
    job = launch(tiny_args("--steps", "2"))
    assert job.wait(120) == 0, job.output()
    assert not job.events("preflight")
    wrong = launch(tiny_args("--steps", "2"), name="wrong", env=child_env(STALWART_PREFLIGHT="always"))
    assert wrong.wait(60) == 2
    assert "--preflight must be one of auto, on, off, got 'always'" in wrong.output()
    assert "Traceback" not in wrong.output()


def test_the_verdict_between_nodes_is_relative_to_the_healthy_links() -> None:
    from stalwart.supervisor.peer_check import judge

    healthy = judge({0: 10.0, 1: 9.0, 2: 11.0, 3: 10.5}, None)
    assert not healthy.slow_links and not healthy.suspects
    one_bad = judge({0: 10.0, 1: 9.0, 2: 0.5, 3: 0.6}, None)  # node 2's links: into 2 (1->2) and out of it (2->3)
    assert one_bad.slow_links == [(1, 2), (2, 3)] and one_bad.suspects == [2]
    pair = judge({0: 0.2, 1: 10.0}, None)  # two nodes: a slow link, but which end is to blame is unknowable
    assert pair.slow_links == [(1, 0)] and pair.suspects == []
    floor = judge({0: 3.0, 1: 3.2, 2: 2.9}, min_gbps=5.0)
    assert len(floor.slow_links) == 3 and floor.suspects == [0, 1, 2]
