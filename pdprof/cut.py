"""What a stage boundary costs: one training step run whole and run cut in two, through the same interpreter.

A pipeline stage is not a slice of a whole-model step. Where pdrun cuts the model, the
stage before the cut runs its backward as a call of its own, started from a gradient that
arrived from outside, after the autograd engine has finished the later stage's call; and
the stage after the cut starts its forward from a tensor that is a fresh leaf. The per-layer
figures of a whole step miss both: on zoo:mnist_cnn cut after ``conv2`` (measured beside a
sibling), the step cut in two took 0.15-0.35 ms longer in its backward than the whole step,
the first stage's backward in pdrun ran ~18% over the sum of its layers' figures, and the
schedule simulation ran ~10% under pdrun's measured time per minibatch.

So pdprof times, each round, a step through ``fx.Interpreter`` as is and the same step with
the value of one narrow cut detached (its consumers see a leaf that requires grad; the loss's
backward stops there, and a second backward call carries the leaf's gradient into the first
part), in alternating order. The differences are the graph's ``cut_forward_ms`` and
``cut_backward_ms``, which the schedule simulation adds at every stage boundary. The cut is
the narrowest kind (one tensor crosses it) nearest the middle of the graph's nodes; a model
without one gets no cut figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from pdprof.clock import Clock
from pdprof.timing import LossFn


def find_cut(module: fx.GraphModule) -> str | None:
    """The node whose value alone crosses from the nodes before it to those after, nearest the middle."""
    nodes = list(module.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    # The last position each node's value is read at: a value crosses the cut after node i when it
    # was made at or before i and is read after i.
    last_use = {n: max((order[u] for u in n.users), default=order[n]) for n in nodes}
    compute = [i for i, n in enumerate(nodes) if n.op not in ("placeholder", "output", "get_attr")]
    if len(compute) < 2:
        return None
    candidates: list[int] = []
    open_values: set[fx.Node] = set()
    for i, n in enumerate(nodes):
        if n.op != "get_attr":  # parameters and buffers stay with their stage: not values that cross
            open_values.add(n)
        open_values = {v for v in open_values if last_use[v] > i}
        # Between two compute nodes, and only this node's value crosses (the inputs' placeholders
        # must all be consumed by now).
        if compute[0] <= i < compute[-1] and open_values == {n} and n.op != "placeholder":
            candidates.append(i)
    if not candidates:
        return None
    middle = (compute[0] + compute[-1]) / 2
    best = min(candidates, key=lambda i: (abs(i - middle), i))
    return str(nodes[best].name)


class CutInterpreter(fx.Interpreter):
    """Runs the graph; the value of node ``cut`` (if any) reaches its consumers as a fresh leaf."""

    def __init__(self, module: fx.GraphModule, cut: str | None) -> None:
        super().__init__(module, garbage_collect_values=True)
        self.cut = cut
        self.before: torch.Tensor | None = None  # the cut value, still attached to the first part
        self.leaf: torch.Tensor | None = None  # what the second part reads instead

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.name == self.cut and isinstance(result, torch.Tensor) and result.requires_grad:
            self.before = result
            self.leaf = result.detach().requires_grad_()
            return self.leaf
        return result


def cut_step(
    module: fx.GraphModule,
    inputs: Sequence[Any],
    target: Any,
    loss_fn: LossFn,
    clock: Clock,
    cut: str | None,
) -> tuple[float, float]:
    """(forward, backward) milliseconds of one training step through the interpreter, cut at ``cut``.

    With ``cut`` None the step is whole: the baseline the cut step is compared with, paying
    the same interpreter overhead. The gradients are those of the whole step either way.
    """
    interp = CutInterpreter(module, cut)
    start = clock.mark()
    loss = loss_fn(interp.run(*inputs), target)
    mid = clock.mark()
    loss.backward()  # type: ignore[no-untyped-call]
    if interp.before is not None and interp.leaf is not None and interp.leaf.grad is not None:
        interp.before.backward(interp.leaf.grad)  # type: ignore[no-untyped-call]
    end = clock.mark()
    clock.settle()
    return clock.ms(start, mid), clock.ms(mid, end)
