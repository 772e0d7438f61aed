"""`stalwart run --preload` and its default (supervisor/preload.py): what the zygote imports for the script, so that
no worker and no replacement imports it again, and the fall-back to new interpreters when that import is unsafe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import child_env
from stalwart.supervisor.preload import integrations_imported, plan

PROBE = """
import os, sys
print(f"rank {os.environ['RANK']}: {PROBED!r} imported before the script: {PROBED in sys.modules}", flush=True)
"""


def _script(tmp_path: Path, probed: str) -> Path:
    script = tmp_path / "train.py"
    script.write_text(f"PROBED = {probed!r}\n" + PROBE)
    return script


@pytest.mark.parametrize(
    "source",
    [
        "from stalwart.integrations.hf import StalwartCallback, Trainer",
        "import stalwart.integrations.hf as integration",
        "from stalwart.integrations import hf",
        "def main():\n    from stalwart.integrations.hf import Trainer\n",
    ],
)
def test_the_integrations_a_script_imports_are_preloaded_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    monkeypatch.delenv("STALWART_PRELOAD", raising=False)
    script = tmp_path / "train.py"
    script.write_text(f"import torch\n{source}\n")
    assert plan(None, str(script), is_module=False).modules == ("stalwart.integrations.hf",)
    assert plan("none", str(script), is_module=False).modules == (), "'none' turns the default off"
    assert plan("numpy, none", str(script), is_module=False).modules == ("numpy",)
    assert plan("numpy", str(script), is_module=False).modules == ("numpy", "stalwart.integrations.hf")
    monkeypatch.setenv("STALWART_PRELOAD", "json")
    assert plan(None, str(script), is_module=False).modules == ("json", "stalwart.integrations.hf")
    assert plan(None, str(script), is_module=False).path == str(tmp_path), "modules beside the script are found"


def test_a_script_that_cannot_be_read_or_parsed_preloads_only_what_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STALWART_PRELOAD", raising=False)
    broken = tmp_path / "broken.py"
    broken.write_text("from stalwart.integrations.hf import (\n")
    assert integrations_imported(broken) == []
    assert integrations_imported(tmp_path / "missing.py") == []
    assert plan("json", "no_such_pkg.train", is_module=True).modules == ("json",), "a module not found: nothing"
    bench_job = plan(None, "stalwart.bench.lightning_job", is_module=True)
    assert bench_job.modules == ("stalwart.integrations.lightning",), "with -m, the module's file is read"


def test_a_preloaded_module_is_imported_once_before_the_workers_are_forked(launch: Any, tmp_path: Path) -> None:
    """email.mime.text: a module neither torch nor stalwart imports, so only the preload can have imported it."""
    script = _script(tmp_path, "email.mime.text")
    job = launch(["--nproc-per-node", "2", "--preload", "email.mime.text", str(script)])
    assert job.wait(120) == 0, job.output()
    for rank in (0, 1):
        assert f"rank {rank}: 'email.mime.text' imported before the script: True" in job.output(), job.output()
    assert all(e["forked"] for e in job.events("worker_spawned")), job.events("worker_spawned")
    plain = launch(["--nproc-per-node", "1", str(script)], name="plain")
    assert plain.wait(120) == 0, plain.output()
    assert "imported before the script: False" in plain.output(), "nothing is preloaded unless asked"


def test_a_preload_that_starts_a_thread_falls_back_to_new_interpreters(launch: Any, tmp_path: Path) -> None:
    """A module beside the script that starts a thread when imported: a fork of the zygote could inherit a lock that
    thread holds, so the zygote forks nothing and the workers start as new interpreters; the run is unaffected."""
    (tmp_path / "threaded.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n"
    )
    script = _script(tmp_path, "threaded")
    job = launch(["--nproc-per-node", "2", str(script)], env=child_env(STALWART_PRELOAD="threaded"))
    assert job.wait(120) == 0, job.output()
    spawned = job.events("worker_spawned")
    assert spawned and not any(e["forked"] for e in spawned), spawned
    assert "imported before the script: False" in job.output(), job.output()


def test_a_preloaded_lightning_takes_each_workers_rank(launch: Any, tmp_path: Path) -> None:
    """Lightning reads the rank into `rank_zero_only` when imported, in the zygote where none is set: each worker
    reads it again from its own environment once forked, so rank 1 does not run what is meant for rank 0."""
    script = tmp_path / "train.py"
    script.write_text(
        "import os\n"
        "from lightning.fabric.utilities.rank_zero import rank_zero_only\n"
        "print('rank', os.environ['RANK'], 'rank_zero_only.rank', rank_zero_only.rank, flush=True)\n"
    )
    job = launch(["--nproc-per-node", "2", "--preload", "lightning.fabric.utilities.rank_zero", str(script)])
    assert job.wait(120) == 0, job.output()
    for rank in (0, 1):
        assert f"rank {rank} rank_zero_only.rank {rank}" in job.output(), job.output()
