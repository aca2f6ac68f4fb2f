"""What an artifact records to reproduce its model: the specs and the tracing options."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from shared.artifact import Strict


class TraceOptions(Strict):
    """How the tracer groups modules into layers; pdrun must trace with the same options."""

    depth: int | None = Field(default=None, ge=0, description="keep modules this deep as single layers")
    leaf_modules: list[str] = Field(
        default_factory=list, description="module class names (or qualified names) kept as single layers"
    )


class RunSpec(Strict):
    """The model, dataset and loss specs with their keyword arguments."""

    model: str | None = Field(
        default=None, description="zoo:NAME, package.module:callable or file.py:callable"
    )
    model_args: dict[str, Any] = Field(default_factory=dict)
    data: str | None = Field(default=None, description="dataset spec, same forms as the model")
    data_args: dict[str, Any] = Field(default_factory=dict)
    loss: str = Field(default="cross_entropy", description="cross_entropy, mse or a callable spec")
    trace: TraceOptions = Field(default_factory=TraceOptions)
