"""Torch's internals around a process's end: the part of runtime/torch_compat.py for the processes a job forks
from one that imported torch (the zygote and its workers, the launchers a launch server forks).

The rules of runtime/torch_compat.py hold here: each entry says what it relies on, why no public way serves, and
the torch releases on which tests/test_torch_compat.py passed ("checked on").
"""

from __future__ import annotations

import weakref

from torch import library


def skip_operator_deregistration_at_exit() -> int:
    """Turn off, in this process and every process it forks later, torch's finalizers for its operator libraries
    (`torch.library.Library`: about 170 once the training side is imported), which at the interpreter's exit take
    each library's operators out of the dispatcher, work for a process about to end. In a forked process they also
    write to pages it shares with its parent: 65 ms of CPU at exit against 5 ms without them (2-core VM,
    2026-11-30), in each worker, zygote and launcher of a job. The user's own finalizers run as before. How many
    were turned off (0 where torch changed what this relies on: its `_del_library` as the finalizers' function,
    and CPython's registry of live finalizers, `weakref.finalize._registry`, which no public API lists). Checked on
    torch 2.13.0."""
    target = getattr(library, "_del_library", None)
    registry = getattr(weakref.finalize, "_registry", None)
    if target is None or not isinstance(registry, dict):
        return 0
    turned = 0
    for finalizer in list(registry):
        held = finalizer.peek()
        if held is not None and held[1] is target and finalizer.atexit:
            finalizer.atexit = False
            turned += 1
    return turned
