"""The docs match the code: every option of `stalwart.Job`, `ResumableLoader` and `stalwart run` in
docs/configuration.md with the code's default, every event the code emits in docs/events.md, the README short with
its links alive, and the README's port of a torchrun script running as pasted, through a kill."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import stalwart
from conftest import child_env, served_python
from stalwart.job import config
from stalwart.supervisor.run_args import build_parser

ROOT = Path(__file__).resolve().parents[1]
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()
EVENTS = (ROOT / "docs" / "events.md").read_text()
README = (ROOT / "README.md").read_text()


def _rows(text: str) -> dict[str, list[str]]:
    """A Markdown table's rows by their first cell's code name (`name` or `--flag ARG`)."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]  # `a\|b` is one cell
        found = re.match(r"^`([^` ]+)", cells[0]) if line.startswith("|") else None
        if found:
            rows[found.group(1)] = cells
    return rows


def _as_documented(value: Any) -> str:
    return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"


def test_every_job_option_is_documented_with_its_default() -> None:
    sections = {**config.SECTIONS, "": config.JobConfig}
    rows = _rows(CONFIGURATION)
    for name, (section, key) in config.FLAT.items():
        assert name in rows, f"stalwart.Job's option {name} is not in docs/configuration.md"
        field = {f.name: f for f in dataclasses.fields(sections[section])}[key]
        default = field.default
        if field.default_factory is not dataclasses.MISSING:  # a default a launcher's flag may change (failover_s)
            with pytest.MonkeyPatch.context() as env:
                env.delenv("STALWART_FAILOVER_S", raising=False)
                default = field.default_factory()
        want = "(required)" if default is dataclasses.MISSING else _as_documented(default)
        assert rows[name][1] == want, f"{name}: the docs say {rows[name][1]}, the code's default is {want}"


def test_every_loader_argument_is_documented() -> None:
    rows = _rows(CONFIGURATION)
    documented = {name for row in rows.values() for name in re.findall(r"`(\w+)`", row[0])}
    arguments = set(inspect.signature(stalwart.ResumableLoader.__init__).parameters) - {"self", "dataset"}
    assert arguments <= documented, f"ResumableLoader arguments missing: {sorted(arguments - documented)}"


def test_every_flag_of_stalwart_run_is_documented() -> None:
    parser = build_parser()
    [own] = [g for g in parser._action_groups if g.title and g.title.startswith("stalwart's own")]
    rows = _rows(CONFIGURATION)
    for action in own._group_actions:
        flag = action.option_strings[0]
        assert flag in rows, f"stalwart run {flag} is not in docs/configuration.md"
        if action.default not in (None, False):
            assert str(action.default) in rows[flag][1], f"{flag}: default {action.default} not in {rows[flag][1]}"


def _emitted() -> set[str]:
    """Every event name the package emits: `emit("name", ...)`, and the persister's `_fail(step, "name", ...)`."""
    names = set()
    for path in (ROOT / "src" / "stalwart").rglob("*.py"):
        text = path.read_text()
        if "emit(" not in text and "_fail(" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute | ast.Name):
                continue
            called = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            where = {"emit": 0, "_fail": 1}.get(called)
            if where is not None and len(node.args) > where:
                arg = node.args[where]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    names.add(arg.value)
    return names


def test_every_event_is_documented() -> None:
    emitted = _emitted()
    assert {"worker_failed", "resumed", "checkpoint_failed", "step_done"} <= emitted, "the scan finds events"
    documented = set(_rows(EVENTS))
    assert not emitted - documented, f"events missing from docs/events.md: {sorted(emitted - documented)}"
    assert not documented - emitted, f"docs/events.md names events nothing emits: {sorted(documented - emitted)}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize(
    "page", ["README.md", "CONTRIBUTING.md", *(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
)
def test_links_between_the_pages_resolve(page: str) -> None:
    path = ROOT / page
    for target, anchor in re.findall(r"\]\(([^)#:\s]*\.md)(?:#([^)\s]+))?\)", path.read_text()):
        linked = (path.parent / target).resolve()
        assert linked.is_file(), f"{page} links to {target}, which does not exist"
        if anchor:
            headings = {_slug(h) for h in re.findall(r"^#+ (.+)$", linked.read_text(), re.M)}
            assert anchor in headings, f"{page} links to {target}#{anchor}, which has no such heading"


def test_the_readme_is_short_and_starts_with_what_it_is_and_its_two_commands() -> None:
    lines = README.splitlines()
    assert len(lines) < 250, f"README.md has {len(lines)} lines"
    first_block = README.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split()[:2] for line in first_block] == [["bash", "scripts/demo.sh"], ["bash", "scripts/test.sh"]]
    assert (ROOT / ".ci" / "run").read_text().rstrip().endswith("exec bash scripts/test.sh")


def ported_script() -> str:
    """The README's port of a torchrun script, as a reader pastes it: its unchanged and added lines."""
    diff = README.split("```diff\n", 1)[1].split("```", 1)[0]
    return "".join(line[1:] + "\n" for line in diff.splitlines() if line[:1] in (" ", "+", ""))


def test_the_readmes_port_runs_as_pasted_and_survives_a_kill(launch: Any, tmp_path: Path) -> None:
    """Pasted into train.py and run as the README says, with rank 1 SIGKILLed at step 120: the run ends well, the
    survivor stayed in its loop, and rank 0 said what protects the run and its progress."""
    script = ported_script()
    assert "stalwart.Job(" in script and "import os" not in script and "dist." not in script
    (tmp_path / "port").mkdir()
    (tmp_path / "port" / "train.py").write_text(script)
    faults = child_env(STALWART_FAULTS="kill@rank=1,step=120", STALWART_WAIT_FOR_REPLACEMENT="0")  # the defaults
    job = launch(["--nproc-per-node", "2", "train.py"], name="port", env=faults)
    assert job.wait(240) == 0, job.output()[-3000:]
    out = job.output()
    assert "stalwart: protecting 2 ranks" in out and "stalwart: step 300/300  loss" in out, out[-3000:]
    killed = [e["rank"] for e in job.events("worker_failed") if e["signal"] == "SIGKILL"]
    assert killed == [1], out[-3000:]
    first, second = job.worker_pids(restart=0), job.worker_pids(restart=1)
    assert first[0] == second[0], "the survivor kept its process"
    assert [e["step"] for e in job.events("job_finished")] == [300]
    assert (job.workdir / "ckpt").is_dir()
    (alone := tmp_path / "alone").mkdir()  # `python train.py`, no launcher: one process, as the README says
    done = served_python(script, cwd=alone, timeout=120)
    assert done.returncode == 0 and "stalwart: step 300/300" in done.stderr, done.stderr[-3000:]
    assert "protecting 1 rank" in done.stderr and (alone / "ckpt" / "step_00000300").is_dir()
