"""ResNet-18 and ResNet-50 (He et al., 2016) as torchvision builds them.

ResNet-18 stacks basic blocks (two 3x3 convs); ResNet-50 torchvision's v1.5 bottleneck (the stride
sits on the 3x3 conv). Every ReLU is ``inplace=True``, as there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from shared.zoo.models.checks import check_image_size, check_positive
from shared.zoo.registry import register_model


def _shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Module | None:
    """The projection a block's identity needs when its shape changes (torchvision's ``downsample``)."""
    if stride == 1 and in_channels == out_channels:
        return None
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
    )


class BasicBlock(nn.Module):
    """Two 3x3 convs (the first strided), plus the identity (or a projected) shortcut."""

    expansion = 1

    def __init__(self, in_channels: int, width: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = _shortcut(in_channels, width, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        result: torch.Tensor = self.relu(out + identity)
        return result


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand, plus the identity (or a projected) shortcut."""

    expansion = 4  # the output has 4x the channels of the 3x3 conv

    def __init__(self, in_channels: int, width: int, stride: int) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(in_channels, out_channels, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        result: torch.Tensor = self.relu(out + identity)
        return result


class ResNet(nn.Module):
    def __init__(
        self, block: type[BasicBlock | Bottleneck], width: int, depths: Sequence[int], num_classes: int
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        channels = width
        stages: list[nn.Sequential] = []
        for i, depth in enumerate(depths):
            stage_width = width * 2**i
            blocks = []
            for j in range(depth):
                blocks.append(block(channels, stage_width, stride=2 if (i > 0 and j == 0) else 1))
                channels = stage_width * block.expansion
            stages.append(nn.Sequential(*blocks))
        # Named layer1..layer4 as in torchvision, so layer names read the same in graphs and plans.
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        logits: torch.Tensor = self.fc(torch.flatten(self.avgpool(x), 1))
        return logits


def _build(
    name: str,
    block: type[BasicBlock | Bottleneck],
    num_classes: int,
    image_size: int,
    width: int,
    depths: Sequence[int],
) -> nn.Module:
    check_image_size(name, image_size, 32)
    check_positive(name, width=width, num_classes=num_classes)
    if len(depths) != 4 or min(depths) < 1:
        raise ValueError(f"depths must be 4 positive block counts (one per stage), got {list(depths)}")
    return ResNet(block, width, depths, num_classes)


@register_model(
    "resnet18",
    "ResNet-18 (torchvision's layout, basic blocks, 11,689,512 parameters)",
    "float32 (N, 3, image_size, image_size), image_size >= 32 (224 in the paper)",
    dataset="synthetic_images",
    defaults={"num_classes": 10, "image_size": 32, "width": 8, "depths": [1, 1, 1, 1]},
)
def resnet18(
    *, num_classes: int = 1000, image_size: int = 224, width: int = 64, depths: Sequence[int] = (2, 2, 2, 2)
) -> nn.Module:
    return _build("resnet18", BasicBlock, num_classes, image_size, width, depths)


@register_model(
    "resnet50",
    "ResNet-50 (torchvision's v1.5 layout, 25,557,032 parameters)",
    "float32 (N, 3, image_size, image_size), image_size >= 32 (224 in the paper)",
    dataset="synthetic_images",
    defaults={"num_classes": 10, "image_size": 32, "width": 8, "depths": [1, 1, 1, 1]},
)
def resnet50(
    *, num_classes: int = 1000, image_size: int = 224, width: int = 64, depths: Sequence[int] = (3, 4, 6, 3)
) -> nn.Module:
    return _build("resnet50", Bottleneck, num_classes, image_size, width, depths)
