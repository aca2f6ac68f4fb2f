"""What a run pays beside forward and backward: each layer's optimizer step (update_ms,
without moving the weights), fetching a batch (data_ms), and neighbours (--concurrent)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from pdprof.cli import main
from pdprof.profiler import ProfileConfig, profile_model
from shared.graph import load_graph
from shared.resolve import cross_entropy
from shared.spec import RunSpec


def _model() -> nn.Module:
    torch.manual_seed(0)
    # A wide layer and a narrow one: the wide one's step must cost more.
    return nn.Sequential(nn.Linear(32, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))


def _profile(model: nn.Module, **kwargs: object) -> dict[str, float]:
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    config = ProfileConfig(RunSpec(model="test"), 64, warmup=1, repeats=5, **kwargs)  # type: ignore[arg-type]
    result = profile_model(model, (x,), y, cross_entropy, config)
    assert set(result.table["phase"]) == {"forward", "backward", "update"}
    assert result.graph.graph["update_overhead_ms"] >= 0
    return {n.id: n.update_ms for n in result.graph.nodes}


@pytest.mark.parametrize(
    ("optimizer", "momentum", "described"), [("sgd", 0.9, "sgd, momentum 0.9"), ("adam", 0.0, "adam")]
)
def test_update_is_timed_on_layers_with_parameters_only(
    optimizer: str, momentum: float, described: str
) -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    config = ProfileConfig(
        RunSpec(model="test"), 64, warmup=1, repeats=5, optimizer=optimizer, momentum=momentum
    )  # type: ignore[arg-type]
    result = profile_model(model, (x,), y, cross_entropy, config)
    update = {n.id: n.update_ms for n in result.graph.nodes}
    params = {n.id for n in result.graph.nodes if n.parameter_bytes > 0}
    assert params and all(update[name] > 0 for name in params)
    assert all(update[name] == 0 for name in update if name not in params)
    assert result.graph.graph["update"] == described
    # The learning rate is zero: profiling leaves the weights as they were.
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_a_bigger_layer_costs_more_to_update() -> None:
    update = _profile(_model(), optimizer="sgd", momentum=0.9)
    # Layer _2 (1024x512) holds 16x the weights of _0 (32x1024) and 100x those of _4 (512x10).
    assert update["_2"] > update["_0"] and update["_2"] > update["_4"]


def test_data_loading_is_timed_and_siblings_run_and_stop() -> None:
    import multiprocessing

    from pdprof.profiler import profile_spec

    spec = RunSpec(model="zoo:resmlp", model_args={"width": 64, "depth": 2}, data="zoo:digits")
    config = ProfileConfig(spec, 32, warmup=1, repeats=3, concurrent=2)
    result = profile_spec(config)
    assert result.graph.graph["data_ms"] > 0
    assert result.graph.graph["concurrent"] == 2
    assert multiprocessing.active_children() == []  # the sibling was stopped and joined


SLOW_DATA = '''
import time
import torch


class Slow(torch.utils.data.Dataset):
    """Every sample read costs 2 ms; with ``table`` the labels also sit in a ``targets`` tensor."""

    def __init__(self, table):
        self.x, self.y = torch.randn(64, 64), torch.randint(0, 10, (64,))
        if table:
            self.targets = self.y

    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.002)
        return self.x[i], self.y[i]


def slow(table=False):
    return Slow(table)
'''


@pytest.mark.parametrize("table", [False, True])
def test_each_stages_fetch_is_timed_the_last_stages_from_the_targets_table_where_there_is_one(
    tmp_path: Path, table: bool
) -> None:
    """data_ms (the inputs), target_ms (the targets alone, the last stage's) and data_target_ms (both,
    a one-stage plan's): reading 8 samples costs at least 16 ms, the table of targets next to nothing."""
    from pdprof.profiler import profile_spec

    (tmp_path / "slow_data.py").write_text(SLOW_DATA)
    spec = RunSpec(
        model="zoo:resmlp",
        model_args={"width": 32, "depth": 1},
        data=f"{tmp_path / 'slow_data.py'}:slow",
        data_args={"table": table},
    )
    extras = profile_spec(ProfileConfig(spec, 8, warmup=1, repeats=3)).graph.graph
    assert extras["data_ms"] >= 16 and extras["data_target_ms"] >= 16
    if table:
        assert extras["target_ms"] < 2
    else:
        assert extras["target_ms"] >= 16


@pytest.mark.parametrize("given", [["--concurrent", "2"], ["--concurrent", "1"], []])
def test_concurrent_cli_option_reaches_the_graph(tmp_path: Path, given: list[str]) -> None:
    import torch

    from pdprof.profiler import auto_concurrent

    out = tmp_path / "g.json"
    args = [
        "--model",
        "zoo:resmlp",
        "--model-arg",
        "width=32",
        "--model-arg",
        "depth=1",
        "--data",
        "zoo:digits",
    ]
    args += ["--batch-size", "16", "--warmup", "0", "--repeats", "2", *given, "-o", str(out)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    # The default, auto: as many workers as this host's cores hold at one thread each.
    expected = int(given[1]) if given else auto_concurrent(torch.device("cpu"), 1)
    assert load_graph(out).graph["concurrent"] == expected


def test_auto_concurrent_fills_the_cores_at_the_threads_each() -> None:
    import torch

    from pdprof.profiler import AUTO_CONCURRENT_MAX, auto_concurrent

    cpu = torch.device("cpu")
    assert auto_concurrent(cpu, 1, cores=2) == 2
    assert auto_concurrent(cpu, 2, cores=8) == 4
    assert auto_concurrent(cpu, 4, cores=2) == 1  # more threads than cores: alone
    assert auto_concurrent(cpu, 1, cores=64) == AUTO_CONCURRENT_MAX
    assert auto_concurrent(torch.device("cuda"), 1, cores=64) == 1  # a GPU worker has its own device


@pytest.mark.parametrize(("choice", "expected"), [("auto", "channels-last"), ("contiguous", "contiguous")])
def test_cnn_profiles_in_the_layout_pdrun_will_run(choice: str, expected: str) -> None:
    from pdprof.profiler import profile_spec

    spec = RunSpec(model="zoo:mnist_cnn", data="zoo:mnist5k")
    result = profile_spec(ProfileConfig(spec, 16, warmup=1, repeats=2, memory_format=choice))  # type: ignore[arg-type]
    assert result.graph.graph["memory_format"] == expected


def test_an_mlp_stays_contiguous_under_auto() -> None:
    assert (
        _profile_graph_extras(
            RunSpec(model="zoo:resmlp", model_args={"width": 32, "depth": 1}, data="zoo:digits")
        )["memory_format"]
        == "contiguous"
    )


def _profile_graph_extras(spec: RunSpec) -> dict[str, object]:
    from pdprof.profiler import profile_spec

    return profile_spec(ProfileConfig(spec, 16, warmup=0, repeats=1)).graph.graph


SIBLING_MODELS = """
import multiprocessing

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, as_dict: bool) -> None:
        super().__init__()
        self.a, self.b, self.as_dict = nn.Linear(16, 16), nn.Linear(16, 4), as_dict

    def forward(self, x):
        y = self.b(torch.relu(self.a(x)))
        return {"logits": y, "features": x} if self.as_dict else y


def dict_out() -> nn.Module:
    return Net(True)


def fails_in_siblings() -> nn.Module:
    if multiprocessing.current_process().name != "MainProcess":
        raise RuntimeError("only a sibling fails")
    return Net(False)


def data():
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(x, x[:, :4].argmax(1))
"""


def _profile_cli(tmp_path: Path, model: str, concurrent: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "sib.py").write_text(SIBLING_MODELS)
    pdprof = str(Path(sys.executable).with_name("pdprof"))
    flags = [
        "--batch-size",
        "16",
        "--warmup",
        "1",
        "--repeats",
        "2",
        "--concurrent",
        concurrent,
        "-o",
        "g.json",
    ]
    return subprocess.run(
        [pdprof, "--model", f"sib.py:{model}", "--data", "sib.py:data", *flags],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_a_model_returning_a_dict_profiles_its_logits_beside_a_sibling(tmp_path: Path) -> None:
    done = _profile_cli(tmp_path, "dict_out", "2")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr  # the sibling calls the model as the profiled process does
    graph = json.loads((tmp_path / "g.json").read_text())
    assert graph["spec"]["trace"]["output"] == "logits"
    assert [n["id"] for n in graph["nodes"] if n["op"] == "call_module"] == ["a", "b"]


def test_a_sibling_that_fails_says_why_in_one_line_at_once(tmp_path: Path) -> None:
    t0 = time.monotonic()
    done = _profile_cli(tmp_path, "fails_in_siblings", "2")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "a sibling process" in lines[0] and "only a sibling fails" in lines[0], lines[0]
    assert time.monotonic() - t0 < 60  # not the sibling start-up's 120 s deadline
    assert not (tmp_path / "g.json").exists()
