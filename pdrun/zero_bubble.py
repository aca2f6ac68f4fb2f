"""The split backward of zero-bubble schedules: B takes a unit's input gradients, W its weight gradients.

Qi et al. (ICLR'24, "Zero Bubble Pipeline Parallelism", section 2): the backward of a stage
is two computations, the gradient with respect to its input (B, which the previous stage
waits for) and with respect to its parameters (W, which nothing waits on but the optimizer
step). B differentiates the unit's roots (its loss, or its outputs with the gradients that
came back) with respect to the received values only, keeping the autograd graph
(``retain_graph=True``) and the gradients at the nodes where the weights' paths leave the
inputs'; W starts from those (``shared.weight_pass``), so it does not redo B's work. The flushing step that follows sees exactly the gradients
one whole backward would have accumulated.

The worker (``pdrun.worker.Worker``) dispatches BACKWARD and WEIGHT here when its schedule
splits them (``zb-h1``); everything else about a unit (its forward, its messages) is the
worker's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdrun.values import grad_leaves, grad_specs
from shared.schedule import Instr, Kind
from shared.weight_pass import WeightPass, backward_input, backward_weight

if TYPE_CHECKING:
    from pdrun.worker import Worker


class SplitBackward:
    """B and W of one worker: what a unit's B found for its W (``shared.weight_pass``), kept until then."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.passes: dict[int, WeightPass] = {}  # by unit, from its B to its W

    def backward_input(self, ins: Instr) -> None:
        """B: the gradients of the values this stage received, sent back at once; the graph is kept for W."""
        w = self.worker
        u = ins.unit
        state = w.inflight[u]
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if state.loss is not None:
            roots.append(state.loss * w.config.loss_scale)
            grads.append(None)
        for name, gs in w.grads.pop(u, {}).items():
            for value, g in zip(grad_leaves(state.sent[name], w.config.specs[name]), gs, strict=True):
                if value.requires_grad:
                    roots.append(value)
                    grads.append(g)
        inputs = [
            leaf
            for n in state.received
            for leaf in grad_leaves(state.received[n], w.config.specs[n])
            if leaf.requires_grad
        ]
        params = [p for p in state.params.values() if p.requires_grad]
        got, self.passes[u] = backward_input(roots, grads, inputs, params)
        for leaf, dg in zip(inputs, got, strict=True):
            if dg is not None:
                leaf.grad = dg
        for a, names in w.config.part.receives(w.s):
            out: list[torch.Tensor] = []
            for n in names:
                spec = w.config.specs[n]
                for leaf, ls in zip(grad_leaves(state.received[n], spec), grad_specs(spec), strict=True):
                    out.append(ls.to_wire(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)))
            w.outbox[(Kind.SEND_GRAD, u, a)] = [w.comm.header(w.base + u, state.version), *out]

    def backward_weight(self, ins: Instr) -> None:
        """W: the parameter gradients of unit ``ins.unit``, accumulated on the live weights; the unit is done."""
        w = self.worker
        u = ins.unit
        state = w.inflight.pop(u)
        got = backward_weight(self.passes.pop(u))
        with torch.no_grad():
            for p, g in got:
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
        w.config.versions.release(state.version, state.params)
        w.stats.units += 1  # a unit counts towards throughput when its backward is done
        w.comm.release(w.base + u)  # the graph held the received values until now
