"""Running a job under a scenario's faults, and checking what it ended with.

A run is `stalwart run` in its own directory (the job's relative paths land there) and its own session, watched
through its event log. Step faults reach the job through STALWART_FAULTS; the harness sends time faults itself,
writing a `fault_injected` event for each (so detection latencies can be measured), and launches the node
again after it killed it, as a scheduler would (step faults are for the first launch only: a relaunched job
starts its restart count from 0 again). Every process a run started is ended by pid when it is over. GPU faults
reach the agent through its scripted telemetry (STALWART_GPU_TELEMETRY): those at a time are in the script from
the start, those at a step are added to it once rank 0 has logged that step (the agent reads it again).

Verification after the run: the launcher's exit status, every committed checkpoint verifies (checksums of every
shard), and the final checkpoint is bitwise the reference run's (every tensor's xxh3, and every rank's state
skeleton) when the scenario expects an identical result.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.chaos import netns
from stalwart.chaos.scenario import GPU_KINDS, HARNESS_KINDS, FaultSpec, Scenario
from stalwart.chaos.store_faults import StoreOutages, lose_region
from stalwart.detect.gpu_providers import add_to_script, write_script
from stalwart.runtime.env import EVENT_LOG_ENV, EXCLUDE_FILE_ENV, FAULTS_ENV, GPU_POLL_ENV, GPU_TELEMETRY_ENV
from stalwart.runtime.process import spawn
from stalwart.supervisor import launch_server, zygote
from stalwart.supervisor.launch_server import LaunchServer, ServedProcess
from stalwart.telemetry.events import EventLog

Progress = Callable[[str], None]
POLL_S = 0.05


@dataclass(slots=True)
class RunResult:
    directory: Path
    exit_code: int | None
    """The last launcher's exit status; None when the run timed out."""
    launches: int
    seconds: float
    sent: list[str] = field(default_factory=list)
    """The time faults the harness sent, in order."""

    @property
    def log(self) -> Path:
        return self.directory / "events.jsonl"


_SERVER: LaunchServer | None = None


def _launch_server() -> LaunchServer | None:
    """This process's launch server (supervisor/launch_server.py), started at its first use and again if it ended:
    a launch forked from it skips the 4-6 s of CPU a new interpreter spends on its imports, twenty times in the
    quick suite. None where forking is off (STALWART_ZYGOTE=0, not Linux): new interpreters then."""
    global _SERVER
    if not zygote.enabled():
        return None
    env = {k: v for k, v in os.environ.items() if k not in (FAULTS_ENV, EVENT_LOG_ENV)}
    _SERVER = launch_server.started(_SERVER, env)
    return _SERVER


class _Launch:
    def __init__(self, cmd: list[str], directory: Path, env: dict[str, str], name: str = "output") -> None:
        path = directory / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | ServedProcess
        netns, plain = launch_server.split_netns(cmd)  # a host's launch is forked into its namespace
        server = _launch_server() if plain[:3] == [sys.executable, "-m", "stalwart"] else None
        if server is not None:
            with contextlib.suppress(RuntimeError):  # the server ended: a new interpreter instead
                self.proc = server.start(plain[3:], env, directory, path, append=True, session=True, netns=netns)
                return
        out = open(path, "ab")  # noqa: SIM115 - the child holds it; closed below
        self.proc = spawn(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=directory, start_new_session=True)
        out.close()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@dataclass(slots=True)
class _Node:
    """One node's launch command and environment, and its current launch."""

    cmd: list[str]
    env: dict[str, str]
    name: str
    launch: _Launch | None = None
    code: int | None = None
    lost: bool = False
    """Killed for good by a `lose_node` fault: its exit does not count until an `add_node` launches it again."""

    def start(self, directory: Path) -> None:
        self.launch, self.code = _Launch(self.cmd, directory, self.env, self.name), None


def run_job(
    scenario: Scenario | None,
    job: list[str],
    directory: Path,
    progress: Progress,
    *,
    timeout_s: float = 600.0,
    nproc: int = 2,
    max_restarts: int = 20,
    launcher_args: tuple[str, ...] = (),
    hosts: int = 1,
) -> RunResult:
    """Run `job` (a script and its arguments) under `stalwart run` in `directory`, with the scenario's faults (None:
    the fault-free reference); on `hosts` = 2, as two nodes of `nproc` ranks each in network namespaces."""
    directory.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(netns.Hosts()) if hosts == 2 else None
        return _run(scenario, job, directory, progress, timeout_s, nproc, max_restarts, launcher_args, net)
    raise AssertionError("unreachable")  # for mypy: the with block returns


