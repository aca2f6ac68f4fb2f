"""The zoo's catalogue: every model with its parameter counts and every dataset with its sizes and shapes.

Models are built under ``torch.device("meta")``: parameters get shapes but no memory
and no initialisation, so counting VGG-16's 138 million takes milliseconds.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from shared.fields import keyword_fields
from shared.zoo import registry


def parameter_count(build: Callable[..., Any], args: dict[str, Any]) -> int:
    """Parameters of ``build(**args)``, counted without allocating them."""
    with torch.device("meta"):
        model = build(**args)
    return sum(p.numel() for p in model.parameters())


def _jsonable(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


def default_arguments(build: Callable[..., Any]) -> dict[str, Any]:
    """The builder's keyword arguments with their defaults (what ``zoo:NAME`` alone builds)."""
    return {
        name: _jsonable(p.default)
        for name, p in inspect.signature(build).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def describe(value: Any) -> Any:
    """A sample's structure: ``{"shape", "dtype"}`` for a tensor, a list for a tuple of tensors."""
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, (tuple, list)):
        return [describe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): describe(v) for k, v in value.items()}
    return {"type": type(value).__name__}


def model_rows() -> list[dict[str, Any]]:
    rows = []
    for name, entry in sorted(registry.models().items()):
        rows.append(
            {
                "name": name,
                "spec": f"zoo:{name}",
                "description": entry.description,
                "parameters": parameter_count(entry.build, {}),
                "arguments": default_arguments(entry.build),
                "input": entry.input,
                "dataset": entry.dataset,
                "small_arguments": _jsonable(entry.defaults),
                "small_parameters": parameter_count(entry.build, entry.defaults),
            }
        )
    return rows


def dataset_rows() -> list[dict[str, Any]]:
    """Each dataset loaded with its default arguments (train and val split) to report real sizes."""
    rows = []
    for name, entry in sorted(registry.datasets().items()):
        sizes = {}
        first: Any = None
        for split in ("train", "val"):
            data = entry.build(split=split)
            sizes[split] = len(data)
            if first is None:
                first = data[0]
        keyword = keyword_fields(first)  # a keyword dataset: (dict of inputs, target), or a dict with labels
        x, y = (dict(keyword[0]), keyword[1]) if keyword is not None else first
        rows.append(
            {
                "name": name,
                "spec": f"zoo:{name}",
                "description": entry.description,
                "samples": sizes,
                "input": describe(x),
                "target": describe(y),
                "sample": entry.sample,
                "arguments": default_arguments(entry.build),
            }
        )
    return rows


def catalog() -> dict[str, Any]:
    """The whole listing, as ``pdprof zoo --json`` prints it."""
    return {"format": "pdprof.zoo/1", "models": model_rows(), "datasets": dataset_rows()}
