"""Keyword inputs: a dataset whose samples are dicts of fields feeds the model's keyword arguments.

A sample is either a dict of fields (``{"input_ids": ..., "attention_mask": ..., "labels": ...}``,
as Hugging Face datasets are) or a pair ``(dict of inputs, target)``. The fields the model's
``forward`` accepts become its inputs, in the order of its signature; the target is the pair's
second half, or the field named ``labels`` (or ``label``) of a dict sample. pdprof records the
mapping in the spec (``spec.inputs``, ``spec.target``) and pdrun reads it back, so every stage
sees the samples as ``((field, field, ...), target)`` tuples, the positional form the rest of the
toolchain speaks, through ``KeywordSamples``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torch import nn

from shared.errors import SpecError

TARGET_FIELDS = ("labels", "label")


def keyword_fields(sample: Any) -> tuple[Mapping[str, Any], Any, str | None] | None:
    """(input fields, target, target field or None) of a keyword sample; None for an ``(input, target)`` pair."""
    if isinstance(sample, Mapping):
        field = next((f for f in TARGET_FIELDS if f in sample), None)
        inputs = {k: v for k, v in sample.items() if k != field}
        return inputs, (sample[field] if field else None), field
    if isinstance(sample, (tuple, list)) and len(sample) == 2 and isinstance(sample[0], Mapping):
        return sample[0], sample[1], None
    return None


def forward_parameters(model: nn.Module) -> list[str]:
    """The names ``model.forward`` takes by keyword, in signature order (``**kwargs`` left out)."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in signature.parameters.values() if p.kind in kinds]


def input_order(model: nn.Module, fields: Mapping[str, Any], spec: str) -> list[str]:
    """The sample's fields in the order of the model's forward; refuses a field forward does not take."""
    accepted = forward_parameters(model)
    unknown = [f for f in fields if f not in accepted]
    if unknown:
        raise SpecError(
            f"dataset spec {spec!r}: field {unknown[0]!r} is not an argument of "
            f"{type(model).__name__}.forward (it takes {', '.join(accepted[:8]) or 'none'}"
            f"{', ...' if len(accepted) > 8 else ''}); drop it from the samples"
        )
    if not fields:
        raise SpecError(f"dataset spec {spec!r}: a sample has no input field besides its target")
    return [name for name in accepted if name in fields]


class KeywordSamples:
    """A dataset of keyword samples seen as ``((field, ...), target)`` pairs, fields in ``inputs`` order."""

    def __init__(self, dataset: Any, inputs: list[str], target: str | None, spec: str = "dataset") -> None:
        self.dataset = dataset
        self.inputs = list(inputs)
        self.target = target
        self.spec = spec

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def targets(self) -> Any:
        """The wrapped dataset's table of targets (``targets[i]`` is sample i's) where its samples are
        (fields, target) pairs: a last stage then gathers its labels from it, without reading every
        sample (``shared.batches``). None where the target is a field of the sample."""
        return getattr(self.dataset, "targets", None) if self.target is None else None

    def __getitem__(self, index: int) -> tuple[tuple[Any, ...], Any]:
        sample = self.dataset[index]
        got = keyword_fields(sample)
        if got is None:
            raise SpecError(
                f"dataset spec {self.spec!r}: sample {index} is {type(sample).__name__}, "
                "expected a dict of fields or a (dict, target) pair like the first"
            )
        fields, target, _ = got
        if isinstance(sample, Mapping) and self.target is not None:
            target = sample.get(self.target)
        missing = [f for f in self.inputs if f not in fields]
        if missing or target is None:
            what = repr(missing[0]) if missing else f"target {self.target!r}"
            raise SpecError(f"dataset spec {self.spec!r}: sample {index} has no field {what}")
        return tuple(fields[f] for f in self.inputs), target


def keyword_dataset(dataset: Any, inputs: list[str] | None, target: str | None, spec: str = "dataset") -> Any:
    """``dataset`` as ``(inputs, target)`` pairs when the spec records keyword inputs; else unchanged."""
    return dataset if inputs is None else KeywordSamples(dataset, inputs, target, spec)