def _run(
    scenario: Scenario | None,
    job: list[str],
    directory: Path,
    progress: Progress,
    timeout_s: float,
    nproc: int,
    max_restarts: int,
    launcher_args: tuple[str, ...],
    net: netns.Hosts | None,
) -> RunResult:
    log = directory / "events.jsonl"
    chaos_log = EventLog(log, role="chaos")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TORCHELASTIC_", "PET_")) and k not in (FAULTS_ENV, EVENT_LOG_ENV)
    }
    env.update({EVENT_LOG_ENV: str(log), "PYTHONUNBUFFERED": "1"})
    if scenario is not None and scenario.step_faults():
        env[FAULTS_ENV] = scenario.step_faults()
    env[EXCLUDE_FILE_ENV] = str(directory / "excluded-nodes.json")  # a drained node stays this run's business
    gpu_script = directory / "gpu-script.json"
    if scenario is not None and any(f.kind in GPU_KINDS for f in scenario.faults):
        _write_gpu_script(scenario, gpu_script, nproc)
        env[GPU_TELEMETRY_ENV] = str(gpu_script)
        env[GPU_POLL_ENV] = "0.2"
    # The proof is bitwise: survivors wait for the replacement instead of training on shrunk (recovery/shrink.py).
    cmd = [
        sys.executable,
        "-m",
        "stalwart",
        "run",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        "--event-log",
        str(log),
        "--wait-for-replacement",
        *launcher_args,
    ]
    if net is None:
        nodes = [_Node([*cmd, *job], env, "output")]
    else:  # host 0 holds the rendezvous store; a new namespace has every port free
        port = random.randrange(20000, 60000)
        elastic = ["--nnodes", "1:2", "--replace-wait-s", "2"] if scenario and scenario.elastic else ["--nnodes", "2"]
        nodes = [
            _Node(
                [
                    *host.prefix(),
                    *cmd,
                    *elastic,
                    "--rdzv-endpoint",
                    f"{net[0].address}:{port}",
                    "--rdzv-conf",
                    f"is_host={int(i == 0)}",
                    "--local-addr",
                    host.address,
                    *job,
                ],
                {**env, "GLOO_SOCKET_IFNAME": host.device},
                f"output-host{i}",
            )
            for i, host in enumerate(net)
        ]
    schedule = _schedule(scenario, timeout_s) if scenario is not None else []
    at_steps = (
        sorted(
            ((f.step, f) for f in scenario.faults if f.kind in (*HARNESS_KINDS, *GPU_KINDS) and f.step is not None),
            key=lambda x: x[0],
        )
        if scenario is not None
        else []
    )
    progress_of: dict[str, int] = {"step": 0, "shrunk": 0, "mirrored": -1}
    store = StoreOutages(directory / (scenario.checkpoint_dir if scenario else "ckpt"), chaos_log, progress)
    started = time.monotonic()
    for node in nodes:
        node.start(directory)
        if net is not None and node is nodes[0]:
            time.sleep(1.0)  # the store's host first, as an operator starts a multi-node job
    result = RunResult(directory, None, 1, 0.0)
    workers: dict[int, int] = {}  # rank -> newest worker pid
    mends: list[tuple[float, int]] = []  # (when, host) a partition ends
    offset = 0
    try:
        while time.monotonic() - started < timeout_s:
            time.sleep(POLL_S)
            offset = _read_pids(log, offset, workers, progress_of)
            now = time.monotonic() - started
            due = []
            while schedule and schedule[0][0] <= now:
                due.append(schedule.pop(0)[1])
            if progress_of["mirrored"] < 0 and any(f.kind == "region_loss" for f in due):  # at a time, as at a step:
                schedule += [(now + POLL_S, f) for f in due if f.kind == "region_loss"]  # not before a mirror has one
                schedule.sort(key=lambda item: item[0])
                due = [f for f in due if f.kind != "region_loss"]
            for at in [a for a in at_steps if _reached(a[1], a[0], progress_of)]:
                at_steps.remove(at)
                due.append(at[1])
            store.mend_due(now, progress_of["step"])
            for when, host in [m for m in mends if m[0] <= now]:
                mends.remove((when, host))
                assert net is not None
                net.mend(host)
                chaos_log.emit("fault_ended", fault="partition", host=host, by="harness")
                progress(f"partition of host {host} mended")
            for spec in due:
                if spec.kind in GPU_KINDS:
                    _add_gpu_fault(spec, gpu_script, chaos_log)
                    result.sent.append(f"{spec.label}: added to the GPU telemetry script")
                    progress(f"{spec.label}: added to the GPU telemetry script")
                    continue
                if spec.kind == "store_outage":
                    until = spec.options.get("until_step")
                    result.sent.append(store.cut(spec.duration_s, None if until is None else int(until), now))
                    continue
                if spec.kind == "partition":
                    assert net is not None
                    if any(h == spec.host for _, h in mends):
                        continue  # already cut off
                    chaos_log.emit(
                        "fault_injected", fault="partition", host=spec.host, duration_s=spec.duration_s, by="harness"
                    )
                    net.cut(spec.host)
                    mends.append((now + spec.duration_s, spec.host))
                    result.sent.append(f"cut host {spec.host} off for {spec.duration_s:g} s")
                    progress(f"{spec.label}: host {spec.host} cut off")
                    continue
                node = nodes[spec.host if net is not None else 0]
                if spec.kind == "add_node":
                    if node.lost:
                        chaos_log.emit("fault_injected", fault="add_node", host=spec.host, by="harness")
                        node.lost = False
                        node.env.pop(FAULTS_ENV, None)
                        node.start(directory)
                        result.launches += 1
                        result.sent.append(f"launched host {spec.host} again")
                        progress(f"{spec.label}: host {spec.host} launched again")
                    continue
                if node.launch is None or node.code is not None:
                    continue  # that node has exited already
                relaunch = _send(spec, workers, node.launch, directory, scenario, chaos_log, result, progress)
                if spec.kind == "lose_node":
                    node.lost, relaunch = True, False
                    workers.clear()
                if relaunch:
                    node.env.pop(FAULTS_ENV, None)
                    node.start(directory)
                    result.launches += 1
                    workers.clear()
            for node in nodes:
                if node.code is None and node.launch is not None:
                    node.code = node.launch.proc.poll()
            counted = [node for node in nodes if not node.lost]
            if all(node.code is not None for node in counted):
                result.exit_code = next((n.code for n in counted if n.code != 0), 0)
                break
    finally:
        for node in nodes:
            if node.launch is not None and node.launch.proc.poll() is None:
                node.launch.kill()
        store.close()
        _read_pids(log, offset, workers, progress_of)
        for pid in workers.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        chaos_log.close()
    result.seconds = time.monotonic() - started
    return result


