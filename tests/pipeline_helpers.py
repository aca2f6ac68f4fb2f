"""A model through the three tools as a user runs them: pdprof and pdplan on the command line, pdrun's launch.

Shared by the tests of models nobody here wrote (Hugging Face, torch.nn containers): each is
profiled, planned on two workers and run pipelined, then compared with one worker running the
same layers on the same data.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from click.testing import CliRunner

from pdplan.cli import main as pdplan_main
from pdprof.cli import main as pdprof_main
from pdrun.config import RunConfig
from pdrun.launch import launch
from pdrun.result import WorkerResult
from shared.plan import Plan, Stage, load_plan

FLUSH = ["--schedule", "1f1b-flush", "--microbatches", "4"]


def profile_and_plan(
    tmp_path: Path,
    model: str,
    data: str,
    *,
    loss: str | None = None,
    batch: int = 8,
    args: tuple[str, ...] = (),
    data_args: tuple[str, ...] = (),
    retime: Callable[[dict[str, Any]], None] | None = None,
) -> Plan:
    """``pdprof --model M --data D [--loss L] | pdplan --workers 2 --straight`` (1f1b-flush, 4 microbatches).

    ``args`` and ``data_args`` (``K=V``) go to ``--model-arg`` and ``--data-arg``; ``retime``, if
    given, edits the profiled graph's nodes (their measured times) before pdplan reads it, to pin a cut.
    """
    graph, plan = tmp_path / "graph.json", tmp_path / "plan.json"
    # One process profiling: these tests check what trains, not the figures (pdprof --concurrent auto
    # would start a sibling trainer on this host).
    flags = ["--model", model, "--data", data, "--batch-size", str(batch), "--warmup", "0", "--repeats", "1"]
    flags += ["--concurrent", "1"]
    flags += ["--loss", loss] if loss else []
    for a in args:
        flags += ["--model-arg", a]
    for a in data_args:
        flags += ["--data-arg", a]
    res = CliRunner().invoke(pdprof_main, [*flags, "-o", str(graph)])
    assert res.exit_code == 0, res.output
    if retime is not None:
        doc = json.loads(graph.read_text())
        for node in doc["nodes"]:
            retime(node)
        graph.write_text(json.dumps(doc))
    res = CliRunner().invoke(
        pdplan_main,
        [str(graph), "--workers", "2", "--bandwidth", "1e9", "--straight", *FLUSH, "-o", str(plan)],
    )
    assert res.exit_code == 0, res.output
    got = load_plan(plan)
    assert len(got.stages) == 2
    return got


def one_worker(plan: Plan) -> Plan:
    """The same plan with every layer in one stage on one worker."""
    layers = [name for stage in plan.stages for name in stage.layers]
    return plan.model_copy(
        update={"stages": [Stage(layers=layers, replicas=1, ranks=[0])], "world_size": 1, "in_flight": 1}
    )


def run(plan: Plan, **kwargs: Any) -> list[WorkerResult]:
    cfg = RunConfig(seed=2, record=True, validate=False, timeout_s=240.0, **kwargs)
    results = launch(plan, cfg)
    assert results is not None
    return results


def params(results: list[WorkerResult]) -> dict[str, torch.Tensor]:
    """Every stage's final parameters by name (a name held by several stages must agree)."""
    merged: dict[str, torch.Tensor] = {}
    for r in sorted(results, key=lambda r: r.rank):
        for name, value in r.params.items():
            if name in merged:
                torch.testing.assert_close(value, merged[name], rtol=0, atol=0)
            merged[name] = value
    return merged


def assert_pipeline_equals_one_worker(plan: Plan, steps: int = 3) -> None:
    """1f1b-flush on two stages ends with the parameters of one worker running the same plan, float64."""
    piped = run(plan, steps=steps, dtype="float64", lr=0.05, momentum=0.9)
    single = run(one_worker(plan), steps=steps, dtype="float64", lr=0.05, momentum=0.9)
    got, want = params(piped), params(single)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        diff = (got[name] - value).abs().max().item()
        assert diff <= 1e-6, f"{name}: pipelined and one worker differ by {diff:.3g}"
    losses = [row["loss"] for r in single for row in r.rows]
    assert all(0 < x < 20 for x in losses)
    assert losses[-1] < losses[0], "training did not move the weights: the comparison would prove nothing"
    piped_losses = [row["loss"] for r in piped if r.stage == 1 for row in r.rows]
    torch.testing.assert_close(torch.tensor(piped_losses), torch.tensor(losses), rtol=0, atol=1e-9)


def assert_1f1b_loss_falls(plan: Plan, steps: int = 12, lr: float = 3e-3) -> None:
    """Asynchronous 1F1B with weight stashing (one unit per step) on the two stages: the loss falls."""
    results = run(plan, steps=steps, schedule="1f1b", microbatches=1, optimizer="adam", lr=lr)
    losses = [row["loss"] for r in results if r.stage == 1 for row in r.rows]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.9 * first, f"1f1b loss {first:.3f} -> {last:.3f} over {steps} steps"
