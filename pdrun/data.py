"""The units of work from the dataset, in one deterministic order every stage agrees on.

Unit ``u`` is batch ``u mod B`` of epoch ``u div B`` (``B`` full batches per epoch, the
last partial batch dropped), each epoch shuffled by a generator seeded with
``seed + epoch``. The first stage takes the unit's inputs and the last its targets; both
compute the same indices, so they see the same samples without talking.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from shared.batches import checked_gather
from shared.errors import SpecError, UserError
from shared.fields import keyword_dataset
from shared.resolve import resolve_dataset
from shared.spec import RunSpec


class Units:
    """A dataset cut into units of ``batch_size`` samples, shuffled per epoch."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        name: str = "dataset",
        pad: bool = False,
    ) -> None:
        self.dataset = dataset
        self.name = name  # how messages name the data: "dataset zoo:digits"
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        # pad (validation): keep the last partial batch, filled up with the epoch's first samples so that
        # every message keeps its known shape; ``real`` says how many of its samples count.
        self.pad = pad
        self.per_epoch = -(-len(dataset) // batch_size) if pad else len(dataset) // batch_size
        if self.per_epoch < 1:
            raise UserError(f"{name}: {len(dataset)} samples, fewer than one batch of {batch_size}")
        self._order: tuple[int, torch.Tensor] | None = None

    def indices(self, unit: int) -> torch.Tensor:
        epoch, b = divmod(unit, self.per_epoch)
        if self._order is None or self._order[0] != epoch:
            n = len(self.dataset)
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._order = (epoch, torch.randperm(n, generator=g))
            else:
                self._order = (epoch, torch.arange(n))
        if self.pad:
            span = torch.arange(b * self.batch_size, (b + 1) * self.batch_size) % len(self.dataset)
            return self._order[1][span]
        return self._order[1][b * self.batch_size : (b + 1) * self.batch_size]

    def real(self, unit: int) -> int:
        """How many of ``unit``'s samples are real (fewer than the batch only in a padded last batch)."""
        b = unit % self.per_epoch
        return min(self.batch_size, len(self.dataset) - b * self.batch_size)

    def batch(self, unit: int, inputs: bool = True, target: bool = True) -> tuple[tuple[Any, ...], Any]:
        """(model inputs as a tuple, target) of ``unit``; a part not asked for is ``()`` or None (``shared.batches``).

        A batch whose samples differ in shape or dtype raises ``DataError`` naming the odd sample."""
        return checked_gather(self.dataset, self.indices(unit), self.name, f" (unit {unit})", inputs, target)


def to_device(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Move a batch to ``device``; floating tensors take the run's dtype."""
    if isinstance(value, torch.Tensor):
        value = value.to(device)
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device, dtype) for v in value)
    return value


def datasets(spec: RunSpec) -> tuple[Any, Any | None]:
    """(training set, validation set or None): the spec with ``split="val"`` when it takes ``split``."""
    if spec.data is None:
        raise SpecError("plan: spec.data: the plan names no dataset; pass one to pdprof with --data")
    train_args = dict(spec.data_args)
    if spec.data.startswith("zoo:"):
        from shared.zoo import registry

        fn = registry.dataset_builder(spec.data[4:])
    else:
        from shared.resolve import load_callable

        fn = load_callable(spec.data, "dataset")
    try:
        takes_split = "split" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes_split = False
    # Keyword samples (dicts of fields) are seen as (inputs, target) pairs in the order pdprof recorded.
    train = keyword_dataset(resolve_dataset(spec.data, train_args), spec.inputs, spec.target, spec.data)
    if not takes_split or train_args.get("split", "train") == "val":
        return train, None
    val = resolve_dataset(spec.data, {**train_args, "split": "val"})
    return train, keyword_dataset(val, spec.inputs, spec.target, spec.data)
