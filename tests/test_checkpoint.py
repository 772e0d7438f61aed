"""Checkpoint invariants in one process: commit, retention, corruption fallback, safe loading, bad input."""

from __future__ import annotations

import io
import json
from collections import OrderedDict, defaultdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stalwart.checkpoint import Checkpointer, layout
from stalwart.checkpoint.serialize import checksum, dumps, loads
from stalwart.errors import CheckpointMismatchError, ConfigError, NoValidCheckpointError, UnsavableStateError
from stalwart.job.dist import Comm, Placement
from stalwart.telemetry.events import EventLog, read_events


def _checkpointer(root: Path, keep_last: int = 3, log: Path | None = None) -> Checkpointer:
    comm = Comm(Placement(rank=0, world_size=1, local_rank=0, restart_count=0), timedelta(seconds=30))
    return Checkpointer(root, comm, EventLog(log), keep_last=keep_last, token="t")


def _state(step: int) -> dict[str, Any]:
    return {"step": step, "objects": {"w": {"weight": torch.full((4, 4), float(step))}}}


def test_save_then_load_roundtrip(tmp_path: Path) -> None:
    ck = _checkpointer(tmp_path / "ck")
    assert ck.save(5, _state(5))
    restored = ck.load_latest()
    assert restored is not None and restored.step == 5
    assert torch.equal(restored.state["objects"]["w"]["weight"], torch.full((4, 4), 5.0))


