"""Checkpoint invariants in one process: commit, retention, corruption fallback, safe loading, bad input,
the background persist (retries, the one-save-in-flight rule), delta checkpoints and the memory:// store."""

from __future__ import annotations

import base64
import io
import json
import os
import threading
from collections import OrderedDict, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from conftest import open_checkpointer
from stalwart.checkpoint import Checkpointer
from stalwart.checkpoint.format import layout
from stalwart.checkpoint.format.serialize import check_loadable
from stalwart.checkpoint.storage import LocalStorage
from stalwart.errors import CheckpointMismatchError, ConfigError, NoValidCheckpointError, UnsavableStateError
from stalwart.telemetry.events import read_events


def _checkpointer(root: Path | str, keep_last: int = 3, log: Path | None = None, **options: Any) -> Checkpointer:
    return open_checkpointer(root, log, keep_last=keep_last, **options)


def _state(step: int) -> dict[str, Any]:
    return {"step": step, "objects": {"w": {"weight": torch.full((4, 4), float(step))}}}


def _storage_error(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    """A save's chaos that fails its first data writes (chaos/save_faults.py)."""
    return None if spec is None else {"storage_error": spec}


def _committed(root: Path) -> list[int]:
    return layout.committed_steps(LocalStorage(root))


def _data_file(step_dir: Path) -> Path:
    return next(step_dir.glob("rank*.data"))


def test_save_then_load_roundtrip(tmp_path: Path) -> None:
    ck = _checkpointer(tmp_path / "ck")
    assert ck.save(5, _state(5), wait=True)
    restored = ck.load_latest()
    assert restored is not None and restored.step == 5
    assert torch.equal(restored.state["objects"]["w"]["weight"], torch.full((4, 4), 5.0))


def test_save_returns_after_the_snapshot_and_persists_in_the_background(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    ck = _checkpointer(tmp_path / "ck", log=log)
    weight = torch.full((256, 256), 1.0)
    assert ck.save(1, {"objects": {"w": {"weight": weight}}}) is True
    weight.fill_(2.0)  # the training loop goes on changing its tensors: the snapshot must not see it
    assert ck.wait_durable()
    restored = ck.load_latest()
    assert restored is not None and torch.equal(restored.state["objects"]["w"]["weight"], torch.full((256, 256), 1.0))
    committed = [e for e in read_events(log) if e["event"] == "checkpoint_committed"]
    assert committed and committed[0]["source"] == "persister" and committed[0]["pid"] != os.getpid()


def test_retention_keeps_last_n_and_clears_interrupted_saves(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    ck = _checkpointer(root, keep_last=2)
    for step in (1, 2, 3):
        ck.save(step, _state(step), wait=True)
    (root / "step_00000002" / "manifest.json").unlink()  # step 2 becomes an interrupted save
    stale = root / "step_00000004" / "rank00000.old-1.data"
    stale.parent.mkdir()
    stale.write_bytes(b"from a crashed attempt at step 4")
    ck.save(4, _state(4), wait=True)
    assert sorted(p.name for p in root.iterdir()) == [
        ".recycle",  # where retired data files wait for a full save to overwrite them
        "stalwart-checkpoints.json",
        "step_00000003",
        "step_00000004",
    ]
    assert sorted(p.name for p in (root / "step_00000004").iterdir()) == [
        "manifest.json",
        "rank00000.t-4.data",
        "rank00000.t-4.meta.json",
    ]


def test_retired_data_files_are_recycled_by_the_next_full_save(tmp_path: Path) -> None:
    """Retention moves a pruned data file to .recycle/ and the next full save overwrites it in place (same
    inode), so no big file is unlinked; every kept checkpoint still verifies and loads exactly."""
    root = tmp_path / "ck"
    ck = _checkpointer(root, keep_last=1)
    inodes = []
    for step in range(1, 6):
        big = {"w": torch.full((64, 1024), float(step)), "tail": torch.arange(10 - step)}  # files shrink
        assert ck.save(step, {"objects": {"o": big}}, wait=True)
        inodes.append(_data_file(root / f"step_{step:08d}").stat().st_ino)
    assert [p.name for p in (root / ".recycle").iterdir()] == ["rank00000.data"]
    assert len(set(inodes)) == 2, "two files take turns: the live one and the recycled one"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_00000005"]
    restored = ck.load_latest()
    assert restored is not None and restored.step == 5
    assert torch.equal(restored.state["objects"]["o"]["w"], torch.full((64, 1024), 5.0))
    assert torch.equal(restored.state["objects"]["o"]["tail"], torch.arange(5))
    assert _data_file(root / "step_00000005").stat().st_size == 64 * 1024 * 4 + 5 * 8  # longer old file truncated


def test_save_without_manifest_is_invisible(tmp_path: Path) -> None:
    ck = _checkpointer(tmp_path / "ck")
    ck.save(1, _state(1), wait=True)
    ck.save(2, _state(2), wait=True)
    (tmp_path / "ck" / "step_00000002" / "manifest.json").unlink()  # as if killed before the commit
    restored = ck.load_latest()
    assert restored is not None and restored.step == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest", "meta"])
def test_damaged_newest_checkpoint_falls_back_with_an_event(tmp_path: Path, damage: str) -> None:
    log = tmp_path / "events.jsonl"
    ck = _checkpointer(tmp_path / "ck", log=log)
    ck.save(1, _state(1), wait=True)
    ck.save(2, _state(2), wait=True)
    step2 = tmp_path / "ck" / "step_00000002"
    shard = _data_file(step2)
    data = shard.read_bytes()
    if damage == "flip":
        shard.write_bytes(data[:10] + bytes([data[10] ^ 1]) + data[11:])
    elif damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "delete":
        shard.unlink()
    elif damage == "meta":
        meta = next(step2.glob("rank*.meta.json"))
        meta.write_text(meta.read_text().replace('"rank": 0', '"rank": 7'))
    else:
        (step2 / "manifest.json").write_text("{not json")
    restored = _checkpointer(tmp_path / "ck", log=log).load_latest()
    assert restored is not None and restored.step == 1
    events = [e["event"] for e in read_events(log)]
    assert "checkpoint_invalid" in events and "checkpoint_quarantined" in events
    assert not step2.exists() and len(list((tmp_path / "ck").glob("step_00000002.invalid-*"))) == 1


def test_loading_never_executes_code_from_a_checkpoint(tmp_path: Path) -> None:
    ck = _checkpointer(tmp_path / "ck")
    ck.save(1, _state(1), wait=True)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (Path.write_text, (marker, "code ran"))

    buf = io.BytesIO()
    torch.save({"objects": Evil()}, buf)  # torch's default protocol: the weights-only unpickler must refuse it
    step = tmp_path / "ck" / "step_00000001"
    meta_path = next(step.glob("rank*.meta.json"))
    meta = json.loads(meta_path.read_text())
    meta["skeleton"] = base64.b64encode(buf.getvalue()).decode()
    payload = json.dumps(meta).encode()
    meta_path.write_bytes(payload)  # a forger who also fixes the manifest's size and checksum
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["ranks"][0].update(bytes=len(payload), xxh3=xxhash.xxh3_64_hexdigest(payload))
    (step / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(NoValidCheckpointError, match="cannot be read safely"):
        _checkpointer(tmp_path / "ck").load_latest()
    assert not marker.exists(), "loading ran code from the checkpoint"


def test_state_that_could_not_be_loaded_back_is_refused_at_save(tmp_path: Path) -> None:
    ck = _checkpointer(tmp_path / "ck")
    with pytest.raises(UnsavableStateError, match=r"state\['objects'\]\['opaque'\] is a .*object"):
        ck.save(1, {"objects": {"opaque": object()}})
    assert _committed(tmp_path / "ck") == []


@pytest.mark.parametrize("value", [np.float64(1.5), np.int64(3), defaultdict(int, a=1), np.zeros(2)])
def test_subclasses_that_weights_only_refuses_are_refused_at_save(value: Any) -> None:
    with pytest.raises(UnsavableStateError):
        check_loadable({"x": value})


def test_everything_accepted_at_save_loads_back(tmp_path: Path) -> None:
    state = {
        "tensor": torch.arange(3),
        "param": torch.nn.Parameter(torch.ones(2)),
        "scalars": [1, 2.5, True, "s", b"b", None, (1, 2)],
        "torch": [torch.Size([2, 3]), torch.float16, torch.device("cpu")],
        "ordered": OrderedDict(a=torch.zeros(1)),
        3: "int key",
        "empty": torch.zeros(0, 3),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
        "bf16": torch.ones(3, dtype=torch.bfloat16),
        "bool": torch.tensor([True, False]),
    }
    ck = _checkpointer(tmp_path / "ck")
    assert ck.save(1, {"objects": {"o": state}}, wait=True)
    restored = ck.load_latest()
    assert restored is not None
    loaded = restored.state["objects"]["o"]
    for key in ("empty", "strided", "bf16", "bool"):
        assert loaded[key].dtype == state[key].dtype and torch.equal(loaded[key], state[key]), key
    assert loaded["scalars"] == state["scalars"] and loaded["torch"] == state["torch"] and loaded[3] == "int key"
    assert torch.equal(loaded["param"], state["param"])


def test_no_valid_checkpoint_stops_instead_of_starting_over(tmp_path: Path) -> None:
    ck = _checkpointer(tmp_path / "ck")
    ck.save(1, _state(1), wait=True)
    shard = _data_file(tmp_path / "ck" / "step_00000001")
    shard.write_bytes(b"garbage")
    with pytest.raises(NoValidCheckpointError, match="none of the 1 checkpoints"):
        _checkpointer(tmp_path / "ck").load_latest()
    assert shard.read_bytes() == b"garbage", "nothing is moved or deleted when nothing verifies"


def test_foreign_directory_is_refused_and_left_alone(tmp_path: Path) -> None:
    root = tmp_path / "theirs"
    root.mkdir()
    (root / "weights.safetensors").write_bytes(b"x")
    with pytest.raises(ConfigError, match="did not write"):
        _checkpointer(root)
    assert [p.name for p in root.iterdir()] == ["weights.safetensors"]


def test_foreign_manifest_is_a_mismatch(tmp_path: Path) -> None:
    ck = _checkpointer(tmp_path / "ck")
    ck.save(1, _state(1), wait=True)
    (tmp_path / "ck" / "step_00000001" / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(CheckpointMismatchError, match="not a stalwart manifest"):
        ck.load_latest()


def test_unwritable_directory_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="not writable"):
        _checkpointer(tmp_path / "file" / "ck")


def test_failing_store_is_retried_with_backoff_and_training_goes_on(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    faults = {2: {"errno": "ENOSPC", "times": 2}}
    ck = _checkpointer(tmp_path / "ck", log=log, save_faults=lambda step: _storage_error(faults.pop(step, None)))
    ck.save(1, _state(1), wait=True)
    assert ck.save(2, _state(2)) is True, "the snapshot is taken; the failing writes happen in the background"
    assert ck.save(3, _state(3)) is False, "one save in flight: the next request is skipped, not queued"
    assert ck.wait_durable(), "the save of step 2 commits once the store works again"
    assert _committed(tmp_path / "ck") == [2, 1]
    events = list(read_events(log))
    retries = [e for e in events if e["event"] == "checkpoint_write_retry"]
    assert [r["attempt"] for r in retries] == [1, 2] and "No space left" in retries[0]["error"]
    assert retries[1]["backoff_s"] > retries[0]["backoff_s"]
    assert any(
        e["event"] == "checkpoint_skipped" and e["step"] == 3 and "still persisting" in e["reason"] for e in events
    )


def test_store_failing_past_the_deadline_gives_up_and_keeps_the_previous(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    faults = {2: {"errno": "EIO", "times": 100}}
    ck = _checkpointer(
        tmp_path / "ck", log=log, persist_timeout_s=1.0, save_faults=lambda step: _storage_error(faults.pop(step, None))
    )
    ck.save(1, _state(1), wait=True)
    assert ck.save(2, _state(2), wait=True) is False
    assert _committed(tmp_path / "ck") == [1]
    assert any(e["event"] == "checkpoint_write_failed" for e in read_events(log))
    assert ck.save(3, _state(3), wait=True) is True, "the next save works again"
    restored = ck.load_latest()
    assert restored is not None and restored.step == 3


def test_delta_checkpoints_write_only_changed_tensors_and_restore_exactly(tmp_path: Path) -> None:
    """Fine-tuning-like: a large frozen tensor, a small trained one. Deltas refer to the last full checkpoint,
    which retention keeps while a kept delta needs it."""
    root = tmp_path / "ck"
    frozen = torch.randn(512, 512)
    head = torch.zeros(64)
    ck = _checkpointer(root, keep_last=1, full_every=3)
    for step in range(1, 5):  # full, delta, delta, full
        head += 1
        assert ck.save(step, {"objects": {"m": {"frozen": frozen, "head": head}}}, wait=True)
        if step == 3:
            assert sorted(p.name for p in root.glob("step_*")) == ["step_00000001", "step_00000003"]
            restored = _checkpointer(root).load_latest()
            assert restored is not None and restored.step == 3
            assert torch.equal(restored.state["objects"]["m"]["frozen"], frozen)
            assert torch.equal(restored.state["objects"]["m"]["head"], torch.full((64,), 3.0))
    manifests = {s: layout.read_manifest(LocalStorage(root), s) for s in (4,)}
    assert manifests[4].base is None, "every third checkpoint is full again"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000004"], "the old base goes with its deltas"


def test_a_full_save_committing_unnoticed_is_still_the_base_of_the_next_delta(tmp_path: Path) -> None:
    """keep_last=1, full_every=2. The full save of step 3 commits after the loop's last poll() and before the
    next save looks for a base. The delta of step 4 must refer to step 3: a delta of step 1 (deleted when step 3
    committed) would point at missing files, and its commit would delete step 3, the only good checkpoint."""
    root = tmp_path / "ck"
    frozen = torch.randn(64, 64)  # unchanged: a delta refers to its base's copy

    def state(step: int) -> dict[str, Any]:
        return {"step": step, "objects": {"m": {"frozen": frozen, "head": torch.full((8,), float(step))}}}

    ck = _checkpointer(root, keep_last=1, full_every=2)
    for step in (1, 2):  # full, delta of 1
        assert ck.save(step, state(step), wait=True)
    assert ck.save(3, state(3)), "a full save, left in flight"
    ck.poll()  # the training loop's poll: step 3 may still be persisting, so nothing is noted yet
    ck._bg.wait()  # step 3 commits now, before the next save (the interleaving, made deterministic)
    assert ck.save(4, state(4), wait=True)
    storage = LocalStorage(root)
    assert layout.read_manifest(storage, 4).base == 3, "the newest full checkpoint is the base"
    assert sorted(_committed(root)) == [3, 4], "the base is kept while its delta needs it"
    restored = _checkpointer(root).load_latest()
    assert restored is not None and restored.step == 4, "the newest checkpoint loads"
    assert torch.equal(restored.state["objects"]["m"]["frozen"], frozen)


def test_delta_bytes_written(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    frozen = torch.randn(256, 1024)
    ck = _checkpointer(root, keep_last=3, full_every=2)
    ck.save(1, {"objects": {"m": {"frozen": frozen, "head": torch.zeros(1024)}}}, wait=True)
    ck.save(2, {"objects": {"m": {"frozen": frozen, "head": torch.ones(1024)}}}, wait=True)
    full, delta = (layout.read_manifest(LocalStorage(root), s) for s in (1, 2))
    assert delta.base == 1 and full.base is None
    assert full.written_bytes >= full.state_bytes
    assert delta.written_bytes * 5 <= full.written_bytes


def test_memory_store_works_in_one_process(tmp_path: Path) -> None:
    ck = _checkpointer("memory://stalwart-test/run", keep_last=2, full_every=2)
    for step in (1, 2, 3):
        assert ck.save(step, _state(step), wait=True)
    restored = ck.load_latest()
    assert restored is not None and restored.step == 3
    assert torch.equal(restored.state["objects"]["w"]["weight"], torch.full((4, 4), 3.0))


def test_tied_tensors_are_written_once(tmp_path: Path) -> None:
    shared = torch.randn(128, 128)
    ck = _checkpointer(tmp_path / "ck")
    ck.save(1, {"objects": {"m": {"embed": shared, "head": shared}}}, wait=True)
    manifest = layout.read_manifest(LocalStorage(tmp_path / "ck"), 1)
    assert manifest.written_bytes == shared.numel() * 4
    restored = ck.load_latest()
    assert restored is not None and torch.equal(restored.state["objects"]["m"]["head"], shared)


def test_a_dead_persister_fails_that_save_and_the_next_one_works(tmp_path: Path) -> None:
    import signal

    log = tmp_path / "events.jsonl"
    faults = {2: {"errno": "EIO", "times": 100}}
    ck = _checkpointer(tmp_path / "ck", log=log, save_faults=lambda step: _storage_error(faults.pop(step, None)))
    ck.save(1, _state(1), wait=True)
    ck.save(2, _state(2))
    proc = ck._bg._proc
    assert proc is not None
    os.kill(proc.pid, signal.SIGKILL)
    assert ck.wait_durable() is False
    assert any(e["event"] == "persister_died" for e in read_events(log))
    assert ck.save(3, _state(3), wait=True) is True


def test_a_request_that_cannot_be_built_fails_that_save_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The request is finished on the sender thread after the stall; if that fails, the save fails, with an
    event, and nothing waits for it forever."""
    import stalwart.checkpoint.manager as manager

    log = tmp_path / "events.jsonl"
    ck = _checkpointer(tmp_path / "ck", log=log)
    real_save = manager.torch.save
    monkeypatch.setattr(manager.torch, "save", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    assert ck.save(1, _state(1)) is True  # the snapshot was taken
    assert ck.wait_durable() is False
    assert any(e["event"] == "checkpoint_failed" and "boom" in e["error"] for e in read_events(log))
    monkeypatch.setattr(manager.torch, "save", real_save)
    assert ck.save(2, _state(2), wait=True) is True
    assert _committed(tmp_path / "ck") == [2]


def test_changing_layouts_and_grad_tensors_are_snapshotted_exactly(tmp_path: Path) -> None:
    """Staging caches a typed view per (offset, dtype, shape); a state whose shapes change between saves, and
    tensors that require grad, must still come back exactly."""
    ck = _checkpointer(tmp_path / "ck")
    shapes = [(4, 6), (6, 4), (24,), (2, 3, 4)]
    for step, shape in enumerate(shapes, start=1):
        w = torch.nn.Parameter(torch.arange(24.0).reshape(shape) * step)
        half = torch.arange(24, dtype=torch.float16) - step
        assert ck.save(step, {"objects": {"o": {"w": w, "h": half}}}, wait=True)
        restored = ck.load_latest()
        assert restored is not None and restored.step == step
        loaded = restored.state["objects"]["o"]
        assert loaded["w"].shape == torch.Size(shape) and torch.equal(loaded["w"], w.detach())
        assert torch.equal(loaded["h"], half) and not loaded["w"].requires_grad


def test_unreadable_manifest_is_skipped_but_never_quarantined(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = _checkpointer(tmp_path / "ck")
    ck.save(1, _state(1), wait=True)
    ck.save(2, _state(2), wait=True)
    real = layout.read_manifest

    def flaky(storage: Any, step: int) -> layout.Manifest:
        if step == 2:
            raise OSError(5, "Input/output error")
        return real(storage, step)

    monkeypatch.setattr(layout, "read_manifest", flaky)
    restored = _checkpointer(tmp_path / "ck").load_latest()
    assert restored is not None and restored.step == 1
    assert (tmp_path / "ck" / "step_00000002" / "manifest.json").exists(), "an I/O error is no proof of corruption"


def test_nothing_readable_now_is_not_a_user_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stalwart.errors import CheckpointError, is_user_error

    ck = _checkpointer(tmp_path / "ck")
    ck.save(1, _state(1), wait=True)

    def broken(storage: Any, step: int) -> layout.Manifest:
        raise OSError(116, "Stale file handle")

    monkeypatch.setattr(layout, "read_manifest", broken)
    with pytest.raises(CheckpointError, match="can be read now") as info:
        _checkpointer(tmp_path / "ck").load_latest()
    assert not is_user_error(info.value), "a passing I/O error is retried by a restart, not reported as bad input"


def test_a_persister_found_dead_by_the_sender_is_replaced_for_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sender thread can find the persister dead (a broken pipe) before the reply reader sees its end. The
    save it was sending fails; the next save must start a new persister, not write to the dead one, and the
    reader's late notice must not fail that next save."""
    import signal

    from stalwart.checkpoint.save.background import Background

    reader_may_go = threading.Event()
    real_read = Background._read_replies
    first: list[Any] = []

    def late_reader(self: Background, proc: Any, stream: Any) -> None:
        first.append(proc)
        if proc is first[0]:  # only the first persister's replies are read late
            reader_may_go.wait(60)
        real_read(self, proc, stream)

    monkeypatch.setattr(Background, "_read_replies", late_reader)
    log = tmp_path / "events.jsonl"
    ck = _checkpointer(tmp_path / "ck", log=log)
    ck._bg.start()
    proc = ck._bg._proc
    assert proc is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert ck.save(1, _state(1)) is True  # the snapshot is taken; sending it finds the pipe broken
    assert ck.wait_durable() is False
    assert ck.save(2, _state(2), wait=True) is True
    reader_may_go.set()
    assert ck.save(3, _state(3), wait=True) is True
    died = [e for e in read_events(log) if e["event"] == "persister_died"]
    assert [e["step"] for e in died] == [1]
    assert _committed(tmp_path / "ck") == [3, 2]
    ck.close()


@pytest.mark.parametrize("end", ["close", "abandon"])
def test_the_pipe_to_a_dead_persister_is_closed_whichever_thread_saw_it_die(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, end: str
) -> None:
    """The persister killed, its reply reader held back: `close()` (its quit meets the broken pipe) or `abandon()`
    (a survivor re-forming) takes the process from the reader, which then leaves the pipe alone. Either must close
    it: a pipe left to the collector is a ResourceWarning, which failed a test (test_mirrors, 2026-11-30)."""
    import signal

    from stalwart.checkpoint.save.background import Background

    reader_may_go = threading.Event()
    real_read = Background._read_replies

    def late_reader(self: Background, proc: Any, stream: Any) -> None:
        reader_may_go.wait(60)
        real_read(self, proc, stream)

    monkeypatch.setattr(Background, "_read_replies", late_reader)
    ck = _checkpointer(tmp_path / "ck")
    ck._bg.start()
    proc = ck._bg._proc
    assert proc is not None and proc.stdin is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    letting_go = threading.Timer(0.2, reader_may_go.set)  # once the process is taken from it (close() joins it)
    letting_go.start()
    try:
        getattr(ck._bg, end)()
        assert proc.stdin.closed, f"{end}() left the pipe to the dead persister open"
    finally:
        reader_may_go.set()
        letting_go.cancel()
        ck.close()


def test_the_persister_process_does_not_import_torch() -> None:
    """Each rank starts one persister; importing torch there costs about 2 s of CPU per start, taken from training
    (a module-level `import torch` in chaos/faults.py once doubled the CPU time of the tests' 2-rank job)."""
    import subprocess
    import sys

    code = "import sys, stalwart.checkpoint.save.persister, stalwart.checkpoint.save.forked\n"
    code += "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_a_persister_remaps_staging_while_a_view_of_the_old_map_lives(tmp_path: Path) -> None:
    """A failed upload's traceback can hold a view of the staging it was writing; when the next save's staging is
    another memfd (it grew), closing the old map raised BufferError, a persister error that skipped that save on
    its rank (issue 46's 60-s S3 outage). The old map is now left to the last view."""
    import os

    from stalwart.checkpoint.save.persister import Persister
    from stalwart.telemetry.events import EventLog

    persister = Persister(EventLog(None), lambda reply: None)
    specs = []
    for size in (4096, 8192):
        fd = os.memfd_create("test-staging")
        os.ftruncate(fd, size)
        specs.append({"pid": os.getpid(), "fd": fd, "size": size})
    held = persister._staging(specs[0])[:16]  # as a traceback's frame would
    assert len(persister._staging(specs[1])) == 8192
    assert bytes(held) == bytes(16)
    for spec in specs:
        os.close(spec["fd"])
