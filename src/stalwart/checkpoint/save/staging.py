"""The snapshot half of a save: copy a rank's tensors into a staging area that the persister reads.

The staging area is one anonymous shared-memory file (memfd) per rank, allocated at the first save and reused
by every later save while the state fits (it grows, never shrinks). The training loop blocks only for the copy
into it. The persister process maps the same memory through /proc/<pid>/fd/<fd>, so nothing is copied again
and nothing is left in /dev/shm when either process dies.

CUDA tensors are copied with non-blocking copies on a side stream into staging memory registered with
cudaHostRegister (pinned), so the copy runs at PCIe bandwidth; the side stream first waits for the compute
stream, and the snapshot waits for the side stream before the persister may read. With `stable` (the storages
only an optimizer step writes, checkpoint/save/overlap.py) the copies of those tensors are left running: the
copy returns their completion event, and whoever hands staging to the persister waits for it first.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence

import torch

from stalwart.checkpoint.save.side_copy import CopyDone, SideCopy

ALIGN = 64
PAGE = 4096
MAX_VIEWS = 65536
_ABANDONED: list[object] = []
"""Staging memory closed while a copy into it was still queued on the GPU (a hung compute stream): kept mapped
for the rest of the process, since a DMA into freed memory would corrupt whatever reuses it."""
GROW_SLACK = 1.1
"""Headroom when (re)allocating, so a state that grows a little (an optimizer's first step) does not
reallocate at every save."""


def placed_in_staging(sizes: list[int]) -> tuple[list[int], int]:
    """Each tensor's offset in staging (tensors of `sizes` bytes, in order), and the bytes staging must hold."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total = aligned(total + size)
    return offsets, total


def aligned(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


ViewCache = dict[tuple[int, torch.dtype, torch.Size], torch.Tensor]


def typed_view(buf: torch.Tensor, cache: ViewCache, offset: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    """A view of the byte buffer `buf` at `offset` with a tensor's dtype and shape, laid out row-major, cached in
    `cache` (a job copies the same shapes to the same offsets every time; the cache is emptied, not grown without
    bound, if the layout keeps changing). Copying a tensor into it needs no reshaping of the source."""
    key = (offset, dtype, shape)
    view = cache.get(key)
    if view is None:
        view = buf[offset : offset + shape.numel() * dtype.itemsize].view(dtype).view(shape)
        if len(cache) > MAX_VIEWS:
            cache.clear()
        cache[key] = view
    return view


class Staging:
    """One rank's staging memory; `spec()` tells the persister how to map it."""

    def __init__(self) -> None:
        self.fd = -1
        self.size = 0
        self._map: mmap.mmap | None = None
        self._buf: torch.Tensor | None = None
        self._pinned = False
        self._pin_device: torch.device | None = None
        self._side = SideCopy()
        self._views: ViewCache = {}
        self._running: CopyDone | None = None  # the newest copy left running on the side stream

    def spec(self) -> dict[str, int]:
        return {"pid": os.getpid(), "fd": self.fd, "size": self.size}

    def ensure(self, nbytes: int, *, pin: bool, device: torch.device | None = None) -> None:
        """At least `nbytes` of staging, registered with CUDA if `pin` (for copies from `device`; None: the
        caller's current one; SideCopy.register). Callable from another thread than the training one."""
        if nbytes > self.size or self.fd < 0:
            self.close()
            size = max(aligned(int(nbytes * GROW_SLACK), PAGE), PAGE)  # whole pages: O_DIRECT writes it as is
            fd = os.memfd_create("stalwart-staging", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                self._map = mmap.mmap(fd, size)
            except BaseException:
                os.close(fd)
                raise
            self.fd, self.size = fd, size
            self._buf = torch.frombuffer(self._map, dtype=torch.uint8)
            # Fault the pages in now, not during the first timed copies. Also before cudaHostRegister: registering
            # untouched pages was measured slower than filling them first and then registering (docs/benchmarks.md).
            self._buf.zero_()
            self._pinned = False
        if pin and not self._pinned and torch.cuda.is_available():
            assert self._buf is not None
            self._pin_device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
            self._pinned = self._side.register(self._buf, self._pin_device)

    def copy_in(
        self, tensors: Sequence[torch.Tensor], offsets: Sequence[int], stable: set[int] | None = None
    ) -> CopyDone | None:
        """Copy every tensor to its offset. Returns None once all bytes are in staging (CUDA copies included),
        or, when `stable` names the storage of some CUDA tensors and staging is pinned, as soon as every other
        byte is: the copies of those tensors then still run on the side stream, and the event returned marks
        their end. Nothing may read staging, nor may the compute stream write those tensors, before it.

        Each tensor is copied into a view of staging with its own dtype and shape (laid out row-major, as a
        contiguous tensor is), so the source needs no reshaping and a non-contiguous tensor is copied once, not
        first made contiguous. The views are cached: a job saves the same shapes at the same offsets every time.
        """
        self.settle()
        with torch.no_grad():  # tensors that require grad are copied as data, with no autograd record
            return self._copy(tensors, offsets, stable if self._pinned else None)

    def _copy(
        self, tensors: Sequence[torch.Tensor], offsets: Sequence[int], stable: set[int] | None
    ) -> CopyDone | None:
        pairs = [(t, self._view(off, t.dtype, t.shape)) for t, off in zip(tensors, offsets, strict=True)]
        done = self._side.copy(pairs, pinned=self._pinned, stable=stable)
        self._running = done
        return done

    def settle(self) -> None:
        """Wait for the copy left running, if any (by the next save it has finished long ago)."""
        if self._running is not None:
            self._running.synchronize()
            self._running = None

    def _view(self, offset: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        assert self._buf is not None
        return typed_view(self._buf, self._views, offset, dtype, shape)

    def close(self) -> None:
        if self._running is not None and not self._running.query():
            # A copy into this memory is still queued behind a compute stream that may never move (a hung
            # collective): keep the memory mapped rather than let the DMA land in freed pages.
            _ABANDONED.append((self._map, self._buf, self.fd))
            self._running, self._map, self._buf, self._pinned, self.fd, self.size = None, None, None, False, -1, 0
            self._views.clear()
            return
        self._running = None
        if self._pinned and self._buf is not None and not self._side.unregister(self._buf, self._pin_device):
            # Still registered: unmapping it would leave CUDA a stale pinned range. Kept for the process's life.
            _ABANDONED.append((self._map, self._buf, self.fd))
            self._map, self._buf, self._pinned, self.fd, self.size = None, None, False, -1, 0
            self._views.clear()
            return
        self._pinned = False
        self._views.clear()
        self._buf = None
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self.size = -1, 0
