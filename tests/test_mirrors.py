"""A job's mirrors (issue 46): each committed checkpoint copied in the background to other locations, verified
there, `keep_last` applied there; a mirror that is down never stalls a save and is caught up when it answers; a
job pointed at a mirror resumes from it. Local directories here; tests/test_s3.py copies to and from a real S3
server with `stalwart ckpt sync`, which copies the same way (checkpoint/save/step_copy.py)."""

from __future__ import annotations

import json
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import stalwart
from conftest import open_checkpointer, run_forked_ranks, tiny_args, wait_for
from stalwart.checkpoint.format import layout
from stalwart.checkpoint.save import failover
from stalwart.checkpoint.storage import open_storage
from stalwart.cli import main
from stalwart.errors import CheckpointError, ConfigError
from stalwart.job.config import CheckpointOptions
from stalwart.telemetry.events import read_events


def _events(log: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(log) if e["event"] == kind]


def _state(step: int) -> dict[str, Any]:
    return {"step": step, "world_size": 1, "objects": {"w": {"weight": torch.full((64, 64), float(step))}}}


def _committed(root: Path) -> list[int]:
    return layout.committed_steps(open_storage(root))


def test_each_commit_is_copied_to_every_mirror_verified_with_keep_last_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log, mirrors = tmp_path / "events.jsonl", [tmp_path / "m1", tmp_path / "m2"]
    ck = open_checkpointer(tmp_path / "ck", log, keep_last=2, mirrors=[{"url": str(m)} for m in mirrors])
    for step in (1, 2, 3, 4):
        assert ck.save(step, _state(step), wait=True)
    ck.close()  # the persister gives the pending copies their time before it ends
    for mirror in mirrors:
        # The newest commit reaches every mirror; an older one may have been replaced by a newer commit before its
        # turn (each mirror has one step pending), so which older one is there depends on the pace: at most
        # keep_last in all, applied at the mirror too.
        steps = _committed(mirror)
        assert steps[0] == 4 and len(steps) <= 2, steps
        assert main(["ckpt", "verify", str(mirror), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["checkpoints"] == {str(s): [] for s in steps}
    mirrored = _events(log, "mirrored")
    assert {(e["location"], e["step"]) for e in mirrored} >= {(str(m), 4) for m in mirrors}
    assert all(e["lag_s"] >= e["seconds"] >= 0 and e["bytes"] > 0 for e in mirrored), mirrored
    assert not _events(log, "mirror_unreachable")


def test_a_mirror_that_is_down_stalls_nothing_and_is_caught_up(tmp_path: Path) -> None:
    """The mirror's parent is a file at first (every copy fails, as for a store that does not answer); the saves
    commit on the primary all the same. Once the path can be made, the next try copies the newest commit."""
    log, blocker = tmp_path / "events.jsonl", tmp_path / "blocker"
    blocker.write_text("not a directory")
    mirror = blocker / "mirror"
    ck = open_checkpointer(tmp_path / "ck", log, keep_last=3, mirrors=[{"url": str(mirror)}])
    for step in (1, 2):
        assert ck.save(step, _state(step), wait=True)
    assert _committed(tmp_path / "ck") == [2, 1], "the primary's saves go on"
    [down] = wait_for(lambda: _events(log, "mirror_unreachable"), 60, "the mirror to be found down")
    assert down["location"] == str(mirror) and down["error"], down
    blocker.unlink()  # the store answers again
    assert ck.save(3, _state(3), wait=True)
    [back] = wait_for(lambda: _events(log, "mirror_caught_up"), 60, "the mirror to be caught up")
    assert back["step"] in (2, 3) and back["outage_s"] > 0  # 2 if its retry came before step 3's commit
    ck.close()
    # The newest commit, not every one it missed: step 1 never reaches it (step 2 replaced it while it was down).
    assert _committed(mirror)[0] == 3 and 1 not in _committed(mirror), _committed(mirror)
    assert len(_events(log, "mirror_unreachable")) == 1, "once per outage"


def test_a_job_with_a_mirror_resumes_from_it_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The region's loss: the primary is gone; a new launch elsewhere resumes bitwise from the mirror, pointed at
    it as its checkpoint directory or with a new checkpoint directory and the mirror as its mirror (failover)."""

    def train(ckpt: Path, steps: int, **options: Any) -> torch.Tensor:
        job = stalwart.Job(ckpt, checkpoint_every=2, **options)
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        job.track(model=model, optim=optim)
        for step, _ in job.steps(None, max_steps=steps):
            loss = model(torch.full((2, 3), float(step))).pow(2).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
        job.close()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    straight = train(tmp_path / "straight", 8)
    m1, m2 = tmp_path / "m1", tmp_path / "m2"
    train(tmp_path / "primary", 6, mirrors=[str(m1), str(m2)])
    assert _committed(m1)[0] == 6 and _committed(m2)[0] == 6
    assert torch.equal(straight, train(m1, 8))
    log = tmp_path / "events.jsonl"
    monkeypatch.setenv("STALWART_EVENT_LOG", str(log))
    assert torch.equal(straight, train(tmp_path / "elsewhere", 8, mirrors=[str(m2)]))
    [resumed] = _events(log, "resumed")
    assert (resumed["step"], resumed["mirror"]) == (6, str(m2)), resumed
    assert _committed(tmp_path / "elsewhere")[0] == 8, "saves go to the new checkpoint directory"


def _flip_a_byte(root: Path, step: int) -> None:
    """Damage one tensor byte of `step` under `root` in place (the manifest and sizes stay as they were)."""
    manifest = layout.read_manifest(open_storage(root), step)
    data = root / next(iter(manifest.tensors.values())).file
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def test_a_load_takes_the_newest_step_that_verifies_in_any_location(tmp_path: Path) -> None:
    """Failover at load: every location's committed steps are candidates, newest first and the checkpoint
    directory first at equal steps; a copy that does not verify (damaged, or a manifest without its files) falls
    back to the next, is never loaded, and is moved aside where it lies."""
    primary, m1, m2 = tmp_path / "ck", tmp_path / "m1", tmp_path / "m2"
    ck = open_checkpointer(primary, keep_last=5)
    for step in (1, 2, 3, 4):
        assert ck.save(step, _state(step), wait=True)
    ck.close()
    for mirror, steps in ((m1, (2, 3, 4)), (m2, (2,))):
        for step in steps:
            assert main(["ckpt", "sync", str(primary), str(mirror), "--step", str(step)]) == 0

    def load(**options: Any) -> tuple[int, str, list[dict[str, Any]]]:
        log = tmp_path / f"events{len(list(tmp_path.glob('events*')))}.jsonl"
        ck = open_checkpointer(primary, log, keep_last=5, mirrors=[{"url": str(m1)}, {"url": str(m2)}], **options)
        restored = ck.load_latest()
        ck.close()
        assert restored is not None
        assert torch.equal(restored.state["objects"]["w"]["weight"], _state(restored.step)["objects"]["w"]["weight"])
        return restored.step, restored.mirror, _events(log, "checkpoint_quarantined")

    assert load() == (4, "", []), "the checkpoint directory first at equal steps"
    _flip_a_byte(primary, 4)
    step, mirror, moved = load()
    assert (step, mirror) == (4, str(m1)), "the same step from the mirror"
    assert [(e["step"], Path(e["path"]).parent) for e in moved] == [(4, primary)], "moved aside where it lies"
    assert _committed(primary) == [3, 2, 1]
    for name in (m1 / layout.step_dir_name(4)).iterdir():  # a manifest there without its files
        if name.name != layout.MANIFEST:
            name.unlink()
    (m1 / layout.step_dir_name(3) / layout.MANIFEST).unlink()  # an interrupted copy: never a candidate
    assert load()[:2] == (3, ""), "m1's step 4 never loads: the next candidate is the primary's step 3"
    shutil.rmtree(primary)  # the region is lost: a new launch with an empty checkpoint directory
    assert load()[:2] == (2, str(m1)), "the newest step that verifies among the mirrors, the first at equal steps"


def test_a_start_from_step_0_needs_every_location_listed(tmp_path: Path) -> None:
    """A mirror that cannot be listed for a moment must not turn a resume into a fresh run: with nothing found
    elsewhere, the start fails as a store that cannot be read fails (the launcher tries again); with a checkpoint
    found elsewhere, it loads."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)  # listing it fails (ELOOP), as a store that does not answer does
    log = tmp_path / "events.jsonl"
    ck = open_checkpointer(tmp_path / "ck", log, mirrors=[{"url": str(loop)}])
    with pytest.raises(CheckpointError, match="cannot list"):
        ck.load_latest()
    ck.close()
    assert _events(log, "checkpoint_list_failed")[0]["location"] == str(loop)
    ck = open_checkpointer(tmp_path / "ck")
    assert ck.save(1, _state(1), wait=True)
    ck.close()
    ck = open_checkpointer(tmp_path / "ck", log, mirrors=[{"url": str(loop)}])
    restored = ck.load_latest()
    assert restored is not None and restored.step == 1 and not restored.mirror


class _Outage:
    """The checkpoint directory down for a while, its data kept: moved aside, a file in its place (every write fails,
    as with a store that does not answer), then put back."""

    def __init__(self, root: Path) -> None:
        self.root, self.away = root, root.with_name(root.name + ".away")

    def __enter__(self) -> None:
        self.root.rename(self.away)
        self.root.write_text("the store is down")

    def __exit__(self, *exc: object) -> None:
        self.root.unlink()
        self.away.rename(self.root)


def test_durable_in_all_counts_a_save_once_every_location_has_it(tmp_path: Path) -> None:
    """durable_in="all": a save the trainer waits on returns once every mirror holds it; with a mirror that cannot
    take it, the save is reported not committed (`checkpoint_not_everywhere`) at the persist deadline, though the
    checkpoint directory has it."""
    log, mirrors = tmp_path / "events.jsonl", [tmp_path / "m1", tmp_path / "m2"]
    ck = open_checkpointer(tmp_path / "ck", log, mirrors=[{"url": str(m)} for m in mirrors], durable_in="all")
    for step in (1, 2):
        assert ck.save(step, _state(step), wait=True)
        assert all(_committed(m)[0] == step for m in mirrors), "on every mirror when save() returned"
    ck.close()
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    down = {"url": str(blocker / "m3")}
    ck = open_checkpointer(tmp_path / "ck", log, mirrors=[down], durable_in="all", persist_timeout_s=2)
    assert not ck.save(3, _state(3), wait=True), "not on every location within the deadline"
    [missing] = _events(log, "checkpoint_not_everywhere")
    assert missing["step"] == 3 and missing["missing"] == [down["url"]], missing
    assert _committed(tmp_path / "ck")[0] == 3, "committed in the checkpoint directory all the same"
    with pytest.raises(ConfigError, match="durable_in"):
        CheckpointOptions(dir="/ck", durable_in="most")


def test_with_the_checkpoint_directory_down_saves_commit_in_a_mirror_and_it_is_caught_up(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Each save tries the primary for failover_s, then commits in the mirror, and rank 0 says so once; no save is
    given up. When the primary answers again, the newest commit is copied back there and saves go there again."""
    log, primary, mirror = tmp_path / "events.jsonl", tmp_path / "ck", tmp_path / "mirror"
    ck = open_checkpointer(primary, log, keep_last=5, mirrors=[{"url": str(mirror)}], failover_s=0.5)
    assert ck.save(1, _state(1), wait=True)
    with _Outage(primary):
        for step in (2, 3):
            assert ck.save(step, _state(step), wait=True), "a checkpoint commits in the mirror"
        assert _committed(mirror)[:2] == [3, 2]
        moved = _events(log, "checkpoint_failover")
        assert {(e["step"], e["location"], e["to"]) for e in moved} == {(s, str(primary), str(mirror)) for s in (2, 3)}
        committed = {e["step"]: e["path"] for e in _events(log, "checkpoint_committed")}
        assert Path(committed[3]).parent == mirror, committed
        assert capfd.readouterr().err.count("the checkpoint directory does not answer") == 1, "said once per outage"
    caught_up = lambda: [e for e in _events(log, "mirror_caught_up") if e["location"] == str(primary)]  # noqa: E731
    assert wait_for(caught_up, 60, "the primary to be caught up")[0]["step"] == 3
    assert ck.save(4, _state(4), wait=True)
    assert Path(_events(log, "checkpoint_committed")[-1]["path"]).parent == primary, "saves go there again"
    assert "the checkpoint directory answers again" in capfd.readouterr().err
    ck.close()
    # The newest commit made in the mirror is copied back (step 2's copy was replaced by step 3's while it was down).
    assert _committed(primary)[:2] == [4, 3] and main(["ckpt", "verify", str(primary)]) == 0
    restored = open_checkpointer(primary, mirrors=[{"url": str(mirror)}]).load_latest()
    assert restored is not None and restored.step == 4 and not restored.mirror


def test_a_delta_does_not_fail_over_and_a_checkpoint_in_a_mirror_is_no_deltas_base(tmp_path: Path) -> None:
    """A delta's base may not be in the mirror: a delta keeps to the checkpoint directory (given up while it is
    down), the save after a delta given up is a full one (which may fail over), and a checkpoint committed in a
    mirror is never the base of a later delta."""
    log, primary, mirror = tmp_path / "events.jsonl", tmp_path / "ck", tmp_path / "mirror"
    options: dict[str, Any] = {"full_every": 3, "failover_s": 0.3, "persist_timeout_s": 2}
    ck = open_checkpointer(primary, log, keep_last=9, mirrors=[{"url": str(mirror)}], **options)
    assert ck.save(1, _state(1), wait=True)  # full
    with _Outage(primary):
        assert not ck.save(2, _state(2), wait=True), "a delta on step 1: not written in the mirror"
        assert ck.save(3, _state(3), wait=True), "full after it: committed in the mirror"
    assert ck.save(4, _state(4), wait=True)
    assert ck.save(5, _state(5), wait=True)
    ck.close()
    storage = open_storage(primary)
    assert layout.read_manifest(storage, 4).base is None, "not a delta on step 3, committed in the mirror"
    assert layout.read_manifest(storage, 5).base == 4
    assert {e["step"] for e in _events(log, "checkpoint_failover")} == {3}


def test_rank_0_commits_where_every_shard_is_and_gives_up_a_split_save() -> None:
    """failover.py's rule for the commit: rank 0's own location when every other rank's meta file is there, else
    the one location where they all are (rank 0 writes its shard there too), else none; when each is somewhere but
    no location holds them all, the save is split and given up."""
    wanted = {"meta-1", "meta-2"}
    assert failover.one_place({0: {"meta-1", "meta-2", "data-1"}}, wanted, 0) == 0
    assert failover.one_place({0: {"meta-1"}, 1: {"meta-1", "meta-2"}}, wanted, 0) == 1, "the others failed over"
    assert failover.one_place({0: {"meta-1", "meta-2"}, 1: {"meta-1", "meta-2"}}, wanted, 1) == 1, "its own first"
    assert failover.one_place({0: {"meta-1"}, 1: set()}, wanted, 0) is None, "rank 2 is still writing"
    assert failover.split({0: {"meta-1"}, 1: set()}, wanted) is None
    assert (
        failover.split({0: {"meta-1"}, 1: {"meta-2"}}, wanted) == "['meta-1'] in location 0; ['meta-2'] in location 1"
    )
    assert failover.one_place({0: set()}, set(), 0) == 0, "one rank: its own location"


def _split_rank(rank: int, store_path: str, root: str) -> None:
    """Rank 1's writes fail in the checkpoint directory (it moves on to the mirror), rank 0's do not: rank 0 writes
    its shard again in the mirror and commits there."""
    from stalwart.checkpoint import Checkpointer
    from stalwart.runtime.dist import Comm, Placement
    from stalwart.telemetry.events import EventLog

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    comm = Comm(Placement(rank, 2, rank, 0), timedelta(seconds=30))
    faults = {"storage_error": {"errno": "EIO", "times": 2}} if rank == 1 else None
    ck = Checkpointer(
        f"{root}/ck",
        comm,
        EventLog(f"{root}/events.jsonl", rank=rank),
        keep_last=3,
        token="t",
        mirrors=[{"url": f"{root}/mirror"}],
        failover_s=0.3,
        save_faults=lambda step: faults if step == 2 else None,
    )
    try:
        state = {"step": 2, "world_size": 2, "objects": {"w": {"weight": torch.full((8,), float(rank))}}}
        assert ck.save(2, state, wait=True), "committed"
        restored = ck.load_latest()
        assert restored is not None and restored.step == 2 and restored.mirror == f"{root}/mirror", restored
        assert torch.equal(restored.state["objects"]["w"]["weight"], torch.full((8,), float(rank)))
    finally:
        ck.close()
        dist.destroy_process_group()


def test_rank_0_joins_the_other_ranks_shards_in_the_mirror(tmp_path: Path) -> None:
    run_forked_ranks(_split_rank, tmp_path, str(tmp_path), timeout=120)
    events = read_events(tmp_path / "events.jsonl")
    moved = sorted((e["rank"], e["to"]) for e in events if e["event"] == "checkpoint_failover")
    assert moved == [(0, str(tmp_path / "mirror")), (1, str(tmp_path / "mirror"))], moved
    assert layout.committed_steps(open_storage(tmp_path / "mirror")) == [2]


def test_prometheus_shows_each_mirrors_step_lag_and_state() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from stalwart.telemetry.metrics import RunMetrics

    registry = CollectorRegistry()
    metrics = RunMetrics(registry)
    for e in (
        {"event": "mirrored", "rank": 0, "step": 20, "location": "s3://eu/run", "lag_s": 1.5},
        {"event": "mirrored", "rank": 0, "step": 20, "location": "/nfs/run", "lag_s": 0.25},
        {"event": "mirror_unreachable", "rank": 0, "step": 30, "location": "/nfs/run"},
        {"event": "checkpoint_failover", "rank": 0, "step": 30, "location": "s3://us/run", "to": "s3://eu/run"},
        {"event": "checkpoint_failover", "rank": 1, "step": 30, "location": "s3://us/run", "to": "s3://eu/run"},
    ):
        metrics.observe(e)
    text = generate_latest(registry).decode()
    for line in (
        'stalwart_mirror_step{location="s3://eu/run"} 20.0',
        'stalwart_mirror_lag_seconds{location="s3://eu/run"} 1.5',
        'stalwart_mirror_up{location="s3://eu/run"} 1.0',
        'stalwart_mirror_up{location="/nfs/run"} 0.0',
        "stalwart_checkpoint_failovers_total 1.0",
    ):
        assert line in text.splitlines(), (line, text)


def test_bench_mirror_read_resumes_from_the_mirror_and_reports_the_raw_floor(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`stalwart bench mirror-read`: each resume must come from the mirror (the bench fails otherwise); the report
    has both reads of every size and their ratio. The figures are docs/benchmarks.md's, not asserted here."""
    assert main(["bench", "mirror-read", "--sizes", "4MB", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["sizes"]
    assert row["bytes"] >= 4_000_000 and row["raw_s"] > 0 and row["resume_s"] > 0
    assert row["ratio"] == pytest.approx(row["raw_s"] / row["resume_s"]) and report["cold"] is False


def test_a_delta_copied_alone_keeps_its_base_there_through_retention(tmp_path: Path) -> None:
    """A delta copied to a mirror brings its base's files without the base's manifest; retention there must keep
    them (they are no interrupted save), or the mirror would hold a delta that cannot load."""
    primary, mirror = tmp_path / "ck", tmp_path / "mirror"
    ck = open_checkpointer(primary, keep_last=3, full_every=2)
    frozen = torch.arange(4096, dtype=torch.float32)  # unchanged: the delta points into its base for it
    for step in (1, 2):
        state = _state(step)
        state["objects"]["w"]["frozen"] = frozen
        assert ck.save(step, state, wait=True)
    ck.close()
    assert main(["ckpt", "sync", str(primary), str(mirror), "--step", "2"]) == 0
    storage = open_storage(mirror)
    manifest = layout.read_manifest(storage, 2)
    assert manifest.base == 1 and _committed(mirror) == [2] and (mirror / layout.step_dir_name(1)).is_dir()
    layout.prune(storage, 1, manifest)
    restored = open_checkpointer(tmp_path / "elsewhere", mirrors=[{"url": str(mirror)}]).load_latest()
    assert restored is not None and restored.step == 2 and restored.mirror == str(mirror)


def test_a_rollback_sets_the_abandoned_steps_aside_in_every_location(tmp_path: Path) -> None:
    """Steps after a rollback's target are a history the job abandoned: a later start, which lists the mirrors
    too, must not resume from a mirror's copy of them."""
    log, primary, mirror = tmp_path / "events.jsonl", tmp_path / "ck", tmp_path / "mirror"
    ck = open_checkpointer(primary, log, keep_last=5, mirrors=[{"url": str(mirror)}])
    for step in (1, 2, 3):
        assert ck.save(step, _state(step), wait=True)
        wait_for(lambda step=step: step in _committed(mirror), 60, f"step {step} on the mirror")
    assert ck.set_aside_after(1, "a test's rollback") == [2, 3]
    assert _committed(primary) == [1] and _committed(mirror) == [1]
    aside = {(e["step"], Path(e["path"]).parent) for e in _events(log, "checkpoint_set_aside")}
    assert aside == {(s, where) for s in (2, 3) for where in (primary, mirror)}, aside
    restored = ck.load_latest()
    assert restored is not None and restored.step == 1


def test_a_copy_killed_half_way_is_never_a_checkpoint_and_the_next_copy_tidies_it(tmp_path: Path) -> None:
    """The persister killed while it copies a commit to the mirror (its process SIGKILLed as soon as the step's
    directory appears there, before the manifest): that step is not committed there, nothing loads it, and the next
    save's copy commits and prunes the remains. Should the copy finish before the kill lands (a fast disk), the step
    is there whole and verified: both outcomes are checked for what must hold."""
    import os
    import signal

    log, primary, mirror = tmp_path / "events.jsonl", tmp_path / "ck", tmp_path / "mirror"
    big = {"step": 1, "world_size": 1, "objects": {"w": {"weight": torch.randn(32 << 20 >> 2)}}}  # 32 MiB
    ck = open_checkpointer(primary, log, keep_last=2, mirrors=[{"url": str(mirror)}])
    assert ck.save(1, big, wait=True)
    step_dir = mirror / layout.step_dir_name(1)
    wait_for(lambda: step_dir.is_dir(), 60, "the copy to start")
    os.kill(ck._bg._proc.pid, signal.SIGKILL)
    ck.close()
    assert _committed(mirror) in ([], [1]), "a copy is committed whole or not at all"
    assert main(["ckpt", "verify", str(mirror)]) == 0, "what the mirror holds as committed verifies"
    ck = open_checkpointer(primary, log, keep_last=2, mirrors=[{"url": str(mirror)}])
    assert ck.save(2, _state(2), wait=True)
    ck.close()  # its copy commits before the persister ends
    assert _committed(mirror)[0] == 2 and main(["ckpt", "verify", str(mirror)]) == 0
    restored = open_checkpointer(tmp_path / "elsewhere", mirrors=[{"url": str(mirror)}]).load_latest()
    assert restored is not None and restored.step == 2


def test_a_mirror_back_after_the_primary_pruned_what_it_missed_gets_the_newest(tmp_path: Path) -> None:
    """The mirror down for three saves while the primary keeps one checkpoint (it pruned the steps the mirror
    missed): back, it gets the newest commit, not a step that is gone, and reports no outage for those."""
    log, blocker = tmp_path / "events.jsonl", tmp_path / "blocker"
    blocker.write_text("not a directory")
    mirror = blocker / "mirror"
    ck = open_checkpointer(tmp_path / "ck", log, keep_last=1, mirrors=[{"url": str(mirror)}])
    for step in (1, 2, 3):
        assert ck.save(step, _state(step), wait=True)
    assert _committed(tmp_path / "ck") == [3], "the primary pruned 1 and 2"
    blocker.unlink()
    assert ck.save(4, _state(4), wait=True)
    ck.close()
    assert _committed(mirror) == [4]
    restored = open_checkpointer(tmp_path / "elsewhere", mirrors=[{"url": str(mirror)}]).load_latest()
    assert restored is not None and restored.step == 4
    assert len(_events(log, "mirror_unreachable")) == 1 and len(_events(log, "mirror_caught_up")) == 1


def test_a_file_of_the_same_name_and_size_left_in_the_mirror_is_copied_again(tmp_path: Path) -> None:
    """A save that failed over to the mirror and was then committed in the checkpoint directory (rank 0's shard
    written again where the other ranks' were) leaves its files in the mirror; rank 0's meta file there has the
    committed one's name and size but not its bytes. The mirror's copy of that step does not take it as copied
    (fc137, 2026-12-01: `mirror_unreachable`, the copy does not verify)."""
    from stalwart.checkpoint.save.step_copy import copy_step

    ck = open_checkpointer(tmp_path / "ck", tmp_path / "ck.jsonl")
    assert ck.save(1, _state(1), wait=True)
    ck.close()
    src, dst = open_storage(tmp_path / "ck"), open_storage(tmp_path / "m")
    layout.prepare_root(dst, create=True)
    step_dir = layout.step_dir_name(1)
    [meta] = [p for p in (tmp_path / "ck" / step_dir).iterdir() if p.name.endswith(".meta.json")]
    left = tmp_path / "m" / step_dir / meta.name
    left.parent.mkdir(parents=True)
    left.write_bytes(bytes(b ^ 1 for b in meta.read_bytes()))  # same name and size, other bytes
    copy = copy_step(src, dst, 1)
    assert not copy.problem, copy.problem
    assert left.read_bytes() == meta.read_bytes() and _committed(tmp_path / "m") == [1]


def test_a_copy_whose_step_the_primary_pruned_meanwhile_is_no_outage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The primary's retention removed the step while it was being copied (keep_last, saves faster than the copies):
    that copy failed for nothing, and the mirror is not reported unreachable; a copy that fails while the step is
    still committed is (what fc130 met under load, 2026-11-30, as a `mirror_unreachable` for a local mirror)."""
    import time

    from stalwart.checkpoint.save import mirroring
    from stalwart.telemetry.events import EventLog

    ck = open_checkpointer(tmp_path / "ck", tmp_path / "ck.jsonl", keep_last=2)
    assert ck.save(1, _state(1), wait=True)
    ck.close()
    primary, real = open_storage(tmp_path / "ck"), mirroring.copy_step

    def pruned_meanwhile(src: Any, dst: Any, step: int, **kwargs: Any) -> Any:
        shutil.rmtree(tmp_path / "ck" / layout.step_dir_name(step))
        return real(src, dst, step, **kwargs)

    log = tmp_path / "events.jsonl"
    mirrors = mirroring.Mirrors(EventLog(log))
    mirror = mirroring._Mirror(str(tmp_path / "m"), None)
    monkeypatch.setattr(mirroring, "copy_step", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    assert mirrors._copy(mirror, primary, 1, time.monotonic(), 2) == "OSError: disk full"
    monkeypatch.setattr(mirroring, "copy_step", pruned_meanwhile)
    assert mirrors._copy(mirror, primary, 1, time.monotonic(), 2) is None
    assert not _events(log, "mirrored"), "nothing was copied"

    class Down:
        def exists(self, rel: str) -> bool:
            raise OSError("connection refused")

    # The copy's source stopped answering: its outage, not the mirror's (fc137's run of the S3 test, 2026-12-01).
    assert not mirroring._still_committed(Down(), 1)  # type: ignore[arg-type]


def test_stalwart_run_mirror_keeps_a_scripts_checkpoints_there(launch: Any) -> None:
    """A script that cannot change: `stalwart run --mirror DIR` gives its Job the mirror (the tiny job passes no
    mirrors=); the run's last checkpoint is there, verified, once the run ended."""
    job = launch(["--mirror", "mirror", *tiny_args("--steps", "8")])
    assert job.wait(180) == 0, job.output()
    assert _committed(job.workdir / "mirror")[0] == 8
    assert {e["step"] for e in job.events("mirrored")} >= {8}


def test_stalwart_run_failover_s_is_the_jobs_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """`stalwart run --failover-s S` reaches a script that cannot change through STALWART_FAILOVER_S; the script's
    own value wins; a value that is no number is one clear error."""
    assert CheckpointOptions(dir="/ck").failover_s == 20.0
    monkeypatch.setenv("STALWART_FAILOVER_S", "0.5")
    assert CheckpointOptions(dir="/ck").failover_s == 0.5
    assert CheckpointOptions(dir="/ck", failover_s=3.0).failover_s == 3.0
    monkeypatch.setenv("STALWART_FAILOVER_S", "soon")
    with pytest.raises(ConfigError, match="STALWART_FAILOVER_S must be a number of seconds"):
        CheckpointOptions(dir="/ck")


@pytest.mark.parametrize(
    ("mirrors", "message"),
    [
        ("s3://one/run", "must be a list of locations"),
        ([""], "each of mirrors must be a path"),
        ([{"url": "/m", "opts": {}}], "each of mirrors must be a path"),
        ([{"url": "/m", "options": "x"}], "options must be a dict"),
        (["/ck"], "is checkpoint_dir itself"),
    ],
)
def test_bad_mirrors_are_one_clear_error(mirrors: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CheckpointOptions(dir="/ck", mirrors=mirrors)
