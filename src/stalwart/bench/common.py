"""What the bench commands share: sizes and their units, the run directory, the machine's description, the
arguments' types. One home, so that no bench command imports another's module for a helper."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import resource
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from stalwart.errors import BenchError, ConfigError
from stalwart.runtime.process import Forked, start_module

Progress = Callable[[str], None]
"""Where a bench command reports what it is doing (stderr), one line at a time."""

MB, GB = 10**6, 10**9  # decimal units, as disk throughput is quoted
MIN_SIZE = 1 * MB


def positive_int(text: str) -> int:
    """argparse type of the bench sub-commands' counts."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def seconds(text: str) -> float:
    """argparse type of a duration in seconds: a finite number, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 or more)")
    return value


def parse_size(text: str) -> int:
    """Bytes of state from '100MB', '1GB', '250MB' or '1.5GB' (decimal units, like the GB/s figures)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([MG])B?\s*", text, re.IGNORECASE)
    if match is None:
        raise ConfigError(f"{text!r} is not a size; give it like 100MB, 1GB or 250MB")
    size = int(float(match[1]) * (GB if match[2].upper() == "G" else MB))
    if size < MIN_SIZE:
        raise ConfigError(f"{text!r} is too small; give at least 1MB")
    return size


def parse_sizes(text: str) -> list[int]:
    """`--sizes 10MB,1GB` for argparse: each part as `parse_size` reads it."""
    try:
        return [parse_size(part) for part in text.split(",")]
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def size_text(n: int) -> str:
    """A size as the tables print it: 100 MB, 1 GB (decimal units)."""
    return f"{n / GB:.3g} GB" if n >= GB else f"{n / MB:.3g} MB"


