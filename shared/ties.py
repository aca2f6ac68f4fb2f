"""Which layers read one parameter: the tied parameters of a traced model (GPT-2's embedding and head).

pdrun sums a tied parameter's gradient over the stages that hold it (``pdrun.tied``); pdprof
records the layers of each tie in the layer graph (``graph.ties``) so that the planner's
simulation can charge that sum, a blocking collective, where a plan puts the layers on
different stages. A tie is found by identity: the same ``nn.Parameter`` object read by
several layers, whatever its qualified names.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from torch import fx, nn

from shared.tracer import TracedModel


def _read_parameters(module: nn.Module, node: fx.Node) -> Iterator[tuple[str, nn.Parameter]]:
    """The parameters a node reads, by the qualified names the stage module will give them."""
    if node.op == "call_module":
        sub = module.get_submodule(str(node.target))
        for name, p in sub.named_parameters(remove_duplicate=False):
            yield f"{node.target}.{name}", p
    elif node.op == "get_attr":
        obj: Any = module
        for part in str(node.target).split("."):
            obj = getattr(obj, part)
        if isinstance(obj, nn.Parameter):
            yield str(node.target), obj


def parameter_reads(traced: TracedModel, layers: Iterable[str]) -> Iterator[tuple[str, str, nn.Parameter]]:
    """(layer, qualified name, parameter) for every parameter each of ``layers`` reads: its own node's
    and, under the export frontend, those of the get_attr nodes folded into it (``Layer.params``)."""
    nodes = traced.fx_nodes()
    folded = {entry.name: entry.params for entry in traced.layers}
    for layer in layers:
        for node in (nodes[layer], *(nodes[p] for p in folded.get(layer, ()))):
            for name, p in _read_parameters(traced.module, node):
                yield layer, name, p


def tied_layers(traced: TracedModel) -> list[list[str]]:
    """Per parameter that more than one layer reads, those layers in the model's order."""
    return [layers for layers, _ in ties(traced)]


def ties(traced: TracedModel) -> list[tuple[list[str], int]]:
    """Per parameter that more than one layer reads: those layers in the model's order, and its bytes."""
    readers: dict[int, tuple[list[str], int]] = {}
    for layer, _, p in parameter_reads(traced, (entry.name for entry in traced.layers)):
        names, _ = readers.setdefault(id(p), ([], p.numel() * p.element_size()))
        if layer not in names:
            names.append(layer)
    return [(names, size) for names, size in readers.values() if len(names) > 1]
