"""One stage as a module: the traced model's fx nodes that a stage owns, and nothing else.

The stage is an ``fx.GraphModule`` built from a sub-graph of the traced model: its inputs
are the model inputs it reads from the batch followed by the values other stages send it;
its output is ``(values to send, model output or None)``. ``fx.GraphModule(root, graph)``
copies only the submodules and parameters the sub-graph names, under their original
qualified names, so a stage holds only its own weights and its state dict keys are the
full model's keys.

[Note: writable inputs] A received value that requires a gradient is an autograd leaf, and
autograd refuses to modify a leaf (or a view of one) in place. A model that does so after a
cut (``conv`` on stage 0, ``ReLU(inplace=True)`` on stage 1) would fail at its first step.
The sample forward (``sample_run``) finds every value some later layer writes in place: its
tensor's version counter moves after the layer that made it (views share the counter, so a
write through a view counts). Only those values, when received, pass through a
``writable`` node that clones them, so the stage's layers modify a copy and the gradient
still reaches the received leaf; every other value is used as received, without a copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from pdrun.partition import Partition
from shared.tracer import TracedModel


@dataclass
class StageModule:
    """A stage's module and the names of what goes in and out of it."""

    index: int
    module: fx.GraphModule
    batch_inputs: tuple[str, ...]  # model inputs read from the batch, in the model's order
    received: tuple[str, ...]  # values received from earlier stages, in producer then topological order
    sent: tuple[str, ...]  # values later stages read: its own in topological order, then those it relays
    has_output: bool  # the last stage: also returns the model's output

    def run(self, batch_inputs: tuple[Any, ...], received: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """Forward: (values to send by name, model output or None)."""
        args = [*batch_inputs, *(received[n] for n in self.received)]
        sent, output = self.module(*args)
        return dict(zip(self.sent, sent, strict=True)), output


def writable(value: Any) -> Any:
    """A copy of a received value's tensors that the stage may modify in place (see [Note: writable inputs])."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Size):
        return type(value)(writable(v) for v in value)
    return value


def build_stage(
    traced: TracedModel, part: Partition, stage: int, written: frozenset[str] = frozenset()
) -> StageModule:
    """The stage's sub-graph of ``traced`` as its own module; received values in ``written`` are
    modified in place by some layer, and the stage's layers read a copy of them."""
    nodes = traced.fx_nodes()
    owned = set(part.layers[stage])
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    batch_inputs = tuple(n for n in part.layers[stage] if nodes[n].op == "placeholder")
    for name in batch_inputs:
        env[name] = graph.node_copy(nodes[name], lambda n: env[n.name])
    received = tuple(name for _, names in part.receives(stage) for name in names)
    for name in received:
        env[name] = graph.placeholder(f"recv_{name}")
    relayed = {name: env[name] for name in received}  # as received: what a relay sends on (pdrun.partition)
    for name in received:
        if name in written:
            env[name] = graph.call_function(writable, (env[name],))

    def arg(n: fx.Node) -> fx.Node:
        # A parameter folded into its readers (no layer of its own) joins every stage that reads it:
        # a tied weight is then the same parameter object in each (shared.tracer_export).
        if n.name not in env and n.op == "get_attr":
            env[n.name] = graph.node_copy(n)
        return env[n.name]

    for name in part.layers[stage]:
        if name not in env:
            env[name] = graph.node_copy(nodes[name], arg)
    onward = {n for _, names in part.consumers(stage) for n in names}
    # Its own values first, in layer order, then the values it relays for later chunks.
    sent = (
        *(n for n in part.layers[stage] if n in onward),
        *(n for n in received if n in onward and n not in owned),
    )
    has_output = stage == part.last
    output: Any = None
    if has_output:
        out_node = next(n for n in traced.module.graph.nodes if n.op == "output")
        output = fx.map_arg(out_node.args[0], lambda n: env[n.name])
    graph.output((tuple(relayed[n] if n not in owned else env[n] for n in sent), output))
    graph.lint()
    module = fx.GraphModule(traced.module, graph, f"{type(traced.module).__name__}Stage{stage}")
    assert owned | set(received) >= set(sent)
    return StageModule(stage, module, batch_inputs, received, sent, has_output)


def sample_values(traced: TracedModel, inputs: tuple[Any, ...]) -> dict[str, Any]:
    """Every layer's value on a sample batch (one forward of the whole model, with autograd on)."""
    return sample_run(traced, inputs)[0]


def sample_run(traced: TracedModel, inputs: tuple[Any, ...]) -> tuple[dict[str, Any], frozenset[str]]:
    """(every layer's value, the layers whose value a later layer modifies in place) on a sample batch."""
    values: dict[str, Any] = {}
    made: dict[str, list[int]] = {}  # each value's tensors' versions right after the layer that made it

    class _Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            value = super().run_node(n)
            values[n.name] = value
            made[n.name] = [t._version for t in _tensors(value)]
            return value

    _Recorder(traced.module).run(*inputs)
    written = frozenset(
        n for n, versions in made.items() if [t._version for t in _tensors(values[n])] != versions
    )
    return values, written


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []
