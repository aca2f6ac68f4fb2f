"""Sizes per layer: output shape and bytes, and the bytes a layer saves for its backward.

An ``fx.Interpreter`` runs the traced graph once (outside any timing, since the hooks it
installs cost time) and looks at each node's result. Saved bytes come from autograd's
``saved_tensors_hooks``: every tensor an op stashes for backward passes through the pack
hook while the layer runs. They are counted by storage, once over the whole model, and
charged to the layer that made the storage, not to the layers that save it:

- a ReLU saves its output and the max-pool after it saves the same tensor as its input:
  one storage, charged once, to the ReLU (the planner's memory model adds a stage's
  received inputs itself, ``pdplan.memory``, since a later stage holds its own copy);
- a view of a parameter (``Linear`` saves ``weight.t()``) is a parameter's storage, left
  out: parameters are the layer's parameter bytes;
- a model input saved by the first layer is charged to the input node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx
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


def _storage(t: torch.Tensor) -> Any:
    """``t``'s untyped storage, or None for a tensor with none to reach (a functorch-batched one)."""
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError):  # "Cannot access storage of BatchedTensorImpl"
        return None


class _SizeInterpreter(fx.Interpreter):
    def __init__(self, module: fx.GraphModule) -> None:
        super().__init__(module, garbage_collect_values=True)
        self.sizes: dict[str, LayerSize] = {}
        self.params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        # Storage -> (the node that made it, the storage): held, so no address is reused while
        # the graph runs and two storages are never taken for one.
        self.maker: dict[int, tuple[str, Any]] = {}
        self.saved: dict[int, int] = {}  # saved storage -> its bytes
        # Saved tensors with no storage to reach (vmap's batched tensors: transformers builds its
        # attention masks under torch.vmap), charged by their own bytes to the layer saving them.
        self.unreached: dict[str, int] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "output":
            return super().run_node(n)

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = _storage(t)
            if storage is None:
                self.unreached[n.name] = self.unreached.get(n.name, 0) + tensor_bytes(t)
                return t
            ptr = storage.data_ptr()
            if ptr not in self.params and storage.nbytes() > 0:
                self.maker.setdefault(ptr, (n.name, storage))  # made inside this layer
                self.saved[ptr] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = super().run_node(n)
        for t in tree_leaves(result):
            storage = _storage(t) if isinstance(t, torch.Tensor) else None
            if storage is not None:
                self.maker.setdefault(storage.data_ptr(), (n.name, storage))
        self.sizes[n.name] = size_of(result)
        return result

    def charged(self) -> dict[str, LayerSize]:
        """Each layer's sizes with the saved storages it made."""
        by_maker = dict(self.unreached)
        for ptr, nbytes in self.saved.items():
            name = self.maker[ptr][0]
            by_maker[name] = by_maker.get(name, 0) + nbytes
        return {name: replace(size, saved_bytes=by_maker.get(name, 0)) for name, size in self.sizes.items()}


def measure_sizes(module: fx.GraphModule, inputs: Sequence[Any]) -> tuple[dict[str, LayerSize], Any]:
    """Run the traced graph once; returns each layer's sizes and the model's output."""
    interp = _SizeInterpreter(module)
    output = interp.run(*inputs)
    return interp.charged(), output
