"""A dead rank is dead at once, and no survivor waits in DDP's reducer for a peer that left.

A worker's descendants (its DataLoader workers, any child it forked) inherit its connections: after the worker's
death they held them open, so the survivor, blocked in a collective with the dead rank, saw no connection error
until they ended (a DataLoader worker's watchdog: about 5 s; a child of the script: never). The agent now ends the
dead worker's process group at once (supervisor/host_pool.py), and ResumableLoader's workers die with their rank.
A survivor blocked in DDP's reducer (C++, where no Python signal handler runs) for a peer whose connections stay
open anyway (a child in a session of its own here; a host cut off by the network in real life) leaves it when its
agent asks: a thread sees the request and completes the pending collectives (runtime/signal_watch.py). Before, it
was killed and replaced after 10 s.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.futures import Future

from conftest import alive, child_env, fault_free_results, tiny_args
from stalwart.runtime import group as reformable
from stalwart.runtime.signal_watch import SignalWatch
from stalwart.runtime.works import AbsorbingWork
from stalwart.supervisor.host_pool import Host, HostContext

ARGS = ("--steps", "30", "--workers", "2")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return fault_free_results(tmp_path_factory.mktemp("dead-rank-reference"), *ARGS)


@pytest.fixture
def holders() -> Iterator[list[Path]]:
    """Where a run's holder child writes its pid; the child is killed after the test, pass or fail."""
    files: list[Path] = []
    yield files
    for path in files:
        if path.exists() and alive(int(path.read_text())):
            os.kill(int(path.read_text()), signal.SIGKILL)


def _survivor_stayed(job: Any) -> None:
    """Rank 0 re-formed inside its loop, in the process it started in."""
    assert {e["rank"] for e in job.events("reformed_in_loop")} == {0}, job.output()[-3000:]
    assert job.worker_pids(restart=0)[0] == job.worker_pids(restart=1)[0]


def test_a_dead_ranks_dataloader_workers_and_children_end_with_it(
    launch: Any, reference: Any, holders: list[Path]
) -> None:
    """The README's loader with num_workers=2, and a child the script forked in its process group: the run ends
    bitwise identical, and the child (which sleeps 600 s holding the rank's sockets) is gone with its rank."""
    job = launch(tiny_args(*ARGS, "--fork-holder", "group"), env=child_env(STALWART_FAULTS="kill@rank=1,step=13"))
    holders.append(job.workdir / "holder.pid")
    assert job.wait(150) == 0, job.output()[-3000:]
    results = job.results()
    assert all(results[r]["sha256"] == reference[r]["sha256"] for r in reference)
    _survivor_stayed(job)


