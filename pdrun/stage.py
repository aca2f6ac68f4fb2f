"""One stage as a module: the traced model's fx nodes that a stage owns, and nothing else.

The stage is an ``fx.GraphModule`` built from a sub-graph of the traced model: its inputs
are the model inputs it reads from the batch followed by the values other stages send it;
its output is ``(values to send, model output or None)``. ``fx.GraphModule(root, graph)``
copies only the submodules and parameters the sub-graph names, under their original
qualified names, so a stage holds only its own weights and its state dict keys are the
full model's keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    sent: tuple[str, ...]  # values some later stage reads, topological order
    has_output: bool  # the last stage: also returns the model's output

    def run(self, batch_inputs: tuple[Any, ...], received: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """Forward: (values to send by name, model output or None)."""
        args = [*batch_inputs, *(received[n] for n in self.received)]
        sent, output = self.module(*args)
        return dict(zip(self.sent, sent, strict=True)), output


def build_stage(traced: TracedModel, part: Partition, stage: int) -> StageModule:
    """The stage's sub-graph of ``traced`` as its own module."""
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
    for name in part.layers[stage]:
        if name not in env:
            env[name] = graph.node_copy(nodes[name], lambda n: env[n.name])
    sent = tuple(n for n in part.layers[stage] if any(n in names for _, names in part.consumers(stage)))
    has_output = stage == part.last
    output: Any = None
    if has_output:
        out_node = next(n for n in traced.module.graph.nodes if n.op == "output")
        output = fx.map_arg(out_node.args[0], lambda n: env[n.name])
    graph.output((tuple(env[n] for n in sent), output))
    graph.lint()
    module = fx.GraphModule(traced.module, graph, f"{type(traced.module).__name__}Stage{stage}")
    assert owned >= set(sent)
    return StageModule(stage, module, batch_inputs, received, sent, has_output)


def sample_values(traced: TracedModel, inputs: tuple[Any, ...]) -> dict[str, Any]:
    """Every layer's value on a sample batch (one forward of the whole model, with autograd on)."""
    values: dict[str, Any] = {}

    class _Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            value = super().run_node(n)
            values[n.name] = value
            return value

    _Recorder(traced.module).run(*inputs)
    return values
