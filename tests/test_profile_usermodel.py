"""Models and datasets as a user writes them in their own file (helpers for the tracer and profiler tests).

The tests copy this file to a temporary directory and name it by path
(``tmp/model.py:build``), the way a user points pdprof at their code.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils.data import TensorDataset


class Branchy(nn.Module):
    """A stem, two branches (one of two layers), a concatenation and a skip connection:

    x -> stem -> relu -+-> left ----------------+-> cat -> merge -> add -> head
                       +-> right_a -> right_b --+                   ^
                       +----------------------------------------------+ (skip)
    """

    def __init__(self, width: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.left = nn.Linear(width, width)
        self.right_a = nn.Linear(width, width)
        self.right_b = nn.ReLU()
        self.merge = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        left = self.left(h)
        right = self.right_b(self.right_a(h))
        merged = self.merge(torch.cat([left, right], dim=1))
        return self.head(merged + h)


# The data flow of Branchy, written out by hand: the edges the traced DAG must have.
BRANCHY_EDGES = {
    ("x", "stem"),
    ("stem", "relu"),
    ("relu", "left"),
    ("relu", "right_a"),
    ("right_a", "right_b"),
    ("left", "cat"),
    ("right_b", "cat"),
    ("cat", "merge"),
    ("merge", "add"),
    ("relu", "add"),
    ("add", "head"),
}


def build(width: int = 16) -> nn.Module:
    return Branchy(width)


def data(size: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(size, 8, generator=g), torch.randint(0, 4, (size,), generator=g))


class TwoInputs(nn.Module):
    """A model called with two tensors, ``model(a, b)``: the dataset's input is a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(4, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.head(self.a(a) * self.b(b))


def build_two() -> nn.Module:
    return TwoInputs()


class PairDataset(torch.utils.data.Dataset[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]]):
    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.a = torch.randn(size, 8, generator=g)
        self.b = torch.randn(size, 4, generator=g)
        self.y = torch.randint(0, 4, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        return (self.a[i], self.b[i]), self.y[i]


def pairs(size: int = 32) -> PairDataset:
    return PairDataset(size)


class Gate(nn.Module):
    """Data-dependent control flow: fx cannot trace through it (and it has a child, so the
    tracer does not keep it whole on its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.scale(x)
        return x


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.gate = Gate()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(self.fc(x)))


def build_gated() -> nn.Module:
    return Gated()


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a layer whose backward time is known in advance."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds  # type: ignore[attr-defined]
        return x.clone()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)  # type: ignore[attr-defined]
        return grad, None


class SlowForward(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x * 1.0


class SlowBackward(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowBackward.apply(x, self.seconds)  # type: ignore[no-any-return]


class Sleepy(nn.Module):
    """fc -> slow_fwd (sleeps in forward) -> slow_bwd (sleeps in backward) -> head."""

    def __init__(self, forward_s: float = 0.02, backward_s: float = 0.03) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.slow_fwd = SlowForward(forward_s)
        self.slow_bwd = SlowBackward(backward_s)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.slow_bwd(self.slow_fwd(self.fc(x))))


def build_sleepy(forward_s: float = 0.02, backward_s: float = 0.03) -> nn.Module:
    return Sleepy(forward_s, backward_s)
