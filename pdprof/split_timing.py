"""What zero bubble's split backward costs: B and W of a stage, against the same stage's one backward.

Zero-bubble schedules (Qi et al., ICLR'24, section 2) run a stage's backward as two instructions:
B, the gradients of what the stage received (``shared.weight_pass.backward_input``), and W, its
weights' gradients (``backward_weight``). Their paper takes them as equal halves of the backward
for transformer layers; they are not, in general, and their sum is not one backward either. On
the zoo's MNIST CNN here (one process, 60 steps) B took 6.6-6.8 ms and W 2.6 ms where one
backward took 7.7-8.0: B carries every activation gradient (a ReLU's, a pooling's) besides the
convolutions' input products, and W re-reads saved inputs the fused backward read once, hot.

So pdprof times, each round, the part of the graph after its narrowest cut (``pdprof.cut``) as a
stage would run it: its forward from a leaf that requires grad, then either one backward down to
that leaf or B then W, in alternating order. The graph's ``backward_input_share`` and
``backward_weight_share`` are B's and W's medians over the fused backward's: the planner's
simulation charges a stage's B and W as those shares of its profiled backward
(``pdplan.schedule_sim.split_backward``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from pdprof.clock import Clock
from pdprof.cut import CutInterpreter
from pdprof.timing import LossFn
from shared.weight_pass import backward_input, backward_weight


def split_after_cut(
    module: fx.GraphModule,
    inputs: Sequence[Any],
    target: Any,
    loss_fn: LossFn,
    clock: Clock,
    cut: str,
    split: bool,
) -> tuple[float, float]:
    """Milliseconds of the backward of the part after ``cut``: (B, W) when ``split``, else (fused, 0).

    The part before the cut gets no backward: its graph is dropped with the step."""
    interp = CutInterpreter(module, cut)
    loss = loss_fn(interp.run(*inputs), target)
    leaf = interp.leaf
    if leaf is None:
        raise ValueError(f"cut {cut!r} made no value that requires grad")
    params: list[torch.Tensor] = [p for p in module.parameters() if p.requires_grad]
    start = clock.mark()
    if not split:
        loss.backward()  # type: ignore[no-untyped-call]
        end = clock.mark()
        clock.settle()
        return clock.ms(start, end), 0.0
    _, weight_pass = backward_input([loss], [None], [leaf], params)
    mid = clock.mark()
    with torch.no_grad():
        for p, g in backward_weight(weight_pass):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)  # as pdrun accumulates them
    end = clock.mark()
    clock.settle()
    return clock.ms(start, mid), clock.ms(mid, end)
