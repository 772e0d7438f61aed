"""`stalwart bench checkpoint`: one small run end to end, its JSON shape, and one-line errors on bad input.

No timing thresholds: the figures depend on the machine; the test checks that every one of them is measured
(positive and finite), not how good it is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import stalwart
from stalwart.bench import checkpoint
from stalwart.cli import main
from stalwart.errors import BenchError

SYSTEM_KEYS = {"stall_s", "durable_s", "write_gbps", "peak_rss_mb"}


def _numbers(obj: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """Every number in a JSON value, with where it is."""
    if isinstance(obj, bool):
        return
    if isinstance(obj, int | float):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _numbers(value, f"{path}.{key}")
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from _numbers(value, f"{path}[{i}]")


def test_small_run_reports_every_system_as_one_json_object(tmp_path: Path) -> None:
    """Served (forked from the tests' launch server, one thread): each measurement is a fork of the bench, as a
    user's is where the bench runs one thread (OMP_NUM_THREADS=1), else a new interpreter."""
    done = stalwart("bench", "checkpoint", "--size", "8MB", "--saves", "3", "--json", "--dir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    out, err = done.stdout, done.stderr
    report = json.loads(out)  # stdout is exactly one JSON object
    assert 7_000_000 < report["state_bytes"] <= 8_100_000
    assert {"memcpy_s", "write_gbps"} <= set(report["floor"])
    assert set(report["systems"]) == {"torch_save", "dcp_save", "dcp_async_save", "stalwart"}
    for name, system in report["systems"].items():
        assert set(system) >= SYSTEM_KEYS, name
        assert system["stall_s"] <= system["durable_s"], name  # both timed from the same instant
    assert "background_slowdown" in report["systems"]["stalwart"]
    numbers = list(_numbers(report))
    assert len(numbers) > 20
    for where, value in numbers:
        assert math.isfinite(value) and value > 0, where
    for name in ("floor", "torch_save", "dcp_save", "dcp_async_save", "stalwart"):
        assert f"{name}: started" in err and f"{name}: done" in err
    assert list(tmp_path.iterdir()) == []  # the bench removed its own directory, and nothing else


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--size", "nonsense"], "--size"),
        (["--size", "0MB"], "too small"),
        (["--saves", "0"], "--saves"),
        (["--bogus"], "unrecognized"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "checkpoint", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_dir_that_is_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "f"
    a_file.write_text("x")
    for where, message in ((a_file, "is a file"), (a_file / "sub", "not writable")):
        assert main(["bench", "checkpoint", "--size", "8MB", "--dir", str(where)]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_a_failed_measurement_exits_1_and_cleans_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_child(
        name: str, size_bytes: int, saves: int, directory: Path, progress: Any, device: str = "cpu"
    ) -> dict[str, Any]:
        directory.mkdir()
        (directory / "partial").write_bytes(b"x")
        raise BenchError(f"measuring {name} failed: boom")

    monkeypatch.setattr(checkpoint, "run_child", failing_child)
    assert main(["bench", "checkpoint", "--size", "8MB", "--dir", str(tmp_path / "new" / "dir")]) == 1
    err = capsys.readouterr().err
    assert "measuring floor failed: boom" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # the directories the bench created are gone, parents included


def test_first_save_reports_both_variants_and_the_training_threads_longest_wait(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from stalwart.bench import first_save

    assert first_save.main(["--size", "16MB"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert set(report["with_prepare"]) == {
        "prepare_call_s", "main_thread_max_gap_s", "prepare_background_s", "first_stall_s", "second_stall_s"
    }  # fmt: skip
    assert set(report["without_prepare"]) == {"first_stall_s", "second_stall_s"}
    for where, value in _numbers(report):
        assert math.isfinite(value) and value >= 0, where
    assert "longest wait to run" in err
