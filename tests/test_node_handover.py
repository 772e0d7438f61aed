"""The hand-over of a survivor's live tensors through the node's shared memory (recovery/node_handover.py): what the
source writes is what each reader maps, a reader's writes stay its own (copy-on-write), and only ranks that share one
node memory directory, on a job of one node, take that way."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import torch

from stalwart.recovery import node_handover


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
