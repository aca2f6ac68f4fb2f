"""Timing each layer's share of the optimizer step.

pdrun steps the optimizer of every stage once per step (per unit in ``1f1b``), and on CPU
that is not small beside a stage's compute: an SGD step with momentum over a 3 MB
fully-connected layer reads and writes its weights, gradients and momentum buffers. So
after each profiled step, while the gradients are still there, each layer's parameters
get their own optimizer of the kind pdrun will run, and its ``step()`` is timed. The
learning rate is zero, so the arithmetic runs but the weights do not move and the
profile's later rounds time the same model.

The first step after a backward costs more, about 0.3 ms on CPU here whichever layer comes
first (on zoo:mnist_cnn a 640-byte conv layer took 0.3 ms first and 0.03 ms next). A stage
pays that once per step, so each layer is stepped twice: the second pass is the layer's
``update_ms``, and the first pass's excess over it is the per-step ``overhead``. A stage's
optimizer is one call over all its layers' parameters; the sum over its layers counts the
per-call overhead (tens of microseconds) once per layer, a small overestimate.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from pdprof.clock import Clock
from shared.tracer import Layer, TracedModel, layer_tensors

OptimizerName = Literal["sgd", "adam"]


def _layer_parameters(traced: TracedModel, layer: Layer) -> list[nn.Parameter]:
    if layer.op != "call_module" and not layer.params:
        return []
    return [p for p in layer_tensors(traced, layer) if isinstance(p, nn.Parameter) and p.requires_grad]


def _optimizer(
    params: list[nn.Parameter], optimizer: OptimizerName, momentum: float
) -> torch.optim.Optimizer:
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=0.0)
    return torch.optim.SGD(params, lr=0.0, momentum=momentum)


class UpdateTimer:
    """One zero-learning-rate optimizer per layer that has parameters; ``time()`` steps each.

    ``whole``: also one optimizer over every parameter, which ``time_whole()`` steps, as pdrun
    steps a stage's (``pdprof.calibrate`` scales the layers' figures to it on CUDA).
    """

    def __init__(
        self,
        traced: TracedModel,
        optimizer: OptimizerName,
        momentum: float,
        clock: Clock,
        whole: bool = False,
    ) -> None:
        self.clock = clock
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        everything: dict[int, nn.Parameter] = {}  # a tied parameter once
        for layer in traced.layers:
            params = _layer_parameters(traced, layer)
            if not params:
                continue
            self.optimizers[layer.name] = _optimizer(params, optimizer, momentum)
            everything.update((id(p), p) for p in params)
        self.whole = (
            _optimizer(list(everything.values()), optimizer, momentum) if whole and everything else None
        )

    def time(self) -> tuple[dict[str, float], float]:
        """Milliseconds of each layer's step, and the first pass's excess; call while gradients are set."""
        first = self._pass()
        second = self._pass()
        return second, max(0.0, sum(first.values()) - sum(second.values()))

    def time_whole(self) -> float | None:
        """Milliseconds of one step of the optimizer over every parameter (None without one)."""
        if self.whole is None:
            return None
        start = self.clock.mark()
        self.whole.step()
        end = self.clock.mark()
        self.clock.settle()
        return self.clock.ms(start, end)

    def _pass(self) -> dict[str, float]:
        marks = {}
        for name, opt in self.optimizers.items():
            start = self.clock.mark()
            opt.step()
            marks[name] = (start, self.clock.mark())
        self.clock.settle()
        return {name: self.clock.ms(a, b) for name, (a, b) in marks.items()}


def describe(optimizer: OptimizerName, momentum: float) -> str:
    """How the update times were taken, for the graph's record."""
    return "adam" if optimizer == "adam" else f"sgd, momentum {momentum:g}"
