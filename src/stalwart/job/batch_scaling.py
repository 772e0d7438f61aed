"""The learning rate when the global batch scales with the world: the user's choice of rule, applied at the step
boundary where the world size changes.

Why here: a job whose ResumableLoader has `batch_size_per_rank` trains each step on that many samples per rank, so
a world of 2 ranks instead of 4 takes half the global batch; a learning rate tuned for the larger batch would
then take too large a step per sample (Goyal et al., 2017: the learning rate in proportion to the global batch for
SGD; the square root is the usual rule for Adam). The optimizers' state loaded from the old world carries the old
world's rates, so they are scaled after the load, every tracked optimizer's parameter groups and every tracked LR
scheduler's base rates alike (a scheduler computing from its base rates keeps the scaling). A fixed global batch
(the default) changes no rate: the same samples make the same update.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from stalwart.data.loader import ResumableLoader
from stalwart.job.config import LR_RULES
from stalwart.runtime.torch_compat import scale_last_lr


def scale_learning_rates(objects: Iterable[Any], old_world: int, new_world: int, rule: str) -> float:
    """Scale the tracked optimizers' and schedulers' learning rates for a world size change from `old_world` to
    `new_world` under `rule` (RecoveryOptions.lr_scaling), if a tracked loader scales its global batch with the
    world; returns the factor applied (1.0: none)."""
    objects = list(objects)
    scaled = any(isinstance(o, ResumableLoader) and o.batch_size_per_rank is not None for o in objects)
    factor = (new_world / old_world) ** LR_RULES[rule] if scaled and old_world > 0 else 1.0
    if factor == 1.0:
        return factor
    for obj in objects:
        if isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                for key in ("lr", "initial_lr"):
                    if isinstance(group.get(key), float | int):
                        group[key] = group[key] * factor
        elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            obj.base_lrs = [lr * factor for lr in obj.base_lrs]
            scale_last_lr(obj, factor)
    return factor