def _schedule(scenario: Scenario, horizon_s: float) -> list[tuple[float, FaultSpec]]:
    """(seconds after the launch, fault) of every time fault, Poisson ones drawn from the scenario's seed."""
    rng = random.Random(scenario.seed)
    times: list[tuple[float, FaultSpec]] = []
    for f in scenario.faults:
        if f.kind in GPU_KINDS:
            continue  # replayed by the agent's scripted GPU provider (_gpu_script)
        if f.at_s is not None:
            times.append((f.at_s, f))
        elif f.mtbf_s is not None:
            t = rng.expovariate(1 / f.mtbf_s)
            while t < horizon_s:
                times.append((t, f))
                t += rng.expovariate(1 / f.mtbf_s)
    return sorted(times, key=lambda x: x[0])


def _write_gpu_script(scenario: Scenario, path: Path, devices: int) -> None:
    """The scripted GPU telemetry the agent replays (detect/gpu_providers.ScriptedProvider): healthy devices, then
    the scenario's warnings and XIDs at their times (those at a step are added when it comes: _add_gpu_fault)."""
    samples: list[dict[str, Any]] = [{"at": 0.0, "index": i, "temperature_c": 60} for i in range(devices)]
    xids: list[dict[str, Any]] = []
    for f in scenario.faults:
        if f.kind in GPU_KINDS and f.at_s is not None:
            (samples if f.kind == "gpu_warning" else xids).append(_gpu_entry(f, f.at_s))
    write_script(path, {"devices": devices, "samples": samples, "xids": xids})


def _gpu_entry(spec: FaultSpec, at_s: float) -> dict[str, Any]:
    """A GPU fault's script entry: a thermal slowdown sample (gpu_warning) or an XID event (gpu_xid)."""
    gpu = int(spec.options.get("gpu", 0))
    if spec.kind == "gpu_warning":
        return {"at": at_s, "index": gpu, "temperature_c": 92, "throttle_reasons": ["hw_thermal_slowdown"]}
    return {"at": at_s, "index": gpu, "xid": int(spec.options["xid"])}


