"""The pieces of a worker in one process: stage modules, the partition's checks, the data order, weight versions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset, default_collate

from pdrun.config import RunConfig
from pdrun.data import Units
from pdrun.launch import launch
from pdrun.partition import partition
from pdrun.plans import cut_plan, traced_for
from pdrun.stage import build_stage, sample_values
from pdrun.values import decode, encode, spec_of
from pdrun.weights import WeightVersions
from shared.errors import PlanError, RunError
from shared.resolve import resolve_dataset, resolve_model
from shared.spec import RunSpec

TWO_INPUTS = '''
import torch
from torch import nn


class TwoInputs(nn.Module):
    """model(x, mask): the mask and h skip to the last stage; a tuple (chunk) crosses from stage 1."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x, mask):
        n = x.size(0)
        h = torch.tanh(self.a(x))
        parts = torch.relu(self.b(h)).chunk(2, dim=1)
        y = torch.cat([parts[1], parts[0]], 1) * mask + h
        return self.head(y).view(n, -1)


def build():
    return TwoInputs()


def data():
    """((x, mask), target) pairs: the model is called as model(x, mask)."""
    g = torch.Generator().manual_seed(0)
    x, m = torch.randn(40, 8, generator=g), (torch.rand(40, 16, generator=g) > 0.3).float()
    y = torch.randint(0, 3, (40,), generator=g)
    return [((x[i], m[i]), y[i]) for i in range(40)]
