"""GPU health (detect/gpu.py, supervisor/gpu_watch.py, supervisor/exclusion.py) through the scripted provider.

No GPU here: the provider is the seam. The scripted one replays samples and XIDs; NVML's is exercised on a lent
GPU (docs/benchmarks.md records what it printed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import child_env, tiny_args
from stalwart.detect.gpu import (
    DRAIN_NODE,
    REPORT,
    RESTART_PROCESS,
    GpuMonitor,
    GpuSample,
    NvmlProvider,
    ScriptedProvider,
    dcgm_metrics,
    playbook,
    provider_from_env,
)
from stalwart.detect.gpu_providers import XidEvent, add_to_script, write_script
from stalwart.errors import ConfigError
from stalwart.supervisor import exclusion
from stalwart.telemetry.events import EventLog, read_events


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_playbook_follows_the_xid_catalog() -> None:
    assert playbook(79).action == DRAIN_NODE and "fallen off the bus" in playbook(79).meaning
    assert playbook(13).action == RESTART_PROCESS
    assert playbook(63).action == REPORT
    # Checked against copies of NVIDIA's Xid Catalog spreadsheet (2026-11-24): IGNORE is report, RESET_GPU reset_gpu.
    assert [playbook(x).action for x in (38, 43, 46, 64, 109, 143)] == [REPORT, REPORT, *["reset_gpu"] * 4]
    assert playbook(99999).action == REPORT and "not in stalwart's playbook" in playbook(99999).meaning


def test_samples_and_xids_become_events_and_actions(tmp_path: Path) -> None:
    clock = _Clock()
    script = {
        "devices": 2,
        "samples": [
            {"at": 0, "index": 0, "temperature_c": 60, "throttle_reasons": [], "ecc_uncorrected_total": 0,
             "ecc_corrected_total": 10},
            {"at": 5, "index": 0, "temperature_c": 91, "throttle_reasons": ["hw_thermal_slowdown", "sw_power_cap"],
             "ecc_uncorrected_total": 2, "ecc_corrected_total": 500},
            {"at": 10, "index": 1, "remapped_rows_failed": True, "remapped_rows_uncorrectable": 3},
        ],
        "xids": [{"at": 5, "index": 1, "xid": 13}, {"at": 5, "index": 0, "xid": 63}],
    }  # fmt: skip
    log = tmp_path / "events.jsonl"
    acted: list[tuple[int, str, str]] = []
    monitor = GpuMonitor(ScriptedProvider(script, clock), EventLog(log), act=lambda *a: acted.append(a))
    monitor.poll()
    assert not list(read_events(log)), "a healthy first sample says nothing"
    clock.now = 5
    monitor.poll()
    clock.now = 10
    monitor.poll()
    events = [(e["event"], e["gpu"]) for e in read_events(log)]
    assert events == [
        ("gpu_throttled", 0),
        ("gpu_ecc_errors", 0),  # uncorrected
        ("gpu_ecc_errors", 0),  # corrected rising
        ("gpu_xid", 1),
        ("gpu_xid", 0),
        ("gpu_rows_remap", 1),
    ], events
    throttled = next(e for e in read_events(log) if e["event"] == "gpu_throttled")
    assert throttled["reasons"] == ["hw_thermal_slowdown"], "a power cap alone is not a health sign"
    assert acted == [(1, RESTART_PROCESS, "XID 13: " + playbook(13).meaning), (1, DRAIN_NODE, "row remapping failed")]


def test_not_supported_readings_are_absent_and_exported_under_dcgm_names() -> None:
    sample = GpuSample(index=0, temperature_c=55.0, ecc_uncorrected_total=0, remapped_rows_pending=False)
    assert dcgm_metrics(sample) == {
        "DCGM_FI_DEV_GPU_TEMP": 55.0,
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 0.0,
        "DCGM_FI_DEV_ROW_REMAP_PENDING": 0.0,
    }


def test_without_nvml_there_is_no_provider_and_a_bad_script_is_one_error(tmp_path: Path) -> None:
    default = provider_from_env({})  # NVML: None on a machine without a GPU or driver, as here
    assert default is None or isinstance(default, NvmlProvider)
    assert provider_from_env({"STALWART_GPU_TELEMETRY": "off"}) is None
    bad = tmp_path / "bad.json"
    bad.write_text('{"samples": [{"at": 0, "temprature": 3}]}')
    with pytest.raises(ConfigError, match="unknown sample fields"):
        provider_from_env({"STALWART_GPU_TELEMETRY": str(bad)})
    with pytest.raises(ConfigError, match="cannot read"):
        provider_from_env({"STALWART_GPU_TELEMETRY": str(tmp_path / "missing.json")})


def test_a_script_file_changed_after_the_start_is_read_again(tmp_path: Path) -> None:
    """How a test or the chaos harness brings a GPU fault at a chosen step: it adds the entry with `at` 0 when the
    job is there, and the provider, made long before, reads the changed file at its next call."""
    clock = _Clock()
    path = tmp_path / "gpu.json"
    write_script(path, {"devices": 2, "samples": [{"at": 0, "index": i, "temperature_c": 60} for i in (0, 1)]})
    provider = ScriptedProvider.from_file(path, clock)
    clock.now = 100
    assert provider.sample(1).temperature_c == 60 and provider.xids() == []
    hot = {"at": 0, "index": 1, "temperature_c": 92, "throttle_reasons": ["hw_thermal_slowdown"]}
    add_to_script(path, samples=[hot], xids=[{"at": 0, "index": 1, "xid": 13}, {"at": 150, "index": 0, "xid": 48}])
    assert provider.sample(1).temperature_c == 92, "of two samples due at the same time, the later in the script"
    assert provider.sample(0).temperature_c == 60
    assert provider.xids() == [XidEvent(1, 13)] and provider.xids() == []
    add_to_script(path, xids=[{"at": 0, "index": 0, "xid": 79}])
    assert provider.xids() == [XidEvent(0, 79)], "XID 13 was delivered before this re-read: not again"
    clock.now = 150
    assert provider.xids() == [XidEvent(0, 48)], "`at` still counts from the provider's start"
    # A writer that does not replace the file whole: half a script, then a complete one that is not a script.
    path.write_text('{"devices": 2, "samples": [{"at": 0, "ind')
    assert provider.sample(1).temperature_c == 92 and provider.xids() == [], "the previous script stays"
    path.write_text(json.dumps({"devices": 2, "samples": [{"at": 0, "index": 1, "temprature": 3}]}))
    assert provider.sample(1).temperature_c == 92 and provider.device_count() == 2
    cool = {"at": 0, "index": 1, "temperature_c": 70}
    write_script(path, {"devices": 2, "samples": [cool], "xids": [{"at": 0, "index": 1, "xid": 13}]})
    assert provider.sample(1).temperature_c == 70, "a good script after a bad one is read"
    assert provider.xids() == [], "still delivered once"
    assert not list(tmp_path.glob(".*.tmp")), "write_script leaves no temporary file behind"


def test_the_exclusion_list_round_trips_and_refuses_a_foreign_file(tmp_path: Path) -> None:
    path = tmp_path / "excluded.json"
    assert exclusion.excluded("n1", path) is None
    exclusion.exclude("GPU 0: XID 79", DRAIN_NODE, host="n1", path=path)
    got = exclusion.excluded("n1", path)
    assert got is not None and got.reason == "GPU 0: XID 79" and got.action == DRAIN_NODE
    assert [e.host for e in exclusion.listed(path)] == ["n1"]
    assert exclusion.clear("n1", path) and not exclusion.clear("n1", path)
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not stalwart's"):
        exclusion.excluded("n1", path)


# -- under stalwart run ------------------------------------------------------------------------------------------


def _script(tmp_path: Path) -> Path:
    """Two healthy GPUs; a test adds its fault at a step (`_at_step`)."""
    path = tmp_path / "gpu.json"
    write_script(path, {"devices": 2, "samples": [{"at": 0.0, "index": i, "temperature_c": 60} for i in (0, 1)]})
    return path


def _at_step(job: Any, step: int) -> None:
    """Wait until rank 0 has logged `step`. A GPU fault added to the script then (with `at` 0) comes after the
    workers' start whatever the load: a time after the launch, under load, can come before it, and a warning
    raised before a worker started is not news to it (detect/risk.py)."""
    job.wait_for(
        lambda: any(e.get("rank") == 0 and e["step"] >= step for e in job.events("step_done")),
        120,
        f"rank 0 at step {step}",
    )


def _env(tmp_path: Path, script: Path) -> dict[str, str]:
    return child_env(
        STALWART_GPU_TELEMETRY=str(script),
        STALWART_GPU_POLL_S="0.2",
        STALWART_EXCLUDE_FILE=str(tmp_path / "excluded.json"),
    )


def test_an_xid_that_needs_a_process_restart_replaces_the_worker_on_that_gpu(launch: Any, tmp_path: Path) -> None:
    script = _script(tmp_path)
    job = launch(tiny_args("--steps", "60", "--step-sleep", "0.1"), env=_env(tmp_path, script))
    _at_step(job, 10)
    add_to_script(script, xids=[{"at": 0, "index": 1, "xid": 13}])
    assert job.wait(180) == 0, job.output()
    assert [(e["gpu"], e["xid"], e["action"]) for e in job.events("gpu_xid")] == [(1, 13, RESTART_PROCESS)]
    acted = job.events("gpu_action")
    assert [(e["gpu"], e["rank"]) for e in acted] == [(1, 1)]
    assert "on GPU 1 after XID 13" in job.output()
    first, second = job.worker_pids(restart=0), job.worker_pids(restart=1)
    assert first[0] == second[0] and first[1] != second[1], "only the worker on GPU 1 was replaced"
    assert not (tmp_path / "excluded.json").exists()


def test_an_xid_that_needs_a_drain_excludes_the_node_and_the_next_launch_refuses(launch: Any, tmp_path: Path) -> None:
    script = _script(tmp_path)
    env = _env(tmp_path, script)
    job = launch(tiny_args("--steps", "200", "--step-sleep", "0.1"), env=env)
    _at_step(job, 10)
    add_to_script(script, xids=[{"at": 0, "index": 1, "xid": 79}])
    assert job.wait(180) == 1, job.output()
    assert "GPU 1: XID 79: GPU has fallen off the bus: drain node" in job.output()
    assert {e["restart"] for e in job.events("worker_spawned")} == {0}, "no restart on an excluded node"
    (node,) = job.events("node_excluded")
    assert node["action"] == DRAIN_NODE
    listed = json.loads((tmp_path / "excluded.json").read_text())["nodes"]
    assert list(listed) == [node["host"]]
    again = launch(tiny_args("--steps", "5"), name="again", env=env)
    assert again.wait(60) == 2, again.output()
    assert f"this node ({node['host']}) is excluded" in again.output() and "Traceback" not in again.output()


@pytest.mark.parametrize(("xid", "action"), [(48, "reset_gpu"), (79, DRAIN_NODE), (94, RESTART_PROCESS), (63, REPORT)])
def test_each_scripted_xid_gets_its_playbook_action_and_event(tmp_path: Path, xid: int, action: str) -> None:
    clock = _Clock()
    log = tmp_path / "events.jsonl"
    acted: list[tuple[int, str, str]] = []
    script = {"devices": 1, "xids": [{"at": 1, "index": 0, "xid": xid}]}
    monitor = GpuMonitor(ScriptedProvider(script, clock), EventLog(log), act=lambda *a: acted.append(a))
    monitor.poll()
    assert not acted and not list(read_events(log)), "not due yet"
    clock.now = 1
    monitor.poll()
    monitor.poll()
    (event,) = list(read_events(log))
    assert (event["event"], event["xid"], event["action"]) == ("gpu_xid", xid, action)
    assert [a[1] for a in acted] == ([] if action == REPORT else [action]), "acted on once, reports are not acted on"


def test_a_gpu_warning_sign_makes_every_rank_checkpoint_at_the_same_step(launch: Any, tmp_path: Path) -> None:
    """Thermal slowdown on GPU 1 (scripted, once rank 0 is at step 15): the agent raises the risk counter on its
    board, the ranks agree on it at a window's end and take a durable checkpoint there, between the regular ones."""
    script = _script(tmp_path)
    # Held in step 16 until the agent raised the risk (train_tiny --hold-at): the ranks agree on it at step 20,
    # whatever the load (120 steps run to outlast the agent's poll were a race with the job's end).
    args = tiny_args("--steps", "40", "--step-sleep", "0.05", "--every", "1000", "--hold-at", "16", "--hold-file", "go")
    job = launch(args, env=_env(tmp_path, script))
    _at_step(job, 15)
    add_to_script(
        script, samples=[{"at": 0, "index": 1, "temperature_c": 92, "throttle_reasons": ["hw_thermal_slowdown"]}]
    )
    job.wait_for(lambda: job.events("gpu_risk"), 120, "the agent to raise the risk")
    (job.workdir / "go").touch()
    assert job.wait(240) == 0, job.output()
    (warned,) = job.events("gpu_risk")
    assert warned["gpu"] == 1 and warned["reason"] == "slowdown (hw_thermal_slowdown)"
    # A straggler flag on a loaded machine is a risk checkpoint too; this test is about the GPU warning.
    taken = [e for e in job.events("risk_checkpoint") if e["reason"].startswith("a GPU warning")]
    assert {e["rank"] for e in taken} == {0, 1} and len({e["step"] for e in taken}) == 1, "every rank, one step"
    assert taken[0]["reason"].startswith("a GPU warning on the node of rank") and taken[0]["taken"]
    step = taken[0]["step"]
    assert step % 10 == 0 and step < 40
    assert (job.workdir / "ckpt" / f"step_{step:08d}").is_dir()


