"""pdrun runs ZB-H1: the split backward (B, then W) trains exactly like one process with batch M x batch size.

Real workers (gloo over 127.0.0.1) in float64, compared parameter by parameter with sequential
training written in tests/test_run_flush.py; the timeline shows that B and W ran apart.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdrun.config import RunConfig
from pdrun.launch import launch
from pdrun.plans import cut_plan
from tests.test_run_flush import RESMLP, assert_same, pipeline_params, sequential


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("cuts", "replicas", "microbatches"), [([5], None, 4), ([3, 6, 9], None, 4), ([5], [1, 2], 4)]
)
def test_zb_h1_equals_sequential(
    tmp_path: Path, cuts: list[int], replicas: list[int] | None, microbatches: int
) -> None:
    batch, steps, seed, lr = 8, 6, 4, 0.2
    plan = cut_plan(
        RESMLP, cuts, batch_size=batch, schedule="zb-h1", microbatches=microbatches, replicas=replicas
    )
    cfg = RunConfig(
        steps=steps,
        seed=seed,
        dtype="float64",
        lr=lr,
        momentum=0.9,
        record=True,
        validate=False,
        trace=str(tmp_path / "trace.json"),
    )
    results = launch(plan, cfg)
    assert results is not None and len(results) == plan.world_size
    initial, want = sequential(
        RESMLP, steps=steps, batch=batch * microbatches, seed=seed, dtype=torch.float64, lr=lr, momentum=0.9
    )
    assert_same(pipeline_params(results), want, 1e-6)
    assert max((want[k] - initial[k]).abs().max().item() for k in want) > 1e-3
    for r in results:
        names = [e["name"] for e in r.events]
        own = steps * microbatches // plan.stages[r.stage].replicas
        assert sum(n.startswith("W") for n in names) == own  # every unit's weight gradients, apart
        assert sum(n.startswith("B") for n in names) == own
