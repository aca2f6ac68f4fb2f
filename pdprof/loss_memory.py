"""What the loss adds to a training step's memory, beyond passing a gradient back to the model.

The loss is not a layer: what it saves for its backward (cross-entropy's log-probabilities) and
what that backward makes (their gradient, the gradient of the model's output) are in the whole
model's memory rise (``graph.memory_rise_bytes``) but in no layer's ``saved_bytes``. For a
language model they are most of a step's memory (the zoo's GPT with GPT-2's 50,257-token
vocabulary at 16 x 64 tokens: 206 MB a tensor, most of a 680 MB rise), and only the last stage,
which computes the loss, pays them. The planner charges this figure (``graph.loss_rise_bytes``)
to the last stage and shares the rest of the overhead among the workers (``pdplan.memory``).

Memory peaks do not add: the loss's tensors are freed before the model's backward makes most of
its own, which then reuse them, so the loss measured alone would count memory the whole step
counts once. So the figure is a difference of two whole steps, measured as the whole model's
rise is (``shared.highwater``): the step with the real loss, less the step with a surrogate loss,
``sum(output * g)`` for fixed random ``g`` (made before the mark), which sends the model's backward
a gradient of the same shapes and keeps nothing of its own. Both run after the first probe, on the
same heap, warmed by one step of each, so the library code they page in counts in neither.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from shared.highwater import mark, rise

PROBE_STEPS = 2  # each probe's steps: on a warmed heap the rise holds from the second on
# The loss's own tensors are a few times the output it reads (cross-entropy: its log-probabilities,
# their gradient, the output's gradient, 2-6 outputs' worth measured): below this many output bytes
# they are lost in a page's noise, and the probe's steps are not worth taking (an image classifier's
# 10 classes); the figure is then 0.
SMALL_OUTPUT_BYTES = 256 * 1024

LossFn = Callable[[Any, Any], torch.Tensor]


def _floating(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _probe(model: nn.Module, step: Callable[[], None], device: torch.device) -> float:
    since = mark(device)
    for _ in range(PROBE_STEPS):
        step()
        model.zero_grad(set_to_none=True)  # as pdrun's optimizer step leaves them
    return rise(since)


def loss_rise(
    model: nn.Module,
    call: nn.Module,
    inputs: Sequence[Any],
    target: Any,
    loss_fn: LossFn,
    device: torch.device,
) -> float:
    """Bytes the real loss's steps rise by beyond the surrogate's (at least 0; NaN when a step fails)."""
    try:
        with torch.no_grad():
            shapes = _floating(call(*inputs))
        weights = [torch.randn_like(t) for t in shapes]
    except Exception:
        return math.nan  # the sizes run names the model's failure
    if sum(t.numel() * t.element_size() for t in shapes) < SMALL_OUTPUT_BYTES:
        return 0.0

    def surrogate() -> None:
        # The same floating outputs, in the same order, each with its fixed gradient handed in as it is:
        # no product, no sum, nothing kept.
        pairs = [(o, g) for o, g in zip(_floating(call(*inputs)), weights, strict=True) if o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], grad_tensors=[g for _, g in pairs])

    def real() -> None:
        loss_fn(call(*inputs), target).backward()  # type: ignore[no-untyped-call]

    try:
        for step in (real, surrogate):  # warm the heap for both first: the probes then compare like with like
            step()
            model.zero_grad(set_to_none=True)
        without = _probe(model, surrogate, device)
        with_loss = _probe(model, real, device)
    except Exception:
        return math.nan  # a model or loss that fails on the batch: the sizes run names it
    return max(0.0, with_loss - without)