def test_warning_signs_are_told_apart_from_failures(tmp_path: Path) -> None:
    warned: list[tuple[int, str]] = []
    acted: list[tuple[int, str, str]] = []
    samples = [
        GpuSample(index=0, ecc_corrected_total=0, ecc_uncorrected_total=0),
        GpuSample(index=0, ecc_corrected_total=500, ecc_uncorrected_total=0, remapped_rows_pending=True),
        GpuSample(index=0, ecc_corrected_total=500, ecc_uncorrected_total=2, remapped_rows_failed=True),
    ]

    class Provider:
        def __init__(self) -> None:
            self.i = -1

        def device_count(self) -> int:
            return 1

        def sample(self, index: int) -> GpuSample:
            return samples[self.i]

        def xids(self) -> list[Any]:
            return []

        def close(self) -> None:
            pass

    provider = Provider()
    monitor = GpuMonitor(provider, EventLog(tmp_path / "e.jsonl"), act=lambda *a: acted.append(a),  # type: ignore[arg-type]
                         warn=lambda i, why: warned.append((i, why)))  # fmt: skip
    for i in range(3):
        provider.i = i
        monitor.poll()
    assert warned == [
        (0, "corrected ECC errors rising (500 since the last poll)"),
        (0, "rows pending remapping (a reset will apply them)"),
        (0, "2 new uncorrected ECC errors"),
    ]
    assert acted == [(0, DRAIN_NODE, "row remapping failed")]
