"""`import stalwart` installs fault injection only where it is asked for (runtime/seams.py): without a fault variable
a process imports no module of chaos/ and has nothing plugged into a seam; with one, the injectors are in from the
import on, as the workers, their persisters and the pre-flight check need, since they get faults through the
environment alone. Each case runs in a fresh interpreter: this test process imported stalwart long ago."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from conftest import child_env
from stalwart.runtime.env import FAULT_ENVS, FAULTS_ENV, NODE_FAULTS_ENV, THREADED_SIDE_COPY_ENV

ALL_SEAMS = ["memory_write", "save_hooks", "side_copy", "step_hooks"]

_REPORT = """
import json, sys
import stalwart
from stalwart.runtime import seams

def chaos():
    return sorted(m for m in sys.modules if m.startswith("stalwart.chaos"))

report = {"after_import": chaos(), "installed": sorted(seams._installed)}
{extra}
print(json.dumps(report))
"""


def _run(extra: str = "", **env: str) -> dict[str, Any]:
    """The report of a fresh `python -c` that imports stalwart in the tests' clean environment (no STALWART_*
    variable but the launcher's WAIT_FOR_REPLACEMENT) plus `env`."""
    clean = child_env(**env)
    assert not any(clean.get(name) for name in FAULT_ENVS if name not in env)
    script = _REPORT.replace("{extra}", extra)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=clean, timeout=60)
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def test_without_a_fault_variable_import_stalwart_loads_no_chaos_and_installs_nothing() -> None:
    report = _run(
        """
report["queried"] = {n: seams.installed(n) is not None for n in (seams.STEP_HOOKS, seams.MEMORY_WRITE, seams.SIDE_COPY)}
seams.installed(seams.SAVE_HOOKS)  # the persister asks at every save; nothing is imported until a request has faults
report["after_queries"] = chaos()
report["still_installed"] = sorted(seams._installed)
"""
    )
    assert report["after_import"] == [], "import stalwart imported chaos/ with no fault variable set"
    assert report["installed"] == [], "import stalwart installed seam hooks with no fault variable set"
    assert report["queried"] == {"step_hooks": False, "memory_write": False, "side_copy": False}
    assert report["after_queries"] == [] and report["still_installed"] == [], "asking a seam installed chaos/"


@pytest.mark.parametrize(
    ("name", "value"),
    [(FAULTS_ENV, "kill@rank=0,step=1000000"), (NODE_FAULTS_ENV, "bad_memory"), (THREADED_SIDE_COPY_ENV, "1")],
)
def test_a_fault_variable_installs_the_injectors_at_import(name: str, value: str) -> None:
    report = _run(**{name: value})
    assert "stalwart.chaos.install" in report["after_import"]
    assert report["installed"] == ALL_SEAMS


def test_a_fault_variable_set_after_the_import_still_installs_them() -> None:
    """As a script's os.environ or a test's monkeypatch sets it, before the seam is used."""
    report = _run(
        f"""
import os
os.environ["{NODE_FAULTS_ENV}"] = "bad_memory"
report["memory_write"] = seams.installed(seams.MEMORY_WRITE) is not None
report["late"] = sorted(seams._installed)
"""
    )
    assert report["installed"] == [] and report["memory_write"] and report["late"] == ALL_SEAMS


def test_a_save_request_with_faults_installs_them_in_a_persister_without_the_variables() -> None:
    """Save faults come to the persister as data in the request (a Checkpointer's save_faults, Job(hooks=...))."""
    report = _run(
        """
import os
from stalwart.telemetry.events import EventLog
faults = {"storage_error": {"errno": "EIO", "times": 1}}
hooks = seams.installed(seams.SAVE_HOOKS)(faults, 3, os.getpid(), EventLog(None))
report["hooks"] = type(hooks).__module__ + "." + type(hooks).__name__
report["late"] = sorted(seams._installed)
"""
    )
    assert report["installed"] == [] and report["late"] == ALL_SEAMS
    assert report["hooks"] == "stalwart.chaos.save_faults.SaveFaults"
