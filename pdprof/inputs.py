"""What pdprof decides about a model's inputs, for the graph to record: keyword fields, frontend, example.

From the model and the dataset's first sample: whether the samples are keyword samples
(``shared.fields``) and which of their fields the model takes; whether the model is traced by
torch.fx or by torch.export (Hugging Face models, ``shared.tracer_export``); and the shapes of
one batch of inputs, which an exported graph is specialized to. pdrun reads all of it back
from the plan's spec and so feeds and traces the model the same way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import default_collate

from shared.errors import SpecError, UserError
from shared.fields import forward_parameters, input_order, keyword_dataset, keyword_fields
from shared.spec import ExampleInput, RunSpec
from shared.tracer import is_hugging_face
from shared.tracer_export import KeywordCall, select_output


def prepare(spec: RunSpec, model: nn.Module, dataset: Any, batch_size: int) -> tuple[RunSpec, Any]:
    """(the spec completed with the inputs' mapping and the frontend, the dataset as (inputs, target) pairs)."""
    name = spec.data or "dataset"
    try:
        sample = dataset[0]
    except Exception as exc:
        raise SpecError(f"dataset spec {name!r}: sample 0 failed: {type(exc).__name__}: {exc}") from exc
    keyword = keyword_fields(sample)
    update: dict[str, Any] = {}
    if keyword is not None:
        fields, target, field = keyword
        if target is None:
            raise SpecError(
                f"dataset spec {name!r}: a dict sample needs a target field (labels or label), "
                f"or be an (inputs dict, target) pair; it has {', '.join(map(str, fields))}"
            )
        update = {"inputs": input_order(model, fields, name), "target": field}
    hugging_face = is_hugging_face(model)
    trace = spec.trace
    if hugging_face and (trace.depth is not None or trace.leaf_modules):
        raise UserError(
            "--depth/--leaf-module: a Hugging Face model is traced with torch.export into runs of ops "
            "per module; these options group torch.fx modules and do not apply (leave them out)"
        )
    spec = spec.model_copy(update=update)
    dataset = keyword_dataset(dataset, spec.inputs, spec.target, name)
    if hugging_face or spec.inputs is not None:
        names = spec.inputs or forward_parameters(model)
        inputs = _first_inputs(dataset, batch_size, name)
        if len(inputs) > len(names):
            raise SpecError(
                f"dataset spec {name!r}: a sample has {len(inputs)} inputs, "
                f"{type(model).__name__}.forward takes {len(names)}"
            )
        example = [
            ExampleInput(name=n, shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."))
            for n, t in zip(names, inputs, strict=False)
        ]
        frontend = "export" if hugging_face else trace.frontend
        spec = spec.model_copy(
            update={"trace": trace.model_copy(update={"frontend": frontend, "example": example})}
        )
    return spec, dataset


def _first_inputs(dataset: Any, batch_size: int, name: str) -> list[torch.Tensor]:
    samples = [dataset[i % len(dataset)] for i in range(batch_size)]
    try:
        inputs, _ = default_collate(samples)
    except (TypeError, RuntimeError) as exc:
        raise SpecError(f"dataset spec {name!r}: cannot batch its samples: {exc}") from None
    inputs = list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            raise SpecError(f"dataset spec {name!r}: input {i} is {type(t).__name__}, expected a tensor")
    return inputs


class OutputField(nn.Module):
    """``model(*args)``, or its field ``field`` when it returns a dict (``logits`` or its first field
    when none was chosen yet): a dict-returning model as its traced graph returns it (the tracer
    rewrites the graph's output to the field the loss reads)."""

    def __init__(self, model: nn.Module, field: str | None) -> None:
        super().__init__()
        self.model = model
        self.field = field

    def forward(self, *args: Any) -> Any:
        return select_output(self.model(*args), self.field)[0]


def model_call(model: nn.Module, spec: RunSpec) -> nn.Module:
    """The user's model as a whole step calls it: by keyword with the recorded output field, or
    positionally with the output field (a dict's)."""
    if spec.trace.frontend == "export" or spec.inputs is not None:
        names = [e.name for e in spec.trace.example]
        return KeywordCall(model, names, spec.trace.output)
    return OutputField(model, spec.trace.output)


def check_vocabulary(spec: RunSpec, model: nn.Module, inputs: tuple[Any, ...]) -> None:
    """Refuse token ids past a Hugging Face model's vocabulary (its embedding would fail with a bare
    ``index out of range in self``), naming the ids' largest and ``config.vocab_size``. The first batch."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not is_hugging_face(model) or not isinstance(vocab, int) or spec.inputs is None:
        return
    ids = dict(zip(spec.inputs, inputs, strict=False)).get("input_ids")
    if (
        isinstance(ids, torch.Tensor)
        and ids.numel()
        and not ids.is_floating_point()
        and int(ids.max()) >= vocab
    ):
        raise UserError(
            f"--data {spec.data}: input_ids go up to {int(ids.max())} in the first batch, but "
            f"{type(model).__name__}'s vocabulary has {vocab} tokens (config.vocab_size); build the model "
            f"with vocab_size above {int(ids.max())}, or give it data of its vocabulary"
        )


def check_target(spec: RunSpec, inputs: tuple[Any, ...], target: Any) -> None:
    """Refuse cross entropy against labels that are the inputs themselves (a causal LM would learn to copy)."""
    if spec.loss != "cross_entropy" or spec.inputs is None or not isinstance(target, torch.Tensor):
        return
    # Labels are ignored at -100 (cross entropy's ignore_index; the zoo's token datasets pad so): the
    # rest equal to the inputs is a copying task all the same.
    kept = target != -100
    for name, value in zip(spec.inputs, inputs, strict=False):
        if (
            isinstance(value, torch.Tensor)
            and value.shape == target.shape
            and bool(kept.any())
            and torch.equal(value[kept], target[kept])
        ):
            raise UserError(
                "--loss cross_entropy: the target "
                + (f"field {spec.target!r}" if spec.target else "(the dataset's, where it is not -100)")
                + f" equals the input {name!r}, so the "
                "model would learn to copy its input; for a causal LM whose labels are its inputs use "
                "--loss causal_lm (predicts token t+1 from tokens up to t)"
            )
