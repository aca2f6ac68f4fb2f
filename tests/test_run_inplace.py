"""In-place operations at a cut: a stage modifies a value it received, and trains as one process does.

The model has an in-place ReLU after every layer, in each of the forms a user writes one
(``nn.ReLU(inplace=True)``, ``F.relu(..., inplace=True)``, ``x.relu_()``, ``torch.relu_``), so
every other cut hands the next stage a value it modifies in place.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch

from pdrun.config import Dtype, RunConfig
from pdrun.launch import launch
from pdrun.partition import partition
from pdrun.plans import cut_plan, traced_for
from pdrun.stage import build_stage, sample_run, writable
from shared.spec import RunSpec
from tests.test_run_flush import assert_same, pipeline_params, sequential

INPLACE_NET = '''
import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    """Four Linear layers, each followed by an in-place ReLU written a different way."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.act1 = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 32)
        self.fc4 = nn.Linear(32, 10)

    def forward(self, x):
        x = self.act1(self.fc1(x))
        x = F.relu(self.fc2(x), inplace=True)
        x = self.fc3(x).relu_()
        return torch.relu_(self.fc4(x))


def build():
    return Net()
'''

LINEARS = ("fc1", "fc2", "fc3", "fc4")


def _spec(tmp_path: Path) -> RunSpec:
    path = tmp_path / "inplace_net.py"
    path.write_text(INPLACE_NET)
    return RunSpec(model=f"{path}:build", data="zoo:digits")


def test_only_values_modified_in_place_are_copied_and_every_cut_gives_the_model_gradients(
    tmp_path: Path,
) -> None:
    spec = _spec(tmp_path)
    traced = traced_for(spec)
    traced.module.double()
    x = torch.randn(8, 64, dtype=torch.float64)
    _, written = sample_run(traced, (x,))
    assert written == set(LINEARS)  # each Linear's output is what its ReLU overwrites; nothing else
    model = traced_for(spec).module.double()
    model(x).sum().backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    names = [layer.name for layer in traced.layers]
    for cut in range(1, len(names)):
        part = partition(traced, cut_plan(spec, [cut], batch_size=8))
        first, second = (build_stage(traced, part, s, written) for s in (0, 1))
        copies = [n.args[0].name for n in second.module.graph.nodes if n.target is writable]  # type: ignore[union-attr]
        received = second.received
        assert copies == [f"recv_{n}" for n in received if n in written], cut
        assert (received[0] in LINEARS) == bool(copies), cut
        traced.module.zero_grad()
        sent, _ = first.run((x,), {})
        # The receiving end, as a worker builds it: a leaf that takes the gradient back.
        leaves = {n: v.detach().requires_grad_(v.requires_grad) for n, v in sent.items()}
        _, out = second.run((), leaves)
        out.sum().backward()
        back = [n for n in sent if sent[n].requires_grad]
        if back:
            torch.autograd.backward([sent[n] for n in back], [leaves[n].grad for n in back])
        for n, p in traced.module.named_parameters():
            assert p.grad is not None and torch.allclose(p.grad, want[n], atol=1e-12), (cut, n)


# Two plans whose boundaries, together, are every cut position of the model's 9 layers.
EVERY_CUT = ([2, 4, 6, 8], [1, 3, 5, 7])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cuts", EVERY_CUT)
def test_flush_equals_one_process_at_every_cut(tmp_path: Path, cuts: list[int]) -> None:
    spec = _spec(tmp_path)
    batch, microbatches, steps = 8, 2, 4
    plan = cut_plan(spec, cuts, batch_size=batch, schedule="1f1b-flush", microbatches=microbatches)
    cfg = RunConfig(steps=steps, seed=2, dtype="float64", lr=0.3, record=True, validate=False)
    results = launch(plan, cfg)
    assert results is not None and len(results) == len(cuts) + 1
    initial, want = sequential(
        spec, steps=steps, batch=batch * microbatches, seed=2, dtype=torch.float64, lr=0.3
    )
    assert_same(pipeline_params(results), want, 1e-6)
    assert max((want[k] - initial[k]).abs().max().item() for k in want) > 1e-3


@pytest.mark.timeout(180)
def test_1f1b_runs_with_in_place_operations_at_every_other_cut(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    plan = cut_plan(spec, EVERY_CUT[0], batch_size=16, schedule="1f1b")
    results = launch(plan, RunConfig(steps=30, seed=0, lr=0.1, validate=False))
    assert results is not None
    losses = [row["loss"] for r in results if r.stage == len(plan.stages) - 1 for row in r.rows]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5, losses


SQUEEZENET = RunSpec(
    model="zoo:squeezenet",
    model_args={"num_classes": 10, "image_size": 32, "width": 0.25, "dropout": 0.0},
    data="zoo:synthetic_images",
    data_args={"image_size": 32, "num_classes": 10, "size": 64},
)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_squeezenet_cut_between_a_conv_and_its_in_place_relu(dtype: str) -> None:
    # float32 on CPU runs channels-last: the received value is then a permuted view, the issue's
    # "a view of a leaf Variable that requires grad is being used in an in-place operation".
    batch, microbatches, steps = 4, 2, 3
    plan = cut_plan(
        SQUEEZENET, ["features_3_squeeze_activation"], batch_size=batch, schedule="1f1b-flush", microbatches=2
    )
    cfg = RunConfig(steps=steps, seed=0, dtype=cast(Dtype, dtype), lr=0.05, record=True, validate=False)
    results = launch(plan, cfg)
    assert results is not None
    torch_dtype = torch.float64 if dtype == "float64" else torch.float32
    initial, want = sequential(
        SQUEEZENET, steps=steps, batch=batch * microbatches, seed=0, dtype=torch_dtype, lr=0.05
    )
    assert_same(pipeline_params(results), want, 1e-6 if dtype == "float64" else 1e-4)
    assert max((want[k] - initial[k]).abs().max().item() for k in want) > 1e-4


DISCARDED_NET = '''
import torch
from torch import nn


