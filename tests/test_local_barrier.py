"""The commit point's barrier through a shared page (runtime/local_barrier.py), between real processes."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from stalwart.errors import PeerGone
from stalwart.runtime.local_barrier import LocalBarrier
from stalwart.runtime.torch_compat import is_peer_failure


def _peer(directory: str, rounds: int, stamps: str, stall_at: int) -> None:
    """Local rank 1: waits `rounds` times, recording the time it left each round; stalls before round `stall_at`."""
    barrier = LocalBarrier(directory, "k", 1, 2, timeout_s=30)
    with open(stamps, "w") as out:
        for i in range(rounds):
            if i == stall_at:
                time.sleep(0.2)
            out.write(f"{time.monotonic()}\n")
            out.flush()
            barrier.wait(1 if i == 30 else 0)
    barrier.close()


def _start(target: object, *args: object) -> multiprocessing.process.BaseProcess:
    proc = multiprocessing.get_context("fork").Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def test_no_rank_leaves_a_round_before_every_rank_arrived(tmp_path: Path) -> None:
    stamps = tmp_path / "arrivals"
    proc = _start(_peer, str(tmp_path), 50, str(stamps), 20)
    try:
        barrier = LocalBarrier(tmp_path, "k", 0, 2, timeout_s=30)
        left = []
        costs = []
        flags = []
        for _ in range(50):
            cost, flag = barrier.wait()
            costs.append(cost)
            flags.append(flag)
            left.append(time.monotonic())
        proc.join(30)
        assert proc.exitcode == 0
        arrived = [float(line) for line in stamps.read_text().split()]
        assert len(arrived) == 50
        # Round 20: the peer arrived 0.2 s late, and this rank waited for it.
        assert all(out >= into for out, into in zip(left, arrived, strict=True))
        assert left[20] - left[19] >= 0.2
        # What the barrier reports is its own cost, not the 0.2 s it waited for the late peer.
        assert costs[20] < 0.2
        # The peer's flag of round 30 comes back in that round only.
        assert [i for i, f in enumerate(flags) if f] == [30]
        barrier.close()
        assert not (tmp_path / "barrier-k").exists()
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()


def _arrive_then_die(directory: str) -> None:
    LocalBarrier(directory, "k", 1, 2, timeout_s=30)  # registers its pid, never waits
    os._exit(0)


def test_a_peer_that_ended_raises_peer_gone(tmp_path: Path) -> None:
    proc = _start(_arrive_then_die, str(tmp_path))
    proc.join(30)
    barrier = LocalBarrier(tmp_path, "k", 0, 2, timeout_s=30)
    started = time.monotonic()
    with pytest.raises(PeerGone) as raised:
        barrier.wait()
    assert time.monotonic() - started < 10  # not the 30 s timeout
    assert is_peer_failure(raised.value)  # re-formed like a failed collective
    barrier.close()


def _stopped_peer(directory: str) -> None:
    LocalBarrier(directory, "k", 1, 2, timeout_s=30)
    os.kill(os.getpid(), signal.SIGSTOP)


def test_a_peer_that_never_comes_times_out(tmp_path: Path) -> None:
    proc = _start(_stopped_peer, str(tmp_path))
    try:
        barrier = LocalBarrier(tmp_path, "k", 0, 2, timeout_s=0.3)
        with pytest.raises(PeerGone, match="timed out"):
            barrier.wait()
        barrier.close()
    finally:
        proc.kill()
        proc.join()


def test_index_outside_the_barrier_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        LocalBarrier(tmp_path, "k", 2, 2, timeout_s=1)
