"""The training-loop integration and the definition of full training state."""

from stalwart.job.job import Job, JobConfig, JobState

__all__ = ["Job", "JobConfig", "JobState"]
