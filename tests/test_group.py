"""The re-formable process group (runtime/group.py): a DDP model keeps training through a peer's death in the
same processes, and ends bitwise identical to a run without it."""

from __future__ import annotations

import json
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from conftest import alive, child_env, served_script
from stalwart.runtime import group as reformable

SCRIPT = Path(__file__).parent / "scripts" / "group_reform.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(tmp_path: Path, kill_at: int | None) -> dict[int, dict[str, Any]]:
    """Run the two ranks (and the replacement after a kill); every process is reaped, also on failure."""
    tmp_path.mkdir(parents=True)
    port, port2 = _free_port(), _free_port()
    env = child_env(KILL_AT=str(kill_at if kill_at is not None else -1))
    procs: list[Any] = []
    logs: list[Path] = []

    def start(*args: str) -> None:  # forked from the tests' launch server: torch imported, as a worker host has it
        log = tmp_path / f"rank{len(logs)}.log"
        logs.append(log)
        procs.append(served_script(SCRIPT, list(args), env, tmp_path, log))

    try:
        for rank in range(2):
            start(str(rank), str(port), str(port2))
        if kill_at is not None:
            assert procs[1].wait(60) == 1, logs[1].read_text()[-2000:]
            start("1", str(port), str(port2), "newcomer")
            procs[1] = procs.pop()
        codes = [p.wait(90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 0], "\n".join(log.read_text()[-1500:] for log in logs)
    results: dict[int, dict[str, Any]] = {}
    for log in logs:
        for line in log.read_text().splitlines():
            if line.startswith("{"):
                found = json.loads(line)
                results[found["rank"]] = found
    return results


def test_survivors_absorb_a_peers_death_and_reform_in_their_loop(tmp_path: Path) -> None:
    reference = _run(tmp_path / "reference", None)
    faulty = _run(tmp_path / "faulty", 5)
    assert sorted(faulty) == [0, 1]
    for rank in (0, 1):
        assert faulty[rank]["sha256"] == reference[rank]["sha256"], f"rank {rank} differs from the fault-free run"
        assert faulty[rank]["setups"] == 1
    assert not [r for r in faulty.values() if alive(r["pid"])], "every process ended"


def test_a_failed_group_completes_collectives_without_raising_and_forwards_to_the_next_formation() -> None:
    """One rank, no peer: a collective after a failure is not run and leaves its tensors as they are; once the next
    formation's group exists, the old object runs its collectives there and reports its state."""
    group = reformable.ReformableGroup(dist.HashStore(), 0, 1, timedelta(seconds=5))
    group.absorb_failures(True)
    t = torch.ones(3)
    group.allreduce([t]).wait()
    assert group.failed is None and t.tolist() == [1.0, 1.0, 1.0]
    group.fail("the agent asked")
    t.fill_(2.0)
    work = group.allreduce([t])
    assert work.wait() and work.get_future().value() == [t]
    assert group.failed is not None and t.tolist() == [2.0, 2.0, 2.0]
    after = reformable.ReformableGroup(dist.HashStore(), 0, 1, timedelta(seconds=5), generation=2)
    after.absorb_failures(True)
    group.succeeded_by(after)
    assert group.latest() is after and group.failed is None and after.generation == 2
    group.allreduce([t]).wait()  # through the old object, on the new formation's backend
    assert group.failed is None and t.tolist() == [2.0, 2.0, 2.0]
    group.fail("again")
    assert after.failed is not None, "a failure met through an old object is the newest formation's"
    group.absorb_failures(False)  # outside a job's loop a failed group raises
    with pytest.raises(RuntimeError, match="the process group failed"):
        group.allreduce([t])


def test_a_joining_rank_runs_no_collective_and_gathers_its_own_tensors() -> None:
    group = reformable.ReformableGroup(dist.HashStore(), 0, 1, timedelta(seconds=5))
    group.join(True)
    mine = torch.tensor([7, 8])
    outs = [torch.zeros(2, dtype=torch.int64) for _ in range(3)]
    assert group.allgather([outs], [mine]).wait()
    assert [o.tolist() for o in outs] == [[7, 8]] * 3
    flat = torch.zeros(6, dtype=torch.int64)
    group._allgather_base(flat, mine).wait()
    assert flat.tolist() == [7, 8] * 3
    b = torch.tensor([1.0])
    group.broadcast([b]).wait()
    assert b.tolist() == [1.0] and group.failed is None


def test_functional_collectives_run_through_the_group_and_are_absorbed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The functional all-gather and reduce-scatter (DTensor's `full_tensor` and `redistribute` call these ops)
    reach the group's Python methods, not gloo straight from C++: there they enqueued holding the GIL and
    deadlocked with a gloo worker (runtime/group.py's `all_gather_single_coalesced`); and here they are absorbed
    like any other collective."""
    ops = torch.ops._c10d_functional
    ran: list[str] = []
    run = reformable.ReformableGroup._run
    monkeypatch.setattr(
        reformable.ReformableGroup, "_run", lambda self, name, *a: ran.append(name) or run(self, name, *a)
    )
    reformable.register()
    dist.init_process_group(backend=reformable.BACKEND, store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        assert isinstance(group, reformable.ReformableGroup)
        t = torch.arange(4.0)
        assert ops.wait_tensor(ops.all_gather_into_tensor(t, 1, group.group_name)).tolist() == t.tolist()
        assert ops.wait_tensor(ops.reduce_scatter_tensor(t, "sum", 1, group.group_name)).tolist() == t.tolist()
        assert ran == ["_allgather_base", "_reduce_scatter_base"]
        outs = [torch.zeros(4), torch.zeros(4)]
        group.all_gather_single_coalesced(outs, [t, t + 1]).wait()  # several tensors: one collective each
        assert [o.tolist() for o in outs] == [t.tolist(), (t + 1).tolist()]
        group.absorb_failures(True)
        group.fail("a peer died")
        ops.wait_tensor(ops.all_gather_into_tensor(t, 1, group.group_name))  # not run: completes without raising
        assert ran[-1] == "_allgather_base" and len(ran) == 5 and group.failed is not None
    finally:
        dist.destroy_process_group()
