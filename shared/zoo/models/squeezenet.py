"""SqueezeNet 1.0 and 1.1 (Iandola et al., 2016): Fire modules, each conv followed by an in-place ReLU.

The layers, their order and their names follow torchvision's recipe (``features.3.squeeze``,
``classifier.1``), so its parameter counts are ours: 1,248,424 (1.0) and 1,235,496 (1.1) for
1000 classes. Every ReLU is ``inplace=True``, as there: a pipeline cut between a conv and its
ReLU hands the next stage a value it modifies in place (pdrun/stage.py gives it a writable copy).
"""

from __future__ import annotations

import torch
from torch import nn

from shared.zoo.models.checks import check_image_size, check_positive
from shared.zoo.registry import register_model

# (squeeze, expand1x1, expand3x3) planes of the eight Fire modules, and where the max-pools go.
_FIRES: tuple[tuple[int, int, int], ...] = (
    (16, 64, 64),
    (16, 64, 64),
    (32, 128, 128),
    (32, 128, 128),
    (48, 192, 192),
    (48, 192, 192),
    (64, 256, 256),
    (64, 256, 256),
)
_POOLS_AFTER = {"1_0": (3, 7), "1_1": (2, 4)}  # pools follow these Fire modules (0-based)


class Fire(nn.Module):
    """Squeeze to few channels with a 1x1 conv, expand with 1x1 and 3x3 convs side by side, concatenate."""

    def __init__(self, inplanes: int, squeeze: int, expand1x1: int, expand3x3: int) -> None:
        super().__init__()
        self.squeeze = nn.Conv2d(inplanes, squeeze, kernel_size=1)
        self.squeeze_activation = nn.ReLU(inplace=True)
        self.expand1x1 = nn.Conv2d(squeeze, expand1x1, kernel_size=1)
        self.expand1x1_activation = nn.ReLU(inplace=True)
        self.expand3x3 = nn.Conv2d(squeeze, expand3x3, kernel_size=3, padding=1)
        self.expand3x3_activation = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.squeeze_activation(self.squeeze(x))
        return torch.cat(
            [self.expand1x1_activation(self.expand1x1(x)), self.expand3x3_activation(self.expand3x3(x))], 1
        )


class SqueezeNet(nn.Module):
    def __init__(self, version: str, num_classes: int, width: float, dropout: float) -> None:
        super().__init__()

        def w(c: int) -> int:
            return max(1, round(c * width))

        stem = 96 if version == "1_0" else 64
        layers: list[nn.Module] = [
            nn.Conv2d(3, w(stem), kernel_size=7, stride=2)
            if version == "1_0"
            else nn.Conv2d(3, w(stem), kernel_size=3, stride=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2, ceil_mode=True),
        ]
        channels = w(stem)
        for i, (s, e1, e3) in enumerate(_FIRES):
            layers.append(Fire(channels, w(s), w(e1), w(e3)))
            channels = w(e1) + w(e3)
            if i in _POOLS_AFTER[version]:
                layers.append(nn.MaxPool2d(kernel_size=3, stride=2, ceil_mode=True))
        self.features = nn.Sequential(*layers)
        final_conv = nn.Conv2d(channels, num_classes, kernel_size=1)
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout), final_conv, nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d((1, 1))
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                # torchvision's init: the final conv small, the others Kaiming-uniform.
                if m is final_conv:
                    nn.init.normal_(m.weight, mean=0.0, std=0.01)
                else:
                    nn.init.kaiming_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.classifier(self.features(x)), 1)


@register_model(
    "squeezenet",
    "SqueezeNet 1.1 (or version='1_0'), torchvision's recipe, in-place ReLUs; pairs with zoo:synthetic_images",
    "float32 (N, 3, S, S), S >= 17 (1.1) or 21 (1.0)",
    dataset="synthetic_images",
    defaults={"num_classes": 10, "image_size": 32, "width": 0.25},
)
def squeezenet(
    *,
    version: str = "1_1",
    num_classes: int = 1000,
    image_size: int = 224,
    width: float = 1.0,
    dropout: float = 0.5,
) -> nn.Module:
    check_positive("squeezenet", num_classes=num_classes, image_size=image_size)
    if version not in _POOLS_AFTER:
        raise ValueError(f"squeezenet: version {version!r} is not one of {', '.join(_POOLS_AFTER)}")
    if not width > 0:
        raise ValueError(f"squeezenet: width ({width}) must be positive")
    check_image_size(f"squeezenet {version}", image_size, 21 if version == "1_0" else 17)
    return SqueezeNet(version, num_classes, width, dropout)