class Discarded(nn.Module):
    """In-place operations whose result is not used, each written a different way, and a value read
    before it is written in place (which a later stage must still see as it was)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.fc3 = nn.Linear(32, 32)
        self.act = nn.ReLU(inplace=True)
        self.fc4 = nn.Linear(32, 10)

    def forward(self, x):
        y = self.fc1(x)
        early = y * 0.5
        y.add_(x[:, :32])
        torch.relu_(y)
        z = self.fc3(y)
        z.mul_(0.5)
        self.act(z)
        return self.fc4(z + early)


def build():
    return Discarded()
'''


def _discarded(tmp_path: Path) -> RunSpec:
    path = tmp_path / "discarded_net.py"
    path.write_text(DISCARDED_NET)
    return RunSpec(model=f"{path}:build", data="zoo:digits")


def test_an_in_place_result_left_unused_orders_the_layers_after_it(tmp_path: Path) -> None:
    # `y.add_(x); relu(y)` traced to a relu that did not depend on the add: a plan ran it first, on
    # another stage, and trained on the wrong value without a word (shared/inplace.py).
    spec = _discarded(tmp_path)
    traced = traced_for(spec)
    edges = set(traced.edges())
    assert {("add_", "relu_"), ("relu_", "fc3"), ("mul_", "act"), ("act", "add")} <= edges, edges
    assert all(any(s == layer.name for s, _ in edges) for layer in traced.layers[:-1])  # none dangles
    model = traced_for(spec).module.double()
    traced.module.double()
    x = torch.randn(8, 64, dtype=torch.float64)
    torch.testing.assert_close(traced.module(x), model(x), rtol=0, atol=0)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cuts", [["add_", "fc3", "act"], ["relu_", "mul_"]])
def test_flush_equals_one_process_with_unused_in_place_results(tmp_path: Path, cuts: list[str]) -> None:
    spec = _discarded(tmp_path)
    batch, microbatches, steps = 8, 2, 3
    plan = cut_plan(spec, cuts, batch_size=batch, schedule="1f1b-flush", microbatches=microbatches)
    results = launch(
        plan, RunConfig(steps=steps, seed=2, dtype="float64", lr=0.3, record=True, validate=False)
    )
    assert results is not None and len(results) == len(cuts) + 1
    initial, want = sequential(
        spec, steps=steps, batch=batch * microbatches, seed=2, dtype=torch.float64, lr=0.3
    )
    assert_same(pipeline_params(results), want, 1e-6)
    assert max((want[k] - initial[k]).abs().max().item() for k in want) > 1e-3
