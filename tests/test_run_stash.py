"""Asynchronous 1f1b: weight stashing and vertical sync, checked per unit on real workers.

Every worker records, per unit, the weight version (and a fingerprint of the weights
themselves) its forward ran on and the one its backward differentiated.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch

from pdrun.config import RunConfig
from pdrun.launch import launch
from pdrun.plans import cut_plan
from pdrun.runner import WorkerResult
from shared.schedule import build_program, max_in_flight
from tests.test_run_flush import RESMLP, assert_same, pipeline_params, sequential

CUTS = [3, 6, 9]  # 4 stages
STEPS = 16


def _log(results: list[WorkerResult]) -> list[dict[str, Any]]:
    rows = [row for r in results for row in r.versions]
    assert len(rows) == STEPS * len(results), "every worker records every unit's backward"
    return rows


def _run(**kwargs: Any) -> list[WorkerResult]:
    plan = cut_plan(RESMLP, CUTS, batch_size=16, schedule="1f1b", vertical_sync=kwargs.pop("vertical_sync", False))
    results = launch(plan, RunConfig(steps=STEPS, lr=0.2, record=True, validate=False, **kwargs))
    assert results is not None
    return results


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
        assert 1 <= r.max_versions <= peaks[(r.stage, 0)]
    assert next(r for r in results if r.stage == 0).max_versions > 1
    # Without vertical sync, one unit meets different weight versions at different stages.
    per_unit: dict[int, set[int]] = defaultdict(set)
    for row in log:
        per_unit[row["unit"]].add(row["forward_version"])
    assert any(len(v) > 1 for v in per_unit.values()), "vertical sync is off: stages should disagree somewhere"


@pytest.mark.timeout(120)
def test_without_stashing_the_mismatch_is_detected() -> None:
    log = _log(_run(stash=False))
    mismatched = [row for row in log if row["backward_print"] != row["forward_print"]]
    assert mismatched, "without stashing some backward must see newer weights than its forward"
    assert all(row["backward_version"] > row["forward_version"] for row in mismatched)


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


@pytest.mark.timeout(120)
def test_one_unit_in_flight_is_sequential_training() -> None:
    # With NOAM = 1 nothing overlaps: 1f1b through the stashed copies must equal plain SGD.
    plan = cut_plan(RESMLP, [6], batch_size=16, schedule="1f1b", in_flight=1)
    results = launch(plan, RunConfig(steps=10, seed=5, lr=0.2, momentum=0.9, dtype="float64", record=True, validate=False))
    assert results is not None
    _, want = sequential(RESMLP, steps=10, batch=16, seed=5, dtype=torch.float64, lr=0.2, momentum=0.9)
    assert_same(pipeline_params(results), want, 1e-6)
