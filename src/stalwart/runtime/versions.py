"""The installed torch's release, for the few places that meet an older one's difference by version rather than
by feature (docs/architecture.md, "Which torch")."""

from __future__ import annotations

import torch


def torch_older_than(release: str) -> bool:
    """Whether the installed torch is older than `release` ("2.5"); a local build ("2.4.1+cu121") counts as its
    release."""
    return torch.torch_version.TorchVersion(torch.__version__) < release
