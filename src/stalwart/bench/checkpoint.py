"""What a checkpoint costs a training loop: stalwart next to torch.save, DCP save and DCP async_save.

For a model plus AdamW state of a given size, one run measures
  - the floor: one in-memory copy of the state (the least any snapshot costs) and an fsync'd write of as many
    bytes (the least any durable checkpoint costs);
  - for every system: the stall (how long the training loop is blocked), the time until the checkpoint is
    durable, the write throughput that makes, the peak RSS and, for the asynchronous ones, how much slower a
    training step runs while a checkpoint is persisted in the background.

Each system runs in a process of its own (`python -m stalwart.bench.checkpoint --system NAME`, which prints one
JSON line): ru_maxrss is then the peak of that system alone, and a background writer or a leak of one system
cannot slow the next.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from stalwart.bench.common import (
    GB,
    MB,
    machine_info,
    make_run_dir,
    peak_rss_mb,
    seconds_text,
)
from stalwart.errors import BenchError, ConfigError
from stalwart.runtime.process import spawn

FLOOR = "floor"
SYSTEMS = ("torch_save", "dcp_save", "dcp_async_save", "stalwart")
DEPTH = 24  # Linear layers: 48 parameter tensors, ~200 tensors with AdamW state, about a small GPT's count
BATCH = 8
BASELINE_STEPS = 10
WRITE_CHUNK = 16 * 2**20
CHILD_TIMEOUT_S = 1800

Progress = Callable[[str], None]


# ---------------------------------------------------------------------------------------------- the workload


class Workload:
    """An MLP and its AdamW optimizer whose parameters plus exp_avg plus exp_avg_sq make about `size_bytes`."""

    def __init__(self, size_bytes: int, device: str = "cpu") -> None:
        torch.manual_seed(0)  # every system's process builds the same state
        self.cuda = device.startswith("cuda")
        params = size_bytes // 12  # fp32 parameters, exp_avg and exp_avg_sq: three 4-byte floats per parameter
        # DEPTH layers of width w hold DEPTH * (w*w + w) parameters.
        width = max(8, int((-DEPTH + math.sqrt(DEPTH**2 + 4 * params * DEPTH)) / (2 * DEPTH)))
        layers: list[torch.nn.Module] = []
        for _ in range(DEPTH):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*layers[:-1]).to(device)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.batch = torch.randn(BATCH, width).to(device)
        self.train_step()  # AdamW creates exp_avg and exp_avg_sq on its first step
        self.state_bytes = sum(t.numel() * t.element_size() for t in tensors_of(self.state(0)))

    def state(self, step: int) -> dict[str, Any]:
        """The state a training loop checkpoints, in the shape stalwart's Checkpointer takes."""
        return {"step": step, "objects": {"model": self.model.state_dict(), "optim": self.optim.state_dict()}}

    def train_step(self) -> float:
        """One forward, backward and AdamW step; returns its seconds (on a GPU, until the GPU has finished it)."""
        started = time.perf_counter()
        self.optim.zero_grad(set_to_none=True)
        self.model(self.batch).square().mean().backward()
        self.optim.step()
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - started


def tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nest of dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_of(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from tensors_of(value)


# ------------------------------------------------------------------------------------------------- the floor


def measure_floor(workload: Workload, directory: Path, repeats: int) -> dict[str, float]:
    """The least a snapshot (memcpy_s) and a durable write (write_gbps) of this many bytes can cost here."""
    tensors = list(tensors_of(workload.state(0)))
    write_s = statistics.median(raw_write_times(workload.state_bytes, directory, repeats))
    return {
        "memcpy_s": statistics.median(memcpy_times(tensors, repeats, pinned=workload.cuda)),
        "write_gbps": workload.state_bytes / write_s / GB,
    }


def memcpy_times(tensors: list[torch.Tensor], repeats: int, *, pinned: bool = False) -> list[float]:
    """Seconds to copy_ every tensor into one preallocated buffer, after one untimed copy. With `pinned` (the
    state is on a GPU): a pinned host buffer and asynchronous copies, the fastest device-to-host copy there is."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pinned)
    buffer.fill_(0)  # touch every page now, so page faults are not part of the copy
    pairs, offset = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        pairs.append((buffer[offset : offset + n], t.reshape(-1).view(torch.uint8)))
        offset += n
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        for dst, src in pairs:
            dst.copy_(src, non_blocking=pinned)
        if pinned:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return times[1:]


def raw_write_times(nbytes: int, directory: Path, repeats: int) -> list[float]:
    """Seconds to os.write `nbytes` to a new file and fsync it, after one untimed write."""
    chunk = memoryview(os.urandom(min(WRITE_CHUNK, nbytes)))  # random: nothing below can compress or dedupe it
    times = []
    for i in range(repeats + 1):
        path = directory / f"raw-{i}"
        started = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = nbytes
            while left:
                left -= os.write(fd, chunk[: min(left, len(chunk))])
            os.fsync(fd)
        finally:
            os.close(fd)
        times.append(time.perf_counter() - started)
        path.unlink()
    return times[1:]


# ----------------------------------------------------------------------------------------------- the systems


class Saver:
    """One checkpointing system. `save` returns when training may go on; `wait` when the checkpoint is durable."""

    asynchronous = False

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step}"

    def save(self, step: int, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def in_flight(self) -> bool:
        return False

    def wait(self) -> None:
        """Block until the last save is durable; a synchronous save already is."""

    def discard(self, step: int) -> None:
        """Remove what save(step) wrote, so a long run does not fill the disk (never timed)."""
        path = self.path(step)
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        """Release threads, processes and groups, so that the peak RSS includes every reaped child."""


class TorchSave(Saver):
    """torch.save to a file, then fsync: the plain synchronous baseline."""

    def save(self, step: int, state: dict[str, Any]) -> None:
        with open(self.path(step), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())


class DcpSave(Saver):
    """torch.distributed.checkpoint.save; its FileSystemWriter fsyncs the data files and the metadata."""

    def __init__(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp  # here: the other systems' processes need not load it

        super().__init__(directory)
        self.dcp = dcp
        join_one_rank_group(directory)

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.dcp.save(state, checkpoint_id=self.path(step))

    def close(self) -> None:
        leave_group()


class DcpAsyncSave(DcpSave):
    """torch.distributed.checkpoint.async_save: copies the state to CPU memory, then writes it in a thread."""

    asynchronous = True

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self._pending: Future[Any] | None = None

    def save(self, step: int, state: dict[str, Any]) -> None:
        response = self.dcp.async_save(state, checkpoint_id=self.path(step))
        self._pending = response if isinstance(response, Future) else response.upload_completion

    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None


class StalwartSave(Saver):
    """stalwart's Checkpointer. Uses the asynchronous API (wait_durable, persist_in_flight, close) where it
    exists, so the bench measures whichever version is installed: with the synchronous one, save() returns
    after the commit and stall equals durable."""

    asynchronous = True

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        # Imported here: a checkpoint module under construction must not break the other systems' processes.
        from stalwart.checkpoint import Checkpointer

        root = directory / "ckpt"
        root.mkdir()
        self._ck: Any = Checkpointer.standalone(root, keep_last=2, token="bench")
        self._fence: Any = None  # overlap_with(): the optimizer's fence, on a GPU
        self._wait: Callable[[], Any] | None = getattr(self._ck, "wait_durable", None)
        self._in_flight: Callable[[], Any] | None = getattr(self._ck, "persist_in_flight", None)

    def save(self, step: int, state: dict[str, Any]) -> None:
        if self._ck.save(step, state) is False:
            raise BenchError(f"stalwart skipped the save of step {step}")

    def in_flight(self) -> bool:
        return bool(self._in_flight()) if self._in_flight is not None else False

    def wait(self) -> None:
        if self._wait is not None and self._wait() is False:
            raise BenchError("stalwart's background persist did not commit")

    def discard(self, step: int) -> None:
        """Nothing: keep_last=2 prunes, as in a real job."""

    def overlap_with(self, optimizer: torch.optim.Optimizer) -> None:
        """On a GPU, as a Job does by default: the optimizer's tensors are copied under the next step."""
        from stalwart.checkpoint.save.overlap import UpdateFence

        self._fence = UpdateFence([optimizer])
        self._ck.overlap = self._fence

    def close(self) -> None:
        if self._fence is not None:
            self._fence.close()
        getattr(self._ck, "close", lambda: None)()


SAVERS: dict[str, type[Saver]] = {
    "torch_save": TorchSave,
    "dcp_save": DcpSave,
    "dcp_async_save": DcpAsyncSave,
    "stalwart": StalwartSave,
}


def join_one_rank_group(directory: Path) -> None:
    """Start a 1-rank gloo process group on a FileStore in `directory`.

    Without a process group DCP still saves, but warns on every call that it assumes a single process (and the
    test suite turns warnings into errors). One rank on a FileStore needs no free port, costs milliseconds, and
    runs DCP's ordinary path: plans gathered over the group, the coordinator writing the metadata.
    """
    import torch.distributed as dist

    store = dist.FileStore(str(directory / "pg-store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=120))


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


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
        progress(f"{size_bytes / MB:,.0f} MB of model + AdamW state {where}, {saves} timed saves per system, "
                 f"in {run_dir}")  # fmt: skip
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
    cmd = [sys.executable, "-m", "stalwart.bench.checkpoint", "--system", name]
    cmd += ["--size-bytes", str(size_bytes), "--saves", str(saves), "--dir", str(directory), "--device", device]
    # The child dies with this process, whatever ends it (a measurement writes gigabytes).
    proc = spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, death_signal=signal.SIGKILL)
    try:
        stdout, stderr = proc.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        proc.communicate()
        raise BenchError(f"measuring {name} took more than {CHILD_TIMEOUT_S} s; stopped it") from exc
    lines = stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        sys.stderr.write("".join(f"  | {line}\n" for line in stderr.splitlines()[-15:]))
        last = (stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
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