def _add_gpu_fault(spec: FaultSpec, path: Path, log: EventLog) -> None:
    """A GPU fault at a step: added to the script with `at` 0, due at once to the agent's provider, which reads
    the script again when it changes; its sample is the device's latest, after the healthy one also at 0."""
    entry = _gpu_entry(spec, 0.0)
    xid = {"xid": entry["xid"]} if "xid" in entry else {}
    log.emit("fault_injected", fault=spec.kind, gpu=entry["index"], by="harness", **xid)
    if spec.kind == "gpu_warning":
        add_to_script(path, samples=[entry])
    else:
        add_to_script(path, xids=[entry])


def _reached(spec: FaultSpec, step: int, progress: dict[str, int]) -> bool:
    """Whether a harness fault at `step` is due: rank 0 has logged that step, and, for an `add_node`, the job has
    gone on at fewer ranks first (launched before the survivors re-formed without it, the host would be their
    replacement, not a new node the job grows back to)."""
    return (
        progress["step"] >= step
        and (spec.kind != "add_node" or bool(progress["shrunk"]))
        and (spec.kind != "region_loss" or progress["mirrored"] >= 0)
    )


def _read_pids(log: Path, offset: int, workers: dict[int, int], progress: dict[str, int]) -> int:
    """Newest worker pid per rank, rank 0's newest completed step, and whether its newest change of world size
    shrank the job, from the log past `offset`."""
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return offset
    end = chunk.rfind(b"\n") + 1
    for line in chunk[:end].splitlines():
        with contextlib.suppress(ValueError):
            e = json.loads(line)
            if e.get("event") == "worker_started" and "rank" in e:
                workers[int(e["rank"])] = int(e["pid"])
            elif e.get("event") == "step_done" and e.get("rank") == 0:
                progress["step"] = max(progress["step"], int(e["step"]))
            elif e.get("event") == "mirrored":
                progress["mirrored"] = max(progress["mirrored"], int(e["step"]))
            elif e.get("event") == "world_resized" and e.get("rank") == 0:
                progress["shrunk"] = int(int(e["to"]) < int(e["from"]))
    return offset + end


def _send(
    spec: FaultSpec,
    workers: dict[int, int],
    launch: _Launch,
    directory: Path,
    scenario: Scenario | None,
    log: EventLog,
    result: RunResult,
    progress: Progress,
) -> bool:
    """Send one time fault; whether the node must be launched again."""
    if spec.kind in ("kill", "stop"):
        pid = workers.get(spec.rank)
        if pid is None:
            progress(f"{spec.label}: rank {spec.rank} has no worker yet; not sent")
            return False
        log.emit("fault_injected", fault=spec.kind, rank=spec.rank, target_pid=pid, by="harness")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL if spec.kind == "kill" else signal.SIGSTOP)
        result.sent.append(f"{spec.kind} rank {spec.rank} (pid {pid})")
        return False
    if spec.kind == "preempt":
        log.emit("fault_injected", fault="preempt", by="harness")
        launch.proc.send_signal(signal.SIGTERM)
        try:
            code = launch.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            launch.kill()
            code = None
        result.sent.append(f"SIGTERM to the launcher (exit status {code}); launched it again")
        progress(f"{spec.label}: launcher exited with status {code}, launching it again")
        return True
    if spec.kind == "corrupt_checkpoint":
        assert scenario is not None
        from stalwart.chaos.verdict import corrupt_newest  # torch: `stalwart chaos` checks its flags without it

        damaged = corrupt_newest(directory / scenario.checkpoint_dir)
        result.sent.append(f"corrupted {damaged}" if damaged else "no committed checkpoint to corrupt")
    lost = spec.kind == "lose_node"
    log.emit("fault_injected", fault=spec.kind, by="harness")
    mine = [pid for pid in workers.values() if not lost or _same_host(pid, launch.proc.pid)]
    launch.kill()
    for pid in mine:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    again = "" if lost else "; launched it again"
    if spec.kind == "region_loss":
        assert scenario is not None
        again = f", {lose_region(directory / scenario.checkpoint_dir)}; launched it again elsewhere"
    result.sent.append(f"killed the node (launcher and workers){again}")
    progress(f"{spec.label}: node killed{', not launched again' if lost else ', launching it again'}")
    return not lost


def _same_host(pid: int, launcher: int) -> bool:
    """Whether worker `pid` runs on the host of `launcher` (the same network namespace): a node lost for good takes
    its own workers only, the other host's train on."""
    try:
        return os.readlink(f"/proc/{pid}/ns/net") == os.readlink(f"/proc/{launcher}/ns/net")
    except OSError:
        return False
