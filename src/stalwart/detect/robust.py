"""Byzantine-robust gradient aggregation for DDP (opt-in): a rank that sends corrupted gradients cannot steer
the model.

Why: DDP averages every rank's gradient, so one rank with a faulty GPU (or corrupted data) that produces huge or
wrong gradients moves every replica by 1/world of its error, step after step; the divergence check cannot see
it, because the replicas stay equal to one another. Robust aggregation replaces the mean by a statistic that a
minority of bad inputs cannot drag far:

- "median": the coordinate-wise median of the ranks' gradients (torch's lower median for an even count);
- "trimmed_mean": per coordinate, the mean after dropping the `trim` largest and `trim` smallest values;
- "krum": the one rank's gradient closest (sum of squared distances to its world - f - 2 nearest others) to the
  rest, f being the number of faulty ranks tolerated (Blanchard et al., NeurIPS 2017).

Use, on the DDP module (it replaces DDP's all-reduce; a communication hook of your own cannot be combined):

    ddp.register_comm_hook(None, stalwart.robust_aggregation("median"))

Cost: each bucket is all-gathered (world times the bytes of an all-reduce) and reduced on the device, once per
step. With honest ranks the result is not the mean, so training is not bitwise the same as plain DDP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from stalwart.errors import ConfigError

METHODS = ("median", "trimmed_mean", "krum")

Hook = Callable[[Any, Any], torch.futures.Future]


def robust_aggregation(method: str = "median", *, trim: int = 1, faulty: int = 1, group: Any = None) -> Hook:
    """A DDP communication hook that aggregates each gradient bucket with `method` instead of the mean."""
    if method not in METHODS:
        raise ConfigError(f"robust_aggregation: method must be one of {', '.join(METHODS)}, got {method!r}")
    if trim < 0 or faulty < 0:
        raise ConfigError("robust_aggregation: trim and faulty must be >= 0")

    def hook(state: Any, bucket: Any) -> torch.futures.Future:
        grads = bucket.buffer()
        world = dist.get_world_size(group)
        gathered = [torch.empty_like(grads) for _ in range(world)]
        dist.all_gather(gathered, grads, group=group)
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(aggregate(torch.stack(gathered), method, trim=trim, faulty=faulty))
        return future

    # DDP checks a hook's annotations; this module's are strings (postponed evaluation), so give it the objects.
    hook.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    return hook


def aggregate(stacked: torch.Tensor, method: str, *, trim: int = 1, faulty: int = 1) -> torch.Tensor:
    """Reduce `stacked` (ranks x values) over its first dimension with `method`."""
    n = stacked.shape[0]
    if method == "median":
        return stacked.median(dim=0).values
    if method == "trimmed_mean":
        if 2 * trim >= n:
            raise ConfigError(f"trimmed_mean: trimming {trim} from each side leaves nothing of {n} ranks")
        ordered = stacked.sort(dim=0).values
        return ordered[trim : n - trim].mean(dim=0)
    if method == "krum":
        keep = n - faulty - 2
        if keep < 1:
            raise ConfigError(f"krum: tolerating {faulty} faulty ranks needs at least {faulty + 3} ranks, not {n}")
        flat = stacked.reshape(n, -1).double()
        distances = torch.cdist(flat, flat).square()
        scores = distances.sort(dim=1).values[:, 1 : keep + 1].sum(dim=1)  # column 0 is the distance to itself
        return stacked[int(scores.argmin())].clone()
    raise ConfigError(f"unknown robust aggregation method {method!r}")
