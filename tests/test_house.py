"""The house's rules, held by walking the source: layers only import downwards, no import cycle, the exception
tree drawn whole, every environment variable named in runtime/env.py."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import stalwart
from stalwart import errors
from stalwart.layers import LAYERS, rank_of

SRC = Path(stalwart.__file__).parent
DOCS = SRC.parent.parent / "docs"


def _modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the stalwart modules it imports, at the top or inside a function (a lazy import still ties them)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                if target.startswith("stalwart") and target in modules and target != name:
                    graph[name].add(target)
    return graph


def _layer(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_every_package_has_a_layer() -> None:
    tops = {_layer(m) for m in _modules() if _layer(m)}
    placed = {name for layer in LAYERS for name in layer}
    assert tops <= placed, f"not in stalwart/layers.py: {sorted(tops - placed)}"


def test_no_import_runs_from_a_lower_layer_to_a_higher_one() -> None:
    upward = []
    for module, targets in _imports(_modules()).items():
        if module == "stalwart":
            continue  # the root puts the parts together
        for target in targets:
            if target == "stalwart":
                continue  # the public API, as a user's script imports it
            if rank_of(_layer(target)) > rank_of(_layer(module)):
                upward.append(f"{module} -> {target}")
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(sorted(upward))


def test_no_import_cycle() -> None:
    graph = _imports(_modules())
    graph = {m: {t for t in ts if t != "stalwart"} for m, ts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


def test_the_layers_in_the_docs_are_the_code_s() -> None:
    text = (DOCS / "architecture.md").read_text()
    drawn = re.search(r"<!-- layers -->\n(.*?)<!-- /layers -->", text, re.S)
    assert drawn, "docs/architecture.md lacks its layers list"
    rows = [line for line in drawn.group(1).splitlines() if line.startswith("| ") and "---" not in line][1:]
    listed = [tuple(n.strip(" `") for n in row.split("|")[2].split(",")) for row in rows]
    assert listed == list(LAYERS)


def test_the_exception_tree_is_drawn_whole() -> None:
    drawn = set(re.findall(r"[├└]── (\w+)", errors.__doc__ or ""))
    defined = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, errors.StalwartError)}
    assert defined - {"StalwartError"} == drawn


def test_product_layers_name_no_environment_variable_of_their_own() -> None:
    """Every STALWART_* variable's name is a constant of runtime/env.py; other modules import it from there."""
    strays = []
    for name, path in _modules().items():
        if name == "stalwart.runtime.env":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            text = node.value if isinstance(node, ast.Constant) else None
            if isinstance(text, str) and re.fullmatch(r"STALWART_[A-Z_]+", text):
                strays.append(f"{name}: {text}")
    assert not strays, "environment variables named outside runtime/env.py:\n" + "\n".join(sorted(strays))


def test_the_job_s_step_changes_in_one_place() -> None:
    """Completed steps move forward, back (a rollback) and to a resumed step only through Job.move_to."""
    tree = ast.parse((SRC / "job" / "job.py").read_text())
    setters = []
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef):
            continue
        for node in ast.walk(func):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AugAssign | ast.AnnAssign) else []  # fmt: skip
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and t.attr == "step" and getattr(t.value, "id", "") == "self":
                        setters.append(func.name)
    assert sorted(setters) == ["move_to", "set_up_parts"], setters  # set_up_parts: its first value, 0


def test_no_module_but_the_job_s_own_touches_its_private_attributes() -> None:
    """The Job's parts are reached through its typed `parts` and `membership` (job/parts.JobView), never through
    `job._something` or `job.__dict__` from another module."""
    touches = []
    for path in sorted(SRC.rglob("*.py")):
        if path == SRC / "job" / "job.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "job"
                and node.attr.startswith("_")
            ):
                touches.append(f"{path.relative_to(SRC)}:{node.lineno}: job.{node.attr}")
    assert not touches, "\n".join(touches)


def test_every_option_has_one_home() -> None:
    """Each documented flat option of stalwart.Job names one field of one section, and every field has one."""
    from dataclasses import fields

    from stalwart.job import config

    wanted = {(s, f.name) for s, kind in config.SECTIONS.items() for f in fields(kind)}
    wanted |= {("", "log_every"), ("", "collective_timeout_s")}
    assert sorted(config.FLAT.values()) == sorted(wanted)
    made = config.JobConfig.of("x", keep_last=7, snapshot_budget=0.05, loss_spike="rollback", max_rollbacks=1)
    assert (made.checkpoint.keep_last, made.snapshot.budget, made.detect.loss_spike) == (7, 0.05, "rollback")
    assert made.recovery.max_rollbacks == 1 and made.checkpoint.dir == "x"


def test_module_and_class_names_are_unique() -> None:
    """A name says which one: no two modules share a file name (but `__init__` and each command's `cli`), no two
    classes share a name."""
    modules = _modules()
    names = [path.name for path in modules.values() if path.name not in ("__init__.py", "cli.py")]
    assert not {n for n in names if names.count(n) > 1}
    classes: dict[str, list[str]] = defaultdict(list)
    for name, path in modules.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                classes[node.name].append(name)
    assert not {k: v for k, v in classes.items() if len(v) > 1}


def test_no_module_is_over_450_lines() -> None:
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > 450}
    assert not long, f"split these: {long}"


def test_lines_are_as_the_formatter_writes_them() -> None:
    """No `# fmt: skip` in the package: a module kept under 450 lines by packing argument lists is one to split.
    (A table whose alignment carries meaning may earn one; name its module here when it does.)"""
    tables: set[str] = set()
    skipped = {
        name: n
        for name, path in _modules().items()
        if name not in tables and (n := path.read_text().count("# fmt: skip"))
    }
    assert not skipped, f"lines the formatter would write otherwise: {skipped}"
