"""VGG-16 (configuration D of Simonyan and Zisserman, 2015), layer for layer as torchvision builds it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from shared.zoo.models.checks import check_image_size
from shared.zoo.models.init import init_conv_linear
from shared.zoo.registry import register_model

# Convolutions per block of configuration D; a max-pool closes each block.
VGG16_BLOCKS = (2, 2, 3, 3, 3)


class VGG(nn.Module):
    def __init__(
        self, widths: Sequence[int], blocks: Sequence[int], hidden: int, num_classes: int, dropout: float
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for width, convs in zip(widths, blocks, strict=True):
            for _ in range(convs):
                layers += [nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(inplace=True)]
                channels = width
            layers.append(nn.MaxPool2d(2, 2))
        self.features = nn.Sequential(*layers)
        # Adaptive pooling to 7x7 keeps the classifier (and the parameter count) independent of the image size.
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(channels * 7 * 7, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )
        init_conv_linear(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))
        return logits


@register_model(
    "vgg16",
    "VGG-16 (torchvision's layout, 138,357,544 parameters); image_size only checks the minimum",
    "float32 (N, 3, image_size, image_size), image_size >= 32 (224 in the paper)",
    dataset="synthetic_images",
    defaults={"num_classes": 10, "image_size": 32, "widths": [8, 16, 32, 64, 64], "hidden": 64},
)
def vgg16(
    *,
    num_classes: int = 1000,
    image_size: int = 224,
    widths: Sequence[int] = (64, 128, 256, 512, 512),
    hidden: int = 4096,
    dropout: float = 0.5,
) -> nn.Module:
    check_image_size("vgg16", image_size, 32)
    if len(widths) != len(VGG16_BLOCKS):
        raise ValueError(f"widths must have {len(VGG16_BLOCKS)} entries (one per block), got {list(widths)}")
    return VGG(widths, VGG16_BLOCKS, hidden, num_classes, dropout)
