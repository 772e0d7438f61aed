"""Sharded state across world sizes (checkpoint/format/sharded.py `reshard`): an FSDP2 job's checkpoint of 4 ranks
loads at 2 and then at 3, every full parameter and AdamW moment bitwise what was saved, and training goes on to
the same parameters as a run of 4 ranks throughout, within floating-point order."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.fsdp

from conftest import TINY, alive, child_env, stalwart, tiny_args

fsdp2 = pytest.mark.skipif(
    not hasattr(torch.distributed.fsdp, "fully_shard"),
    reason="this torch's FSDP2 is private (fully_shard is public from torch 2.6) and makes CUDA streams on a CPU",
)
ARGS = ("--fsdp", "--no-randomness", "--gbs", "12", "--every", "4", "--hidden", "30")
"""A hidden width of 30 shards unevenly at 4 (8, 8, 8, 6) and at 3 ranks, and the 1-row output layer leaves
empty shards; 12 samples a step divide among 4, 2 and 3 ranks."""
TOLERANCE = 1e-5
"""Largest difference from the 4-rank run, relative to the largest magnitude of each tensor: another world size
sums the gradients in another order (docs/checkpoints.md)."""


def _load(path: Path) -> dict[str, torch.Tensor]:
    return dict(torch.load(path, weights_only=True))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(a) == sorted(b) and any(k.endswith("exp_avg_sq") for k in a), what
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), f"{what}: {key} differs"


@fsdp2
def test_fsdp2_state_of_4_ranks_goes_on_at_2_then_at_3(launch: Any, tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"
    four = launch(tiny_args("--steps", "16", *ARGS, "--dump-dir", str(dumps / "4"), "--dump-at", "8", nproc=4),
                  name="four", env=child_env())  # fmt: skip
    assert four.wait(180) == 0, four.output()
    # The 2-rank job starts from the 4-rank job's checkpoint of step 8.
    ckpt = tmp_path / "ckpt"
    shutil.copytree(four.workdir / "ckpt", ckpt)
    for later in ("step_00000012", "step_00000016"):
        shutil.rmtree(ckpt / later)
    resize = ("--ckpt", str(ckpt), "--allow-resize")
    two = launch(tiny_args("--steps", "12", *ARGS, *resize, "--dump-dir", str(dumps / "2"), nproc=2), name="two")
    assert two.wait(180) == 0, two.output()
    three = launch(tiny_args("--steps", "16", *ARGS, *resize, "--dump-dir", str(dumps / "3"), nproc=3), name="three")
    assert three.wait(180) == 0, three.output()

    _same(_load(dumps / "2" / "resumed-8.pt"), _load(dumps / "4" / "at-8.pt"), "4 -> 2 ranks")
    _same(_load(dumps / "3" / "resumed-12.pt"), _load(dumps / "2" / "end-12.pt"), "2 -> 3 ranks")
    for job, old, new in ((two, 4, 2), (three, 2, 3)):
        [changed] = [e for e in job.events("world_resized") if e.get("rank") == 0]
        assert (changed["from"], changed["to"], changed["tier"]) == (old, new, "durable"), changed
    ended, reference = _load(dumps / "3" / "end-16.pt"), _load(dumps / "4" / "end-16.pt")
    assert sorted(ended) == sorted(reference)
    for key, want in reference.items():
        diff = float((ended[key].double() - want.double()).abs().max())
        assert diff <= TOLERANCE * max(float(want.abs().max()), 1e-12), f"{key}: {diff} from the 4-rank run"
    pids = {e["worker_pid"] for job in (four, two, three) for e in job.events("worker_spawned")}
    assert not [pid for pid in pids if alive(pid)], "no worker outlives its launcher"


def _ranks(workdir: Path, nproc: int, snapshots: Path, *args: str, code: int = 0) -> list[dict[str, Any]]:
    """The tiny job's `nproc` ranks with torchrun's environment and no launcher (no agent of ours): their memory
    tier is `snapshots`, kept across the runs the way a restarted node's agent keeps it; their events. Each rank
    is forked from the tests' launch server (conftest.served_script; as new interpreters under torchrun they were
    14 imports of torch in this test, about 100 s of CPU). As torchrun does, the first rank that fails
    ends the others. `code`: 0, or 1 where a rank must fail. Every process is reaped, also on failure."""
    import socket
    import time

    from conftest import served_script
    from stalwart.telemetry.events import read_events

    workdir.mkdir(parents=True)
    base = child_env(STALWART_SNAPSHOT_DIR=str(snapshots), STALWART_EVENT_LOG=str(workdir / "events.jsonl"))
    with socket.socket() as probe:  # a free port for rank 0's store, as torchrun --standalone finds one
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    job = ["--ckpt", str(workdir.parent / "ckpt"), "--out", str(workdir / "out"), *args]
    procs: list[Any] = []
    try:
        for rank in range(nproc):
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                   "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0"}  # fmt: skip
            procs.append(served_script(TINY, job, env, workdir, workdir / f"output-{rank}.log"))
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        (workdir / "output.log").write_text("".join(
            (workdir / f"output-{rank}.log").read_text(errors="replace") for rank in range(len(procs))
        ))  # fmt: skip
    ended = 1 if any(p.returncode != 0 for p in procs) else 0
    assert ended == code, (workdir / "output.log").read_text()[-3000:]
    return list(read_events(workdir / "events.jsonl"))


@fsdp2
def test_fsdp2_state_of_4_ranks_reshards_from_node_memory_at_2_then_at_3(tmp_path: Path) -> None:
    """A restart at another world size takes the old ranks' full snapshots from node memory (newer than the
    durable checkpoint), resharded: every parameter and AdamW moment bitwise what the old world held (training on
    from there is the durable test's above, within 1e-5 of a 4-rank run). The ranks' memory is that of two nodes:
    at 4 ranks two ranks each, at 2 ranks one each, at 3 ranks two and one; each time a node lacks some old ranks'
    images and gets them from the other node's memory (recovery/memory_reshard.py)."""
    snapshots = Path("/dev/shm") / f"stalwart-test-reshard-{os.getpid()}"
    snapshots.mkdir()
    dumps = tmp_path / "dumps"
    args, one = (*ARGS, "--ranks-per-node", "2"), (*ARGS, "--ranks-per-node", "1")
    try:
        _ranks(tmp_path / "four", 4, snapshots, "--steps", "10", *args, "--dump-dir", str(dumps / "4"))
        # The durable checkpoint of step 10 is gone: only node memory holds it (the durable one is of step 8).
        shutil.rmtree(tmp_path / "ckpt" / "step_00000010")
        _ranks(tmp_path / "refused", 2, snapshots, "--steps", "12", *one, code=1)
        refused = (tmp_path / "refused" / "output.log").read_text()
        assert "stalwart: error: node memory holds step 10 of a job of 4 ranks and this job has 2" in refused
        resize = ("--allow-resize",)
        two = _ranks(tmp_path / "two", 2, snapshots, "--steps", "12", *one, *resize, "--dump-dir", str(dumps / "2"))
        three = _ranks(tmp_path / "three", 3, snapshots, "--steps", "14", *args, *resize,
                          "--dump-dir", str(dumps / "3"))  # fmt: skip
    finally:
        shutil.rmtree(snapshots, ignore_errors=True)
    _same(_load(dumps / "2" / "resumed-10.pt"), _load(dumps / "4" / "end-10.pt"), "4 -> 2 ranks from memory")
    _same(_load(dumps / "3" / "resumed-12.pt"), _load(dumps / "2" / "end-12.pt"), "2 -> 3 ranks from memory")
    for events, old, new, step in ((two, 4, 2, 10), (three, 2, 3, 12)):
        [changed] = [e for e in events if e["event"] == "world_resized" and e.get("rank") == 0]
        assert (changed["from"], changed["to"], changed["tier"], changed["step"]) == (old, new, "memory", step)
    for events, moved in ((two, 4), (three, 2)):  # each node lacked old images; a rank fetched only what it reads
        sources = {e["rank"]: e["source"] for e in events if e["event"] == "resumed"}
        fetched = {r: int(re.search(rf"(\d+) bytes of {moved} images moved between nodes", s)[1])
                   for r, s in sources.items()}  # fmt: skip
        # Rank 0's new shards and its old rank's state lie in its own node's images (at 2 ranks: old ranks 0 and 1,
        # at 3: old rank 0 of 2); a whole-image move would have sent its node the others' all the same.
        assert fetched[0] == 0 and all(fetched[r] > 0 for r in fetched if r), sources


@pytest.mark.parametrize("url", ["local", "memory://reshard-ranges"])
def test_a_byte_range_reads_the_same_on_every_storage(tmp_path: Path, url: str) -> None:
    """What resharding reads of another rank's file: a range, or a range straight into a tensor's memory."""
    from stalwart.checkpoint.storage import open_storage

    storage = open_storage(tmp_path if url == "local" else url)
    storage.write_bytes("f.data", bytes(range(256)) * 4)
    assert storage.read_range("f.data", 250, 10) == bytes([250, 251, 252, 253, 254, 255, 0, 1, 2, 3])
    out = torch.zeros(6, dtype=torch.uint8)
    assert storage.read_range_into("f.data", 1020, out.numpy().data) == 4, "fewer at the file's end"
    assert out.tolist() == [252, 253, 254, 255, 0, 0]


def test_the_reshard_bench_loads_every_byte_at_another_world_size(tmp_path: Path) -> None:
    """`stalwart bench reshard` end to end, small: 2 ranks save, 1 rank loads from the checkpoint and from node
    memory (its checks: every byte of the state is in the loaded shards, read from that tier), beside the floor; a
    --dir that cannot be made is one line."""
    import json

    here = dict(os.environ)
    done = stalwart(
        "bench",
        "reshard",
        "--size",
        "2MB",
        "--from",
        "2",
        "--to",
        "1",
        "--dir",
        str(tmp_path),
        "--json",
        env=here,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert [(r["to"], r["tier"]) for r in report["rounds"]] == [(1, "durable"), (1, "memory")]
    assert all(r["reshard_s"] > 0 and r["floor_s"] > 0 for r in report["rounds"])
    assert report["state_bytes"] == 8 * 1024 * 4 * (2 * 10**6 // (8 * 1024 * 4))
    assert list(tmp_path.iterdir()) == [], "its directory is removed"
    (tmp_path / "file").write_text("")
    bad = stalwart("bench", "reshard", "--dir", str(tmp_path / "file" / "x"), env=here)
    assert bad.returncode == 1 and "cannot be made" in bad.stderr and "Traceback" not in bad.stderr
    tier = stalwart("bench", "reshard", "--tiers", "disk", env=here)
    assert tier.returncode == 2 and "--tiers takes durable,memory" in tier.stderr and "Traceback" not in tier.stderr


def test_a_durable_shard_is_read_and_checked_only_in_the_blocks_that_overlap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 4-rank checkpoint loaded on 3 ranks needs part of a saved shard: with per-block checksums only the blocks
    holding that part are read (not 1.5x the state's bytes); damage in another block does not matter, in one of
    them it is found; a shard without blocks (a small one, a compressed delta) is read whole, as before."""
    from stalwart.checkpoint.format import layout
    from stalwart.checkpoint.format.serialize import dtype_name
    from stalwart.checkpoint.load.shards import DurableShards
    from stalwart.checkpoint.load.verify import read_tensor
    from stalwart.checkpoint.storage import open_storage
    from stalwart.errors import CheckpointCorruptError

    monkeypatch.setattr(layout, "BLOCK_BYTES", 64)
    storage = open_storage(tmp_path)
    shard = torch.arange(40 * 8, dtype=torch.float32).reshape(40, 8)  # 32 bytes a row: 20 blocks
    raw = shard.numpy().tobytes()
    rel, tid = "step_00000001/rank00000.t.data", "D/model/w@0"
    (tmp_path / "step_00000001").mkdir()
    storage.write_bytes(rel, b"x" * 16 + raw)
    blocks, size = layout.block_digests(tid, raw)
    entry = layout.TensorEntry(rel, 16, len(raw), len(raw), dtype_name(torch.float32), (40, 8), layout.xxh3(raw),
                               blocks=blocks, block_bytes=size)  # fmt: skip
    assert len(entry.blocks) == 20 and layout.TensorEntry.from_json(entry.to_json()) == entry
    monkeypatch.setattr(layout, "BLOCK_BYTES", 128)  # a later version's block size reads the entry as written
    shards = DurableShards(storage, layout.Manifest(1, 1, "t", [], {tid: entry}, 0.0))
    out = torch.empty(10, 8)
    assert shards.read_region(tid, [40, 8], (slice(13, 23), slice(0, 8)), out)
    assert torch.equal(out, shard[13:23]) and shards.bytes == 6 * 64, "rows 13-22: bytes 416-735, blocks 6-11"
    assert not shards.read_region(tid, [40, 8], (slice(0, 40), slice(0, 4)), torch.empty(40, 4)), "not one range"
    with open(tmp_path / rel, "r+b") as f:  # a bit flipped in row 30
        f.seek(16 + 30 * 32)
        byte = f.read(1)[0]
        f.seek(16 + 30 * 32)
        f.write(bytes([byte ^ 1]))
    assert shards.read_region(tid, [40, 8], (slice(13, 23), slice(0, 8)), out) and torch.equal(out, shard[13:23])
    with pytest.raises(CheckpointCorruptError, match="block 15"):
        shards.read_region(tid, [40, 8], (slice(28, 32), slice(0, 8)), torch.empty(4, 8))
    with pytest.raises(CheckpointCorruptError, match="xxh3"):
        read_tensor(storage, entry, None)
    whole = layout.TensorEntry(rel, 16, len(raw), len(raw), entry.dtype, entry.shape, entry.xxh3)
    shards = DurableShards(storage, layout.Manifest(1, 1, "t", [], {tid: whole}, 0.0))
    assert not shards.read_region(tid, [40, 8], (slice(13, 23), slice(0, 8)), out) and shards.bytes == 0
