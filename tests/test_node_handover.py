"""The hand-over of a survivor's live tensors through the node's shared memory (recovery/node_handover.py): what the
source writes is what each reader maps, a reader's writes stay its own (copy-on-write), and only ranks that share one
node memory directory, on a job of one node, take that way; before the file, a reader copies the source's tensors
straight from its memory, and where the kernel refuses one reader every rank takes the file."""

from __future__ import annotations

import json
import multiprocessing
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import child_env, run_forked_ranks, stalwart
from stalwart.recovery import node_handover
from stalwart.runtime import cross_memory
from stalwart.runtime.dist import Comm, Placement


def _pieces() -> tuple[list[tuple[int, torch.Tensor]], int]:
    a = torch.arange(1000, dtype=torch.float32)
    b = torch.arange(77, dtype=torch.int64).reshape(7, 11)
    c = torch.tensor([], dtype=torch.float16)
    return [(0, a), (4032, b), (4672, c)], 4672


def _read_and_write_in_another_process(path: str, size: int, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    buf = node_handover.read(Path(path), size)
    first = buf[:4000].view(torch.float32).clone()
    buf[:4000].view(torch.float32).fill_(-1.0)  # its own page now
    out.put(first.tolist())


def test_what_the_source_writes_is_what_readers_map_and_their_writes_stay_their_own(tmp_path: Path) -> None:
    pieces, size = _pieces()
    path = node_handover.path_of(tmp_path, 12, 0)
    node_handover.write(path, pieces, size)
    assert path.name == "handover-12-0.bin" and path.stat().st_size == size
    assert not path.with_suffix(".partial").exists()
    mine = node_handover.read(path, size)
    assert torch.equal(mine[:4000].view(torch.float32), pieces[0][1])
    assert torch.equal(mine[4032:4648].view(torch.int64).reshape(7, 11), pieces[1][1])
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    other = ctx.Process(target=_read_and_write_in_another_process, args=(str(path), size, out))
    other.start()
    seen = out.get(timeout=60)
    other.join(60)
    assert other.exitcode == 0 and seen == pieces[0][1].tolist()
    assert torch.equal(mine[:4000].view(torch.float32), pieces[0][1]), "another reader's write is not seen here"
    mine[:4000].view(torch.float32).add_(1.0)
    again = node_handover.read(path, size)
    assert torch.equal(again[:4000].view(torch.float32), pieces[0][1]), "nor this reader's, in the file"
    node_handover.remove(path)
    assert not path.exists()
    assert torch.equal(mine[4032:4648].view(torch.int64).reshape(7, 11), pieces[1][1]), "a mapping outlives the file"
    node_handover.remove(path)  # twice: nothing to remove is no error


def test_nothing_to_hand_over_is_an_empty_tensor(tmp_path: Path) -> None:
    path = node_handover.path_of(tmp_path, 0, 1)
    node_handover.write(path, [], 0)
    assert node_handover.read(path, 0).numel() == 0


def test_only_ranks_of_a_one_node_job_sharing_a_directory_agree_on_a_key(tmp_path: Path) -> None:
    key = node_handover.node_key(tmp_path, 2, 2)
    assert key != 0 and key == node_handover.node_key(tmp_path / ".", 2, 2)
    assert node_handover.node_key(tmp_path / "other", 2, 2) != key
    assert node_handover.node_key(tmp_path, 2, 4) == 0, "ranks on other nodes: broadcast"
    assert node_handover.node_key(None, 2, 2) == 0, "no node memory"


def _direct_rank(rank: int, store_path: str, refuse: bool, told: bool) -> None:
    """Rank 1 is the source: its pieces (a tensor, a matrix, an empty one, a transposed one, the skeleton's bytes)
    read by rank 0 straight from its memory. `refuse`: rank 0 reads as another user, which the kernel refuses.
    `told`: the ranks learned the source's offer before (as the restore's LightReady carries it), else the source
    broadcasts it."""
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    comm = Comm(Placement(rank, 2, rank, 0), timedelta(seconds=30))
    a = torch.arange(1000, dtype=torch.float32)
    b = torch.arange(77, dtype=torch.int64).reshape(7, 11)
    t = torch.arange(12, dtype=torch.float64).reshape(3, 4).t()  # not contiguous: its copy is read
    skeleton = torch.frombuffer(bytearray(b"skeleton"), dtype=torch.uint8)
    spans = [(0, 4000), (4032, 616), (4672, 0), (4672, 96), (4800, 8)]
    pieces = [p.reshape(-1) for p in (a, b, torch.empty(0), t)] + [skeleton] if rank == 1 else None
    if refuse and rank == 0:
        os.setresuid(65534, 65534, 65534)
    own = torch.zeros(7, 11, dtype=torch.int64)  # the reader's own tensor for the matrix: read into
    into = [None, own, None, torch.zeros(3, 3), None] if rank == 0 else None  # a wrong size is not used
    with node_handover.offering(pieces if told else None) as offer:
        learned = node_handover.Offer(*comm.all_gather_ints(list(offer))[1]) if told else None
        assert learned is None or learned.pid != 0, "every piece is in CPU memory as one block: offered"
        got = node_handover.read_directly(comm, 1, pieces, spans, 4808, into, learned)
    if refuse:
        assert got is None, "a refused read: every rank takes the file"
    elif rank == 1:
        assert got == [], "the source keeps its own tensors"
    else:
        assert got is not None and [p.numel() for p in got] == [n for _, n in spans]
        assert torch.equal(got[0].view(torch.float32), a)
        assert torch.equal(own, b) and got[1].data_ptr() == own.data_ptr(), "read into the reader's own tensor"
        assert torch.equal(got[3].view(torch.float64), t.reshape(-1))
        assert bytes(got[4].tolist()) == b"skeleton"
    comm.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("told", [False, True], ids=["broadcast", "told_before"])
@pytest.mark.parametrize("refuse", [False, True], ids=["read", "refused"])
def test_a_reader_copies_the_sources_tensors_straight_from_its_memory_or_all_take_the_file(
    tmp_path: Path, refuse: bool, told: bool
) -> None:
    if refuse and os.geteuid() != 0:
        pytest.skip("reading as another user needs root to change users")
    run_forked_ranks(_direct_rank, tmp_path, refuse, told)


def test_a_source_whose_pieces_are_not_in_one_block_offers_nothing() -> None:
    with node_handover.offering([torch.zeros(4, 4).t()]) as offer:
        assert offer == node_handover.NO_OFFER
    with node_handover.offering(None) as offer:
        assert offer == node_handover.NO_OFFER
    with node_handover.offering([torch.zeros(3)]) as offer:
        assert offer.pid == os.getpid() and offer.table != 0


def test_a_read_from_a_process_that_is_gone_says_why() -> None:
    ctx = multiprocessing.get_context("fork")
    gone = ctx.Process(target=lambda: None)
    gone.start()
    gone.join(30)
    buf = torch.zeros(8, dtype=torch.uint8)
    why = cross_memory.read_into(gone.pid or 0, [(buf.data_ptr(), buf.data_ptr(), 8)])
    assert why.startswith(f"process_vm_readv from pid {gone.pid}:") and "No such process" in why, why
    assert cross_memory.read_into(os.getpid(), [(buf.data_ptr(), 0, 0)]) == "", "nothing to read is done"


@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_a_read_split_over_threads_copies_every_byte_once(lanes: int) -> None:
    """cross_memory.read_into cuts the bytes into equal shares, one per thread, across piece boundaries."""
    sources = [torch.arange(n, dtype=torch.uint8) for n in (1000, 0, 7, 4096, 333)]
    targets = [torch.zeros(n, dtype=torch.uint8) for n in (1000, 0, 7, 4096, 333)]
    pieces = [(t.data_ptr(), s.data_ptr(), s.numel()) for t, s in zip(targets, sources, strict=True)]
    assert cross_memory.read_into(os.getpid(), pieces, lanes=lanes) == ""
    assert all(torch.equal(t, s) for t, s in zip(targets, sources, strict=True))


def test_bench_handover_measures_every_way_against_the_floor() -> None:
    out = stalwart("bench", "handover", "--sizes", "1MB,2MB", "--repeats", "1", "--json", env=child_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [r["bytes"] for r in report["sizes"]] == [10**6, 2 * 10**6]
    for r in report["sizes"]:
        assert r["floor"]["copy_s"] > 0 and r["floor"]["allocating_copy_s"] > 0 and r["floor"]["copy_all_cores_s"] > 0
        for way in ("broadcast", "file", "direct_new", "direct"):
            assert 0 < r[way]["handed_s"] <= r[way]["loaded_s"], (way, r)
    assert not list(Path("/dev/shm").glob("stalwart-bench-handover-*")), "its node memory directory is removed"


def _load_rank(rank: int, store_path: str, case: str, shm: str) -> None:
    """`live_handover.hand_over_and_load` between a source (rank 1) and a reader (rank 0) of one node: the read from
    the source's memory and the load agreed on in one gather. `case`: "read"; "refused" (the reader's kernel refuses
    the read: the fake stands in for a Yama or seccomp policy, which a test cannot set per process); "unusable" (the
    reader's load fails)."""
    from stalwart.recovery import live_handover

    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    comm = Comm(Placement(rank, 2, rank, 0), timedelta(seconds=30))
    a = torch.arange(1000, dtype=torch.float32)
    b = torch.arange(77, dtype=torch.int64).reshape(7, 11)
    layout = {"a": (0, 4000, torch.float32, [1000]), "b": (4032, 616, torch.int64, [7, 11])}
    mine = {"a": a, "b": b} if rank == 1 else {}
    flat = [a, b.reshape(-1), torch.frombuffer(bytearray(b"skel"), dtype=torch.uint8)] if rank == 1 else None
    own = torch.zeros(1000)  # the reader's model: read into
    if rank == 0 and case == "refused":
        cross_memory.read_into = lambda pid, pieces, lanes=None: "refused (a test's stand-in for the kernel's policy)"

    def load(live: dict[str, torch.Tensor], skeleton: bytes) -> tuple[torch.Tensor, torch.Tensor, bytes]:
        if rank == 0 and case == "unusable":
            raise ValueError("an unreadable skeleton")
        return live["a"].clone(), live["b"].clone(), skeleton

    with node_handover.offering(flat) as offer:
        told = node_handover.Offer(*comm.all_gather_ints(list(offer))[1])
        pieces = live_handover.Pieces(mine, flat, offer)
        own_tensors = (lambda: {"a": own}) if rank == 0 else None
        args = (comm, 1, pieces, told, layout, 4672, b"skel" if rank == 1 else b"", 4, 3, Path(shm), own_tensors)
        loaded, route, problem = live_handover.hand_over_and_load(
            comm, lambda direct: live_handover.hand_over(*args, direct=direct), told.pid != 0, load
        )
    if case == "unusable":
        assert loaded is None, "the reader's load failed: no rank uses its own"
        assert problem == ("an unreadable skeleton" if rank == 0 else "another rank's is not whole"), problem
    else:
        assert loaded is not None and problem == "", problem
        assert torch.equal(loaded[0], a) and torch.equal(loaded[1], b) and loaded[2] == b"skel"
        way = "read from its memory" if case == "read" else "handed over through node memory"
        assert route == way, route
        if rank == 0 and case == "read":
            assert torch.equal(own, a), "read into the reader's own tensor"
    comm.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("case", ["read", "refused", "unusable"])
def test_the_read_and_the_load_are_agreed_in_one_gather_and_a_refused_read_takes_the_file(
    tmp_path: Path, case: str
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    run_forked_ranks(_load_rank, tmp_path, case, str(shm))
    assert not list(shm.iterdir()), "the file taken after a refused read is removed"
