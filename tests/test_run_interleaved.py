"""pdrun runs interleaved 1F1B: V stage modules per rank, trained exactly like one process with batch M x batch size.

Real workers (gloo over 127.0.0.1) in float64; the plan's chunks are consecutive layer ranges,
chunk c of worker w at stages[c * S + w] on w's rank, compared parameter by parameter with the
sequential training of tests/test_run_flush.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from pdrun.cli import main
from pdrun.config import RunConfig
from pdrun.interleaved import ALL_CHUNKS, virtual_instr
from pdrun.launch import launch
from pdrun.metrics import summary
from pdrun.partition import partition
from pdrun.plans import cut_plan
from pdrun.timeline import chrome_trace
from shared.plan import Plan, save_plan
from shared.resolve import resolve_model
from shared.schedule import make_pipeline, worker_program
from shared.spec import RunSpec
from shared.tables import RUN_METRICS, load_table
from shared.tracer import trace
from tests.test_run_flush import RESMLP, assert_same, pipeline_params, sequential

DEEP = RESMLP.model_copy(update={"model_args": {"width": 32, "depth": 4}})
BLOCKS = [4, 8, 12, 16, 20]  # DEEP cut after each residual add: only the block's output crosses
DEEPER = RESMLP.model_copy(update={"model_args": {"width": 32, "depth": 6}})  # 8 chunks: 4 ranks x 2
DEEPER_BLOCKS = [4, 8, 12, 16, 20, 24, 28]


def assert_one_process(results: list[Any], spec: RunSpec, cfg: RunConfig, batch: int, replicas: int) -> None:
    """Every replica's parameters equal one process's training at ``batch`` (float64, 1e-6), which moved."""
    initial, want = sequential(
        spec,
        steps=cfg.steps,
        batch=batch,
        seed=cfg.seed,
        dtype=torch.float64,
        lr=cfg.lr,
        momentum=cfg.momentum,
    )
    for r in range(replicas):  # every replica ends with the same weights, one process's
        assert_same({k: p for x in results if x.replica == r for k, p in x.params.items()}, want, 1e-6)
    assert max((want[k] - initial[k]).abs().max().item() for k in want) > 1e-3


def run_float64(plan: Path, *args: str) -> dict[str, Any]:
    """``pdrun PLAN`` in float64 at the resume tests' settings, quietly, without validation: its JSON summary."""
    common = ["-q", "--no-val", "--dtype", "float64", "--lr", "0.2", "--momentum", "0.9", "--seed", "6"]
    res = CliRunner().invoke(main, [str(plan), *common, *args])
    assert res.exit_code == 0, res.output
    out: dict[str, Any] = json.loads(res.stdout)
    return out


def interleaved_plan(
    cuts: list[int],
    workers: int,
    chunks: int,
    batch: int,
    microbatches: int,
    spec: RunSpec = RESMLP,
    replicas: int = 1,
) -> Plan:
    """``cut_plan``'s V x S stages as chunks: stage v on worker v % S's ranks (``replicas`` of them)."""
    flat = cut_plan(spec, cuts, batch_size=batch, schedule="1f1b-flush", microbatches=microbatches)
    assert len(flat.stages) == workers * chunks
    data = flat.model_dump()
    for v, stage in enumerate(data["stages"]):
        stage["replicas"] = replicas
        stage["ranks"] = [v % workers * replicas + r for r in range(replicas)]
    data.update(
        schedule="interleaved-1f1b", virtual_stages=chunks, world_size=workers * replicas, in_flight=workers
    )
    return Plan.model_validate(data)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("spec", "cuts", "workers", "chunks", "m"),
    [
        (RESMLP, [3, 6, 9], 2, 2, 4),
        (DEEP, BLOCKS, 2, 3, 4),
        (DEEP, BLOCKS, 3, 2, 6),
        (DEEPER, DEEPER_BLOCKS, 4, 2, 8),
    ],
)
def test_interleaved_equals_sequential(
    spec: RunSpec, cuts: list[int], workers: int, chunks: int, m: int
) -> None:
    batch, steps, seed, lr = 8, 5, 6, 0.2
    plan = interleaved_plan(cuts, workers, chunks, batch, m, spec)
    cfg = RunConfig(steps=steps, seed=seed, dtype="float64", lr=lr, momentum=0.9, record=True, validate=False)
    results = launch(plan, cfg)
    assert results is not None and len(results) == workers
    initial, want = sequential(
        spec, steps=steps, batch=batch * m, seed=seed, dtype=torch.float64, lr=lr, momentum=0.9
    )
    assert_same(pipeline_params(results), want, 1e-6)
    assert max((want[k] - initial[k]).abs().max().item() for k in want) > 1e-3
    assert all(r.steps == steps for r in results)
    # The last worker reports the last chunk's stage, so the summary finds its losses.
    last = next(r for r in results if r.stage == len(plan.stages) - 1)
    assert last.rank == workers - 1
    assert [row["step"] for row in last.rows] == list(range(steps)) and all(
        0 < row["loss"] < 10 for row in last.rows
    )
    assert summary(results, plan)["final_loss"] == last.rows[-1]["loss"]
    # A rank's rows count all its chunks' instructions (not the shown chunk's alone): what is left of
    # the wall time besides them is bookkeeping between instructions, not a chunk's compute.
    for r in results:
        timed = sum(row["compute_s"] + row["comm_s"] + row["idle_s"] for row in r.rows)
        assert timed >= 0.8 * sum(row["wall_s"] for row in r.rows), (r.rank, timed)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("workers", "replicas", "m"), [(2, 2, 4), (2, 2, 8)])
