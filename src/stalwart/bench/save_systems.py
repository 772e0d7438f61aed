"""What `stalwart bench checkpoint` measures: the workload (a model and its AdamW state of a given size), the
machine's floor (a memory copy, an fsync'd write), and each system's save (torch.save, DCP's save and
async_save, stalwart) behind one interface, `Saver` (bench/checkpoint.py runs them, each in its own process)."""

from __future__ import annotations

import math
import os
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from stalwart.bench.common import GB
from stalwart.errors import BenchError

DEPTH = 24  # Linear layers: 48 parameter tensors, ~200 tensors with AdamW state, about a small GPT's count


BATCH = 8


WRITE_CHUNK = 16 * 2**20


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
