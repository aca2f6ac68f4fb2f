"""The zoo's registry: built-in models and datasets by name, for ``zoo:NAME`` specs.

Models and datasets register themselves with a decorator that records what a user
needs to know to pick one: a description, the input a model expects, the dataset it
pairs with. ``pdprof zoo`` lists them.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from shared.errors import SpecError

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class ModelEntry:
    name: str
    build: Callable[..., Any]
    description: str
    input: str  # e.g. "float32 (N, 3, 224, 224)"
    dataset: str | None = None  # the zoo dataset it pairs with
    defaults: dict[str, Any] = field(default_factory=dict)  # small-size arguments for tests and demos


@dataclass(frozen=True)
class DatasetEntry:
    name: str
    build: Callable[..., Any]
    description: str
    sample: str  # e.g. "input float32 (64,), target int64 ()"


MODELS: dict[str, ModelEntry] = {}
DATASETS: dict[str, DatasetEntry] = {}


def register_model(
    name: str,
    description: str,
    input: str,
    dataset: str | None = None,
    defaults: dict[str, Any] | None = None,
) -> Callable[[F], F]:
    def wrap(fn: F) -> F:
        MODELS[name] = ModelEntry(name, fn, description, input, dataset, dict(defaults or {}))
        return fn

    return wrap


def register_dataset(name: str, description: str, sample: str) -> Callable[[F], F]:
    def wrap(fn: F) -> F:
        DATASETS[name] = DatasetEntry(name, fn, description, sample)
        return fn

    return wrap


def _load() -> None:
    # Importing the modules runs their decorators.
    from shared.zoo import datasets, models  # noqa: F401


def _unknown(kind: str, name: str, known: dict[str, Any]) -> SpecError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean zoo:{close[0]}?" if close else ""
    return SpecError(
        f"{kind} spec 'zoo:{name}': no such zoo {kind} (known: {', '.join(sorted(known))}){hint}"
    )


def model_builder(name: str) -> Callable[..., Any]:
    _load()
    if name not in MODELS:
        raise _unknown("model", name, MODELS)
    return MODELS[name].build


def dataset_builder(name: str) -> Callable[..., Any]:
    _load()
    if name not in DATASETS:
        raise _unknown("dataset", name, DATASETS)
    return DATASETS[name].build


def models() -> dict[str, ModelEntry]:
    _load()
    return dict(MODELS)


def datasets() -> dict[str, DatasetEntry]:
    _load()
    return dict(DATASETS)