def test_replicated_interleaved_equals_sequential(workers: int, replicas: int, m: int) -> None:
    # Each stage's replicas split the step's microbatches (unit u on replica u % n) and all-reduce
    # every chunk's gradient before the step: one process's training with batch M x batch size.
    batch, steps, seed, lr = 8, 4, 6, 0.2
    plan = interleaved_plan([3, 6, 9], workers, 2, batch, m, replicas=replicas)
    cfg = RunConfig(steps=steps, seed=seed, dtype="float64", lr=lr, momentum=0.9, record=True, validate=True)
    results = launch(plan, cfg)
    assert results is not None and len(results) == workers * replicas
    assert_one_process(results, RESMLP, cfg, batch * m, replicas)
    assert all(r.steps == steps and r.units == steps * m for r in results)
    assert all(r.replica_sum for r in results)  # every rank all-reduced with its stage's other replica
    # Validation: each replica scores its own units; the sums over the replicas are the whole set's.
    flat = launch(cut_plan(RESMLP, [3, 6, 9], batch_size=batch, schedule="1f1b-flush", microbatches=m), cfg)
    assert flat is not None
    got = [r.validation for r in results if r.stage == len(plan.stages) - 1]
    want_val = next(r for r in flat if r.stage == 3).validation
    assert len(got) == replicas and all(len(v) == 1 for v in got)
    for v in got:
        assert v[0]["count"] == want_val[0]["count"] > 0 and v[0]["correct"] == want_val[0]["correct"]
        assert v[0]["loss_sum"] == pytest.approx(want_val[0]["loss_sum"], rel=1e-9)


@pytest.mark.timeout(120)
def test_an_interleaved_run_traces_every_instruction_in_its_chunks_thread() -> None:
    plan = interleaved_plan([3, 6, 9], 2, 2, 8, 4)
    steps, m = 2, 4
    results = launch(plan, RunConfig(steps=steps, validate=False, trace="unused.json"))
    assert results is not None
    trace = chrome_trace(results)
    events = trace["traceEvents"]
    assert isinstance(events, list)
    pipe = make_pipeline("interleaved-1f1b", [1, 1], microbatches=m, chunks=2)
    for rank in (0, 1):
        threads = {
            e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name" and e["pid"] == rank
        }
        assert threads == {0: f"chunk 0 (stage {rank})", 1: f"chunk 1 (stage {2 + rank})"}
        boxes = [e for e in events if e["ph"] == "X" and e["pid"] == rank]
        # The rank's stream in its order, each on the chunk that runs it (a receive: the one after the
        # sender's); a step runs on every chunk, one box in each chunk's thread.
        want = []
        for ins in worker_program("interleaved-1f1b", pipe, (rank, 0), steps * m):
            c, _ = virtual_instr(ins, rank, pipe)
            want += [(str(ins), k) for k in ((0, 1) if c == ALL_CHUNKS else (c,))]
        assert [(e["name"], e["tid"]) for e in boxes] == want
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in boxes)
        assert sum(e["name"].startswith("F") for e in boxes) == steps * m * 2


@pytest.mark.timeout(180)
def test_an_interleaved_run_validates_as_the_same_chunks_one_a_rank_do() -> None:
    # Both train as one process does (float64), so their validation passes, after the same steps,
    # see the same weights: the chunked pass must give the pipelined one's sums.
    batch, m, steps = 8, 4, 3
    cfg = RunConfig(steps=steps, seed=6, dtype="float64", lr=0.2, momentum=0.9, validate=True)
    chunked = launch(interleaved_plan([3, 6, 9], 2, 2, batch, m), cfg)
    flat = launch(cut_plan(RESMLP, [3, 6, 9], batch_size=batch, schedule="1f1b-flush", microbatches=m), cfg)
    assert chunked is not None and flat is not None
    got = next(r for r in chunked if r.stage == 3).validation
    want = next(r for r in flat if r.stage == 3).validation
    assert len(got) == len(want) == 1 and got[0]["step"] == want[0]["step"] == steps
    assert got[0]["count"] == want[0]["count"] > 0 and got[0]["correct"] == want[0]["correct"]
    assert got[0]["loss_sum"] == pytest.approx(want[0]["loss_sum"], rel=1e-9)
    assert summary(chunked, interleaved_plan([3, 6, 9], 2, 2, batch, m))["validation"][0]["step"] == steps


