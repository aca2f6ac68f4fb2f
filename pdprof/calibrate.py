"""On CUDA, the per-layer figures anchored to the whole they are part of.

A mark on CUDA is an event recorded on the stream, and the backward's marks are Python hooks
that the autograd engine calls for every node; both take CPU time. When a step is launch-bound
(the GPU waits on the CPU to issue its kernels: small layers, small batches, a fast GPU), the
GPU waits on that time too, so each layer's event-timed figure carries the cost of its own
marks. Likewise each layer's optimizer step, timed on its own optimizer, launches its own
kernels, where pdrun's stage steps one optimizer over all its parameters in a few fused calls.

Measured on an H200 (``make gpu-check``, 2026-12-04, torch 2.11, batch 32): the layers summed to
1.40x a plain training step for ResNet-50 (224 x 224), 1.36x for ResNet-18, 1.52x for a 4 x 256
GPT; the GPT's layers' optimizer steps summed to 1.44 ms where pdrun's one step over the same
parameters took 0.48 ms; and one-worker plans predicted 1.42x (ResNet-18) and 1.71x (GPT) the
time per minibatch pdrun measured.

So on CUDA each forward, backward and loss figure is scaled by the whole step's time over the
profiled step's (layers, loss and the backward's tail), and each layer's update by one optimizer
step over all parameters over the layers' sum: the layers keep the proportions measured, and
their total is what a real step pays. The whole step there is one of the traced graph, which
pdrun's stages run, not of the user's model: a Hugging Face model's exported graph of aten ops
runs slower than the model (anchored to the model, a 4-block GPT-2's one-worker plan predicted
0.80 of pdrun's time on the H200). The factors are recorded in the graph (``calibration``).
On CPU nothing is scaled: a mark is a clock read outside the layer's call, and the layers sum to
0.96-1.05 of a directly timed step (``bench.bench_profiler``).
"""

from __future__ import annotations

from dataclasses import dataclass

# Where the figures are anchored: CUDA, for the reason above. tests/test_profile_calibrate.py anchors
# CPU too, to run this path where there is no GPU.
ANCHORED_DEVICES = frozenset({"cuda"})


def anchored(device_type: str) -> bool:
    """Whether a profile on ``device_type`` is scaled to its whole step (and times one optimizer step)."""
    return device_type in ANCHORED_DEVICES


@dataclass(frozen=True)
class Calibration:
    """Factors applied to the profiled figures: 1.0 where nothing is scaled."""

    compute: float = 1.0  # forward, backward and the loss's figures
    update: float = 1.0  # each layer's optimizer step

    def as_record(self, measured_ratio: float | None) -> dict[str, float | None]:
        """What the graph records: the factors, and the layer sum / whole step before scaling."""
        return {"compute": self.compute, "update": self.update, "measured_ratio": measured_ratio}


def _factor(whole_ms: float, parts_ms: float) -> float:
    return whole_ms / parts_ms if whole_ms > 0 and parts_ms > 0 else 1.0


def calibrate(
    device_type: str, step_ms: float, profiled_ms: float, update_whole_ms: float | None, update_sum_ms: float
) -> Calibration:
    """The factors for a profile on ``device_type``: the whole step over the profiled step's parts,
    one optimizer step over all parameters over the layers' steps (when timed)."""
    if not anchored(device_type):
        return Calibration()
    update = 1.0 if update_whole_ms is None else _factor(update_whole_ms, update_sum_ms)
    return Calibration(compute=_factor(step_ms, profiled_ms), update=update)
