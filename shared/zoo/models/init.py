"""torchvision's initialisation of its VGG and MobileNetV2 recipes, shared by the zoo's copies."""

from __future__ import annotations

from torch import nn


def init_conv_linear(model: nn.Module) -> None:
    """Convs Kaiming-normal over their outputs (ReLU gain), linears N(0, 0.01), biases zero.

    Batch norms keep torch's own start (weight one, bias zero), which is torchvision's too.
    """
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.zeros_(m.bias)
