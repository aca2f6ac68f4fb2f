"""pdrun runs what ``pdplan --schedule auto`` chooses among the second-wave schedules, exactly.

zoo:resmlp is profiled for real, then its layer times are pinned (forward, backward and
update per layer, no loss or step overhead) so that the choice is the same on any machine:
on two workers with free links auto picks 2bw (no flush, a step per 8 units); under a
memory limit that leaves one weight version, zb-h1; on a deeper and wider ResMLP, whose residual
blocks let two chunks per worker send only to the next, interleaved-1f1b. Each plan, as pdplan wrote it, trains
in real workers (gloo, float64) and is compared with its schedule's update rule computed
here: 2BW's W(t+1) = W(t) - lr grad f(W(t-1)) (tests/test_run_2bw.py), and for zb-h1, a
flushing schedule as is interleaved-1f1b, one process on batches of M x the batch size
(tests/test_run_flush.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pdplan.cli import main as pdplan_main
from pdprof.cli import main as pdprof_main
from pdrun.config import RunConfig
from pdrun.launch import launch
from shared.plan import Plan, load_plan
from shared.spec import RunSpec
from tests.test_run_2bw import two_bw_by_hand
from tests.test_run_flush import RESMLP, assert_same, pipeline_params, sequential
from tests.test_run_interleaved import DEEP

BATCH = 8
WIDE = DEEP.model_copy(update={"model_args": {"width": 64, "depth": 4}})


def _profile(path: Path, spec: RunSpec, forward: float, backward: float, update: float) -> Path:
    """``spec`` profiled, with every layer's times pinned (ms), no loss, data or step overhead, zero
    bubble's split as halves, and no process overhead in the memory model."""
    args = [
        "--model",
        spec.model or "",
        "--data",
        spec.data or "",
        "--batch-size",
        str(BATCH),
        "--concurrent",
        "1",
    ]
    for key, value in spec.model_args.items():
        args += ["--model-arg", f"{key}={value}"]
    res = CliRunner().invoke(pdprof_main, [*args, "--warmup", "0", "--repeats", "1", "-o", str(path)])
    assert res.exit_code == 0, res.output
    doc = json.loads(path.read_text())
    for node in doc["nodes"]:
        if node["op"] != "input":
            node.update(
                forward_ms=forward,
                backward_ms=backward,
                update_ms=update if node["parameter_bytes"] > 0 else 0.0,
            )
    for key in doc["graph"]:
        if key.endswith("_ms"):
            doc["graph"][key] = 0.0
    # Zero bubble's B and W as halves of a backward (Qi et al.'s T_B = T_W), not this host's figures.
    doc["graph"]["backward_input_share"] = doc["graph"]["backward_weight_share"] = 0.5
    # The limits below choose among the schedules' own terms; the process overhead (4 MB here, far
    # above them) would be the same for every candidate.
    doc["graph"]["memory_rise_bytes"] = None
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """RESMLP: forward 2 ms, backward 1 ms, update 0.5 ms a layer."""
    return _profile(tmp_path_factory.mktemp("auto_runs") / "graph.json", RESMLP, 2.0, 1.0, 0.5)


def _auto(graph: Path, *extra: str) -> Plan:
    out = graph.with_name(f"plan{len(extra)}.json")
    res = CliRunner().invoke(
        pdplan_main, [str(graph), "--workers", "2", "--bandwidth", "1e12", *extra, "-o", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert "chosen by simulation" in res.stderr
    return load_plan(out)


@pytest.mark.timeout(300)
def test_auto_chooses_2bw_and_pdrun_follows_its_update_rule(graph: Path) -> None:
    plan = _auto(graph)
    assert plan.schedule == "2bw" and plan.alternatives[0].schedule == "2bw"
    steps, seed, lr = 4, 2, 0.3
    results = launch(
        plan, RunConfig(steps=steps, seed=seed, dtype="float64", lr=lr, record=True, validate=False)
    )
    assert results is not None and len(results) == plan.world_size
    want, _ = two_bw_by_hand(steps, BATCH, plan.microbatches, seed, lr)
    assert_same(pipeline_params(results), want, 1e-6)
    assert all(r.steps == steps and r.max_versions <= 2 for r in results)


def _trains_as_one_process(plan: Plan, spec: RunSpec, seed: int, steps: int = 4, lr: float = 0.2) -> None:
    """pdrun on ``plan`` ends with one process's weights after the same steps on M x batch samples (float64)."""
    cfg = RunConfig(steps=steps, seed=seed, dtype="float64", lr=lr, momentum=0.9, record=True, validate=False)
    results = launch(plan, cfg)
    assert results is not None and len(results) == plan.world_size
    initial, want = sequential(
        spec,
        steps=steps,
        batch=BATCH * plan.microbatches,
        seed=seed,
        dtype=torch.float64,
        lr=lr,
        momentum=0.9,
    )
    assert_same(pipeline_params(results), want, 1e-6)
    assert max((want[k] - initial[k]).abs().max().item() for k in want) > 1e-3


@pytest.mark.timeout(300)
def test_auto_under_memory_chooses_zb_h1_and_pdrun_trains_it_as_one_process(graph: Path) -> None:
    # 2bw's second weight version and 1f1b's stash no longer fit; zb-h1 holds one weight version, as
    # 1f1b-flush, and its units' graphs and weight-gradient inputs until their W (55,040 bytes at M=8).
    plan = _auto(graph, "--memory", "5.6e4")
    assert plan.schedule == "zb-h1", [a.schedule for a in plan.alternatives]
    assert all(s.predicted is not None and s.predicted.memory_bytes <= 5.6e4 for s in plan.stages)
    _trains_as_one_process(plan, RESMLP, seed=3)


@pytest.mark.timeout(400)
def test_auto_under_memory_chooses_interleaved_and_pdrun_trains_it_as_one_process(tmp_path: Path) -> None:
    graph = _profile(tmp_path / "graph.json", WIDE, 2.0, 1.0, 0.0)
    # 2bw and 1f1b hold a second weight version (286 kB at the larger stage); of the one-version
    # schedules, two chunks per worker leave the smallest bubble ((S - 1) chunk slots against zb-h1's
    # (S - 1) forwards) at 264 kB, the units and messages of M = 8 in flight included. (At DEEP's width,
    # 32, those activations cost more than the second weight version saves.)
    plan = _auto(graph, "--memory", "2.7e5")
    assert plan.schedule == "interleaved-1f1b" and plan.virtual_stages == 2, [
        a.schedule for a in plan.alternatives
    ]
    assert [s.ranks for s in plan.stages] == [[0], [1], [0], [1]]
    _trains_as_one_process(plan, WIDE, seed=6)
