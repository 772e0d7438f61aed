"""Copying tensors into host memory on a CUDA side stream, some of them left running under the next step.

Shared by the durable checkpoint's staging (save/staging.py) and the memory tier's slots (tiers/memory.py): both
copy a rank's tensors into views of one host buffer, and both may leave the copies of "stable" tensors (storages
that only an optimizer's step writes, save/overlap.py) running on the side stream while training goes on. The
caller then holds the returned event: nothing may read the destination, nor the compute stream write those
tensors, before it (UpdateFence.defer orders the next optimizer step after it on the GPU).

The destination memory is registered with CUDA through the same object (`register`, `unregister`: save/host_pin.py),
and only a registered ("pinned") destination gets copies left running.

`ThreadedSideCopy` is the same contract on a CPU: the stable tensors' copies run on a thread and the event is a
threading one; registering always succeeds. It exists for the tests (CI has no GPU) and is never chosen by the Job
on its own: a test passes it to a MemoryTier, or sets STALWART_TEST_THREADED_SIDE_COPY=1 for a job's workers,
which plugs it into the memory tier's seam (runtime/seams.SIDE_COPY, chaos/install.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from stalwart.checkpoint.save import host_pin
from stalwart.checkpoint.save.overlap import storage_key
from stalwart.runtime import seams

Pair = tuple[torch.Tensor, torch.Tensor]
"""(source tensor, destination view in host memory of the same dtype and shape)."""


class CopyDone(Protocol):
    """The end of copies left running: a torch.cuda.Event, or a ThreadDone."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class SideCopy:
    """One side stream (created on first use, on the sources' device) and the copies queued on it."""

    on_host = False
    """Whether copies left running run on the host (a thread): then CPU sources can be left copying too."""

    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None

    def register(self, buf: torch.Tensor, device: torch.device | None) -> bool:
        """Register the host buffer `buf` for copies from `device` (None: the current one); whether it is."""
        return host_pin.register(buf.data_ptr(), buf.numel(), device)

    def unregister(self, buf: torch.Tensor, device: torch.device | None) -> bool:
        """Undo `register`; False if CUDA still counts `buf` as registered (it must then stay mapped)."""
        return host_pin.unregister(buf.data_ptr(), device)

    def copy(self, pairs: Sequence[Pair], *, pinned: bool, stable: set[int] | None) -> CopyDone | None:
        """Copy every source into its destination. Returns None once all bytes are there, or, when `stable`
        names the storages of some CUDA sources and the destination is `pinned`, as soon as every other byte
        is: those copies still run, and the returned event marks their end."""
        if not pinned:
            stable = None
        now: list[Pair] = []
        later: list[Pair] = []
        host: list[Pair] = []
        devices = {t.device for t, _ in pairs if t.is_cuda}
        for pair in pairs:
            t = pair[0]
            if not t.is_cuda or len(devices) > 1:
                # Several GPUs in one process: each would need its own side stream and event; a blocking copy,
                # queued after that device's compute, is simple and correct (and rare enough to be slow).
                host.append(pair)
            elif stable is not None and storage_key(t) in stable:
                later.append(pair)
            else:
                now.append(pair)
        first = done = None
        if now or later:
            device = (now or later)[0][0].device
            if self._stream is None or self._stream.device != device:
                self._stream = torch.cuda.Stream(device=device)
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(device))  # sees every write queued before the copy
            with torch.cuda.stream(stream):
                for t, dst in now:
                    dst.copy_(t, non_blocking=pinned)
                if now:
                    first = torch.cuda.Event()
                    first.record(stream)
                for t, dst in later:
                    dst.copy_(t, non_blocking=True)
                    t.record_stream(stream)  # the allocator must not reuse its memory before the copy ran
                if later:
                    done = torch.cuda.Event()
                    done.record(stream)
        for t, dst in host:  # meanwhile the GPU's copies run
            dst.copy_(t)
        if first is not None:
            first.synchronize()
        return done


class ThreadDone:
    """A threading event with torch.cuda.Event's query() and synchronize() (ThreadedSideCopy's)."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def set(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()


class ThreadedSideCopy(SideCopy):
    """SideCopy's contract on a CPU, for tests: the copies of stable CPU sources run on a thread, started only
    once `release` is set (a test holds it to see what happens while a copy is still running). A source must
    not change before the event: the fence (UpdateFence with host=True) waits for it before an optimizer step,
    as the GPU's compute stream waits for a side stream."""

    on_host = True

    def __init__(self, release: threading.Event | None = None) -> None:
        super().__init__()
        self.release = release if release is not None else threading.Event()
        if release is None:
            self.release.set()
        self.threads: list[threading.Thread] = []
        self.registered = 0  # buffers registered and not unregistered
        self._count_lock = threading.Lock()

    def register(self, buf: torch.Tensor, device: torch.device | None) -> bool:
        with self._count_lock:  # (slots register on threads of their own)
            self.registered += 1
        return True

    def unregister(self, buf: torch.Tensor, device: torch.device | None) -> bool:
        with self._count_lock:
            self.registered -= 1
        return True

    def copy(self, pairs: Sequence[Pair], *, pinned: bool, stable: set[int] | None) -> CopyDone | None:
        if not pinned:
            stable = None  # as on a GPU: a copy into memory not yet registered is never left running
        later = [p for p in pairs if stable is not None and storage_key(p[0]) in stable]
        chosen = {id(p) for p in later}
        for pair in pairs:
            if id(pair) not in chosen:
                pair[1].copy_(pair[0])
        if not later:
            return None
        done = ThreadDone()

        def run() -> None:
            self.release.wait()
            with torch.no_grad():
                for t, dst in later:
                    dst.copy_(t)
            done.set()

        thread = threading.Thread(target=run, daemon=True, name="threaded-side-copy")
        thread.start()
        self.threads.append(thread)
        return done


def installed_side_copy() -> SideCopy | None:
    """The copier plugged into runtime/seams.SIDE_COPY (the tests' threaded stand-in), if any."""
    factory = seams.installed(seams.SIDE_COPY)
    side: SideCopy | None = factory() if factory is not None else None
    return side


def ended(done: CopyDone, wait_s: float | None) -> bool:
    """Whether the copies have ended, waiting for them for at most `wait_s` seconds (None: as long as it takes)."""
    if wait_s is None:
        done.synchronize()
        return True
    deadline = time.monotonic() + wait_s
    while not done.query():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True
