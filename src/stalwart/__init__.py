"""stalwart keeps PyTorch distributed training making progress through failure.

job = stalwart.Job(checkpoint_dir="runs/gpt/ckpt")
job.track(model=model, optim=optim, sched=sched, data=loader)
for step, batch in job.steps(loader, max_steps=10_000):
    ...

The training API is imported on first use, so torch-free parts (the checkpoint persister process, the event
log) start without paying for `import torch`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from stalwart.chaos import install as _chaos
from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    ConfigError,
    StalwartError,
)

if TYPE_CHECKING:
    from stalwart import data
    from stalwart.data import ResumableLoader
    from stalwart.detect.robust import robust_aggregation
    from stalwart.job import Job, JobConfig

__version__ = "0.1.0"

# The composition root: fault injection plugs into the product's seams here, so that no product module imports
# chaos/ and every process that imports stalwart (a worker, its persister, the pre-flight check) has it.
_chaos.install()

_LAZY = {
    "Job": "stalwart.job",
    "JobConfig": "stalwart.job",
    "ResumableLoader": "stalwart.data",
    "robust_aggregation": "stalwart.detect.robust",
}

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "ConfigError",
    "Job",
    "JobConfig",
    "ResumableLoader",
    "StalwartError",
    "__version__",
    "data",
    "robust_aggregation",
]


def __getattr__(name: str) -> Any:
    if name == "data":
        return importlib.import_module("stalwart.data")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'stalwart' has no attribute {name!r}")
