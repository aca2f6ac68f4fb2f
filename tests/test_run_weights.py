"""Weight versions are copied lazily: only when a step would overwrite memory a held unit still uses."""

from __future__ import annotations

import torch
from torch import nn

from pdrun.weights import WeightVersions


def _stage() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = nn.Linear(4, 3)
    return module, torch.optim.SGD(module.parameters(), lr=0.5)


def _backward(params: dict[str, torch.Tensor]) -> None:
    x = torch.ones(2, 4)
    (x @ params["weight"].t() + params["bias"]).sum().backward()


def test_a_version_released_before_the_step_is_never_copied() -> None:
    module, opt = _stage()
    versions = WeightVersions(module, stash=True)
    live_ptr = module.weight.data_ptr()
    n, params = versions.acquire()
    assert params["weight"].data_ptr() == live_ptr  # the live memory, not a copy
    _backward(params)
    versions.release(n, params)
    assert module.weight.grad is not None
    versions.before_step()
    opt.step()
    versions.stepped()
    assert module.weight.data_ptr() == live_ptr  # no copy was made
    assert versions.held() == 0


def test_a_held_version_keeps_its_weights_through_the_step_and_its_backward_sees_them() -> None:
    module, opt = _stage()
    versions = WeightVersions(module, stash=True)
    before = module.weight.detach().clone()
    n0, p0 = versions.acquire()  # unit 0
    n1, p1 = versions.acquire()  # unit 1, same version
    x = torch.ones(2, 4)
    out1 = (x @ p1["weight"].t() + p1["bias"]).sum()  # unit 1's forward, before the step
    _backward(p0)
    versions.release(n0, p0)
    versions.before_step()
    opt.step()
    versions.stepped()
    assert not torch.equal(module.weight, before)  # the live weights moved on
    assert torch.equal(p1["weight"], before)  # unit 1's version did not
    out1.backward()  # no in-place modification error: its saved weights are untouched
    assert p1["weight"].grad is not None
    versions.release(n1, p1)
    n2, p2 = versions.acquire()
    assert n2 == 1 and torch.equal(p2["weight"], module.weight)
