"""Replicated stages and DAG models on real workers."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pdrun.config import RunConfig
from pdrun.launch import launch
from pdrun.metrics import transport_of
from pdrun.partition import partition
from pdrun.plans import cut_plan, traced_for
from shared.resolve import resolve_dataset
from shared.spec import RunSpec
from tests.test_run_flush import RESMLP, assert_same, pipeline_params, sequential


@pytest.mark.timeout(120)
def test_replicated_stage_trains_and_replicas_stay_identical() -> None:
    # 3 workers: stage 0 on ranks 0 and 1 (units round-robin), stage 1 on rank 2.
    plan = cut_plan(RESMLP, [6], batch_size=16, schedule="1f1b", replicas=[2, 1])
    assert plan.world_size == 3 and plan.in_flight == 2
    # A step of this plan is one round of 2 units (lcm of the replicas, shape.units_per_step): 20 steps, 40 units.
    results = launch(plan, RunConfig(steps=20, lr=0.1, momentum=0.9, record=True, validate=False))
    assert results is not None and len(results) == 3
    r0, r1 = sorted((r for r in results if r.stage == 0), key=lambda r: r.replica)
    assert r0.params.keys() == r1.params.keys() and r0.params
    for name in r0.params:
        assert torch.equal(r0.params[name], r1.params[name]), f"replicas diverged on {name}"
    # Units went round-robin: replica i ran exactly the units u with u % 2 == i.
    assert sorted(v["unit"] for v in r0.versions) == list(range(0, 40, 2))
    assert sorted(v["unit"] for v in r1.versions) == list(range(1, 40, 2))
    # Every rank agrees on the run's 20 steps; stage 1 updated twice in each, each replica of stage 0 once.
    assert {r.steps for r in results} == {20} and {r.units for r in results} == {40}
    assert sorted(r.updates for r in results) == [20, 20, 40]
    last = next(r for r in results if r.stage == 1)
    assert [row["step"] for row in last.rows] == list(range(20))  # one metrics row per step of the run
    losses = [row["loss"] for row in last.rows]
    assert sum(losses[-4:]) / 4 < 0.7 * sum(losses[:4]) / 4, f"loss did not fall: {losses}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("schedule", "transport"), [("1f1b-flush", "auto"), ("1f1b-flush", "gloo"), ("gpipe", "auto")]
)
def test_replicated_stage_with_flush_equals_sequential(schedule: str, transport: str) -> None:
    # auto: the replicas sum their gradients through shared memory (pdrun/transport/shm_sum.py); gloo: all-reduce.
    # gpipe: a replica's last backward in a step is its first unit's (backwards run in reverse), and only
    # that one may start the all-reduce's buckets early.
    plan = cut_plan(RESMLP, [6], batch_size=16, schedule=schedule, microbatches=4, replicas=[2, 1])  # type: ignore[arg-type]
    cfg = RunConfig(steps=10, seed=1, lr=0.2, momentum=0.9, dtype="float64", record=True, validate=False)
    results = launch(plan, replace(cfg, transport=transport))  # type: ignore[arg-type]
    assert results is not None
    assert [transport_of(r) for r in results] == ["shm" if transport == "auto" else "gloo"] * 3
    assert [r.replica_sum for r in results] == [transport.replace("auto", "shm")] * 2 + [None]
    _, want = sequential(RESMLP, steps=10, batch=64, seed=1, dtype=torch.float64, lr=0.2, momentum=0.9)
    assert_same(pipeline_params(results), want, 1e-6)


SKIP_MODEL = """
import torch
from torch import nn


class Skip(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        n = x.size(0)
        h = torch.relu(self.a(x))
        g = self.c(torch.relu(self.b(h)))
        return self.head((g + h).view(n, -1))


def build():
    return Skip()
"""


@pytest.mark.timeout(120)
def test_skip_connection_across_stages_goes_straight_to_its_consumer(tmp_path: Path) -> None:
    path = tmp_path / "skip.py"
    path.write_text(SKIP_MODEL)
    spec = RunSpec(model=f"{path}:build", data="zoo:digits")
    plan = cut_plan(spec, ["b", "c"], batch_size=16, schedule="1f1b-flush", microbatches=3)
    part = partition(traced_for(spec), plan)
    # h crosses from stage 0 to stage 2 directly, with the int n (sent as a tensor); stage 1 never sees them.
    assert set(part.sends) == {(0, 1), (0, 2), (1, 2)}
    assert part.sends[(0, 2)] == ("size", "relu") and part.sends[(0, 1)] == ("relu",)
    results = launch(plan, RunConfig(steps=10, seed=2, lr=0.3, dtype="float64", record=True, validate=True))
    assert results is not None
    _, want = sequential(spec, steps=10, batch=48, seed=2, dtype=torch.float64, lr=0.3)
    assert_same(pipeline_params(results), want, 1e-6)
    # Validation ran through the pipeline: the last stage counted every full batch of the validation split.
    last = next(r for r in results if r.stage == 2)
    assert last.validation and last.validation[0]["count"] == len(
        resolve_dataset("zoo:digits", {"split": "val"})
    )
    assert last.validation[0]["correct"] > 0.3 * last.validation[0]["count"]
