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

from collections import Counter
from typing import Any

import torch
from torch.utils.data import TensorDataset, default_collate

from shared.errors import DataError


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


def checked_gather(
    dataset: Any, indices: torch.Tensor, name: str, where: str = "", inputs: bool = True, target: bool = True
) -> tuple[tuple[Any, ...], Any]:
    """:func:`gather`, with a failure that is the data's said as ``DataError`` naming ``name`` (how messages
    name the data: ``dataset zoo:digits``) and the sample (``where``: `` (unit 12)``): a sample whose read
    raises, or one whose shapes or dtypes differ from the rest of its batch (which cannot be stacked)."""
    try:
        return gather(dataset, indices, inputs, target)
    except Exception as exc:
        odd = _odd_sample(dataset, indices, name, where)
        if odd is None:
            raise DataError(f"{name}: a batch{where} failed: {type(exc).__name__}: {exc}") from exc
        raise DataError(odd) from None


def _odd_sample(dataset: Any, indices: torch.Tensor, name: str, where: str) -> str | None:
    """The sample of the batch that fails to read, or is unlike most of it, in words; None when every
    sample reads and looks alike."""
    layouts: dict[int, str] = {}
    for i in map(int, indices):
        try:
            layouts[i] = _layout(dataset[i])
        except Exception as exc:
            return f"{name}: sample {i}{where}: reading it raised {type(exc).__name__}: {exc}"
    common, _ = Counter(layouts.values()).most_common(1)[0]
    odd = next((i for i, layout in layouts.items() if layout != common), None)
    if odd is None:
        return None
    usual = next(i for i, layout in layouts.items() if layout == common)
    return (
        f"{name}: sample {odd}{where} is {layouts[odd]}, but sample {usual} of the same batch "
        f"is {common}; every sample needs the same shapes and dtypes"
    )


def _layout(value: Any) -> str:
    """A sample's structure, shapes and dtypes: what must agree for samples to be stacked."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_layout(v) for v in value) + ")"
    return type(value).__name__