'''


def _spec(tmp_path: Path) -> RunSpec:
    path = tmp_path / "two.py"
    path.write_text(TWO_INPUTS)
    return RunSpec(model=f"{path}:build", data=f"{path}:data")


def test_stages_chained_compute_the_models_output(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    plan = cut_plan(spec, ["b", "getitem"], batch_size=4)
    traced = traced_for(spec)
    part = partition(traced, plan)
    assert part.input_stage_of == {"x": 0, "mask": 0}
    assert part.sends[(0, 2)] == ("mask", "size", "tanh")  # straight to the consumer, past stage 1
    assert part.sends[(0, 1)] == ("tanh",) and part.sends[(1, 2)] == ("chunk",)
    x, mask = torch.randn(4, 8), (torch.rand(4, 16) > 0.5).float()
    want = traced.module(x, mask)
    values = sample_values(traced, (x, mask))
    specs = {n: spec_of(values[n]) for names in part.sends.values() for n in names}
    assert specs["size"].kind == "int" and not specs["mask"].requires_grad and specs["tanh"].requires_grad
    assert specs["chunk"].kind == "tuple" and len(specs["chunk"].items) == 2 and specs["chunk"].requires_grad
    stages = [build_stage(traced, part, s) for s in range(3)]
    # Each stage holds only its own parameters, under the model's names.
    assert [sorted(n for n, _ in st.module.named_parameters()) for st in stages] == [
        ["a.bias", "a.weight"],
        ["b.bias", "b.weight"],
        ["head.bias", "head.weight"],
    ]
    inbox: dict[int, dict[str, Any]] = {0: {}, 1: {}, 2: {}}
    output = None
    for st in stages:
        batch = (x, mask) if st.batch_inputs else ()
        sent, output = st.run(batch, inbox[st.index])
        for b, names in part.consumers(st.index):
            for n in names:  # through the wire format, as between processes
                wire = [t.clone() for t in encode(sent[n], specs[n], torch.device("cpu"))]
                inbox[b][n] = decode(iter(wire), specs[n])
    torch.testing.assert_close(output, want)


def test_partition_names_what_does_not_fit(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    traced = traced_for(spec)
    plan = cut_plan(spec, ["b"], batch_size=4)
    swapped = plan.model_copy(deep=True)
    swapped.stages[0].layers.remove("a")
    swapped.stages[1].layers.append("a")
    with pytest.raises(
        PlanError, match=r"stages\[0\]: not convex: layer 'tanh' \(stage 0\) reads 'a' from the later stage 1"
    ):
        partition(traced, swapped)
    unknown = plan.model_copy(deep=True)
    unknown.stages[1].layers.append("conv9")
    with pytest.raises(PlanError, match=r"stages\[1\]\.layers: layer 'conv9' is not in the traced model"):
        partition(traced, unknown)
    other = plan.model_copy(update={"graph_hash": "sha256:" + "1" * 64})
    with pytest.raises(PlanError, match="graph_hash"):
        partition(traced, other)


def test_units_are_the_same_samples_everywhere_and_reshuffled_per_epoch() -> None:
    data = TensorDataset(torch.arange(10.0).unsqueeze(1), torch.arange(10))
    a, b = Units(data, 3, seed=7), Units(data, 3, seed=7)
    assert a.per_epoch == 3
    assert [a.indices(u).tolist() for u in range(6)] == [b.indices(u).tolist() for u in range(6)]
    first = sorted(i for u in range(3) for i in a.indices(u).tolist())
    assert len(set(first)) == 9  # one epoch: no sample twice, the last partial batch dropped
    assert [a.indices(u).tolist() for u in range(3)] != [a.indices(u).tolist() for u in range(3, 6)]
    inputs, target = a.batch(4)
    assert inputs[0].shape == (3, 1) and target.tolist() == a.indices(4).tolist()
    val = Units(data, 4, seed=0, shuffle=False, pad=True)
    assert val.per_epoch == 3 and [val.real(u) for u in range(3)] == [4, 4, 2]
    assert val.indices(2).tolist() == [8, 9, 0, 1]


def test_weight_versions_share_copies_and_keep_what_vertical_sync_needs() -> None:
    module = torch.nn.Linear(2, 2)
    versions = WeightVersions(module, stash=True)
    n0, p0 = versions.acquire()
    n1, p1 = versions.acquire()
    assert n0 == n1 == 0 and p0 is p1 and versions.held() == 1  # no step between: one shared version
    versions.before_step()  # as the worker does before every step: the held version keeps its memory
    with torch.no_grad():
        module.weight.add_(1.0)  # an optimizer step
    versions.stepped()
    n2, p2 = versions.acquire()
    assert n2 == 1 and versions.held() == 2 and not torch.equal(p2["weight"], p0["weight"])
    p0["weight"].grad = torch.ones(2, 2)
    versions.release(0, p0)
    assert module.weight.grad is not None and torch.equal(module.weight.grad, torch.ones(2, 2))
    versions.release(0, p1)
    assert versions.held() == 1  # version 0 is gone once no unit holds it

    synced = WeightVersions(module, stash=True, history=True)
    synced.acquire(0)
    for _ in range(2):
        synced.before_step()
        synced.stepped()
    n, _ = synced.acquire(1)  # an older version a later unit may still name
    assert n == 1
    with pytest.raises(RunError, match="version 5"):
        synced.acquire(5)


@pytest.mark.timeout(120)
def test_a_model_of_two_inputs_trains_through_three_stages_like_one_process(tmp_path: Path) -> None:
    # Inputs as a tuple (model(x, mask)), an int, a skip past stage 1 and a tuple of tensors on the wire.
    spec = _spec(tmp_path)
    plan = cut_plan(spec, ["b", "getitem"], batch_size=4, schedule="1f1b-flush", microbatches=2)
    results = launch(plan, RunConfig(steps=4, lr=0.3, dtype="float64", record=True, validate=False))
    assert results is not None
    got = {n: t for r in results for n, t in r.params.items()}
    assert spec.model is not None and spec.data is not None
    torch.manual_seed(0)
    model = resolve_model(spec.model).double()
    data = resolve_dataset(spec.data)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    for step in range(4):  # batch 8 = 2 units of 4; 5 such batches per epoch of 40
        order = torch.randperm(40, generator=torch.Generator().manual_seed(0))
        (x, m), y = default_collate([data[int(i)] for i in order[step * 8 : (step + 1) * 8]])
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x.double(), m.double()), y)
        torch.autograd.backward([loss])
        opt.step()
    for name, p in model.named_parameters():
        assert (got[name] - p.detach()).abs().max().item() < 1e-6, name
