"""Sizes per layer: output shape and bytes, and the bytes a layer saves for its backward.

An ``fx.Interpreter`` runs the traced graph once (outside any timing, since the hooks it
installs cost time) and looks at each node's result. Saved bytes come from autograd's
``saved_tensors_hooks``: every tensor an op stashes for backward passes through the pack
hook while the layer runs; parameters are left out (they are the layer's parameter bytes)
and a tensor saved twice is counted once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves


@dataclass(frozen=True)
class LayerSize:
    """What one layer's output and saved tensors weigh."""

    activation_bytes: int
    activation_parts: list[int] | None  # per output tensor, when there are several
    saved_bytes: int
    output_shape: Any  # nested lists: a tensor's shape, or a list of them


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def shape_of(value: Any) -> Any:
    """A JSON-friendly shape: a tensor's shape as a list, containers as lists of those, else None."""
    if isinstance(value, torch.Tensor):
        return list(value.shape)
    if isinstance(value, (tuple, list)):
        return [shape_of(v) for v in value]
    if isinstance(value, dict):
        return {str(k): shape_of(v) for k, v in value.items()}
    return None


def size_of(value: Any, saved: int = 0) -> LayerSize:
    tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    parts = [tensor_bytes(t) for t in tensors]
    return LayerSize(sum(parts), parts if len(parts) > 1 else None, saved, shape_of(value))


class _SizeInterpreter(fx.Interpreter):
    def __init__(self, module: fx.GraphModule) -> None:
        super().__init__(module, garbage_collect_values=True)
        self.sizes: dict[str, LayerSize] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "output":
            return super().run_node(n)
        seen: dict[tuple[int, int], int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not isinstance(t, nn.Parameter):
                seen[(t.data_ptr(), tensor_bytes(t))] = tensor_bytes(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = super().run_node(n)
        self.sizes[n.name] = size_of(result, sum(seen.values()))
        return result


def measure_sizes(module: fx.GraphModule, inputs: Sequence[Any]) -> tuple[dict[str, LayerSize], Any]:
    """Run the traced graph once; returns each layer's sizes and the model's output."""
    interp = _SizeInterpreter(module)
    output = interp.run(*inputs)
    return interp.sizes, output
