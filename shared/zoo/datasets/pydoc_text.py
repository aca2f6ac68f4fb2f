"""Character-level text from Python's own documentation (``pydoc_data.topics``), for the GPT model.

The text ships with every CPython, so nothing is downloaded. The vocabulary is fixed:
0 stands for any character outside it, then tab, newline and printable ASCII (98 ids).
A sample is a block of ``block_size`` characters and, as target, the same block shifted
by one character (the next character at every position).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch.utils.data import Dataset

from shared.zoo.datasets.synthetic import SPLITS, check_split
from shared.zoo.registry import register_dataset

CHARS = "\t\n" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE = 1 + len(CHARS)  # id 0: a character outside CHARS


def encode(text: str) -> np.ndarray:
    """Characters -> ids (int64); anything outside the vocabulary becomes 0."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    table = np.zeros(128, dtype=np.int64)
    for i, ch in enumerate(CHARS, start=1):
        table[ord(ch)] = i
    return np.where(codes < 128, table[np.minimum(codes, 127)], 0)


def decode(ids: torch.Tensor | np.ndarray) -> str:
    """Ids -> text, with ``\\ufffd`` for id 0."""
    return "".join(CHARS[i - 1] if 0 < i <= len(CHARS) else "\ufffd" for i in np.asarray(ids).tolist())


@functools.cache
def corpus() -> torch.Tensor:
    """The whole text as ids: every topic, in sorted order of topic name."""
    from pydoc_data.topics import topics

    return torch.from_numpy(encode("\n\n".join(topics[k] for k in sorted(topics))))


class CharBlocks(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping blocks of the corpus, chosen by index."""

    def __init__(self, data: torch.Tensor, starts: torch.Tensor, block_size: int) -> None:
        self.data = data
        self.starts = starts
        self.block_size = block_size

    def __len__(self) -> int:
        return int(self.starts.numel())

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.starts[index])
        chunk = self.data[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


@register_dataset(
    "pydoc_text",
    "character-level text of Python's pydoc_data.topics (~465k characters, 98-symbol vocabulary); "
    "7,267 blocks of 64 with Python 3.11 (the text varies with the Python version), 90/10 train/val",
    "input int64 (block_size,), target int64 (block_size,) = input shifted by one",
)
def pydoc_text(
    *, block_size: int = 64, split: str = "train", val_fraction: float = 0.1, seed: int = 0
) -> CharBlocks:
    check_split(split)
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    data = corpus()
    blocks = (int(data.numel()) - 1) // block_size
    if blocks < 2:
        raise ValueError(f"block_size {block_size} leaves fewer than 2 blocks of text")
    return CharBlocks(data, split_blocks(blocks, split, val_fraction, seed) * block_size, block_size)


def split_blocks(blocks: int, split: str, val_fraction: float, seed: int) -> torch.Tensor:
    """Which of ``blocks`` blocks are ``split``'s: a seeded shuffle, its last ``val_fraction`` (1 at least) val."""
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed))
    cut = blocks - max(1, round(blocks * val_fraction))
    return order[:cut] if split == SPLITS[0] else order[cut:]
