"""Small models for fast tests and the demo: a residual MLP and an MNIST-size CNN."""

from __future__ import annotations

import torch
from torch import nn

from shared.zoo.registry import register_model


class ResidualBlock(nn.Module):
    """``x + W2 relu(W1 x)``: a skip connection the planner sees as a DAG edge."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.fc2(self.act(self.fc1(x)))
        return out


class ResidualMLP(nn.Module):
    def __init__(self, in_features: int, width: int, depth: int, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Linear(in_features, width)
        self.blocks = nn.Sequential(*[ResidualBlock(width) for _ in range(depth)])
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.blocks(torch.relu(self.stem(x.flatten(1)))))
        return logits


@register_model(
    "resmlp",
    "residual MLP (skip connections); pairs with zoo:digits",
    "float32 (N, in_features)",
    dataset="digits",
    defaults={"width": 64, "depth": 2},
)
def resmlp(*, in_features: int = 64, width: int = 128, depth: int = 4, num_classes: int = 10) -> nn.Module:
    return ResidualMLP(in_features, width, depth, num_classes)


class MnistCNN(nn.Module):
    def __init__(self, channels: int, num_classes: int, image_size: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(2)
        self.flatten = nn.Flatten()
        side = image_size // 4
        self.fc1 = nn.Linear(2 * channels * side * side, 128)
        self.relu3 = nn.ReLU()
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool1(self.relu1(self.conv1(x)))
        x = self.pool2(self.relu2(self.conv2(x)))
        logits: torch.Tensor = self.fc2(self.relu3(self.fc1(self.flatten(x))))
        return logits


@register_model(
    "mnist_cnn",
    "two-conv CNN for 28x28 digits; pairs with zoo:mnist5k",
    "float32 (N, 1, 28, 28)",
    dataset="mnist5k",
    defaults={"channels": 8},
)
def mnist_cnn(*, channels: int = 16, num_classes: int = 10, image_size: int = 28) -> nn.Module:
    return MnistCNN(channels, num_classes, image_size)
