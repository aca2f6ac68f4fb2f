"""pdprof profile: a user's model file becomes a layer graph and a profile table, timed honestly."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from pdprof.cli import main
from pdprof.profiler import ProfileConfig, profile_spec
from shared.graph import LayerGraph, load_graph
from shared.spec import RunSpec
from shared.tables import PROFILE_TABLE, load_table
from shared.tracer import trace
from tests.test_profile_usermodel import BRANCHY_EDGES, build

HERE = Path(__file__).resolve().parent


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    """The test models as a user's own file, outside any package."""
    path = tmp_path / "model.py"
    shutil.copy(HERE / "test_profile_usermodel.py", path)
    return path


def pdprof(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_user_file_profiles_into_a_dag_with_sizes_and_a_table(user_file: Path, tmp_path: Path) -> None:
    out, table = tmp_path / "graph.json", tmp_path / "profile.parquet"
    code, stdout, stderr = pdprof(
        "--model",
        f"{user_file}:build",
        "--model-arg",
        "width=16",
        "--data",
        f"{user_file}:data",
        "--batch-size",
        "16",
        "--warmup",
        "1",
        "--repeats",
        "3",
        "-o",
        str(out),
        "--table",
        str(table),
    )
    assert code == 0, stderr
    assert stdout == ""  # with -o, nothing on stdout
    graph = load_graph(out)

    # The nodes and edges are exactly the tracer's (pdrun re-traces and compares the hash).
    traced = trace(build(16))
    assert [n.id for n in graph.nodes] == [layer.name for layer in traced.layers]
    assert {(e.source, e.target) for e in graph.edges} == BRANCHY_EDGES
    assert graph.structure_hash() == traced.structure_hash()

    # Sizes: float32 activations of a batch of 16, parameters of the layer's own module.
    nodes = {n.id: n for n in graph.nodes}
    assert nodes["relu"].activation_bytes == 16 * 16 * 4
    assert nodes["cat"].output_shape == [16, 32]
    assert nodes["stem"].parameter_bytes == (8 * 16 + 16) * 4
    assert nodes["cat"].parameter_bytes == 0
    # The Linear after cat keeps cat's output for backward: charged to cat, which made it (pdprof.sizes).
    assert nodes["cat"].saved_bytes >= nodes["cat"].activation_bytes
    for edge in graph.edges:
        assert edge.bytes == nodes[edge.source].activation_bytes
    assert all(n.forward_ms > 0 for n in graph.nodes if n.op != "input")
    assert all(n.backward_ms > 0 for n in graph.nodes if n.parameter_bytes > 0)

    # What it takes to reproduce the profile.
    assert graph.spec.model == f"{user_file}:build" and graph.spec.model_args == {"width": 16}
    assert graph.spec.data == f"{user_file}:data" and graph.spec.loss == "cross_entropy"
    assert (graph.batch_size, graph.input_shape, graph.device, graph.threads) == (16, [16, 8], "cpu", 1)
    assert graph.writer.torch == torch.__version__.split("+")[0] or graph.writer.torch == torch.__version__
    assert graph.timing is not None and (graph.timing.warmup, graph.timing.repeats) == (1, 3)
    assert "run-queue wait" in graph.timing.method and "glibc malloc thresholds fixed" in graph.timing.method

    # The table holds every sample; the graph's figures are their means (--statistic's default).
    df, meta = load_table(table, PROFILE_TABLE)
    with_params = [n for n in graph.nodes if n.parameter_bytes > 0]
    assert len(df) == (len(graph.nodes) * 2 + len(with_params)) * 3  # forward, backward; update where weights
    assert_figures_are(df, graph, "mean")
    assert graph.timing.method.endswith("; mean of the rounds")
    assert meta["graph_hash"] == graph.structure_hash() and meta["batch_size"] == 16
    assert len(meta["step_ms"]) == 3
    assert "layer sum / whole step" in stderr

    # --statistic median: the medians of the same kind of table.
    code, _, stderr = pdprof(
        *("--model", f"{user_file}:build", "--data", f"{user_file}:data", "--batch-size", "16"),
        *("--warmup", "0", "--repeats", "4", "--statistic", "median", "-o", str(out), "--table", str(table)),
    )
    assert code == 0, stderr
    graph = load_graph(out)
    assert_figures_are(load_table(table, PROFILE_TABLE)[0], graph, "median")
    assert graph.timing is not None and graph.timing.method.endswith("; median of the rounds")


def assert_figures_are(df: pd.DataFrame, graph: LayerGraph, statistic: str) -> None:
    """Every node's forward, backward and update figure is ``statistic`` of its rows in the table."""
    expected = df.groupby(["layer", "phase"])["ms"].agg(statistic)
    differs = df.groupby(["layer", "phase"])["ms"].agg("mean" if statistic == "median" else "median")
    assert any(expected[k] != pytest.approx(differs[k]) for k in expected.index)  # the two tell apart here
    for n in graph.nodes:
        assert expected[(n.id, "forward")] == pytest.approx(n.forward_ms)
        if n.parameter_bytes > 0:
            assert expected[(n.id, "update")] == pytest.approx(n.update_ms)
        assert expected[(n.id, "backward")] == pytest.approx(n.backward_ms)


def test_graph_goes_to_stdout_of_a_real_process(user_file: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from pdprof.cli import main; main()",
            "--model",
            f"{user_file}:build_two",
            "--data",
            f"{user_file}:pairs",
            "--batch-size",
            "8",
            "--warmup",
            "0",
            "--repeats",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={"OMP_NUM_THREADS": "1", "PATH": ""},
    )
    assert proc.returncode == 0, proc.stderr
    graph = LayerGraph.model_validate(json.loads(proc.stdout))
    # The dataset's input is a pair: the model is called as model(a, b).
    assert [n.id for n in graph.nodes if n.op == "input"] == ["a", "b"]
    assert graph.input_shape == [[8, 8], [8, 4]]
    assert graph.node("mul").activation_bytes == 8 * 16 * 4
    assert "pdprof: " in proc.stderr


@pytest.mark.serial  # times the machine: run alone (Makefile)
def test_time_lands_on_the_layer_that_spends_it(user_file: Path) -> None:
    """A layer sleeping 20 ms in forward and one sleeping 30 ms in backward are charged exactly that."""
    spec = RunSpec(model=f"{user_file}:build_sleepy", data=f"{user_file}:data")
    graph = profile_spec(ProfileConfig(spec, batch_size=4, warmup=1, repeats=3)).graph
    nodes = {n.id: n for n in graph.nodes}
    assert 20 <= nodes["slow_fwd"].forward_ms < 35
    assert nodes["slow_fwd"].backward_ms < 5
    assert 30 <= nodes["slow_bwd"].backward_ms < 45
    assert nodes["slow_bwd"].forward_ms < 5
    for name in ("fc", "head"):
        assert nodes[name].forward_ms < 5 and nodes[name].backward_ms < 5
    assert graph.timing is not None and graph.timing.ratio == pytest.approx(1.0, abs=0.1)


@pytest.mark.serial  # times the machine: run alone (Makefile)
def test_layer_sum_agrees_with_a_whole_training_step() -> None:
    """On a conv net, forward+backward summed over layers is within 15% of a directly timed step."""
    spec = RunSpec(
        model="zoo:mnist_cnn",
        model_args={"channels": 16},
        data="zoo:synthetic",
        data_args={"size": 32, "shape": (1, 28, 28)},
    )
    graph = profile_spec(ProfileConfig(spec, batch_size=32, warmup=2, repeats=12)).graph
    timing = graph.timing
    assert timing is not None and timing.step_ms is not None and timing.layer_sum_ms is not None
    assert timing.layer_sum_ms == pytest.approx(sum(n.forward_ms + n.backward_ms for n in graph.nodes))
    assert timing.ratio == pytest.approx(timing.layer_sum_ms / timing.step_ms)
    assert 0.85 <= timing.ratio <= 1.15, (
        f"layer sum {timing.layer_sum_ms:.2f} ms vs step {timing.step_ms:.2f} ms"
    )


def test_grouping_options_reach_the_tracer_and_the_spec(user_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "g.json"
    code, _, stderr = pdprof(
        "--model",
        f"{user_file}:build_gated",
        "--data",
        f"{user_file}:data",
        "--batch-size",
        "4",
        "--leaf-module",
        "Gate",
        "--warmup",
        "0",
        "--repeats",
        "1",
        "-o",
        str(out),
    )
    assert code == 0, stderr
    graph = load_graph(out)
    assert [n.id for n in graph.nodes] == ["x", "fc", "gate", "head"]
    assert graph.spec.trace.leaf_modules == ["Gate"]
    assert graph.node("gate").parameter_bytes == (16 * 16 + 16) * 4


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model", "{f}:build_gated"], "module 'gate' (Gate): data-dependent control flow"),
        (["--model", "{d}/nope.py:build"], "nope.py' not found"),
        (["--model", "zoo:resmlpp"], "did you mean zoo:resmlp"),
        (["--model", "{f}:build", "--device", "bogus"], "--device 'bogus'"),
        (
            ["--model", "{f}:build", "--loss", "mse"],
            "loss 'mse' failed on the model's output [4, 4] and target [4]",
        ),
        (["--model", "{f}:build_two"], "model '{f}:build_two' failed on a batch of shape [4, 8]"),
        (["--model", "{f}:build", "--model-arg", "depth=3"], "unexpected keyword argument 'depth'"),
    ],
)
def test_user_errors_exit_2_with_one_line(user_file: Path, args: list[str], expected: str) -> None:
    fill = {"f": str(user_file), "d": str(user_file.parent)}
    argv = [a.format(**fill) for a in args] + [
        "--data",
        f"{user_file}:data",
        "--batch-size",
        "4",
        "--repeats",
        "1",
        "--concurrent",
        "1",  # the error comes from this process; a sibling trainer would only add its start-up
    ]
    code, stdout, stderr = pdprof(*argv)
    assert code == 2
    assert stdout == ""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("pdprof: error: ")
    assert expected.format(**fill) in lines[0]


