"""Write pytest's assertion-rewritten bytecode of the tests once, before the suite's workers start.

Why: each pytest-xdist worker imports every test module through pytest's assertion rewriter, which parses and
rewrites the module and, where bytecode may be written, caches the result in `tests/__pycache__`. Where
PYTHONDONTWRITEBYTECODE is set (as on the machines the suite runs on) nothing is cached, and each of the four
workers rewrote all of them again: about 6 s of CPU each on the 2-core VM (2026-11-30), 24 s in all at the suite's
start, when the workers also import torch and mypy runs beside them. Here it is done once, in two processes.

pytest reads a cached rewrite whatever PYTHONDONTWRITEBYTECODE says, and only where its source hash matches the
file's (a checked-hash pyc, PEP 552), so a stale one is never used. This uses pytest's own rewriter (private names
of `_pytest.assertion.rewrite`, pytest 9.2): where those are missing or fail, it writes nothing and says so, and
the workers rewrite as before. Usage: python scripts/precompile_tests.py DIR...
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path


def _write(path: str) -> str:
    """The rewritten bytecode of the module at `path` in its cache directory; '' or why not."""
    try:
        from _pytest.assertion import rewrite

        fn = Path(path)
        source_hash, code = rewrite._rewrite_test(fn, None)  # None: the rewriter's defaults
        cache = rewrite.get_cache_dir(fn)
        cache.mkdir(parents=True, exist_ok=True)
        pyc = cache / (fn.name[:-3] + rewrite.PYC_TAIL)
        partial = pyc.with_name(f"{pyc.name}.{os.getpid()}")
        with open(partial, "wb") as fp:
            rewrite._write_pyc_fp(fp, source_hash, code)
        os.replace(partial, pyc)
        return ""
    except Exception as exc:  # an optimisation: where it fails, the workers rewrite themselves
        return f"{path}: {type(exc).__name__}: {exc}"


def main(dirs: list[str]) -> int:
    try:  # once, before the pool forks
        from _pytest.assertion import rewrite  # noqa: F401
    except ImportError as exc:
        print(f"precompile_tests: nothing cached (the workers rewrite the tests): {exc}")
        return 0
    files = sorted(str(p) for d in dirs for p in Path(d).glob("*.py"))
    with multiprocessing.get_context("fork").Pool(2) as pool:
        failed = [why for why in pool.map(_write, files) if why]
    if failed:
        print(f"precompile_tests: {len(failed)} of {len(files)} not cached (the workers rewrite them): {failed[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
