"""AlexNet (Krizhevsky et al., 2012) in torchvision's single-tower layout."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from shared.zoo.models.checks import check_image_size
from shared.zoo.registry import register_model


class AlexNet(nn.Module):
    def __init__(self, widths: Sequence[int], hidden: int, num_classes: int, dropout: float) -> None:
        super().__init__()
        if len(widths) != 5:
            raise ValueError(f"widths must have 5 entries (one per convolution), got {list(widths)}")
        w1, w2, w3, w4, w5 = widths
        self.features = nn.Sequential(
            nn.Conv2d(3, w1, kernel_size=11, stride=4, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(w1, w2, kernel_size=5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(w2, w3, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(w3, w4, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(w4, w5, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(dropout),
            nn.Linear(w5 * 6 * 6, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))
        return logits


@register_model(
    "alexnet",
    "AlexNet (torchvision's layout, 61,100,840 parameters)",
    "float32 (N, 3, image_size, image_size), image_size >= 63 (224 in the paper)",
    dataset="synthetic_images",
    defaults={"num_classes": 10, "image_size": 64, "widths": [16, 32, 48, 32, 32], "hidden": 64},
)
def alexnet(
    *,
    num_classes: int = 1000,
    image_size: int = 224,
    widths: Sequence[int] = (64, 192, 384, 256, 256),
    hidden: int = 4096,
    dropout: float = 0.5,
) -> nn.Module:
    # Below 63 pixels the third max-pool sees a map smaller than its 3x3 window.
    check_image_size("alexnet", image_size, 63)
    return AlexNet(widths, hidden, num_classes, dropout)