def test_threads_are_fixed_recorded_and_restored(user_file: Path) -> None:
    before = torch.get_num_threads()
    spec = RunSpec(model=f"{user_file}:build", data=f"{user_file}:data")
    result = profile_spec(ProfileConfig(spec, batch_size=4, warmup=0, repeats=1, threads=2))
    assert result.graph.threads == 2 and result.table_meta["threads"] == 2
    assert result.graph.timing is not None and "2 thread(s)" in result.graph.timing.method
    assert torch.get_num_threads() == before


def test_the_memory_probe_sees_the_gradients_of_the_whole_model() -> None:
    """The graph records the high-water rise of the model's first steps, which holds every gradient."""
    spec = RunSpec(
        model="zoo:resmlp",
        model_args={"width": 512, "depth": 4},
        data="zoo:synthetic",
        data_args={"size": 256, "shape": (64,)},
    )
    graph = profile_spec(ProfileConfig(spec, batch_size=128, warmup=0, repeats=1)).graph
    params = sum(n.parameter_bytes for n in graph.nodes)
    assert params > 4e6  # four 512 x 512 layers: the rise below is not lost in the noise of a page
    rise = graph.graph["memory_rise_bytes"]
    assert params <= rise < params + 500e6, (params, rise)


def test_the_memory_probe_leaves_out_the_modules_torch_imports_on_a_first_call(tmp_path: Path) -> None:
    """In a fresh process, torch's MultiheadAttention given a key padding mask imports sympy and mpmath
    on its first call (36 MB), which a pdrun worker has imported before its memory mark: the probe
    counted it (46.4 MB for this 565 KB model, 6-7 MB measured per pdrun worker) and now does not."""
    out = tmp_path / "graph.json"
    argv = ["--model", "zoo:transformer_encoder", "--data", "zoo:pydoc_lines", "--batch-size", "16"]
    argv += ["--repeats", "1", "-o", str(out)]
    proc = subprocess.run(
        [sys.executable, "-c", "from pdprof.cli import main; main()", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={"OMP_NUM_THREADS": "1", "PATH": ""},
    )
    assert proc.returncode == 0, proc.stderr
    rise = json.loads(out.read_text())["graph"]["memory_rise_bytes"]
    assert 0 < rise < 25e6, rise  # the model's own step and the process floor: 12 MB measured


def test_the_loss_probe_sees_what_a_wide_loss_adds_beyond_a_gradient() -> None:
    """A 20,000-way cross-entropy on 64 rows: its step saves log-probabilities and makes their gradient
    (5.1 MB each) where a surrogate that only passes a gradient back keeps nothing of its own; the probe
    sees at least one such tensor. On the MNIST CNN's 10 classes the loss adds next to nothing."""
    from pdprof.loss_memory import loss_rise

    head = torch.nn.Linear(8, 20_000)
    x, y = torch.randn(64, 8), torch.randint(0, 20_000, (64,))
    one = 64 * 20_000 * 4
    rise = loss_rise(head, head, (x,), y, torch.nn.functional.cross_entropy, torch.device("cpu"))
    assert one <= rise < 8 * one, (one, rise)
    spec = RunSpec(model="zoo:mnist_cnn", data="zoo:mnist5k")
    graph = profile_spec(ProfileConfig(spec, batch_size=64, warmup=0, repeats=1)).graph
    loss = graph.graph["loss_rise_bytes"]
    assert 0 <= loss < 0.25 * graph.graph["memory_rise_bytes"], graph.graph


BACKWARD_BUG = """
import torch
from torch import nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        y = torch.relu(self.lin(x))
        y.mul_(2.0)  # relu saved y for its backward: the model's own bug
        return y


def build():
    return M()


def data(split="train"):
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(x, x[:, :4].argmax(1))
"""


def test_a_model_whose_own_backward_fails_is_a_user_error(tmp_path: Path) -> None:
    # The traced graph writes out of place (shared/inplace.py) and trains; the user's model does not, and
    # failed in pdprof's timing loop as "internal error", exit 1.
    f = tmp_path / "m.py"
    f.write_text(BACKWARD_BUG)
    code, stdout, stderr = pdprof(
        "--model",
        f"{f}:build",
        "--data",
        f"{f}:data",
        "--batch-size",
        "4",
        "--repeats",
        "1",
        "--concurrent",
        "1",
    )
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and stdout == "" and len(lines) == 1, stderr
    assert lines[0].startswith(
        f"pdprof: error: model '{f}:build' failed in its backward on a batch of shape [4, 8] from '{f}:data': "
        "RuntimeError: one of the variables needed for gradient computation has been modified by an inplace"
    ), lines[0]
