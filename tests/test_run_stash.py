"""Asynchronous 1f1b: weight stashing and vertical sync, checked per unit on real workers.

Every worker records, per unit, the weight version (and a fingerprint of the weights
themselves) its forward ran on and the one its backward differentiated.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import Any

import pytest
import torch

from pdrun.config import RunConfig
from pdrun.launch import launch
from pdrun.plans import cut_plan
from pdrun.result import WorkerResult
from shared.resolve import resolve_dataset, resolve_loss, resolve_model
from shared.schedule import build_program, max_in_flight
from tests.test_run_flush import RESMLP, assert_same, pipeline_params, sequential, unit_batch

CUTS = [3, 6, 9]  # 4 stages
STEPS = 16
LR, MOMENTUM, SEED = 0.2, 0.5, 0


def _log(results: list[WorkerResult]) -> list[dict[str, Any]]:
    rows = [row for r in results for row in r.versions]
    assert len(rows) == STEPS * len(results), "every worker records every unit's backward"
    return rows


def _run(**kwargs: Any) -> list[WorkerResult]:
    plan = cut_plan(
        RESMLP, CUTS, batch_size=16, schedule="1f1b", vertical_sync=kwargs.pop("vertical_sync", False)
    )
    cfg = RunConfig(
        steps=STEPS, seed=SEED, lr=LR, momentum=MOMENTUM, dtype="float64", record=True, validate=False
    )
    results = launch(plan, replace(cfg, **kwargs))
    assert results is not None
    return results


def stale_sgd(results: list[WorkerResult], batch: int = 16) -> dict[str, torch.Tensor]:
    """PipeDream's update rule, written out sequentially on the whole model, from the recorded versions.

    Unit k's gradient at stage s is taken on that stage's weights after v(k, s) steps (the version the
    worker recorded for its forward) and applied to the latest weights: ``w <- w - lr * grad(w_v)``.
    """
    assert RESMLP.model is not None and RESMLP.data is not None
    torch.manual_seed(SEED)
    model = resolve_model(RESMLP.model, RESMLP.model_args).double()
    data = resolve_dataset(RESMLP.data, RESMLP.data_args)
    loss_fn = resolve_loss(RESMLP.loss)
    stage_of = {name: r.stage for r in results for name in r.params}
    version = {(row["unit"], row["stage"]): row["forward_version"] for r in results for row in r.versions}
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    live = dict(model.named_parameters())
    history = [{n: p.detach().clone() for n, p in live.items()}]  # history[v]: after v steps
    for k in range(STEPS):
        x, y = unit_batch(data, k, batch, SEED, torch.float64)
        used = {n: history[version[(k, stage_of[n])]][n].clone().requires_grad_() for n in live}
        loss = loss_fn(torch.func.functional_call(model, used, (x,)), y)
        grads = torch.autograd.grad(loss, list(used.values()))
        for p, g in zip(live.values(), grads, strict=True):
            p.grad = g
        opt.step()
        history.append({n: p.detach().clone() for n, p in live.items()})
    return history[-1]


@pytest.mark.timeout(120)
def test_stashing_backward_uses_forward_weights() -> None:
    results = _run()
    log = _log(results)
    for row in log:
        assert row["backward_version"] == row["forward_version"], row
        assert row["backward_print"] == row["forward_print"], row
    # Several units were in flight: stage 0 ran unit 3 on version 0 (NOAM = 4), so staleness was real.
    stage0 = {row["unit"]: row["forward_version"] for row in log if row["stage"] == 0}
    assert stage0[3] == 0 and stage0[STEPS - 1] == STEPS - 4
    # At most as many versions as units in flight, and more than one where units overlap.
    program = build_program("1f1b", [1, 1, 1, 1], STEPS, in_flight=4)
    peaks = max_in_flight(program)
    for r in results:
        if peaks[(r.stage, 0)] == 1:
            # One unit at a time (the last stage): nothing steps between its forward and backward, so it
            # stashes nothing, and the prints above show its backward still saw the forward's weights.
            assert r.max_versions == 0
        else:
            assert 1 <= r.max_versions <= peaks[(r.stage, 0)]
    assert next(r for r in results if r.stage == 0).max_versions > 1
    # Without vertical sync, one unit meets different weight versions at different stages.
    per_unit: dict[int, set[int]] = defaultdict(set)
    for row in log:
        per_unit[row["unit"]].add(row["forward_version"])
    assert any(len(v) > 1 for v in per_unit.values()), (
        "vertical sync is off: stages should disagree somewhere"
    )
    # The weights are exactly PipeDream's update rule with those versions.
    assert_same(pipeline_params(results), stale_sgd(results), 1e-6)


@pytest.mark.timeout(120)
def test_without_stashing_the_mismatch_is_detected() -> None:
    results = _run(stash=False)
    log = _log(results)
    mismatched = [row for row in log if row["backward_print"] != row["forward_print"]]
    assert mismatched, "without stashing some backward must see newer weights than its forward"
    assert all(row["backward_version"] > row["forward_version"] for row in mismatched)
    # ... and the weights leave PipeDream's rule: the reference built from the forward versions disagrees.
    want = stale_sgd(results)
    got = pipeline_params(results)
    assert max((got[n] - want[n]).abs().max().item() for n in want) > 1e-4


@pytest.mark.timeout(120)
def test_vertical_sync_runs_each_unit_on_one_version() -> None:
    results = _run(vertical_sync=True)
    log = _log(results)
    per_unit: dict[int, set[int]] = defaultdict(set)
    for row in log:
        assert row["backward_print"] == row["forward_print"], row
        per_unit[row["unit"]].add(row["forward_version"])
    assert all(len(v) == 1 for v in per_unit.values()), {u: v for u, v in per_unit.items() if len(v) > 1}
    assert per_unit[STEPS - 1] == {STEPS - 4}
    # Every unit saw one consistent model: its gradient is the whole model's at version v(k).
    assert_same(pipeline_params(results), stale_sgd(results), 1e-6)


@pytest.mark.timeout(120)
def test_one_unit_in_flight_is_sequential_training() -> None:
    # With NOAM = 1 nothing overlaps: 1f1b through the stashed copies must equal plain SGD.
    plan = cut_plan(RESMLP, [6], batch_size=16, schedule="1f1b", in_flight=1)
    results = launch(
        plan, RunConfig(steps=10, seed=5, lr=0.2, momentum=0.9, dtype="float64", record=True, validate=False)
    )
    assert results is not None
    _, want = sequential(RESMLP, steps=10, batch=16, seed=5, dtype=torch.float64, lr=0.2, momentum=0.9)
    assert_same(pipeline_params(results), want, 1e-6)
