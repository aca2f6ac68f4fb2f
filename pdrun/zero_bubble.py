"""The split backward of zero-bubble schedules: B takes a unit's input gradients, W its weight gradients.

Qi et al. (ICLR'24, "Zero Bubble Pipeline Parallelism", section 2): the backward of a stage
is two computations, the gradient with respect to its input (B, which the previous stage
waits for) and with respect to its parameters (W, which nothing waits on but the optimizer
step). B differentiates the unit's roots (its loss, or its outputs with the gradients that
came back) with respect to the received values only, keeping the autograd graph
(``retain_graph=True``); W differentiates the same roots with respect to the stage's live
parameters and frees the graph. The flushing step that follows sees exactly the gradients
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

if TYPE_CHECKING:
    from pdrun.worker import Worker


class SplitBackward:
    """B and W of one worker: the roots a unit's B differentiated, kept until its W."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.roots: dict[int, tuple[list[torch.Tensor], list[torch.Tensor | None]]] = {}

    def backward_input(self, ins: Instr) -> None:
        """B: the gradients of the values this stage received, sent back at once; the graph is kept for W."""
        w = self.worker
        u = ins.unit
        state = w.inflight[u]
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if state.loss is not None:
            roots.append(state.loss * w.loss_scale)
            grads.append(None)
        for name, gs in w.grads.pop(u, {}).items():
            for value, g in zip(grad_leaves(state.sent[name], w.specs[name]), gs, strict=True):
                if value.requires_grad:
                    roots.append(value)
                    grads.append(g)
        inputs = [
            leaf
            for n in state.received
            for leaf in grad_leaves(state.received[n], w.specs[n])
            if leaf.requires_grad
        ]
        if roots and inputs:
            got = torch.autograd.grad(roots, inputs, grads, retain_graph=True, allow_unused=True)
            for leaf, g in zip(inputs, got, strict=True):
                leaf.grad = g
        self.roots[u] = (roots, grads)
        for a, names in w.part.receives(w.s):
            out: list[torch.Tensor] = []
            for n in names:
                spec = w.specs[n]
                for leaf, ls in zip(grad_leaves(state.received[n], spec), grad_specs(spec), strict=True):
                    out.append(ls.to_wire(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)))
            w.outbox[(Kind.SEND_GRAD, u, a)] = [w.comm.header(w.base + u, state.version), *out]

    def backward_weight(self, ins: Instr) -> None:
        """W: the parameter gradients of unit ``ins.unit``, accumulated on the live weights; the unit is done."""
        w = self.worker
        u = ins.unit
        state = w.inflight.pop(u)
        roots, grads = self.roots.pop(u)
        params = [p for p in state.params.values() if p.requires_grad]
        if roots and params:
            got = torch.autograd.grad(roots, params, grads, allow_unused=True)
            with torch.no_grad():
                for p, g in zip(params, got, strict=True):
                    if g is None:
                        continue
                    if p.grad is None:
                        p.grad = g
                    else:
                        p.grad.add_(g)
        w.versions.release(state.version, state.params)
        w.stats.units += 1  # a unit counts towards throughput when its backward is done
        w.comm.release(w.base + u)  # the graph held the received values until now
