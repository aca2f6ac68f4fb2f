"""Channels-last memory layout for a run's image tensors: when to use it, and how it is applied.

On CPU, oneDNN's convolutions and PyTorch's pooling kernels are much faster on NHWC
("channels-last") tensors than on the default NCHW: on zoo:mnist_cnn (batch 64, one thread)
``MaxPool2d`` over a 16x28x28 map takes ~1.45 ms in NCHW and ~0.22 ms in channels-last, and a
first stage's forward and backward ~3.7 ms against ~1.35 ms. The layout changes where values
sit in memory, not what they are: pooling picks the same elements, and a convolution's
results differ by float rounding only (its kernels sum in another order).

``auto`` uses it for float32 on CPU when the model has a 2-d convolution. Every rank decides
from the same model and options, so both ends of a message agree on the layout a
4-d value travels in (see ``pdrun.values``: it goes as a contiguous NHWC tensor, so neither
end copies it, and the gradient coming back has the layout its activation had).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

MemoryFormat = Literal["auto", "contiguous", "channels-last"]


def use_channels_last(
    choice: MemoryFormat, model: nn.Module, device: torch.device, dtype: torch.dtype
) -> bool:
    """Whether a run keeps its 4-d floating tensors channels-last."""
    if choice != "auto":
        return choice == "channels-last"
    # float64 convolutions do not run on oneDNN, and on CUDA the choice depends on the kernels: leave both alone.
    conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
    return conv and device.type == "cpu" and dtype == torch.float32


def module_to_channels_last(module: nn.Module) -> None:
    """Re-lay the module's 4-d parameters and buffers in place (before an optimizer holds them).

    Only 4-d ones: ``Module.to(memory_format=...)`` would refuse a Conv3d's 5-d weight.
    The parameter objects stay the same; their values are unchanged. ``to``, not
    ``contiguous``: a weight with one input channel (16, 1, 3, 3) counts as contiguous in
    both layouts, so ``contiguous`` keeps its NCHW strides, and a convolution picks its
    layout from the weight's strides (it would stay NCHW, and so would the pooling after it).
    """
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 4:
                p.data = p.data.to(memory_format=torch.channels_last)
        for holder in module.modules():
            for name, b in holder.named_buffers(recurse=False):
                if b is not None and b.dim() == 4:
                    setattr(holder, name, b.to(memory_format=torch.channels_last))


def inputs_to_channels_last(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """A batch's model inputs in the run's layout: 4-d floating tensors channels-last, the rest as they are.

    (A no-op for single-channel images, whose layouts coincide.)
    """
    return tuple(
        v.contiguous(memory_format=torch.channels_last)
        if isinstance(v, torch.Tensor) and v.dim() == 4 and v.is_floating_point()
        else v
        for v in values
    )
