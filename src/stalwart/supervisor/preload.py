"""What the zygote imports for the script, beyond torch and stalwart: the heavy frameworks it would import itself.

Why: every worker host forked from the zygote (supervisor/zygote.py) starts with what the zygote imported. A
script on the Hugging Face Trainer spends about 5 s of CPU importing transformers, in every worker and again in
every replacement, on the critical path of a recovery that waits for it (2-core VM, 2026-12-01). Imported once in
the zygote, it is shared by every fork and costs a replacement nothing.

Which modules: those named by `stalwart run --preload` (or $STALWART_PRELOAD), comma-separated, and by default the
stalwart integrations the script imports (`stalwart.integrations.hf` brings transformers with it), found by reading
the script's imports without running it (with `-m`, the module's file). `--preload none` turns the default off.

A fork is only safe from a process with no other thread and no CUDA driver: `load` says whether the imports kept
it so (the zygote refuses to fork otherwise, and hosts start as new interpreters, as before). A module that fails
to import is left to the script, whose own import reports it.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from stalwart.runtime.env import PRELOAD_ENV

INTEGRATIONS = "stalwart.integrations."
NONE = "none"


@dataclass(frozen=True)
class Preload:
    """What the zygote imports for the script, and the directory its imports are found in first (as for the
    script itself: its own directory, or with `-m` the current one), so that a module beside the script can be
    named too."""

    modules: tuple[str, ...] = ()
    path: str = ""


def plan(flag: str | None, script: str, *, is_module: bool) -> Preload:
    """The modules to preload for `script` (a file, or with `is_module` a module name): `flag` (the option's value,
    else $STALWART_PRELOAD), and unless it says "none", the stalwart integrations the script imports."""
    given = flag if flag is not None else os.environ.get(PRELOAD_ENV, "")
    named = [m.strip() for m in given.split(",") if m.strip()]
    path = os.getcwd() if is_module else os.path.dirname(os.path.abspath(script))
    if NONE in named:
        return Preload(tuple(m for m in named if m != NONE), path)
    source = _module_file(script) if is_module else Path(script)
    found = integrations_imported(source) if source is not None else []
    return Preload(tuple(dict.fromkeys(named + found)), path)


def _module_file(name: str) -> Path | None:
    """The file `python -m name` runs (its package's `__main__` for a package); None if there is none."""
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:  # a package: its __main__
            spec = importlib.util.find_spec(f"{name}.__main__")
    except (ImportError, ValueError):
        return None
    origin = spec.origin if spec is not None else None
    return Path(origin) if origin and origin.endswith(".py") else None


def integrations_imported(script: Path) -> list[str]:
    """The `stalwart.integrations.*` modules `script` imports anywhere in its text; none if it cannot be read."""
    try:
        tree = ast.parse(script.read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return []
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith(INTEGRATIONS)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith(INTEGRATIONS):
                found.append(node.module)
            elif node.module == INTEGRATIONS.rstrip("."):  # from stalwart.integrations import hf
                found += [INTEGRATIONS + alias.name for alias in node.names]
    return list(dict.fromkeys(found))


def load(preload: Preload) -> bool:
    """Import the modules (each one that fails is skipped); False when that started a thread, after which forking
    is not safe. sys.path is as it was after."""
    threads = _native_threads()
    before = list(sys.path)
    sys.path.insert(0, preload.path)
    try:
        for name in preload.modules:
            with contextlib.suppress(Exception):
                importlib.import_module(name)
    finally:
        sys.path[:] = before
    return _native_threads() == threads


def _native_threads() -> int:
    """This process's threads, Python's and native ones (a library's pool is invisible to `threading`)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def settle() -> None:
    """A worker forked from the zygote took its environment: what a preloaded module read of it when imported, in
    the zygote where no rank is set, is read again. Lightning keeps the rank on `rank_zero_only` from its import
    (0 there): every rank would run what is meant for rank 0 until its Trainer is made."""
    rank_zero = sys.modules.get("lightning.fabric.utilities.rank_zero")
    only, get_rank = getattr(rank_zero, "rank_zero_only", None), getattr(rank_zero, "_get_rank", None)
    if only is not None and callable(get_rank):
        with contextlib.suppress(Exception):
            only.rank = get_rank() or 0
