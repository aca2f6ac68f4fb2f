"""One batch of a dataset, gathered the way pdrun's workers fetch it (and pdprof times it).

A ``TensorDataset`` of (inputs, targets) is indexed with the batch's indices in one gather
per tensor, and only for the parts asked for: the same tensors as collating its samples one
by one (a stack of the same rows), without a ``__getitem__`` call per sample and without
the images on a last stage that needs only the labels (py-spy, 2-stage CNN: collating took
~15% of the first stage's compute and ~5% of the last's). Any other map-style dataset is
indexed sample by sample and collated, except that a stage that needs only the labels
takes them from the dataset's ``targets`` tensor where it has one (one row per sample; a keyword
dataset passes on the table of the dataset it wraps, ``shared.fields.KeywordSamples``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import TensorDataset, default_collate


def gather(
    dataset: Any, indices: torch.Tensor, inputs: bool = True, target: bool = True
) -> tuple[tuple[Any, ...], Any]:
    """(model inputs as a tuple, target) of the samples at ``indices``; a part not asked for is ``()``/None."""
    if type(dataset) is TensorDataset and len(dataset.tensors) == 2:
        x, y = dataset.tensors
        # index_select, not x[indices]: the same rows in a third of the time (advanced indexing's setup).
        return ((x.index_select(0, indices),) if inputs else ()), (
            y.index_select(0, indices) if target else None
        )
    targets = getattr(dataset, "targets", None)
    plain = getattr(dataset, "target_transform", None) is None  # torchvision's: targets[i] is not the target
    if not inputs and plain and isinstance(targets, torch.Tensor) and len(targets) == len(dataset):
        # Only the labels (a last stage): from the dataset's table of targets (torchvision's convention,
        # the zoo's synthetic data), without fetching the inputs sample by sample.
        return (), (targets.index_select(0, indices) if target else None)
    samples = [dataset[int(i)] for i in indices]
    # Collate only the parts asked for: a stage is not failed (or slowed) by the parts it does not read.
    got = default_collate([s[0] for s in samples]) if inputs else ()
    labels = default_collate([s[1] for s in samples]) if target else None
    if not isinstance(got, (tuple, list)):
        got = (got,)
    return tuple(got), labels
