"""pdrun runs ZB-V: two chunks a rank placed in a V, the backward split into B and W, trained exactly like one
process with batch M x batch size.

Real workers (gloo over 127.0.0.1) in float64; the plan's 2 x S chunks are consecutive layer ranges, chunk 1
of worker w at stages[2S - 1 - w], so the last worker's two chunks hand each unit over in its own process.
Compared parameter by parameter with the sequential training of tests/test_run_flush.py.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from pdrun.config import RunConfig
from pdrun.launch import launch
from pdrun.partition import partition
from pdrun.plans import cut_plan
from shared.plan import Plan, save_plan
from shared.resolve import resolve_model
from shared.schedule import chunk_owner
from shared.spec import RunSpec
from shared.tracer import trace
from tests.test_run_flush import RESMLP
from tests.test_run_interleaved import DEEPER, DEEPER_BLOCKS, assert_one_process, run_float64


def zb_v_plan(
    cuts: list[int], workers: int, batch: int, microbatches: int, spec: RunSpec = RESMLP, replicas: int = 1
) -> Plan:
    """``cut_plan``'s 2 x S stages as zb-v's chunks: stage v on the ranks of the worker holding it in the V."""
    flat = cut_plan(spec, cuts, batch_size=batch, schedule="1f1b-flush", microbatches=microbatches)
    assert len(flat.stages) == 2 * workers
    data = flat.model_dump()
    for v, stage in enumerate(data["stages"]):
        w = chunk_owner(workers, v, vshape=True)[0]
        stage["replicas"] = replicas
        stage["ranks"] = [w * replicas + r for r in range(replicas)]
    data.update(schedule="zb-v", virtual_stages=2, world_size=workers * replicas, in_flight=workers)
    return Plan.model_validate(data)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("spec", "cuts", "workers", "replicas", "m"),
    [(RESMLP, [3, 6, 9], 2, 1, 4), (DEEPER, DEEPER_BLOCKS, 4, 1, 8), (RESMLP, [3, 6, 9], 2, 2, 4)],
)
def test_zb_v_equals_sequential(
    tmp_path: Path, spec: RunSpec, cuts: list[int], workers: int, replicas: int, m: int
) -> None:
    batch, steps, seed, lr = 8, 5, 6, 0.2
    plan = zb_v_plan(cuts, workers, batch, m, spec, replicas)
    trace = str(tmp_path / "trace.json")
    cfg = RunConfig(steps=steps, seed=seed, dtype="float64", lr=lr, momentum=0.9, record=True, trace=trace)
    cfg = replace(cfg, validate=replicas > 1)
    results = launch(plan, cfg)
    assert results is not None and len(results) == workers * replicas
    assert_one_process(results, spec, cfg, batch * m, replicas)
    assert all(r.steps == steps and r.units == steps * m for r in results)
    # The loss is on the first worker (the V's last chunk), which reports it.
    last = next(r for r in results if r.stage == len(plan.stages) - 1)
    assert last.rank // replicas == 0 and all(0 < row["loss"] < 10 for row in last.rows)
    for r in results:
        names = [e["name"] for e in r.events]
        own = 2 * steps * m // replicas  # both chunks' units
        assert sum(n.startswith("W") for n in names) == own  # every unit's weight gradients, apart
        assert sum(n.startswith("B") for n in names) == own
        # The V's turn stays in the process: no rank messages itself over a link.
        assert r.rank not in r.links
    if replicas > 1:
        # Validation: each replica scores its own units through the V; the sums over the replicas (each
        # replica's entry) are the whole set's.
        flat = launch(cut_plan(spec, cuts, batch_size=batch, schedule="1f1b-flush", microbatches=m), cfg)
        assert flat is not None
        want_val = next(r for r in flat if r.stage == len(plan.stages) - 1).validation
        got = [r.validation for r in results if r.stage == len(plan.stages) - 1]
        assert len(got) == replicas and all(len(v) == 1 for v in got)
        for v in got:
            assert v[0]["count"] == want_val[0]["count"] > 0 and v[0]["correct"] == want_val[0]["correct"]
            assert v[0]["loss_sum"] == pytest.approx(want_val[0]["loss_sum"], rel=1e-9)


@pytest.mark.timeout(120)
def test_zb_v_relays_a_value_that_skips_chunks_and_equals_sequential() -> None:
    # Chunks [x .. relu] [fc1, act] [fc2] [add ..]: the residual (relu's output) goes from chunk 0 on rank 0
    # to the add in chunk 3 on rank 0, relayed by chunk 1 (rank 1) and chunk 2 (rank 1, the V's turn);
    # its gradient comes back the same way through the split backward (B sends it on, W has none).
    batch, steps, seed, lr, m = 8, 5, 6, 0.2, 4
    plan = zb_v_plan([4, 6, 7], 2, batch, m)
    part = partition(trace(resolve_model(RESMLP.model or "", RESMLP.model_args)), plan)
    assert "relu" in part.sends[(1, 2)] and "relu" in part.sends[(2, 3)]
    cfg = RunConfig(steps=steps, seed=seed, dtype="float64", lr=lr, momentum=0.9, record=True, validate=False)
    results = launch(plan, cfg)
    assert results is not None
    assert_one_process(results, RESMLP, cfg, batch * m, 1)


@pytest.mark.timeout(180)
def test_a_zb_v_run_resumed_from_its_checkpoint_trains_as_one_run(tmp_path: Path) -> None:
    # Each chunk is written as its virtual stage (rank 0's two files are stages 0 and 3) and restored so:
    # 2 steps, a checkpoint and 2 more resumed give the weights of 4 steps in one run.
    path = tmp_path / "plan.json"
    save_plan(zb_v_plan([3, 6, 9], 2, 8, 4), path)

    def run(*args: str) -> dict[str, Any]:
        return run_float64(path, *args)

    run("--steps", "4", "--checkpoint-dir", str(tmp_path / "w"))
    ck = tmp_path / "ck"
    assert run("--steps", "2", "--checkpoint-dir", str(ck))["checkpoint_steps"] == [2]
    resumed = run("--steps", "2", "--checkpoint-dir", str(ck), "--resume")
    assert resumed["resumed_from_step"] == 2 and resumed["checkpoint_steps"] == [4]
    for s in range(4):
        want = torch.load(tmp_path / "w" / "step-000004" / f"stage{s}.pt", weights_only=True)["model"]
        got = torch.load(ck / "step-000004" / f"stage{s}.pt", weights_only=True)["model"]
        assert set(got) == set(want) and all(
            torch.allclose(got[k], want[k], rtol=0, atol=1e-12) for k in want
        )
