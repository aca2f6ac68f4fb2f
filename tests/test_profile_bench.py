"""bench.bench_profiler: two profiles of one model, compared per layer and against whole steps."""

from __future__ import annotations

import json

import pytest

from bench import bench_profiler
from shared.graph import LayerGraph, Node


def _graph(times: dict[str, tuple[float, float]]) -> LayerGraph:
    nodes = [
        Node(id=k, forward_ms=f, backward_ms=b, activation_bytes=0, parameter_bytes=0)
        for k, (f, b) in times.items()
    ]
    return LayerGraph(batch_size=1, nodes=nodes)


def test_agreement_compares_figures_above_the_threshold() -> None:
    a = _graph({"big": (10.0, 20.0), "small": (0.5, 0.2), "drift": (2.0, 0.1)})
    b = _graph({"big": (10.5, 20.0), "small": (0.9, 0.2), "drift": (3.0, 0.1)})
    result = bench_profiler.agreement(a, b, min_ms=1.0)
    assert result["figures_compared"] == 3  # big.forward, big.backward, drift.forward
    assert result["within_10pct"] == 2
    assert result["max_rel_diff"] == pytest.approx(0.5)
    assert result["worst"][0]["figure"] == "drift.forward"
    layers = bench_profiler.agreement(a, b, min_ms=1.0, per_layer=True)
    # big: 30 vs 30.5; drift: 2.1 vs 3.1; small: 0.7 vs 1.1 (above 1 ms in one run)
    assert layers["figures_compared"] == 3 and layers["within_10pct"] == 1
    assert [w["figure"] for w in layers["worst"]] == ["small", "drift", "big"]


def test_bench_runs_end_to_end_on_a_small_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "bench_profiler",
        "--model",
        "zoo:resmlp",
        "--data",
        "zoo:digits",
        "--batch-size",
        "32",
        "--warmup",
        "1",
        "--repeats",
        "3",
        "--min-ms",
        "0.01",
    ]
    monkeypatch.setattr("sys.argv", argv)
    assert bench_profiler.main() == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["runs"]) == 2 and result["layers"] == 21
    for run in result["runs"]:
        assert run["ratio"] == pytest.approx(run["layer_sum_ms"] / run["step_ms"])
    assert result["agreement"]["figures_compared"] > 0
