"""What the two recipe scripts (recipe_accelerate.py, recipe_fabric.py) share: their dataset and how each rank
writes its parameters' digest, so that the tests compare a run with a kill against one without."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch


class Samples(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))


def write_digest(out: Path, rank: int, step: int, module: torch.nn.Module) -> None:
    """The whole parameters' sha256 (FSDP2's shards gathered first: every rank calls it, in the same order)."""
    from torch.distributed.tensor import DTensor

    digest = hashlib.sha256()
    for name, t in module.state_dict().items():
        t = t.full_tensor() if isinstance(t, DTensor) else t
        digest.update(name.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"step": step, "sha256": digest.hexdigest()}))
