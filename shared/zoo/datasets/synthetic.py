"""Deterministic synthetic data of any shape, for benchmarks and tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import Dataset

from shared.zoo.registry import register_dataset


class SyntheticDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``size`` samples, each generated from ``seed`` and its index, so any subset is reproducible."""

    def __init__(
        self, size: int, shape: Sequence[int], num_classes: int, seed: int, target_shape: Sequence[int] = ()
    ) -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        g = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn((size, *shape), generator=g)
        self.targets = torch.randint(0, num_classes, (size, *target_shape), generator=g)

    def __len__(self) -> int:
        return int(self.inputs.shape[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]


@register_dataset("synthetic", "random inputs of any shape and class targets (seeded)", "input float32 shape, target int64 ()")
def synthetic(
    size: int = 1024,
    shape: Sequence[int] = (64,),
    num_classes: int = 10,
    seed: int = 0,
    target_shape: Sequence[int] = (),
) -> SyntheticDataset:
    return SyntheticDataset(size, tuple(shape), num_classes, seed, tuple(target_shape))