def peak_rss_mb() -> float:
    """Peak RSS of this process or of its largest reaped child (stalwart may persist in a child process).

    Not reported apart: Linux starts a child's ru_maxrss at its parent's RSS when it was forked, so the
    children's figure alone would be the parent's size at spawn time, not the child's own use.
    """
    own, children = (resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return max(own, children) * 1024 / MB  # ru_maxrss is in KiB on Linux


def make_run_dir(parent: Path | None) -> tuple[Path, Path]:
    """A new directory for this run, and the top-most directory this call created (the only one removed later)."""
    if parent is None:
        run_dir = Path(tempfile.mkdtemp(prefix="stalwart-bench-"))
        return run_dir, run_dir
    parent = parent.absolute()
    if parent.exists() and not parent.is_dir():
        raise ConfigError(f"--dir {parent} is a file, not a directory")
    missing = first_missing(parent)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        run_dir = Path(tempfile.mkdtemp(prefix="stalwart-bench-", dir=parent))
    except OSError as exc:
        if missing is not None:
            shutil.rmtree(missing, ignore_errors=True)
        raise ConfigError(f"--dir {parent} is not writable: {exc.strerror or exc}") from exc
    return run_dir, missing or run_dir


@contextlib.contextmanager
def scratch_dir(parent: Path | None, prefix: str) -> Iterator[Path]:
    """A new directory for one run's processes, under `parent` when given (made if missing), removed afterwards
    with everything in it; a `parent` that cannot be made is one line (BenchError)."""
    if parent is not None:
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BenchError(f"--dir {parent} cannot be made: {exc.strerror or exc}") from exc
    with tempfile.TemporaryDirectory(prefix=prefix, dir=parent) as tmp:
        yield Path(tmp)


def first_missing(path: Path) -> Path | None:
    """The top-most ancestor of `path` (or `path` itself) that does not exist yet; None if it exists."""
    missing = None
    for p in (path, *path.parents):
        if p.exists():
            break
        missing = p
    return missing


def seconds_text(s: float) -> str:
    """Milliseconds below a second, seconds above: '14.3 ms', '1.88 s'."""
    return f"{s * 1e3:,.1f} ms" if s < 1 else f"{s:,.2f} s"


def machine_info(run_dir: Path) -> dict[str, Any]:
    """What the figures depend on: cores, torch, and the disk (a tmpfs measures memory, not a disk)."""
    import torch  # here: the bench commands answer a bad flag without importing torch (seconds of start-up)

    return {
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "dir": str(run_dir),
        "filesystem": filesystem_of(run_dir.resolve()),
    }


def filesystem_of(path: Path) -> str:
    """The type of the filesystem holding `path`, from /proc/mounts ('unknown' where there is none)."""
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, fields[2]
    except OSError:
        pass
    return kind


def free_port() -> int:
    """A TCP port free on loopback now (the rendezvous or store of runs the bench starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(module: str, world: int, args: list[str], logs: Path, what: str, timeout_s: float) -> None:
    """Run `world` ranks of `module` (each `python -m module *args`, with torchrun's variables for a gloo group on
    loopback and one thread each) to their end, their output in `logs`/rank<R>.log. Forked with torch imported
    where this process is one thread (runtime/process.py), else interpreters: each rank measures its own work, not
    its start. BenchError, with the failed rank's last lines, when one fails or all do not end within `timeout_s`
    (`what` names the run in the message)."""
    port = free_port()
    procs: list[subprocess.Popen[bytes] | Forked] = []
    outputs = [logs / f"{what.replace(' ', '-')}-rank{rank}.log" for rank in range(world)]
    try:
        for rank in range(world):
            env = {k: v for k, v in os.environ.items() if not k.startswith(("STALWART_", "TORCHELASTIC_", "PET_"))}
            env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            procs.append(start_module(module, args, env=env, out=outputs[rank]))
        codes = [p.wait(timeout_s) for p in procs]
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"{what} did not finish in {timeout_s:.0f} s") from exc
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        tail = outputs[codes.index(next(c for c in codes if c))].read_text()[-1500:]
        raise BenchError(f"{what} failed:\n{tail}")


def params_sha256(module: Any) -> str:
    """The sha256 of a module's state, the same bytes on every system: how the bench jobs say two runs ended alike.
    A DTensor (FSDP2) is gathered first, a collective every rank makes."""
    import hashlib

    import torch  # here: the bench commands answer a bad flag without importing torch

    digest = hashlib.sha256()
    for name, t in module.state_dict().items():
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        digest.update(name.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class TrainerStepClock:
    """The Trainer benches' jobs (trainer_job.py, lightning_job.py): rank 1 of the first start SIGKILLs itself as
    step `kill_at` + 1 begins (the time of the kill written to `<out>/kill.txt` first), and each step end sleeps
    `step_s` and appends "global step, wall time" to `<out>/steps-<pid>.txt`, which bench/trainer.py reads."""

    def __init__(self, out: Path, step_s: float, kill_at: int) -> None:
        self.out, self.step_s, self.kill_at = out, step_s, kill_at
        self.path = out / f"steps-{os.getpid()}.txt"
        first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.victim = kill_at >= 0 and os.environ.get("RANK") == "1" and first_start

    def begins(self, step: int) -> None:
        if self.victim and step == self.kill_at:
            (self.out / "kill.txt").write_text(f"{time.time()}\n")
            os.kill(os.getpid(), signal.SIGKILL)

    def ended(self, step: int) -> None:
        time.sleep(self.step_s)
        with open(self.path, "a") as f:
            f.write(f"{step} {time.time()}\n")


def trainer_job_args(systems: tuple[str, str]) -> argparse.Namespace:
    """The Trainer benches' jobs' command line (bench/trainer.py passes it); after `--setup-s` of sleep, `--out`
    made."""
    p = argparse.ArgumentParser()
    p.add_argument("--system", choices=systems, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-s", type=float, required=True)
    p.add_argument("--setup-s", type=float, required=True)
    p.add_argument("--kill-at", type=int, default=-1)
    args = p.parse_args()
    time.sleep(args.setup_s)
    args.out.mkdir(parents=True, exist_ok=True)
    return args
