"""What a checkpoint costs a training loop: stalwart next to torch.save, DCP save and DCP async_save.

For a model plus AdamW state of a given size, one run measures
  - the floor: one in-memory copy of the state (the least any snapshot costs) and an fsync'd write of as many
    bytes (the least any durable checkpoint costs);
  - for every system: the stall (how long the training loop is blocked), the time until the checkpoint is
    durable, the write throughput that makes, the peak RSS and, for the asynchronous ones, how much slower a
    training step runs while a checkpoint is persisted in the background.

Each system runs in a process of its own (`python -m stalwart.bench.checkpoint --system NAME`, which prints one
JSON line): ru_maxrss is then the peak of that system alone, and a background writer or a leak of one system
cannot slow the next. That process is a fork of the bench where the bench runs one thread (OMP_NUM_THREADS=1: no
BLAS pool), else a new interpreter. Forks saved about 4 s of CPU each (the 8 MB run: 42.1 s -> 24.1 s for the
five), and start from less resident memory: 8 MB of state, torch 2.13 on the CPU (2026-11-29), setup_rss_mb 364
forked against 418 as an interpreter, the growth during the saves (peak - setup) the same within 3 MB per system.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from stalwart.bench.common import (
    GB,
    MB,
    Progress,
    machine_info,
    make_run_dir,
    peak_rss_mb,
    seconds_text,
)
from stalwart.bench.save_systems import (
    DcpAsyncSave,
    DcpSave,
    Saver,
    StalwartSave,
    TorchSave,
    Workload,
    measure_floor,
)
from stalwart.errors import BenchError, ConfigError
from stalwart.runtime.process import start_module

FLOOR = "floor"
SYSTEMS = ("torch_save", "dcp_save", "dcp_async_save", "stalwart")
BASELINE_STEPS = 10
CHILD_TIMEOUT_S = 1800
CHILD = "stalwart.bench.checkpoint"
"""The module each measurement runs as (`child_main`)."""


# ---------------------------------------------------------------------------------------------- the workload


# ------------------------------------------------------------------------------------------------- the floor


# ----------------------------------------------------------------------------------------------- the systems


SAVERS: dict[str, type[Saver]] = {
    "torch_save": TorchSave,
    "dcp_save": DcpSave,
    "dcp_async_save": DcpAsyncSave,
    "stalwart": StalwartSave,
}


# ------------------------------------------------------------------------------------------ one system's run


def time_saves(saver: Saver, workload: Workload, saves: int, first_step: int) -> tuple[list[float], list[float]]:
    """Stall and durable seconds of `saves` saves, after one untimed warm-up save (imports, thread pools and
    first page faults are one-off costs a long job never pays again).

    On a GPU a save may leave work that delays the next step (stalwart's copy overlapped with it, which that
    step's optimizer step waits for), so there the stall is the save's time plus whatever the next training step
    took beyond a quiet step's median: what the training loop loses in all."""
    stalls, durables = [], []
    quiet = statistics.median(workload.train_step() for _ in range(BASELINE_STEPS)) if workload.cuda else 0.0
    for i in range(saves + 1):
        step = first_step + i
        state = workload.state(step)
        started = time.perf_counter()
        saver.save(step, state)
        stall = time.perf_counter() - started
        if workload.cuda:
            stall += max(0.0, workload.train_step() - quiet)
        saver.wait()
        durable = time.perf_counter() - started
        saver.discard(step - 1)
        if i:
            stalls.append(stall)
            durables.append(durable)
    return stalls, durables


def background_slowdown(saver: Saver, workload: Workload, saves: int, first_step: int) -> float:
    """Median training-step time while a save is persisted in the background, over the median with none.

    After each save, steps run until it is durable, and at least one: a save that returns durable (a
    synchronous one) is then measured on the step right after it, which shows any cost it leaves behind.
    """
    for _ in range(2):
        workload.train_step()
    quiet = [workload.train_step() for _ in range(BASELINE_STEPS)]
    busy = []
    for i in range(saves):
        step = first_step + i
        saver.save(step, workload.state(step))
        busy.append(workload.train_step())
        while saver.in_flight():
            busy.append(workload.train_step())
        saver.wait()
        saver.discard(step - 1)
    return statistics.median(busy) / statistics.median(quiet)


def measure_system(saver: Saver, workload: Workload, saves: int) -> dict[str, Any]:
    """Stall, durable time and throughput (medians), and the background slowdown of an asynchronous system."""
    try:
        stalls, durables = time_saves(saver, workload, saves, first_step=1)
        durable_s = statistics.median(durables)
        result: dict[str, Any] = {
            "stall_s": statistics.median(stalls),
            "durable_s": durable_s,
            "write_gbps": workload.state_bytes / durable_s / GB,
            "samples": {"stall_s": stalls, "durable_s": durables},
        }
        if saver.asynchronous:
            result["background_slowdown"] = background_slowdown(saver, workload, saves, first_step=saves + 2)
    finally:
        saver.close()
    return result


def measure(system: str, size_bytes: int, saves: int, directory: Path, device: str = "cpu") -> dict[str, Any]:
    """Everything about one system (or the floor), measured in this process."""
    directory.mkdir()
    workload = Workload(size_bytes, device)
    result: dict[str, Any] = {"system": system, "state_bytes": workload.state_bytes, "setup_rss_mb": peak_rss_mb()}
    if system == FLOOR:
        result.update(measure_floor(workload, directory, max(3, saves)))
    else:
        saver = SAVERS[system](directory)
        if workload.cuda and isinstance(saver, StalwartSave):
            saver.overlap_with(workload.optim)
        result.update(measure_system(saver, workload, saves))
    result["peak_rss_mb"] = peak_rss_mb()
    return result


# ------------------------------------------------------------------------------------------- the whole bench


def run_bench(
    size_bytes: int, saves: int, parent: Path | None, progress: Progress, device: str = "cpu"
) -> dict[str, Any]:
    """Measure the floor and every system, each in its own process, and return the report."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA device on this machine")
    run_dir, created = make_run_dir(parent)
    started = time.perf_counter()
    try:
        machine = machine_info(run_dir)
        machine["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        where = f"on {machine['device']}" if device == "cuda" else "on the CPU"
        progress(
            f"{size_bytes / MB:,.0f} MB of model + AdamW state {where}, {saves} timed saves per system, in {run_dir}"
        )
        results = {
            name: run_child(name, size_bytes, saves, run_dir / name, progress, device) for name in (FLOOR, *SYSTEMS)
        }
    finally:
        shutil.rmtree(created, ignore_errors=True)
    return build_report(results, saves, machine, time.perf_counter() - started)


def run_child(
    name: str, size_bytes: int, saves: int, directory: Path, progress: Progress, device: str = "cpu"
) -> dict[str, Any]:
    """Run `python -m stalwart.bench.checkpoint --system NAME` and return the JSON line it prints."""
    progress(f"{name}: started")
    started = time.perf_counter()
    args = ["--system", name, "--size-bytes", str(size_bytes), "--saves", str(saves), "--dir", str(directory)]
    args += ["--device", device]
    out, err = directory.with_name(f"{name}.out"), directory.with_name(f"{name}.err")
    # Forked with torch imported where this process is one thread (runtime/process.py), else an interpreter: either
    # way the child dies with this process, whatever ends it (a measurement writes gigabytes). A fork's peak RSS
    # starts at this process's RSS then, about what a new interpreter has once it imported torch.
    proc = start_module(CHILD, args, env=dict(os.environ), out=out, err=err)
    try:
        proc.wait(CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        proc.wait()
        raise BenchError(f"measuring {name} took more than {CHILD_TIMEOUT_S} s; stopped it") from exc
    lines = out.read_text(errors="replace").strip().splitlines()
    if proc.returncode != 0 or not lines:
        stderr_lines = err.read_text(errors="replace").splitlines()
        sys.stderr.write("".join(f"  | {line}\n" for line in stderr_lines[-15:]))
        last = ([line for line in stderr_lines if line.strip()] or [f"exit status {proc.returncode}"])[-1]
        raise BenchError(f"measuring {name} failed: {last}")
    try:
        result: dict[str, Any] = json.loads(lines[-1])
    except json.JSONDecodeError as exc:
        raise BenchError(f"measuring {name} printed no result: {lines[-1][:200]!r}") from exc
    progress(f"{name}: done in {time.perf_counter() - started:.1f} s ({summary_of(result)})")
    return result


def summary_of(result: dict[str, Any]) -> str:
    if result["system"] == FLOOR:
        return f"memcpy {seconds_text(result['memcpy_s'])}, write {result['write_gbps']:.2f} GB/s"
    return f"stall {seconds_text(result['stall_s'])}, durable {seconds_text(result['durable_s'])}"


def build_report(
    results: dict[str, dict[str, Any]], saves: int, machine: dict[str, Any], elapsed_s: float
) -> dict[str, Any]:
    """The JSON object `--json` prints: state_bytes, floor, systems, then ratios, machine and run details."""
    sizes = {r["state_bytes"] for r in results.values()}
    if len(sizes) != 1:
        raise BenchError(f"the systems' processes built different states ({sorted(sizes)} bytes)")
    fl = results[FLOOR]
    floor = {"memcpy_s": fl["memcpy_s"], "write_gbps": fl["write_gbps"], "peak_rss_mb": fl["peak_rss_mb"]}
    keys = ("stall_s", "durable_s", "write_gbps", "peak_rss_mb", "background_slowdown", "setup_rss_mb", "samples")
    systems = {name: {k: results[name][k] for k in keys if k in results[name]} for name in SYSTEMS}
    return {
        "state_bytes": sizes.pop(),
        "floor": floor,
        "systems": systems,
        "ratios": ratios(floor, systems),
        "machine": machine,
        "saves": saves,
        "elapsed_s": elapsed_s,
    }


def ratios(floor: dict[str, float], systems: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The comparisons the bench exists for; each is a plain quotient of medians."""
    stall = {name: s["stall_s"] for name, s in systems.items()}
    return {
        "stall_vs_memcpy": {name: s / floor["memcpy_s"] for name, s in stall.items()},
        "write_vs_floor": {name: s["write_gbps"] / floor["write_gbps"] for name, s in systems.items()},
        "torch_save_stall_over_stalwart_stall": stall["torch_save"] / stall["stalwart"],
        "stalwart_stall_over_dcp_async_stall": stall["stalwart"] / stall["dcp_async_save"],
        "stalwart_background_slowdown": systems["stalwart"]["background_slowdown"],
    }


def child_main(argv: list[str]) -> int:
    """Internal mode: measure one system in this process and print one JSON line."""
    p = argparse.ArgumentParser(
        prog="python -m stalwart.bench.checkpoint",
        description="internal: measure one system and print one JSON line (run by 'stalwart bench checkpoint')",
    )
    p.add_argument("--system", required=True, choices=(FLOOR, *SYSTEMS))
    p.add_argument("--size-bytes", type=int, required=True)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--dir", required=True, help="a directory that does not exist yet; it is created")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args(argv)
    print(json.dumps(measure(args.system, args.size_bytes, args.saves, Path(args.dir), args.device)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
