"""`stalwart ckpt list|verify|inspect`: reads a checkpoint directory for people, and changes nothing."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart.checkpoint import Checkpointer
from stalwart.cli import main
from stalwart.runtime.dist import Comm, Placement
from stalwart.telemetry.events import EventLog


def _make(root: Path, steps: tuple[int, ...] = (1, 2, 3), full_every: int = 1) -> None:
    comm = Comm(Placement(rank=0, world_size=1, local_rank=0, restart_count=0), timedelta(seconds=30))
    ck = Checkpointer(root, comm, EventLog(None), keep_last=5, token="t", full_every=full_every)
    model = torch.nn.Linear(4, 2)
    frozen = torch.nn.Linear(64, 64)
    try:
        for step in steps:
            with torch.no_grad():
                model.weight.fill_(step)  # each step's checkpoint holds different weights
            objects = {"model": model.state_dict(), "frozen": frozen.state_dict(), "data": {"epoch": 0}}
            assert ck.save(step, {"step": step, "world_size": 1, "objects": objects}, wait=True)
    finally:
        ck.close()


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_list_verify_inspect_on_a_healthy_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ck"
    _make(root)
    before = _snapshot(root)
    assert main(["ckpt", "list", str(root), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [(c["step"], c["status"]) for c in listed] == [(1, "committed"), (2, "committed"), (3, "committed")]
    assert main(["ckpt", "verify", str(root)]) == 0
    assert capsys.readouterr().out.count(": ok") == 3
    assert main(["ckpt", "inspect", str(root), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    model = {"tensors": 2, "bytes": 40, "dtypes": ["float32"], "content": ""}
    assert summary["step"] == 3 and summary["objects"]["model"] == model
    assert summary["objects"]["data"]["content"] == "epoch=0"
    assert summary["kind"] == "full" and summary["bytes_saved"] == 0
    assert _snapshot(root) == before, "reading changes nothing"


def test_inspect_says_what_a_loader_an_optimizer_and_a_scheduler_hold() -> None:
    """The content column: a ResumableLoader's position, an optimizer's step count and rate, a scheduler's last rate
    (issue #45: the loader showed as "0 tensors")."""
    from stalwart import ResumableLoader
    from stalwart.checkpoint.tools.inspect import describe

    loader = ResumableLoader(list(range(60)), global_batch_size=6, rank=0, world_size=2)
    for _, _ in zip(range(4), loader, strict=False):
        pass
    assert describe(loader.state_dict()) == "position: epoch 0, global batch 4 of 10"
    model = torch.nn.Linear(3, 1)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    for _ in range(3):
        model(torch.ones(2, 3)).sum().backward()
        optim.step()
        sched.step()
    assert describe(optim.state_dict()) == "2 parameters with state, step 3, lr 0.0005"
    assert describe(sched.state_dict()) == "last_epoch 3, last lr 0.0005"
    assert describe({"seen": 5, "name": "x", "flag": True}) == "seen=5" and describe(torch.ones(1)) == ""


@pytest.mark.parametrize("columns", ["40", "80", None])
def test_inspect_shows_the_bytes_a_delta_saved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, columns: str | None
) -> None:
    # A path longer than any terminal, and narrow or unknown widths: no phrase may break across lines.
    root = tmp_path.joinpath(*["a-long-directory-name"] * 12, "ck")
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    _make(root, steps=(1, 2), full_every=2)
    assert main(["ckpt", "inspect", str(root), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["kind"] == "delta" and summary["base"] == 1
    assert summary["written_bytes"] < summary["state_bytes"] and summary["bytes_saved"] > 0
    assert main(["ckpt", "inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert "delta of step 1" in out and "bytes saved" in out
    assert main(["ckpt", "verify", str(root)]) == 0, "a delta verifies through its base"


def test_verify_reports_damage_and_exits_nonzero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ck"
    _make(root)
    shard = next((root / "step_00000002").glob("rank*.data"))
    shard.write_bytes(shard.read_bytes()[:-10])
    (root / "step_00000003" / "manifest.json").unlink()  # an interrupted save
    assert main(["ckpt", "verify", str(root), "--json"]) == 1
    result = json.loads(capsys.readouterr().out)["checkpoints"]
    assert result["1"] == [] and "truncated" in " ".join(result["2"]) and "3" not in result
    assert main(["ckpt", "list", str(root), "--json"]) == 0
    statuses = {c["step"]: c["status"] for c in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert statuses == {1: "committed", 2: "committed", 3: "interrupted"}
    assert main(["ckpt", "inspect", str(root), "--step", "2"]) == 2
    assert "see 'stalwart ckpt verify'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ckpt", "list", "/no/such/dir"], "does not exist"),
        (["ckpt", "verify", "{foreign}"], "not a stalwart checkpoint directory"),
        (["ckpt", "inspect", "{ck}", "--step", "9"], "no committed checkpoint at step 9"),
        (["ckpt", "inspect", "{ck}", "--rank", "4"], "outside the checkpoint's 1 ranks"),
        (["ckpt", "frob", "{ck}"], "invalid choice"),
        (["ckpt", "inspect", "{tampered}"], "not a stalwart manifest"),
        (["ckpt", "sync", "{ck}", "{foreign}"], "holds files stalwart did not write"),
        (["ckpt", "sync", "{ck}", "{ck}"], "is the checkpoint directory itself"),
        (["ckpt", "sync", "{ck}"], "the following arguments are required: destination"),
    ],
)
def test_bad_input_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    _make(tmp_path / "ck", steps=(1,))
    _make(tmp_path / "tampered", steps=(1,))
    (tmp_path / "tampered" / "step_00000001" / "manifest.json").write_text(json.dumps({"format": "other"}))
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "model.bin").write_bytes(b"x")
    args = [a.format(ck=tmp_path / "ck", foreign=tmp_path / "foreign", tampered=tmp_path / "tampered") for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_export_to_dcp_loads_back_with_dcp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root, out = tmp_path / "ck", tmp_path / "exported"
    _make(root)
    assert main(["ckpt", "export", str(root), "--to", str(out), "--step", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["objects"] == ["data", "frozen", "model"]

    fresh = torch.nn.Linear(4, 2)
    state = {"model": fresh.state_dict(), "stalwart": {"step": 0, "world_size": 0, "rank": -1}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns when it loads without a process group
        dcp.load(state, checkpoint_id=str(out))
        dcp_to_torch_save(str(out), str(tmp_path / "one_file.pt"))
    fresh.load_state_dict(state["model"])
    assert torch.equal(fresh.weight, torch.full((2, 4), 2.0)), "the weights of step 2, not of the newest"
    assert state["stalwart"]["step"] == 2
    one_file = torch.load(tmp_path / "one_file.pt", weights_only=True)
    assert torch.equal(one_file["model"]["weight"], torch.full((2, 4), 2.0))

    assert main(["ckpt", "export", str(root), "--to", str(out)]) == 2, "an existing export is never overwritten"
    assert "nothing is overwritten" in capsys.readouterr().err


def _latest(root: Path) -> Any:
    comm = Comm(Placement(rank=0, world_size=1, local_rank=0, restart_count=0), timedelta(seconds=30))
    ck = Checkpointer(root, comm, EventLog(None), keep_last=5, token="t")
    try:
        restored = ck.load_latest()
    finally:
        ck.close()
    assert restored is not None
    return restored


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_sync_copies_each_committed_step_verified_resumes_and_repairs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`stalwart ckpt sync SRC DST` (a mirror, issue 46): every committed step copied, a delta's base first and
    verified where it landed; a second run copies nothing; a file lost at the destination is copied again; one
    damaged in place (same size) is found and repaired with --verify; the source is only read."""
    src, dst = tmp_path / "ck", tmp_path / "mirror"
    _make(src, steps=(1, 2, 3, 4), full_every=2)  # 2 and 4 are deltas of 1 and 3
    before = _snapshot(src)

    def sync(*extra: str) -> list[tuple[int, int, bool]]:
        assert main(["ckpt", "sync", str(src), str(dst), "--json", *extra]) == 0
        return [(r["step"], r["files"], r["already"]) for r in json.loads(capsys.readouterr().out)["steps"]]

    assert sync() == [(1, 2, False), (2, 2, False), (3, 2, False), (4, 2, False)]
    assert main(["ckpt", "verify", str(dst), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoints"] == {"4": [], "3": [], "2": [], "1": []}
    assert sync() == [(1, 0, True), (2, 0, True), (3, 0, True), (4, 0, True)]

    next((dst / "step_00000003").glob("rank*.data")).unlink()  # lost: step 4's tensors point into it too
    assert sync() == [(1, 0, True), (2, 0, True), (3, 1, False), (4, 0, True)]
    _flip(next((dst / "step_00000001").glob("rank*.data")), 200)  # inside a tensor (they are 64-byte aligned)
    assert sync() == [(1, 0, True), (2, 0, True), (3, 0, True), (4, 0, True)], "same size: not read without --verify"
    assert sync("--verify") == [(1, 2, False), (2, 0, True), (3, 0, True), (4, 0, True)]
    assert main(["ckpt", "verify", str(dst)]) == 0
    assert _snapshot(src) == before, "the source is only read"
    restored = [_latest(root) for root in (src, dst)]  # a job pointed at the mirror resumes from it, as from SRC
    assert restored[0].step == restored[1].step == 4  # a delta, loaded through its base's copied files
    for name, tensor in restored[0].state["objects"]["model"].items():
        assert torch.equal(tensor, restored[1].state["objects"]["model"][name]), name
    capsys.readouterr()

    (src / "step_00000004" / "manifest.json").unlink()  # an interrupted save: never copied
    assert main(["ckpt", "sync", str(src), str(tmp_path / "other"), "--step", "4"]) == 2
    assert "no committed checkpoint at step 4" in capsys.readouterr().err


def test_sync_never_commits_a_copy_that_does_not_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A source damaged in one tensor: that step and the delta that points into it are not committed at the
    destination (their files are there, no manifest: no load takes them), the others are; exit status 1."""
    src, dst = tmp_path / "ck", tmp_path / "mirror"
    _make(src, steps=(1, 2, 3, 4), full_every=2)
    _flip(next((src / "step_00000003").glob("rank*.data")), 200)
    assert main(["ckpt", "sync", str(src), str(dst)]) == 1
    out = capsys.readouterr().out
    assert "step 3: NOT copied" in out and "xxh3" in out and "2 did not verify there" in out, out
    assert sorted(p.parent.name for p in dst.glob("*/manifest.json")) == ["step_00000001", "step_00000002"]
    assert main(["ckpt", "list", str(dst), "--json"]) == 0
    statuses = {c["step"]: c["status"] for c in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert statuses == {1: "committed", 2: "committed", 3: "interrupted", 4: "interrupted"}


def test_status_says_how_far_each_mirror_is_behind_and_whether_it_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, behind, gone = tmp_path / "ck", tmp_path / "behind", tmp_path / "gone"
    _make(src, steps=(1, 2, 3, 4), full_every=1)
    assert main(["ckpt", "sync", str(src), str(behind), "--step", "2"]) == 0
    capsys.readouterr()
    assert main(["ckpt", "status", str(src), str(behind), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["locations"]
    assert [(r["step"], r["steps_behind"], r["problem"]) for r in rows] == [(4, 0, ""), (2, 2, "")]
    assert rows[1]["seconds_behind"] >= 0
    assert main(["ckpt", "status", str(src), str(behind)]) == 0 and "ok" in capsys.readouterr().out  # the table
    _flip(next((behind / "step_00000002").glob("rank*.data")), 200)
    assert main(["ckpt", "status", str(src), str(behind), str(gone), "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)["locations"]
    assert rows[0]["problem"] == "" and "xxh3" in rows[1]["problem"] and "does not exist" in rows[2]["problem"], rows
