"""Values that cross a stage boundary: their specs, found once, and how they travel as tensors.

A value is what a layer produced: a tensor, a Python number, a ``torch.Size``, ``None``, or a
tuple or list of those (``x.split(...)`` before its ``getitem``). One forward pass of a sample
batch gives each value's *spec*; the spec fixes the tensors a message carries (its *leaves*,
in order), so the receiver allocates buffers of known shape and rebuilds the value from them.
Numbers and sizes travel as small int64/float64 tensors. A 4-d tensor of a channels-last run
(``shared.layout``) travels as its contiguous NHWC permutation, so that neither end copies it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

_NUMBERS = {"int": torch.int64, "float": torch.float64, "bool": torch.int64}


@dataclass(frozen=True)
class ValueSpec:
    """What a crossing value looks like: a leaf (one tensor on the wire) or a tuple/list of specs."""

    kind: str  # "tensor", "int", "float", "bool", "ints" (a torch.Size), "none", "tuple" or "list"
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.int64
    requires_grad: bool = False  # for a tuple or list: any of its items
    items: tuple[ValueSpec, ...] = ()
    channels_last: bool = False  # a 4-d tensor that travels and lives in NHWC order
    written: bool = False  # a layer modifies the value in place: its receiver copies it (pdrun/stage.py)

    def empty(self, device: torch.device) -> torch.Tensor:
        """A receive buffer for this leaf, as it travels (contiguous; ``from_wire`` gives the value)."""
        if self.channels_last:
            n, c, h, w = self.shape
            return torch.empty((n, h, w, c), dtype=self.dtype, device=device)
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    def to_wire(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor as it travels: a channels-last value as its NHWC permutation (a view, no copy)."""
        if self.channels_last:
            return t.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1)
        return t

    def from_wire(self, t: torch.Tensor) -> torch.Tensor:
        """The value of a received tensor: an NHWC buffer viewed back as NCHW with channels-last strides."""
        return t.permute(0, 3, 1, 2) if self.channels_last else t


def with_channels_last(spec: ValueSpec) -> ValueSpec:
    """``spec`` with its 4-d floating tensors marked channels-last (a channels-last run)."""
    if spec.kind in ("tuple", "list"):
        return replace(spec, items=tuple(with_channels_last(i) for i in spec.items))
    if spec.kind == "tensor" and len(spec.shape) == 4 and spec.dtype.is_floating_point:
        return replace(spec, channels_last=True)
    return spec


def spec_of(value: Any) -> ValueSpec:
    """The spec of a sample value."""
    if isinstance(value, torch.Tensor):
        return ValueSpec("tensor", tuple(value.shape), value.dtype, value.requires_grad)
    if value is None:
        return ValueSpec("none")
    if isinstance(value, bool):
        return ValueSpec("bool", (1,), torch.int64)
    if isinstance(value, int):
        return ValueSpec("int", (1,), torch.int64)
    if isinstance(value, float):
        return ValueSpec("float", (1,), torch.float64)
    if isinstance(value, (tuple, list)):
        if isinstance(value, torch.Size) or (value and all(type(v) is int for v in value)):
            return ValueSpec("ints", (len(value),), torch.int64)
        items = tuple(spec_of(v) for v in value)
        kind = "list" if isinstance(value, list) else "tuple"
        return ValueSpec(kind, requires_grad=any(i.requires_grad for i in items), items=items)
    raise TypeError(
        f"cannot send a {type(value).__name__} between stages "
        "(tensors, numbers, sizes, None and tuples or lists of them only)"
    )


def leaves(spec: ValueSpec) -> list[ValueSpec]:
    """The specs of the tensors a value travels as, in order."""
    if spec.kind in ("tuple", "list"):
        return [leaf for item in spec.items for leaf in leaves(item)]
    return [] if spec.kind == "none" else [spec]


def leaf_values(value: Any, spec: ValueSpec) -> list[Any]:
    """The parts of ``value`` matching ``leaves(spec)``."""
    if spec.kind in ("tuple", "list"):
        return [v for item, s in zip(value, spec.items, strict=True) for v in leaf_values(item, s)]
    return [] if spec.kind == "none" else [value]


def encode(value: Any, spec: ValueSpec, device: torch.device) -> list[torch.Tensor]:
    """The tensors that carry ``value`` to another stage."""
    out: list[torch.Tensor] = []
    for v, s in zip(leaf_values(value, spec), leaves(spec), strict=True):
        if s.kind == "tensor":
            out.append(s.to_wire(v.detach()))
        else:
            data = [v] if s.kind in _NUMBERS else list(v)
            out.append(torch.tensor(data, dtype=s.dtype, device=device))
    return out


def decode(tensors: Iterator[torch.Tensor], spec: ValueSpec) -> Any:
    """Rebuild a value from the received tensors; a tensor that needs a gradient becomes a leaf that takes one."""
    if spec.kind in ("tuple", "list"):
        items = [decode(tensors, s) for s in spec.items]
        return items if spec.kind == "list" else tuple(items)
    if spec.kind == "none":
        return None
    t = next(tensors)
    if spec.kind == "tensor":
        return spec.from_wire(t).requires_grad_(spec.requires_grad)
    if spec.kind == "int":
        return int(t.item())
    if spec.kind == "float":
        return float(t.item())
    if spec.kind == "bool":
        return bool(t.item())
    return torch.Size(int(v) for v in t.tolist())


def grad_leaves(value: Any, spec: ValueSpec) -> list[torch.Tensor]:
    """The tensors of ``value`` that take a gradient, in leaf order."""
    return [v for v, s in zip(leaf_values(value, spec), leaves(spec), strict=True) if s.requires_grad]


def grad_specs(spec: ValueSpec) -> list[ValueSpec]:
    """The leaves of ``spec`` whose gradients travel back."""
    return [s for s in leaves(spec) if s.requires_grad]
