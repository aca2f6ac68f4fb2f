"""pdprof's CUDA calibration (pdprof.calibrate), run on the CPU: the same code path, anchored here too."""

from __future__ import annotations

import pandas as pd
import pytest

from pdprof import calibrate as calibration
from pdprof.calibrate import Calibration, calibrate
from pdprof.profiler import ProfileConfig, profile_spec
from shared.spec import RunSpec


def test_factors_are_the_whole_over_its_parts_on_cuda_and_none_elsewhere() -> None:
    got = calibrate("cuda", step_ms=20.0, profiled_ms=28.0, update_whole_ms=0.5, update_sum_ms=1.5)
    assert got.compute == pytest.approx(20.0 / 28.0)
    assert got.update == pytest.approx(0.5 / 1.5)
    assert calibrate("cpu", 20.0, 28.0, 0.5, 1.5) == Calibration()
    # Nothing to scale by: a step or a sum of zero, or no whole update timed, leaves the figures alone.
    assert calibrate("cuda", 0.0, 28.0, None, 1.5) == Calibration()
    assert calibrate("cuda", 20.0, 0.0, 0.5, 0.0) == Calibration()


def test_an_anchored_profile_scales_the_layers_to_the_whole_step_and_keeps_the_raw_samples(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setattr(calibration, "ANCHORED_DEVICES", frozenset({"cuda", "cpu"}))
    spec = RunSpec(model="zoo:resmlp", model_args={"width": 64, "depth": 2}, data="zoo:digits")
    result = profile_spec(ProfileConfig(spec, 32, warmup=1, repeats=3))
    graph = result.graph
    record = graph.graph["calibration"]
    assert record["compute"] != 1.0 and record["update"] != 1.0
    assert "scaled to the whole step" in graph.timing.method
    # Layers, loss and the backward's tail now add up to the directly timed step.
    total = sum(n.forward_ms + n.backward_ms for n in graph.nodes) + sum(
        graph.graph[k] for k in ("loss_forward_ms", "loss_backward_ms", "unattributed_backward_ms")
    )
    assert total == pytest.approx(graph.timing.step_ms, rel=1e-9)
    # The table keeps what was measured: its means, scaled, are the graph's figures.
    path = tmp_path / "t.parquet"
    result.table.to_parquet(path)
    raw = pd.read_parquet(path).groupby(["layer", "phase"])["ms"].mean()
    for node in graph.nodes:
        if node.op == "input":
            continue
        assert node.forward_ms == pytest.approx(raw[(node.id, "forward")] * record["compute"], rel=1e-9)
        assert node.update_ms == pytest.approx(raw.get((node.id, "update"), 0.0) * record["update"], rel=1e-9)
    measured = raw.xs("forward", level="phase").sum() + raw.xs("backward", level="phase").sum()
    assert record["measured_ratio"] == pytest.approx(measured / graph.timing.step_ms, rel=1e-9)


def test_a_cpu_profile_is_not_scaled() -> None:
    spec = RunSpec(model="zoo:resmlp", model_args={"width": 32, "depth": 1}, data="zoo:digits")
    graph = profile_spec(ProfileConfig(spec, 16, warmup=1, repeats=2)).graph
    assert graph.graph["calibration"]["compute"] == 1.0 and graph.graph["calibration"]["update"] == 1.0
    assert graph.timing.layer_sum_ms == pytest.approx(sum(n.forward_ms + n.backward_ms for n in graph.nodes))
