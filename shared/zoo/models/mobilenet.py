"""MobileNetV2 (Sandler et al., CVPR 2018): inverted residual blocks of depthwise convolutions.

The layers, their order and their names follow torchvision's recipe (``features.1.conv.0.0``,
``classifier.1``), so its parameter count is ours: 3,504,872 for 1000 classes. Every activation is an
in-place ReLU6, as there. The paper's Table 2 gives the block settings below.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.zoo.models.checks import check_image_size, check_positive
from shared.zoo.models.init import init_conv_linear
from shared.zoo.registry import register_model

# (expansion t, output channels c, repeats n, first stride s) of each bottleneck sequence: Table 2.
_SETTINGS: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


def _divisible(value: float, divisor: int = 8) -> int:
    """Channels rounded to a multiple of ``divisor``, never below 90% of ``value`` (torchvision's rule)."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def _conv_bn_relu6(inp: int, out: int, kernel: int = 3, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(inp, out, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(out),
        nn.ReLU6(inplace=True),
    )


class InvertedResidual(nn.Module):
    """Expand with a 1x1 conv, filter depthwise 3x3, project linearly with a 1x1 conv; add the input
    when the shape is kept."""

    def __init__(self, inp: int, out: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = round(inp * expand)
        self.use_residual = stride == 1 and inp == out
        layers: list[nn.Module] = [] if expand == 1 else [_conv_bn_relu6(inp, hidden, kernel=1)]
        layers += [
            _conv_bn_relu6(hidden, hidden, stride=stride, groups=hidden),
            nn.Conv2d(hidden, out, 1, bias=False),
            nn.BatchNorm2d(out),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.conv(x)
        return x + out if self.use_residual else out


class MobileNetV2(nn.Module):
    def __init__(self, num_classes: int, width: float, dropout: float) -> None:
        super().__init__()
        channels = _divisible(32 * width)
        last = _divisible(1280 * max(1.0, width))
        layers: list[nn.Module] = [_conv_bn_relu6(3, channels, stride=2)]
        for t, c, n, s in _SETTINGS:
            out = _divisible(c * width)
            for i in range(n):
                layers.append(InvertedResidual(channels, out, s if i == 0 else 1, t))
                channels = out
        layers.append(_conv_bn_relu6(channels, last, kernel=1))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(last, num_classes))
        init_conv_linear(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))
        return logits


@register_model(
    "mobilenet_v2",
    "MobileNetV2 (torchvision's layout, 3,504,872 parameters); width scales every block's channels",
    "float32 (N, 3, image_size, image_size), image_size >= 32 (224 in the paper)",
    dataset="synthetic_images",
    defaults={"num_classes": 10, "image_size": 32, "width": 0.25},
)
def mobilenet_v2(
    *, num_classes: int = 1000, image_size: int = 224, width: float = 1.0, dropout: float = 0.2
) -> nn.Module:
    check_image_size("mobilenet_v2", image_size, 32)
    check_positive("mobilenet_v2", num_classes=num_classes)
    if width <= 0:
        raise ValueError(f"mobilenet_v2: width must be positive, got {width}")
    return MobileNetV2(num_classes, width, dropout)