def test_retention_keeps_last_n_and_clears_interrupted_saves(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    ck = _checkpointer(root, keep_last=2)
    for step in (1, 2, 3):
        ck.save(step, _state(step))
    (root / "step_00000002" / "manifest.json").unlink()  # step 2 becomes an interrupted save
    stale = root / "step_00000004" / "rank00000.old-1.pt"
    stale.parent.mkdir()
    stale.write_bytes(b"from a crashed attempt at step 4")
    ck.save(4, _state(4))
    assert sorted(p.name for p in root.iterdir()) == ["stalwart-checkpoints.json", "step_00000003", "step_00000004"]
    assert sorted(p.name for p in (root / "step_00000004").iterdir()) == ["manifest.json", "rank00000.t-4.pt"]


def test_save_without_manifest_is_invisible(tmp_path: Path) -> None:
    ck = _checkpointer(tmp_path / "ck")
    ck.save(1, _state(1))
    ck.save(2, _state(2))
    (tmp_path / "ck" / "step_00000002" / "manifest.json").unlink()  # as if killed before the commit
    restored = ck.load_latest()
    assert restored is not None and restored.step == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_damaged_newest_checkpoint_falls_back_with_an_event(tmp_path: Path, damage: str) -> None:
    log = tmp_path / "events.jsonl"
    ck = _checkpointer(tmp_path / "ck", log=log)
    ck.save(1, _state(1))
    ck.save(2, _state(2))
    step2 = tmp_path / "ck" / "step_00000002"
    shard = next(step2.glob("rank*.pt"))
    data = shard.read_bytes()
    if damage == "flip":
        shard.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "delete":
        shard.unlink()
    else:
        (step2 / "manifest.json").write_text("{not json")
    restored = _checkpointer(tmp_path / "ck", log=log).load_latest()
    assert restored is not None and restored.step == 1
    events = [e["event"] for e in read_events(log)]
    assert "checkpoint_invalid" in events and "checkpoint_quarantined" in events
    assert not step2.exists() and len(list((tmp_path / "ck").glob("step_00000002.invalid-*"))) == 1


def test_loading_never_executes_code_from_a_checkpoint(tmp_path: Path) -> None:
    ck = _checkpointer(tmp_path / "ck")
    ck.save(1, _state(1))
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (Path.write_text, (marker, "code ran"))

    buf = io.BytesIO()
    torch.save({"objects": Evil()}, buf)  # torch's default protocol: the weights-only unpickler must refuse it
    payload = buf.getvalue()
    step = tmp_path / "ck" / "step_00000001"
    name = next(step.glob("rank*.pt")).name
    (step / name).write_bytes(payload)
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["shards"][0].update(bytes=len(payload), crc32=checksum(payload))
    (step / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(NoValidCheckpointError, match="cannot be read safely"):
        _checkpointer(tmp_path / "ck").load_latest()
    assert not marker.exists(), "loading ran code from the checkpoint"


def test_state_that_could_not_be_loaded_back_is_refused_at_save(tmp_path: Path) -> None:
    ck = _checkpointer(tmp_path / "ck")
    with pytest.raises(UnsavableStateError, match=r"state\['objects'\]\['opaque'\] is a .*object"):
        ck.save(1, {"objects": {"opaque": object()}})
    assert layout.committed_steps(tmp_path / "ck") == []


@pytest.mark.parametrize("value", [np.float64(1.5), np.int64(3), defaultdict(int, a=1), np.zeros(2)])
def test_subclasses_that_weights_only_refuses_are_refused_at_save(value: Any) -> None:
    with pytest.raises(UnsavableStateError):
        dumps({"x": value})


def test_everything_accepted_at_save_loads_back() -> None:
    state = {
        "tensor": torch.arange(3),
        "param": torch.nn.Parameter(torch.ones(2)),
        "scalars": [1, 2.5, True, "s", b"b", None, (1, 2)],
        "torch": [torch.Size([2, 3]), torch.float16, torch.device("cpu")],
        "ordered": OrderedDict(a=torch.zeros(1)),
        3: "int key",
    }
    loaded = loads(dumps(state), "roundtrip")
    assert loaded["scalars"] == state["scalars"] and loaded["torch"] == state["torch"] and loaded[3] == "int key"
    assert torch.equal(loaded["param"], state["param"])


def test_no_valid_checkpoint_stops_instead_of_starting_over(tmp_path: Path) -> None:
    ck = _checkpointer(tmp_path / "ck")
    ck.save(1, _state(1))
    shard = next((tmp_path / "ck" / "step_00000001").glob("rank*.pt"))
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
    ck.save(1, _state(1))
    (tmp_path / "ck" / "step_00000001" / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(CheckpointMismatchError, match="not a stalwart manifest"):
        ck.load_latest()


def test_unwritable_directory_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="not writable"):
        _checkpointer(tmp_path / "file" / "ck")


@pytest.mark.parametrize("failing", ["shard", "manifest"])
def test_write_failure_skips_the_save_and_keeps_the_previous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    log = tmp_path / "events.jsonl"
    ck = _checkpointer(tmp_path / "ck", log=log)
    ck.save(1, _state(1))
    real = layout.write_durable

    def full_disk(path: Path, data: bytes, **kwargs: Any) -> None:
        if (path.name == "manifest.json") == (failing == "manifest"):
            raise OSError(28, "No space left on device")
        real(path, data, **kwargs)

    monkeypatch.setattr(layout, "write_durable", full_disk)
    assert ck.save(2, _state(2)) is False
    monkeypatch.undo()
    assert layout.committed_steps(tmp_path / "ck") == [1]
    assert any(e["event"] == "checkpoint_write_failed" for e in read_events(log))
    assert ck.save(3, _state(3)) is True, "the next save works again"


def test_unreadable_manifest_is_skipped_but_never_quarantined(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = _checkpointer(tmp_path / "ck")
    ck.save(1, _state(1))
    ck.save(2, _state(2))
    real = layout.read_manifest

    def flaky(root: Path, step: int) -> layout.Manifest:
        if step == 2:
            raise OSError(5, "Input/output error")
        return real(root, step)

    monkeypatch.setattr(layout, "read_manifest", flaky)
    restored = _checkpointer(tmp_path / "ck").load_latest()
    assert restored is not None and restored.step == 1
    assert (tmp_path / "ck" / "step_00000002" / "manifest.json").exists(), "an I/O error is no proof of corruption"


def test_nothing_readable_now_is_not_a_user_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stalwart.errors import CheckpointError, is_user_error

    ck = _checkpointer(tmp_path / "ck")
    ck.save(1, _state(1))

    def broken(root: Path, step: int) -> layout.Manifest:
        raise OSError(116, "Stale file handle")

    monkeypatch.setattr(layout, "read_manifest", broken)
    with pytest.raises(CheckpointError, match="can be read now") as info:
        _checkpointer(tmp_path / "ck").load_latest()
    assert not is_user_error(info.value), "a passing I/O error is retried by a restart, not reported as bad input"
