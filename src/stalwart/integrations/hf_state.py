"""What stalwart.integrations.hf tracks of the Hugging Face Trainer besides its model, optimizer and scheduler (its
progress and the loss it sums towards its next log line), Accelerate's world size kept with the job's group, and
which of Accelerate's engines it covers. Apart from hf.py so that each stays one screenful of responsibility."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import transformers

from stalwart.errors import ConfigError


def check_dataset(dataset: Any) -> None:
    """An iterable dataset (torch's, or a streaming `datasets.IterableDataset`) raises ConfigError: its position is
    not a function of the step, so a replacement could only read the stream again up to the restored step, and
    Accelerate dispatches its batches from rank 0 with a collective of the data loader's (one a replacement and a
    survivor running its step again would not meet in)."""
    streaming = sys.modules.get("datasets")
    if isinstance(dataset, torch.utils.data.IterableDataset) or (
        streaming is not None and isinstance(dataset, getattr(streaming, "IterableDataset", ()))
    ):
        raise ConfigError(
            f"stalwart.integrations.hf does not cover an iterable dataset ({type(dataset).__name__}): its position "
            "is not a function of the step, so a recovery cannot put it back without reading it again; use a "
            "map-style dataset (one with __getitem__ and __len__)"
        )


def check_engine(trainer: Any) -> str | None:
    """The engine Accelerate wraps the model in (the Trainer's `is_deepspeed_enabled`, `is_fsdp_enabled` and FSDP
    plugin's version), as the Trainer's init made it: one the integration cannot run a failed step again through
    raises ConfigError, saying which and why; FSDP2, covered but not yet run under this Trainer (Accelerate
    enables FSDP only with a GPU), returns the line to say at start; DDP or one process returns None."""
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise ConfigError(
            "stalwart.integrations.hf does not cover DeepSpeed: its engine accumulates gradients and steps the "
            "optimizer itself (a failed step's micro-batches cannot be run again through it); use DDP (or FSDP2, "
            "fsdp_config={'version': 2}, not yet tested)"
        )
    if not getattr(trainer, "is_fsdp_enabled", False):
        return None
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if getattr(plugin, "fsdp_version", 1) != 2:
        raise ConfigError(
            "stalwart.integrations.hf does not cover FSDP1 (FullyShardedDataParallel), whose flat parameters "
            "stalwart does not snapshot or reshard; use FSDP2: fsdp_config={'version': 2}"
        )
    return (
        "stalwart: FSDP2 under the Hugging Face Trainer has not been tested yet (Accelerate enables FSDP only on a "
        "GPU): its recovery in the Trainer's loop is unverified"
    )


class TrainerProgress:
    """The Trainer's progress (its `TrainerState`, and what it has logged of the loss), tracked by the Job so that a
    restore puts it back. The same on every rank (the Trainer gathers what it sums; no tensor of one rank's is
    here), so replicated: it may change after the optimizer step (the global step does) without turning light
    snapshots off."""

    stalwart_replicated = True
    FIELDS = (
        "global_step",
        "epoch",
        "total_flos",
        "best_metric",
        "best_global_step",
        "best_model_checkpoint",
        "num_input_tokens_seen",
    )

    def __init__(self, trainer: transformers.Trainer) -> None:
        self._trainer = trainer
        self._log: tuple[int, str] = (-1, "")  # the log history as JSON, by its length

    def state_dict(self) -> dict[str, Any]:
        """Read at every step's end (a replicated object's skeleton): the log history, which grows with the run and
        is only appended to, is encoded again only when it grew."""
        t = self._trainer
        fields = {name: getattr(t.state, name, None) for name in self.FIELDS}
        fields["logged_total"] = getattr(t, "_total_loss_scalar", 0.0)
        fields["logged_at"] = getattr(t, "_globalstep_last_logged", 0)
        history = t.state.log_history
        if self._log[0] != len(history):
            self._log = (len(history), json.dumps(history))
        return {"json": json.dumps(fields), "log_history": self._log[1]}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        t = self._trainer
        fields = json.loads(saved["json"])
        t._total_loss_scalar = fields.pop("logged_total")
        t._globalstep_last_logged = fields.pop("logged_at")
        for name, value in fields.items():
            if hasattr(t.state, name):
                setattr(t.state, name, value)
        t.state.log_history = json.loads(saved["log_history"])
        self._log = (len(t.state.log_history), saved["log_history"])


class LoggedLoss:
    """The loss this rank summed towards the Trainer's next log line, as it was before the step's optimizer step
    (`capture`, at `on_pre_optimizer_step`), and the step last logged then. Per rank, and unchanged after the
    optimizer step (the log line's reset comes later), so light snapshots stay on. A restore puts it back unless a
    log line consumed it since (`settle`): a replacement or a restart logs the same loss as a run without the
    failure."""

    def __init__(self, trainer: transformers.Trainer) -> None:
        self._trainer = trainer
        self._sum: torch.Tensor | None = None
        self._logged_at = 0
        self.loaded_at: int | None = None

    def capture(self) -> None:
        t = self._trainer
        since = getattr(t, "_tr_loss", None)
        self._sum = since.detach().clone() if since is not None else None
        self._logged_at = getattr(t, "_globalstep_last_logged", 0)

    def state_dict(self) -> dict[str, Any]:
        return {"since_logged": self._sum, "logged_at": self._logged_at}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self._sum, self._logged_at = saved["since_logged"], saved["logged_at"]
        self.loaded_at = saved["logged_at"]
        t = self._trainer
        if self._sum is not None and hasattr(t, "_tr_loss"):
            t._tr_loss = self._sum.to(t._tr_loss.device).clone()

    def settle(self, new_formation: bool) -> None:
        """After a restore, and in every rank's first step of a formation (`new_formation`: the job (re)formed, all its
        ranks call it there together): a sum that a log line consumed after it was taken is none, and a rank whose
        sum is not of the Trainer's current log window (a replacement whose predecessor's snapshot is older than
        the survivors' last log line, after they trained on shrunk) takes the mean of the other ranks' sums, so
        that the next log line is the job's."""
        t = self._trainer
        since = getattr(t, "_tr_loss", None)
        stale = self.loaded_at is not None and self.loaded_at != getattr(t, "_globalstep_last_logged", 0)
        self.loaded_at = None
        if since is None:
            return
        if not new_formation or not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            if stale:
                t._tr_loss = torch.zeros_like(since)
            return
        mine = torch.stack([since.detach() * (not stale), torch.tensor(float(not stale), device=since.device)])
        torch.distributed.all_reduce(mine)
        if stale:
            total, count = mine.tolist()
            t._tr_loss = torch.full_like(since, total / count if count else 0.0)


def match_accelerate() -> None:
    """Accelerate sizes its gathers and scales its losses by the world it started in (`num_processes` of its
    `PartialState` and `AcceleratorState`, the Trainer's `args.world_size`); while the survivors train on shrunk
    their group is smaller, and back at full size after the grow. Its shared states follow the job's group."""
    if not torch.distributed.is_initialized():
        return
    from accelerate.state import AcceleratorState, PartialState

    size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    for shared in (PartialState._shared_state, AcceleratorState._shared_state):
        if "num_processes" in shared and (shared["num_processes"], shared.get("process_index")) != (size, rank):
            shared["num_processes"], shared["process_index"] = size, rank