def test_the_agent_ends_a_dead_workers_descendants_at_its_first_look(tmp_path: Path) -> None:
    """A worker host that forks a child (sleeping 600 s, as a DataLoader worker holds its rank's sockets) and dies:
    once the agent's process context has seen the death, the child is ended too, without waiting for the round's
    restart (which ends the host's process group as well, but only after the survivors re-armed)."""
    script = tmp_path / "fork_and_die.py"
    script.write_text(
        "import os, signal, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n    time.sleep(600)\n    os._exit(0)\n"
        f"open({str(tmp_path / 'child.pid')!r}, 'w').write(str(pid))\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    host = Host(warm=False)
    context = HostContext({0: host}, str(script), reform=True)
    child_file = tmp_path / "child.pid"
    try:
        assert host.activate([str(script)], {**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 60
        while host.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not host.alive() and child_file.exists()
        child = int(child_file.read_text())
        result = context._poll()
        assert result is not None and 0 in result.failures
        deadline = time.monotonic() + 30  # SIGKILL was sent in _poll; the kernel ends the child right after
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not alive(child), "the dead worker's child lives on after the agent saw the death"
    finally:
        if child_file.exists() and alive(int(child_file.read_text())):
            os.kill(int(child_file.read_text()), signal.SIGKILL)
        host.kill()


def test_a_survivor_in_ddps_reducer_leaves_it_when_asked(launch: Any, reference: Any, holders: list[Path]) -> None:
    """The dead rank's connections stay open (its child left its process group), so nothing errors in the survivor's
    all-reduce: the agent's request to re-form must reach it inside the reducer's wait."""
    job = launch(tiny_args(*ARGS, "--fork-holder", "session"), env=child_env(STALWART_FAULTS="kill@rank=1,step=13"))
    holders.append(job.workdir / "holder.pid")
    assert job.wait(150) == 0, job.output()[-3000:]
    results = job.results()
    assert all(results[r]["sha256"] == reference[r]["sha256"] for r in reference)
    _survivor_stayed(job)


def test_a_watched_signal_reaches_a_thread_while_the_main_thread_waits_in_cpp() -> None:
    signum = signal.SIGRTMIN + 5
    previous = signal.signal(signum, lambda s, f: None)  # Python writes the wakeup fd for handled signals only
    waited: Future[str] = Future()
    watch = SignalWatch(signum, lambda: waited.set_result("watch"))
    fallback = threading.Timer(60, lambda: waited.done() or waited.set_result("timeout"))
    try:
        assert watch.start()
        threading.Timer(0.2, os.kill, (os.getpid(), signum)).start()
        fallback.start()
        assert waited.wait() == "watch"  # a C++ wait with the GIL released: no Python handler runs in it
    finally:
        fallback.cancel()
        watch.close()
        signal.signal(signum, previous)


class _NeverDone(dist.Work):
    """A backend's collective that waits for a peer that never answers."""

    def __init__(self) -> None:
        super().__init__()
        self.future: Future[Any] = Future()

    def get_future(self) -> Future[Any]:
        return self.future


def test_a_failed_group_completes_its_pending_collectives() -> None:
    group = reformable.ReformableGroup(dist.HashStore(), 0, 1, timedelta(seconds=10), connect=False)
    tensor = torch.ones(2)
    work = AbsorbingWork(group, _NeverDone(), [tensor])
    assert not work.get_future().done()
    group.fail("the agent asked this worker to re-form: a peer failed")
    assert work.get_future().done() and work.get_future().value() == [tensor]
    late = AbsorbingWork(group, _NeverDone(), [tensor])  # started after the failure: completed at once
    assert late.get_future().done()


class _DeathSignal(torch.utils.data.Dataset):
    """Each sample is the parent-death signal armed in the process that loads it (Linux prctl PR_GET_PDEATHSIG)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        import ctypes

        armed = ctypes.c_int(0)
        ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(armed), 0, 0, 0)
        return torch.tensor(armed.value)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux's")
def test_resumable_loaders_workers_die_with_their_rank() -> None:
    """Without it a dead rank's DataLoader workers hold its sockets until torch's watchdog in them notices, 5 s."""
    from stalwart import ResumableLoader

    loader = ResumableLoader(_DeathSignal(), global_batch_size=2, seed=0, num_workers=1)
    batch = next(iter(loader))
    assert batch.tolist() == [signal.SIGKILL, signal.SIGKILL]


def test_a_watch_closes_though_a_forked_child_holds_its_pipe() -> None:
    """A DataLoader worker forked while the watch runs inherits its pipe: the watch must still stop at once (it
    waited out its 1 s join at every re-formation, before the thread was woken by a byte)."""
    signum = signal.SIGRTMIN + 5
    previous = signal.signal(signum, lambda s, f: None)
    watch = SignalWatch(signum, lambda: None)
    assert watch.start()
    thread = watch._thread
    child = os.fork()
    if child == 0:  # holds every descriptor of the parent, the pipe's write end too
        time.sleep(30)
        os._exit(0)
    try:
        watch.close()
        assert thread is not None and not thread.is_alive(), "the watch's thread outlived close()"
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        signal.signal(signum, previous)


def test_a_late_failure_of_a_released_collective_does_not_fail_the_next_formation() -> None:
    """A collective released when its formation failed may fail on its backend after the job re-formed: the newest
    formation must not be taken as failed (a survivor training on shrunk was, and ran its script again)."""
    old = reformable.ReformableGroup(dist.HashStore(), 0, 1, timedelta(seconds=10), connect=False)
    work = AbsorbingWork(old, _NeverDone(), [torch.ones(1)])
    old.fail("the agent asked this worker to re-form: a peer failed")
    new = reformable.ReformableGroup(dist.HashStore(), 0, 1, timedelta(seconds=10), generation=2, connect=False)
    old.succeeded_by(new)
    work._work.future.set_exception(RuntimeError("Connection reset by peer"))  # type: ignore[attr-defined]
    assert new.failed is None
