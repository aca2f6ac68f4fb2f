"""The data check before any worker starts: one batch of the plan's size through the whole model.

Without it a dataset the model cannot take fails inside a worker with torch's own words
(``Given groups=1, weight of size [16, 1, 3, 3], expected input[64, 3, 32, 32] ...``), blamed
on whichever rank failed first. The launcher runs unit 0's batch through the traced model on
CPU without gradients, layer by layer, and through the loss, so the first layer that refuses
the data is named with the data spec and the samples, in one line and exit status 2.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from pdrun.data import Units, to_device
from shared.errors import DataError
from shared.resolve import resolve_loss
from shared.tracer import TracedModel


def check_data(traced: TracedModel, units: Units, loss: str) -> None:
    """Raise ``DataError`` naming the layer (or the loss) that refuses unit 0's batch."""
    indices = units.indices(0).tolist()
    shown = ", ".join(map(str, indices[:3])) + (", ..." if len(indices) > 3 else "")
    # A sample that fails to read, or is unlike the others, is named by Units itself (shared.batches).
    inputs, target = units.batch(0)
    where = f"{units.name}: batch 0 (samples {shown}; input {describe(inputs)})"
    dtype = next((p.dtype for p in traced.module.parameters() if p.is_floating_point()), torch.float32)
    inputs, target = (
        to_device(inputs, torch.device("cpu"), dtype),
        to_device(target, torch.device("cpu"), dtype),
    )
    takes = [n.name for n in traced.module.graph.nodes if n.op == "placeholder"]
    if len(inputs) != len(takes):
        raise DataError(
            f"{where}: the model takes {len(takes)} input(s) ({', '.join(takes)}), a sample gives {len(inputs)}"
        )
    with torch.no_grad():
        try:
            output = _Checked(traced.module, where).run(*inputs)
        except DataError as exc:  # fx's interpreter appends the failing node's code to the message
            raise DataError(str(exc).splitlines()[0]) from None
        try:
            resolve_loss(loss)(output, target)
        except Exception as exc:
            raise DataError(
                f"{where}: loss {loss!r} refused the model's output {describe(output)} and the target "
                f"{describe(target)}: {_why(exc)}"
            ) from None


class _Checked(fx.Interpreter):
    """The traced model run node by node; the first node that raises is named in a ``DataError``."""

    def __init__(self, module: fx.GraphModule, where: str) -> None:
        super().__init__(module)
        self.where = where

    def run_node(self, n: fx.Node) -> Any:
        try:
            return super().run_node(n)
        except DataError:
            raise
        except Exception as exc:
            args = [self.env[a] for a in n.all_input_nodes if a in self.env]
            raise DataError(
                f"{self.where}: layer {n.name!r} ({_what(self.module, n)}) refused {describe(tuple(args))}: "
                f"{_why(exc)}"
            ) from None


def _what(module: torch.nn.Module, n: fx.Node) -> str:
    if n.op == "call_module":
        return f"module {n.target} {type(module.get_submodule(str(n.target))).__name__}"
    if n.op == "call_method":
        return f"method .{n.target}()"
    return f"function {getattr(n.target, '__name__', n.target)}"


def describe(value: Any) -> str:
    """A value's dtypes and shapes in words: ``float32 (16, 3, 32, 32)``; tuples in parentheses."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(describe(v) for v in value)
        return inner if len(value) == 1 else f"({inner})"
    return type(value).__name__


def _why(exc: BaseException) -> str:
    """torch's first line (its own words, without fx's appended node code)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
