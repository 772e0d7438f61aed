"""The demo's data: character windows of the Shakespeare text shipped in demo/assets (public domain)."""

from __future__ import annotations

from importlib import resources

import torch
from torch.utils.data import Dataset


def load_text() -> str:
    return resources.files("stalwart.demo").joinpath("assets/tinyshakespeare.txt").read_text(encoding="utf-8")


class CharWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of `block_size + 1` characters; sample i is (input, next-char target)."""

    def __init__(self, ids: torch.Tensor, block_size: int) -> None:
        self.ids = ids
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[i * self.block_size : (i + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


def encode(text: str) -> tuple[torch.Tensor, int]:
    vocab = sorted(set(text))
    lookup = {ch: i for i, ch in enumerate(vocab)}
    return torch.tensor([lookup[ch] for ch in text], dtype=torch.long), len(vocab)