@pytest.mark.timeout(120)
def test_an_interleaved_run_draws_the_progress_bar_and_its_validation(tmp_path: Path) -> None:
    # The rank of the last chunk draws the bar from that chunk's rows, as the last stage's worker does.
    path = tmp_path / "plan.json"
    save_plan(interleaved_plan([3, 6, 9], 2, 2, 8, 4), path)
    done = subprocess.run(
        [str(Path(sys.executable).parent / "pdrun"), str(path), "--steps", "3", "--lr", "0.1"],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert "3/3" in done.stderr and "samples/s" in done.stderr, done.stderr
    assert "epoch 0: val loss" in done.stderr, done.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_value_that_skips_chunks_is_relayed_and_training_equals_one_process(replicas: int) -> None:
    # Cuts inside the residual blocks: a block's input goes from chunk 1 to its add in chunk 3, so
    # chunk 2 relays it (and relays its gradient back); the run trains as one process does, every
    # replica of the chunks relaying its own units.
    plan = interleaved_plan([2, 4, 6, 8, 10], 2, 3, 8, 4, replicas=replicas)
    part = partition(trace(resolve_model(RESMLP.model or "", RESMLP.model_args)), plan)
    relayed = set(part.sends[(1, 2)]) & set(part.sends[(2, 3)])
    assert relayed and not {a for a, b in part.sends if b > a + 1}
    batch, steps, seed, lr = 8, 5, 6, 0.2
    cfg = RunConfig(steps=steps, seed=seed, dtype="float64", lr=lr, momentum=0.9, record=True, validate=False)
    results = launch(plan, cfg)
    assert results is not None
    assert_one_process(results, RESMLP, cfg, batch * 4, replicas)


@pytest.mark.timeout(180)
def test_an_interleaved_run_resumed_from_its_checkpoint_trains_as_one_run(tmp_path: Path) -> None:
    # Every chunk is written as its virtual stage and restored as the one-chunk runner restores a
    # stage: 2 steps, a checkpoint, 2 more resumed, give the weights and losses of 4 steps at once.
    path = tmp_path / "plan.json"
    save_plan(interleaved_plan([3, 6, 9], 2, 2, 8, 4), path)
    ck = tmp_path / "ck"

    def run(*args: str) -> dict[str, Any]:
        return run_float64(path, *args)

    run("--steps", "4", "--metrics", str(tmp_path / "whole.parquet"), "--checkpoint-dir", str(tmp_path / "w"))
    first = run("--steps", "2", "--checkpoint-dir", str(ck), "--metrics", str(tmp_path / "a.parquet"))
    assert first["checkpoint_steps"] == [2]
    assert sorted(f.name for f in (ck / "step-000002").glob("*.pt")) == [
        "rank0.pt",
        "rank1.pt",
        "stage0.pt",
        "stage1.pt",
        "stage2.pt",
        "stage3.pt",
    ]
    resumed = run(
        "--steps", "2", "--checkpoint-dir", str(ck), "--resume", "--metrics", str(tmp_path / "b.parquet")
    )
    assert resumed["resumed_from_step"] == 2 and resumed["steps"] == 2 and resumed["checkpoint_steps"] == [4]
    for s in range(4):
        want = torch.load(tmp_path / "w" / "step-000004" / f"stage{s}.pt", weights_only=True)["model"]
        got = torch.load(ck / "step-000004" / f"stage{s}.pt", weights_only=True)["model"]
        assert set(got) == set(want) and all(
            torch.allclose(got[k], want[k], rtol=0, atol=1e-12) for k in want
        )
    whole, _ = load_table(tmp_path / "whole.parquet", RUN_METRICS)
    parts = [load_table(tmp_path / f"{x}.parquet", RUN_METRICS)[0] for x in "ab"]

    def last_losses(df: Any) -> list[float]:
        return [float(v) for v in df[df["stage"] == 3].sort_values("step")["loss"]]

    assert last_losses(parts[0]) + last_losses(parts[1]) == pytest.approx(last_losses(whole), rel=1e-12)
