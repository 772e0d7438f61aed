"""stalwart keeps PyTorch distributed training making progress through failure.

job = stalwart.Job(checkpoint_dir="runs/gpt/ckpt")
job.track(model=model, optim=optim, sched=sched, data=loader)
for step, batch in job.steps(loader, max_steps=10_000):
    ...
"""

from stalwart import data
from stalwart.data import ResumableLoader
from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    ConfigError,
    StalwartError,
)
from stalwart.job import Job, JobConfig

__version__ = "0.1.0"

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
]
