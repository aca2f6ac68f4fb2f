"""One input batch from a dataset of ``(input, target)`` pairs, on the profiling device."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import default_collate

from shared.errors import SpecError


def first_batch(
    dataset: Any, batch_size: int, device: torch.device, spec: str = "dataset"
) -> tuple[tuple[Any, ...], Any]:
    """The first ``batch_size`` samples (repeated when the dataset is smaller), collated.

    Returns ``(inputs, target)``: ``inputs`` is the tuple of positional arguments of the model,
    one element for a plain tensor input, several when the dataset's input is a tuple.
    """
    samples = [dataset[i % len(dataset)] for i in range(batch_size)]
    for i, sample in enumerate(samples[:1]):
        if not isinstance(sample, (tuple, list)) or len(sample) != 2:
            raise SpecError(
                f"dataset spec {spec!r}: sample {i} is {type(sample).__name__}"
                f"{f' of length {len(sample)}' if isinstance(sample, (tuple, list)) else ''}, "
                "expected an (input, target) pair"
            )
    try:
        inputs, target = default_collate(samples)
    except (TypeError, RuntimeError) as exc:
        raise SpecError(f"dataset spec {spec!r}: cannot batch its samples: {exc}") from None
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    return tuple(_to(a, device) for a in args), _to(target, device)


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value


def batch_shape(inputs: tuple[Any, ...]) -> Any:
    """The input shape to record: one tensor's shape, or a list of them for tuple inputs."""
    from pdprof.sizes import shape_of

    return shape_of(inputs[0]) if len(inputs) == 1 else shape_of(list(inputs))
