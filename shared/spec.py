"""What an artifact records to reproduce its model: the specs and the tracing options.

A spec that names a file (``../models.py:build``) means that file wherever the artifact is
read: pdprof records it absolute, and a relative path in an artifact (written by hand, or by
an older pdprof) is read relative to the artifact's own folder, so ``pdrun /elsewhere/plan.json``
works from any directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from shared.artifact import Strict


class ExampleInput(Strict):
    """One traced input as torch.export needs it: its keyword, shape and dtype (the batch it specializes to)."""

    name: str = Field(min_length=1)
    shape: list[int]
    dtype: str = Field(description="a torch dtype name: int64, float32, ...")


class TraceOptions(Strict):
    """How the tracer groups modules into layers; pdrun must trace with the same options."""

    frontend: Literal["fx", "export"] = Field(
        default="fx",
        description="fx: torch.fx at module granularity; export: torch.export (Hugging Face models), "
        "op runs grouped by the module they belong to",
    )
    example: list[ExampleInput] = Field(
        default_factory=list, description="export: the inputs the graph was exported for, in order"
    )
    output: str | None = Field(
        default=None, description="the field of a dict or ModelOutput output the loss reads (e.g. logits)"
    )

    depth: int | None = Field(default=None, ge=0, description="keep modules this deep as single layers")
    leaf_modules: list[str] = Field(
        default_factory=list, description="module class names (or qualified names) kept as single layers"
    )


def file_target(spec: str) -> str | None:
    """The file of a ``path/to/file.py:callable`` spec; None for ``zoo:NAME``, modules and built-in names."""
    target, sep, attr = spec.rpartition(":")
    if spec.startswith("zoo:") or not sep or not target or not attr:
        return None
    return target if target.endswith(".py") or "/" in target or "\\" in target else None


def anchored_spec(spec: str, base: str | os.PathLike[str]) -> str:
    """``spec`` with a relative file path made absolute against the folder ``base``."""
    target = file_target(spec)
    if target is None or Path(target).is_absolute():
        return spec
    attr = spec.rpartition(":")[2]
    return f"{os.path.normpath(Path(base).resolve() / target)}:{attr}"


def artifact_folder(source: str | os.PathLike[str]) -> Path:
    """The folder an artifact's relative file specs are read against: its own, or the cwd for ``-``."""
    return Path.cwd() if str(source) == "-" else Path(source).resolve().parent


class RunSpec(Strict):
    """The model, dataset and loss specs with their keyword arguments."""

    model: str | None = Field(
        default=None, description="zoo:NAME, package.module:callable or file.py:callable"
    )
    model_args: dict[str, Any] = Field(default_factory=dict)
    data: str | None = Field(default=None, description="dataset spec, same forms as the model")
    data_args: dict[str, Any] = Field(default_factory=dict)
    loss: str = Field(default="cross_entropy", description="cross_entropy, causal_lm, mse or a callable spec")
    inputs: list[str] | None = Field(
        default=None,
        description="keyword inputs: the dataset fields passed to the model's forward, in its order",
    )
    target: str | None = Field(
        default=None, description="keyword inputs: the sample field used as the target (e.g. labels)"
    )
    trace: TraceOptions = Field(default_factory=TraceOptions)

    def anchored(self, base: str | os.PathLike[str]) -> RunSpec:
        """This spec with its relative file paths (model, data, loss) made absolute against ``base``."""
        return self.model_copy(
            update={
                "model": None if self.model is None else anchored_spec(self.model, base),
                "data": None if self.data is None else anchored_spec(self.data, base),
                "loss": anchored_spec(self.loss, base),
            }
        )
