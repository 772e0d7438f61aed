"""stalwart keeps PyTorch distributed training making progress through failure.

job = stalwart.Job(checkpoint_dir="runs/gpt/ckpt")
job.track(model=model, optim=optim, sched=sched, data=loader)
for step, batch in job.steps(loader, max_steps=10_000):
    ...

The training API is imported on first use, so torch-free parts (the checkpoint persister process, the event
log) start without paying for `import torch`. Fault injection (chaos/) is imported only where it is asked for
(runtime/seams.py), so a production process loads none of it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    ConfigError,
    StalwartError,
)
from stalwart.runtime import seams as _seams

if TYPE_CHECKING:
    from stalwart import data
    from stalwart.data import ResumableLoader
    from stalwart.detect.robust import robust_aggregation
    from stalwart.job import Job, JobConfig

__version__ = "0.1.0"


def _install_chaos() -> None:
    """Plug chaos/'s fault injectors into the product's seams. Imported here, in the composition root, so that no
    product module imports chaos/; and only when runtime/seams.py finds fault injection asked for (a fault variable,
    or a save request that carries faults), so that a process without faults loads no module of chaos/."""
    from stalwart.chaos import install

    install.install()


# Run now where a fault variable is set, so that every process a faulty run starts (a worker, its persister, the
# pre-flight check) has the injectors from `import stalwart` on; else held until something asks.
_seams.offer(_install_chaos)

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
