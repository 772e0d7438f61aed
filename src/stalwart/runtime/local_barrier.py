"""A barrier of the ranks of one node through a shared page, for the commit point of every step.

Why: light snapshots put a barrier in every step (job/step_commit.py). Over stalwart's gloo group one barrier cost
milliseconds per step (docs/benchmarks.md): the request goes from the
training thread to gloo's work thread, its TCP loop thread and the loopback socket, then to the peer's threads and
back, and on busy cores every hand-off waits for the scheduler. That alone is three times the light snapshots'
half of the 1% snapshot budget, so they were turned off and a kill lost up to the full copies' interval.

When every rank of the group is on this node, the ranks arrive at the commit point within microseconds of each
other (they have just left the same gradient allreduce). Each rank writes its arrival count into its own line of
a shared page and reads the others': usually all are there at the first look, without a system call.

Waiting, when a peer is not there yet: a sleep that grows by a quarter from 20 us to 1 ms between looks, so that
the agent's REFORM_SIGNAL raises ReformRequested in between, as it would in a collective. A peer whose process has ended
(or is a zombie) raises PeerGone at once; past the collective timeout the barrier raises PeerGone too.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from pathlib import Path

from stalwart.errors import PeerGone
from stalwart.runtime.process import process_state

LINE = 64
"""Bytes per rank: one cache line each, so two ranks' writes never share a line."""
FIRST_SLEEP_S = 20e-6
LONGEST_SLEEP_S = 1e-3
CHECK_PEERS_EVERY_S = 0.01


class LocalBarrier:
    """A reusable barrier of `size` processes of one node, the ranks of one group incarnation.

    The page is a file named by `key` in `directory` (the node's shared-memory directory of the run), created by
    whichever rank comes first; `key` must be the same on every rank and new for every group (agreed through
    the group once, see Job). Line `index` holds that rank's arrival count, pid, last arrival time and flag.
    """

    def __init__(self, directory: str | os.PathLike[str], key: str, index: int, size: int, timeout_s: float) -> None:
        if not 0 <= index < size:
            raise ValueError(f"index {index} outside a barrier of {size}")
        self.path = Path(directory) / f"barrier-{key}"
        self.index = index
        self.size = size
        self.timeout_s = timeout_s
        self._count = 0
        nbytes = max(mmap.PAGESIZE, LINE * size)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < nbytes:
                os.ftruncate(fd, nbytes)  # the same size on every rank: a second ftruncate changes nothing
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self._words = memoryview(self._map).cast("q")  # aligned 8-byte loads and stores
        self._stride = LINE // 8
        self._words[index * self._stride + 1] = os.getpid()

    def wait(self, flag: int = 0) -> tuple[float, int]:
        """Return once every rank has called `wait` as often as this one; PeerGone if one cannot any more.

        Returns the seconds from the last rank's arrival to this rank's return (what the barrier itself cost:
        the rest of the wait is the ranks' skew, which the next collective would have waited for anyway) and the
        largest `flag` any rank brought to this round, the same on every rank."""
        self._count += 1
        count, words, stride = self._count, self._words, self._stride
        me = self.index * stride
        # By the round's parity: a rank that has left this round may arrive at the next one before a slower
        # peer has read this round's time and flag, but not at the one after (that needs the slow peer too).
        odd = count & 1
        words[me + 2 + odd] = time.monotonic_ns()  # CLOCK_MONOTONIC: one clock for every process of the node
        words[me + 4 + odd] = flag
        words[me] = count  # after the time and the flag: a rank that sees the count sees them
        waiting = [i for i in range(self.size) if i != self.index]
        sleep = FIRST_SLEEP_S
        started = checked = 0.0
        while True:
            waiting = [i for i in waiting if words[i * stride] < count]
            if not waiting:
                last = max(words[i * stride + 2 + odd] for i in range(self.size))
                flags = max(words[i * stride + 4 + odd] for i in range(self.size))
                return max(0, time.monotonic_ns() - last) / 1e9, flags
            now = time.monotonic()
            if not started:
                started = checked = now
            elif now - checked >= CHECK_PEERS_EVERY_S:
                checked = now
                self._check_peers(waiting)
                if now - started > self.timeout_s:
                    raise PeerGone(f"local barrier timed out after {self.timeout_s:.0f} s waiting for {waiting}")
            time.sleep(sleep)  # REFORM_SIGNAL's handler raises here
            sleep = min(1.25 * sleep, LONGEST_SLEEP_S)

    def _check_peers(self, waiting: list[int]) -> None:
        for i in waiting:
            pid = self._words[i * self._stride + 1]
            if pid and process_state(pid) in ("?", "Z", "X"):
                raise PeerGone(f"local barrier: the process of local peer {i} (pid {pid}) has ended")

    def close(self) -> None:
        """Unmap and remove the page (a peer still mapping it keeps its own view)."""
        self._words.release()
        self._map.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
