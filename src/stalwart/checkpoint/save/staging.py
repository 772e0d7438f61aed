"""The snapshot half of a save: copy a rank's tensors into a staging area that the persister reads.

The staging area is one anonymous shared-memory file (memfd) per rank, allocated at the first save and reused
by every later save while the state fits (it grows, never shrinks). The training loop blocks only for the copy
into it. The persister process maps the same memory through /proc/<pid>/fd/<fd>, so nothing is copied again
and nothing is left in /dev/shm when either process dies.

CUDA tensors are copied with non-blocking copies on a side stream into staging memory registered with
cudaHostRegister (pinned), so the copy runs at PCIe bandwidth; the side stream first waits for the compute
stream, and the snapshot waits for the side stream before the persister may read.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence

import torch

ALIGN = 64
PAGE = 4096
MAX_VIEWS = 65536
GROW_SLACK = 1.1
"""Headroom when (re)allocating, so a state that grows a little (an optimizer's first step) does not
reallocate at every save."""


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
        self._stream: torch.cuda.Stream | None = None
        self._views: ViewCache = {}

    def spec(self) -> dict[str, int]:
        return {"pid": os.getpid(), "fd": self.fd, "size": self.size}

    def ensure(self, nbytes: int, *, pin: bool) -> None:
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
            self._buf.zero_()  # fault the pages in now, not during the first timed copies
        if pin and not self._pinned and torch.cuda.is_available():
            assert self._buf is not None
            err = torch.cuda.cudart().cudaHostRegister(self._buf.data_ptr(), self.size, 0)
            self._pinned = int(err) == 0

    def copy_in(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
        """Copy every tensor to its offset; returns once all bytes are in staging (CUDA copies included).

        Each tensor is copied into a view of staging with its own dtype and shape (laid out row-major, as a
        contiguous tensor is), so the source needs no reshaping and a non-contiguous tensor is copied once, not
        first made contiguous. The views are cached: a job saves the same shapes at the same offsets every time.
        """
        with torch.no_grad():  # tensors that require grad are copied as data, with no autograd record
            self._copy(tensors, offsets)

    def _copy(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
        on_gpu = False
        for t, off in zip(tensors, offsets, strict=True):
            dst = self._view(off, t.dtype, t.shape)
            if t.is_cuda:
                if not on_gpu:  # the side stream must see every write the compute stream has queued
                    if self._stream is None:
                        self._stream = torch.cuda.Stream(device=t.device)
                    self._stream.wait_stream(torch.cuda.current_stream(t.device))
                    on_gpu = True
                assert self._stream is not None
                with torch.cuda.stream(self._stream):
                    dst.copy_(t, non_blocking=self._pinned)
            else:
                dst.copy_(t)
        if on_gpu and self._stream is not None:
            self._stream.synchronize()

    def _view(self, offset: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        assert self._buf is not None
        return typed_view(self._buf, self._views, offset, dtype, shape)

    def close(self) -> None:
        if self._pinned and self._buf is not None:
            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(self._buf.data_ptr())
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
