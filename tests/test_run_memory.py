"""pdrun records each worker's peak memory, and the plan's memory model predicts it (MNIST CNN)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdplan.build import PlanConfig, with_memory, worker_peaks
from pdplan.more_schedules import plan_for
from pdrun.config import RunConfig
from pdrun.launch import launch
from pdrun.metrics import frame, save, summary
from pdrun.plans import cut_plan
from shared.graph import LayerGraph, load_graph
from shared.plan import Cluster, Level, Prediction
from shared.spec import RunSpec
from shared.tables import RUN_METRICS, load_table

MNIST = RunSpec(model="zoo:mnist_cnn", model_args={"channels": 16}, data="zoo:mnist5k")
# The model holds weights, gradients, optimizer state and saved activations, and each process what
# pdprof's memory probe measured beyond the whole model's tensors (library code, kernel caches,
# the allocator's slack: pdplan.memory). A stage's own share of that overhead is not the whole
# model's: over seven models' stages (bench_predict) measured / predicted ran 0.70-1.40, where
# without the overhead it ran 1.5-7.6; here, under make test's load, stage 1 measured 0.56 once.
# Stage 0 (conv1's 3.2 MB outputs and their gradients) is a known under-prediction (docs/pdplan.md):
# 1.24-1.43 alone, 1.55 once under make test's load (2026-12-03), 2.03 once in a fresh clone's CI
# (2026-12-08): glibc's heap placement of its interleaved 3.2, 1.6 and 0.8 MB blocks, which moves from run
# to run (issue 17; the heap spans 42.9 MB for 19.8 MB of live blocks). Stated band: 0.5-2.5 (a missing
# overhead reads 3.6-4.2 on stage 0, one charged twice below 0.5).
LOW, HIGH = 0.5, 2.5


def _profile(tmp_path: Path) -> LayerGraph:
    # In a process of its own, as a user runs pdprof: the memory probe counts from a fresh heap, where
    # this test process has paged in and freed what every earlier test ran.
    out = tmp_path / "graph.json"
    subprocess.run(
        [
            str(Path(sys.executable).parent / "pdprof"),
            *("--model", "zoo:mnist_cnn", "--model-arg", "channels=16", "--data", "zoo:mnist5k"),
            *("--batch-size", "64", "--warmup", "1", "--repeats", "2", "-o", str(out)),
        ],
        check=True,
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=120,
    )
    return load_graph(out)


@pytest.mark.timeout(240)
def test_two_stage_run_records_peak_memory_near_the_prediction(tmp_path: Path) -> None:
    graph = _profile(tmp_path)
    plan = cut_plan(MNIST, ["conv2"], batch_size=64, schedule="1f1b-flush", microbatches=4)
    plan = plan.model_copy(
        update={"cluster": Cluster(levels=[Level(workers=2, bandwidth=1e9)], optimizer="momentum")}
    )
    plan = with_memory(plan, graph)
    results = launch(plan, RunConfig(steps=6, seed=0, momentum=0.9))
    assert results is not None
    table = frame(results)
    assert (table["peak_memory_bytes"] > 0).all()
    out = summary(results, plan)
    memory = out["memory"]
    assert [m["stage"] for m in memory] == [0, 1]
    for m in memory:
        assert set(m["measured_bytes"]) == set(plan.stages[m["stage"]].ranks)  # one figure per rank
        assert m["predicted_bytes"] > 0
        measured = max(m["measured_bytes"].values())
        assert LOW <= measured / m["predicted_bytes"] <= HIGH, memory
    # A run of another schedule than the plan's (pdrun --schedule gpipe) has no prediction beside it:
    # the plan's is for its 1f1b-flush, and the summary says so rather than compare the two.
    ran = plan.model_copy(update={"schedule": "gpipe"})
    other = summary(results, ran, plan)
    assert all(m["predicted_bytes"] is None and m["measured_over_predicted"] is None for m in other["memory"])
    assert other["predicted_samples_per_s"] is None
    assert other["predicted_for"].startswith(
        "1f1b-flush, 4 microbatches: plan again with pdplan --schedule gpipe"
    )
    assert "predicted_for" not in summary(results, plan, plan)
    # A plan whose layers were moved by hand after pdplan predicted it (its stamp no longer matches)
    # has no prediction beside the run either: before, its old figures stood there without a word.
    predicted = Prediction(time_per_minibatch_s=0.01, data_parallel_time_per_minibatch_s=0.02)
    stamped = plan.model_copy(update={"predicted": predicted}).with_layout()
    assert "predicted_for" not in summary(results, stamped, stamped)
    moved = [stamped.stages[0].layers[:-1], [stamped.stages[0].layers[-1], *stamped.stages[1].layers]]
    edited = stamped.model_copy(
        update={
            "stages": [s.model_copy(update={"layers": m}) for s, m in zip(stamped.stages, moved, strict=True)]
        }
    )
    assert edited.edited_since_predicted() and not stamped.edited_since_predicted()
    stale = summary(results, edited, edited)
    assert (
        all(m["predicted_bytes"] is None for m in stale["memory"])
        and stale["predicted_samples_per_s"] is None
    )
    assert stale["predicted_for"].startswith(
        "the layout pdplan wrote: the plan was edited after pdplan predicted it"
    )
    # The column round-trips through the metrics file; a file without it (older pdrun) still loads.
    path = tmp_path / "run.parquet"
    save(results, str(path), plan, {})
    loaded, _ = load_table(path, RUN_METRICS)
    assert math.isclose(loaded["peak_memory_bytes"].max(), table["peak_memory_bytes"].max())
    save_old = tmp_path / "old.parquet"
    from shared.tables import save_table

    save_table(table.drop(columns=["peak_memory_bytes"]), save_old, RUN_METRICS, {})
    assert "peak_memory_bytes" not in load_table(save_old, RUN_METRICS)[0].columns


@pytest.mark.timeout(240)
def test_an_interleaved_rank_records_its_peak_beside_its_chunks_predicted_sum(tmp_path: Path) -> None:
    # A rank is one process holding its V chunks: the summary compares its one peak with the sum of
    # its chunks' predictions, which is how pdplan predicts a worker (pdplan.build.worker_peaks).
    graph = _profile(tmp_path)
    config = PlanConfig(
        workers=(2,), bandwidths=(1e9,), schedule="interleaved-1f1b", microbatches=4, optimizer="momentum"
    )
    plan = plan_for(graph, config, 2)
    results = launch(plan, RunConfig(steps=6, seed=0, momentum=0.9, validate=False))
    assert results is not None
    assert (frame(results)["peak_memory_bytes"] > 0).all()
    out = summary(results, plan, plan)
    memory = out["memory"]
    assert [(m["stage"], m["chunks"]) for m in memory] == [(0, [0, 2]), (1, [1, 3])]
    assert plan.predicted is not None and plan.predicted.simulated_time_per_minibatch_s
    simulated = plan.predicted.simulated_time_per_minibatch_s
    assert out["predicted_samples_per_s"] == pytest.approx(plan.batch_size / simulated, rel=1e-12)
    for m, predicted in zip(memory, worker_peaks(plan), strict=True):
        assert set(m["measured_bytes"]) == set(plan.stages[m["stage"]].ranks)
        assert m["predicted_bytes"] == pytest.approx(predicted, rel=1e-12)
        assert LOW <= max(m["measured_bytes"].values()) / predicted <= HIGH, memory


def test_a_worker_over_the_plans_memory_limit_is_said() -> None:
    from pdrun.metrics import over_limit_note

    memory = [
        {"stage": 0, "measured_bytes": {"0": 50.3e6}},
        {"stage": 1, "measured_bytes": {"1": 19.0e6, "2": 26.5e6}},
    ]
    note = over_limit_note({"memory_limit_bytes": 26e6, "memory": memory})
    assert note is not None and note.startswith(
        "note: measured peak memory over the plan's --memory 26.0 MB per worker: stage 0 rank 0 50.3 MB, "
        "stage 1 rank 2 26.5 MB ("
    ), note
    assert over_limit_note({"memory_limit_bytes": 60e6, "memory": memory}) is None
    assert over_limit_note({"memory_limit_bytes": None, "memory": memory}) is None


PEAK_READS = """
import torch
from pdrun import peak
from pdrun.step_rows import StepRows

peak.READ_EVERY_S = 60.0  # however slow the host, the second read below comes within it
peak.start(torch.device("cpu"), torch.nn.Linear(4, 4))
first = peak.peak_bytes()
big = torch.ones(64 * 2**20 // 4)  # 64 MB touched
cached = peak.peak_bytes()  # within READ_EVERY_S of the first read: its figure, not the 64 MB
rows = StepRows()
rows.append({"step": 0, "peak_memory_bytes": cached})
peak.settle(rows)  # the last row is read afresh
print(first, cached, rows[-1]["peak_memory_bytes"], peak.peak_bytes(fresh=True))
"""


def test_the_peak_is_read_at_most_every_few_ms_and_the_last_row_afresh() -> None:
    # Reading /proc/self/status every step took 12% of a small model's 0.5 ms steps.
    out = subprocess.run(
        [sys.executable, "-c", PEAK_READS], capture_output=True, text=True, check=True, timeout=60
    )
    first, cached, settled, fresh = map(float, out.stdout.split())
    assert cached == first
    assert settled >= first + 60e6 and fresh >= settled
