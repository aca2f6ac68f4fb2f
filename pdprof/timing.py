"""Timing one training step two ways: per layer (forward and backward) and as a whole.

Forward: an ``fx.Interpreter`` runs the traced graph one node at a time and marks the
clock just before and after each node's own call, so the argument plumbing of the
interpreter is not charged to any layer.

Backward: one layer's backward is not a call we can wrap; the autograd engine runs the
graph's nodes (``ConvolutionBackward0``, ``AccumulateGrad``, ...) in its own order. So
during the forward each autograd node is claimed by the layer that created it (walking
``grad_fn.next_functions`` from the layer's outputs, stopping at nodes an earlier layer
claimed), and a post-hook on every node marks the clock when the node finishes. The
time between two consecutive marks is charged to the layer of the later node:

    backward()  |--loss--|--fc--|--flatten--|--layer4_2_conv3--| ... |--conv1--|  return
                start    m1     m2          m3                  ...   mN

The marks partition the backward pass, so the per-layer backward times add up to the
whole backward (what a real step pays, engine overhead included) rather than to a sum of
isolated re-runs, which on CPU would miss the engine and the cache effects of the real
order. This is why the layer sum agrees with a directly timed step (``Timing.ratio``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.autograd.graph import Node, get_gradient_edge
from torch.utils._pytree import tree_leaves

from pdprof.clock import Clock

LOSS = "(loss)"  # the autograd nodes the loss function creates: timed, but not a layer

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class StepTimes:
    """One profiled step: forward and backward milliseconds per layer, and the loss's share."""

    forward: dict[str, float] = field(default_factory=dict)
    backward: dict[str, float] = field(default_factory=dict)
    loss_forward: float = 0.0
    loss_backward: float = 0.0
    unattributed_backward: float = 0.0  # after the last node's hook, until backward() returns

    def of(self, phase: str) -> dict[str, float]:
        return self.forward if phase == "forward" else self.backward


def _claim(value: Any, name: str, owner: dict[Node, str]) -> None:
    """Give ``name`` every autograd node reachable from ``value`` that no earlier layer owns."""
    # get_gradient_edge gives a tensor's grad_fn, or a leaf's (a parameter's) AccumulateGrad node.
    stack: list[Node | None] = [
        get_gradient_edge(t).node
        for t in tree_leaves(value)
        if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    while stack:
        fn = stack.pop()
        if fn is None or fn in owner:
            continue
        owner[fn] = name
        stack.extend(nxt for nxt, _ in fn.next_functions)


class _TimingInterpreter(fx.Interpreter):
    """Runs the traced graph node by node, marking the clock around each node's own call."""

    def __init__(self, module: fx.GraphModule, clock: Clock) -> None:
        super().__init__(module, garbage_collect_values=True)
        self.clock = clock
        self.marks: dict[str, tuple[Any, Any]] = {}
        self.owner: dict[Node, str] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "output":
            return super().run_node(n)
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            start = self.clock.mark()
            result = getattr(self, n.op)(n.target, args, kwargs)
            end = self.clock.mark()
        self.marks[n.name] = (start, end)
        _claim(result, n.name, self.owner)
        return result


def profiled_step(
    module: fx.GraphModule, inputs: Sequence[Any], target: Any, loss_fn: LossFn, clock: Clock
) -> StepTimes:
    """One forward + loss + backward through the traced graph, timed per layer."""
    interp = _TimingInterpreter(module, clock)
    output = interp.run(*inputs)
    loss_start = clock.mark()
    loss = loss_fn(output, target)
    loss_end = clock.mark()
    owner = interp.owner
    _claim(loss, LOSS, owner)

    events: list[tuple[str, Any]] = []

    def hook_for(name: str) -> Callable[[Any, Any], None]:
        def hook(_grad_inputs: Any, _grad_outputs: Any) -> None:
            events.append((name, clock.mark()))

        return hook

    handles = [fn.register_hook(hook_for(name)) for fn, name in owner.items()]
    try:
        start = clock.mark()
        loss.backward()  # type: ignore[no-untyped-call]
        end = clock.mark()
    finally:
        for handle in handles:
            handle.remove()
    clock.settle()

    times = StepTimes()
    for name, (a, b) in interp.marks.items():
        times.forward[name] = clock.ms(a, b)
    times.loss_forward = clock.ms(loss_start, loss_end)
    backward: dict[str, float] = defaultdict(float)
    previous = start
    for name, mark in events:
        backward[name] += clock.ms(previous, mark)
        previous = mark
    times.unattributed_backward = clock.ms(previous, end)
    times.loss_backward = backward.pop(LOSS, 0.0)
    times.backward = dict(backward)
    return times


def whole_step(model: nn.Module, inputs: Sequence[Any], target: Any, loss_fn: LossFn, clock: Clock) -> float:
    """Milliseconds of one plain training step (forward + loss + backward) of the user's model."""
    start = clock.mark()
    loss = loss_fn(model(*inputs), target)
    loss.backward()  # type: ignore[no-untyped-call]
    end = clock.mark()
    clock.settle()
    return clock.ms(start, end)
