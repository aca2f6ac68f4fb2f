"""Deterministic synthetic data of any shape (for benchmarks and tests), images included.

Samples are generated lazily from ``(seed, split, index)``, so a dataset of large
images costs no memory up front and any subset is reproducible on any worker.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import Dataset

from shared.zoo.registry import register_dataset

SPLITS = ("train", "val")


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def sample_generator(seed: int, split: str, index: int) -> torch.Generator:
    """The generator for one sample: distinct for every (seed, split, index), the same on every run."""
    # torch's CPU generator keeps only the low 32 bits of a seed, so (seed, split) must not sit above them.
    # Offsetting the index by a multiple of the golden-ratio constant keeps the samples of one (seed, split)
    # distinct and spreads the (seed, split) pairs evenly over the 2**32 streams, far apart for small seeds.
    stream = index + (seed * 2 + SPLITS.index(split)) * 0x9E3779B1
    return torch.Generator().manual_seed(stream % 2**32)


class SyntheticDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``size`` samples: a standard-normal input of ``shape`` and class targets of ``target_shape``."""

    def __init__(
        self,
        size: int,
        shape: Sequence[int],
        num_classes: int,
        seed: int,
        target_shape: Sequence[int] = (),
        split: str = "train",
    ) -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        if num_classes < 1:
            raise ValueError(f"num_classes must be at least 1, got {num_classes}")
        check_split(split)
        self.size = size
        self.shape = tuple(int(s) for s in shape)
        self.target_shape = tuple(int(s) for s in target_shape)
        self.num_classes = num_classes
        self.seed = seed
        self.split = split
        # Every target at once, from a stream of its own: a last pipeline stage reads only the targets
        # (shared.batches.gather), and generating each sample's input to reach its target cost it as
        # much as the first stage's whole data loading (ResMLP, batch 128: 1.2 ms a unit).
        g = sample_generator(seed, split, size)  # the stream sample ``size`` would have: unused by any
        self.targets = torch.randint(0, num_classes, (size, *self.target_shape), generator=g)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self.size <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} samples")
        g = sample_generator(self.seed, self.split, index % self.size)
        return torch.randn(self.shape, generator=g), self.targets[index % self.size]


@register_dataset(
    "synthetic",
    "random inputs of any shape and class targets (seeded; 1,024 train / 256 val by default)",
    "input float32 shape (default (64,)), target int64 target_shape (default ())",
)
def synthetic(
    *,
    size: int | None = None,
    shape: Sequence[int] = (64,),
    num_classes: int = 10,
    seed: int = 0,
    target_shape: Sequence[int] = (),
    split: str = "train",
) -> SyntheticDataset:
    check_split(split)
    n = size if size is not None else (1024 if split == "train" else 256)
    return SyntheticDataset(n, tuple(shape), num_classes, seed, tuple(target_shape), split)


@register_dataset(
    "synthetic_images",
    "random ImageNet-shaped images and 1,000 classes for the vision models (seeded; 256 train / 64 val)",
    "input float32 (3, image_size, image_size) (default 224), target int64 ()",
)
def synthetic_images(
    *,
    size: int | None = None,
    image_size: int = 224,
    channels: int = 3,
    num_classes: int = 1000,
    seed: int = 0,
    split: str = "train",
) -> SyntheticDataset:
    check_split(split)
    n = size if size is not None else (256 if split == "train" else 64)
    return SyntheticDataset(n, (channels, image_size, image_size), num_classes, seed, (), split)
