"""shared.weight_pass: B then W give exactly one backward's gradients, and W does not redo B's work.

Each case builds a small graph in float64 the way a stage does (received values as leaves that
require grad, the weights as leaves), runs the split backward and compares every gradient with
one ``torch.autograd.grad`` over the same roots.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from shared.weight_pass import backward_input, backward_weight

Case = Callable[[torch.Tensor, dict[str, torch.Tensor]], list[torch.Tensor]]


def _cnn(x: torch.Tensor, p: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    h = F.relu(F.conv2d(x, p["c1"], p["b1"], padding=1))
    h = F.batch_norm(h, None, None, p["g"], p["beta"], training=True)  # a boundary with three outputs
    h = F.conv2d(h, p["c2"])
    return [F.linear(h.flatten(1), p["fc"]).logsumexp(1).sum()]


def _shared(x: torch.Tensor, p: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    # One weight used twice in a row: its group has two boundaries, one on the other's weight side.
    return [torch.tanh(torch.tanh(x @ p["w"]) @ p["w"]).sum()]


def _gate(x: torch.Tensor, p: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    # A weight-only branch (sigmoid of a parameter) meets the input path at the product.
    return [(x * torch.sigmoid(p["gate"]) @ p["w"]).pow(2).sum()]


def _apart(x: torch.Tensor, p: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    # A second root made of weights alone (a position table sent on): its gradient never crosses x's paths.
    return [(x @ p["w"]).sum(), p["pos"] * 2.0]


SHAPES: dict[str, tuple[Case, tuple[int, ...], dict[str, tuple[int, ...]]]] = {
    "cnn": (
        _cnn,
        (3, 2, 6, 6),
        {"c1": (4, 2, 3, 3), "b1": (4,), "g": (4,), "beta": (4,), "c2": (3, 4, 3, 3), "fc": (5, 48)},
    ),
    "shared": (_shared, (4, 5), {"w": (5, 5)}),
    "gate": (_gate, (4, 5), {"gate": (5,), "w": (5, 3)}),
    "apart": (_apart, (4, 5), {"w": (5, 3), "pos": (2, 3), "unused": (2,)}),
}


def _built(name: str, x_requires_grad: bool = True):  # type: ignore[no-untyped-def]
    fn, x_shape, p_shapes = SHAPES[name]
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(x_shape, dtype=torch.float64, generator=gen).requires_grad_(x_requires_grad)
    p = {k: torch.randn(s, dtype=torch.float64, generator=gen).requires_grad_() for k, s in p_shapes.items()}
    roots = fn(x, p)
    grads = [
        None if r.dim() == 0 else torch.randn(r.shape, dtype=torch.float64, generator=gen) for r in roots
    ]
    return x, p, roots, grads


def _same(have: torch.Tensor | None, want: torch.Tensor | None) -> bool:
    if want is None:
        return have is None
    return have is not None and torch.allclose(have, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("x_requires_grad", [True, False], ids=["received", "first-stage"])
def test_b_then_w_equal_one_backward(name: str, x_requires_grad: bool) -> None:
    x, p, roots, grads = _built(name, x_requires_grad)
    inputs = [x] if x_requires_grad else []
    want = torch.autograd.grad(roots, [*inputs, *p.values()], grads, retain_graph=True, allow_unused=True)
    got_x, wp = backward_input(roots, grads, inputs, list(p.values()))
    by_param = {id(t): g for t, g in backward_weight(wp)}
    have = [*got_x, *(by_param.get(id(t)) for t in p.values())]
    names = ["x"] * len(inputs) + list(p)
    assert [n for n, h, w in zip(names, have, want, strict=True) if not _same(h, w)] == []
    assert any(w is not None for w in want[len(inputs) :])


def test_w_runs_only_the_weight_side() -> None:
    # The ReLU between the convolutions lies on the input path only: B runs it, W must not again.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    c1, c2 = (
        torch.randn(s, dtype=torch.float64, generator=gen, requires_grad=True)
        for s in [(3, 2, 3, 3), (2, 3, 3, 3)]
    )
    h = torch.relu(F.conv2d(x, c1, padding=1))
    runs = {"relu": 0, "conv2": 0}
    assert h.grad_fn is not None
    h.grad_fn.register_prehook(lambda g: runs.__setitem__("relu", runs["relu"] + 1))
    out = F.conv2d(h, c2)
    assert out.grad_fn is not None
    out.grad_fn.register_prehook(lambda g: runs.__setitem__("conv2", runs["conv2"] + 1))
    loss = out.square().sum()
    _, wp = backward_input([loss], [None], [x], [c1, c2])
    assert runs == {"relu": 1, "conv2": 1}
    got = dict((id(t), g) for t, g in backward_weight(wp))
    assert runs == {"relu": 1, "conv2": 2}  # W: conv2's weight product again, nothing behind it
    want = torch.autograd.grad(loss, [c1, c2], retain_graph=True)
    assert torch.allclose(got[id(c1)], want[0], rtol=0, atol=1e-12)
    assert torch.allclose(got[id(c2)], want[1], rtol=0, atol=1e-12)
    assert wp.plain == [] and len(wp.groups) == 2  # each weight from its own convolution's recorded gradient
