"""Round trips of every artifact (layer graph, plan, profile table, run metrics) and atomic writes.

The strategies here build valid artifacts of every shape the contracts allow; the fuzz
tests (tests/test_fuzz_loaders.py) start from them and break them.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path
from typing import Any

import networkx as nx
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.artifact import Writer, dump_json
from shared.errors import ArtifactError, UserError
from shared.graph import Edge, LayerGraph, Node, Timing, graph_hash, load_graph, save_graph
from shared.io import atomic_write_bytes, is_special, write_output
from shared.plan import (
    Cluster,
    Level,
    Plan,
    Prediction,
    Stage,
    StagePrediction,
    batch_of_shape,
    load_plan,
    save_plan,
)
from shared.spec import RunSpec, TraceOptions
from shared.tables import PROFILE_TABLE, RUN_METRICS, load_table, save_table

SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# --- strategies -----------------------------------------------------------------------------

names = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
sizes = st.floats(min_value=0, max_value=1e13, allow_nan=False, allow_infinity=False)
json_scalars = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | sizes | names
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(names, inner, max_size=3),
    max_leaves=6,
)
shapes = (
    st.none()
    | st.lists(st.integers(1, 4096), max_size=4)
    | st.lists(st.lists(st.integers(1, 64), max_size=3), max_size=2)
)


@st.composite
def run_specs(draw: st.DrawFn) -> RunSpec:
    return RunSpec(
        model=draw(st.none() | st.sampled_from(["zoo:mlp", "pkg.models:build", "models/net.py:Net"])),
        model_args=draw(
            st.dictionaries(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), json_values, max_size=3)
        ),
        data=draw(st.none() | st.just("zoo:synthetic")),
        loss=draw(st.sampled_from(["cross_entropy", "mse", "torch.nn:MSELoss"])),
        trace=TraceOptions(
            depth=draw(st.none() | st.integers(0, 5)),
            leaf_modules=draw(
                st.lists(st.sampled_from(["Bottleneck", "TransformerEncoderLayer"]), max_size=2)
            ),
        ),
    )


@st.composite
def layer_graphs(draw: st.DrawFn) -> LayerGraph:
    """A valid layer graph: unique ids, edges only forward in a random order (so a DAG)."""
    ids = draw(st.lists(names, min_size=1, max_size=8, unique=True))
    nodes = [
        Node(
            id=i,
            op=draw(st.sampled_from(["input", "call_module", "call_function", "group", "pipedream"])),
            target=draw(st.text(max_size=20)),
            forward_ms=draw(sizes),
            backward_ms=draw(sizes),
            activation_bytes=draw(sizes),
            activation_parts=draw(st.none() | st.lists(sizes, max_size=3)),
            parameter_bytes=draw(sizes),
            saved_bytes=draw(sizes),
            output_shape=draw(shapes),
            members=draw(st.none() | st.lists(names, max_size=3)),
        )
        for i in ids
    ]
    pairs = [(a, b) for a in range(len(ids)) for b in range(a + 1, len(ids))]
    chosen = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=12)) if pairs else []
    edges = [Edge(source=ids[a], target=ids[b], bytes=draw(sizes)) for a, b in chosen]
    timing = draw(
        st.none()
        | st.builds(
            Timing,
            method=st.sampled_from(["cuda-events", "perf_counter"]),
            warmup=st.integers(0, 10),
            repeats=st.integers(1, 50),
            step_ms=st.none() | sizes,
            layer_sum_ms=st.none() | sizes,
            ratio=st.none() | st.floats(0, 10),
        )
    )
    return LayerGraph(
        writer=Writer(
            toolchain=draw(st.sampled_from(["0.1.0", "1.2.3"])), torch=draw(st.none() | st.just("2.13.0"))
        ),
        source=draw(st.sampled_from(["pdprof", "pipedream:vgg16.txt"])),
        spec=draw(run_specs()),
        batch_size=draw(st.integers(1, 4096)),
        input_shape=draw(shapes),
        device=draw(st.sampled_from(["cpu", "cuda", "unknown"])),
        threads=draw(st.none() | st.integers(1, 64)),
        timing=timing,
        graph=draw(st.dictionaries(names, json_values, max_size=2)),
        nodes=nodes,
        edges=edges,
    )


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    """A valid plan: every layer in one stage, ranks 0..world_size-1 each used once."""
    layers = draw(st.lists(names, min_size=1, max_size=10, unique=True))
    cuts = (
        sorted(draw(st.sets(st.integers(1, max(1, len(layers) - 1)), max_size=len(layers) - 1)))
        if len(layers) > 1
        else []
    )
    bounds = [0, *cuts, len(layers)]
    groups = [layers[a:b] for a, b in itertools.pairwise(bounds) if b > a]
    replicas = [draw(st.integers(1, 3)) for _ in groups]
    world = sum(replicas)
    ranks = draw(st.permutations(list(range(world))))
    stages, at = [], 0
    for group, r in zip(groups, replicas, strict=True):
        predicted = draw(
            st.none()
            | st.builds(StagePrediction, compute_s=sizes, allreduce_s=sizes, time_s=sizes, memory_bytes=sizes)
        )
        stages.append(Stage(layers=group, replicas=r, ranks=list(ranks[at : at + r]), predicted=predicted))
        at += r
    cluster = draw(
        st.none()
        | st.builds(
            Cluster,
            levels=st.lists(
                st.builds(Level, workers=st.integers(1, 16), bandwidth=st.floats(1e3, 1e12)),
                min_size=1,
                max_size=3,
            ),
            memory_bytes=st.none() | st.floats(1, 1e12),
            straight=st.booleans(),
        )
    )
    overall = draw(
        st.none()
        | st.builds(
            Prediction,
            time_per_minibatch_s=sizes,
            data_parallel_time_per_minibatch_s=sizes,
            throughput_samples_per_s=st.none() | sizes,
            bottleneck_stage=st.none() | st.integers(0, len(stages) - 1),
            speedup_over_data_parallel=st.none() | st.floats(0, 100),
        )
    )
    shape = draw(shapes)
    return Plan(
        graph_hash=graph_hash(layers, [])
        if draw(st.booleans())
        else "sha256:" + draw(st.from_regex(r"[0-9a-f]{64}", fullmatch=True)),
        spec=draw(run_specs()),
        # A plan's batch is the one its graph was profiled at (dim 0 of its input tensors), when it says.
        batch_size=batch_of_shape(shape) or draw(st.integers(1, 1024)),
        input_shape=shape,
        schedule=draw(st.sampled_from(["1f1b", "1f1b-flush", "gpipe"])),
        microbatches=draw(st.integers(1, 64)),
        in_flight=draw(st.integers(1, 16)),
        vertical_sync=draw(st.booleans()),
        world_size=world,
        cluster=cluster,
        stages=stages,
        predicted=overall,
    )


@st.composite
def profile_tables(draw: st.DrawFn) -> pd.DataFrame:
    rows = draw(st.integers(0, 12))
    return pd.DataFrame(
        {
            "layer": pd.Series(draw(st.lists(names, min_size=rows, max_size=rows)), dtype=object),
            "phase": pd.Series(
                draw(st.lists(st.sampled_from(["forward", "backward"]), min_size=rows, max_size=rows)),
                dtype=object,
            ),
            "repeat": pd.Series(
                draw(st.lists(st.integers(0, 1000), min_size=rows, max_size=rows)), dtype="int64"
            ),
            "ms": pd.Series(draw(st.lists(sizes, min_size=rows, max_size=rows)), dtype="float64"),
            "activation_bytes": pd.Series(
                draw(st.lists(st.integers(0, 2**40), min_size=rows, max_size=rows)), dtype="int64"
            ),
        }
    )


@st.composite
def run_metrics(draw: st.DrawFn) -> pd.DataFrame:
    rows = draw(st.integers(0, 12))
    return pd.DataFrame(
        {
            "step": pd.Series(
                draw(st.lists(st.integers(0, 10**6), min_size=rows, max_size=rows)), dtype="int64"
            ),
            "rank": pd.Series(
                draw(st.lists(st.integers(0, 64), min_size=rows, max_size=rows)), dtype="int64"
            ),
            # A diverged run's NaN/inf loss is data, recorded as it was.
            "loss": pd.Series(
                draw(st.lists(st.floats(width=64), min_size=rows, max_size=rows)), dtype="float64"
            ),
            "samples_per_s": pd.Series(draw(st.lists(sizes, min_size=rows, max_size=rows)), dtype="float64"),
        }
    )


table_meta = st.dictionaries(
    st.sampled_from(["model", "batch_size", "device", "steps"]), json_scalars, max_size=3
)


def no_temp_files(directory: Path) -> bool:
    return not [p for p in directory.iterdir() if p.name.endswith(".tmp")]


# --- round trips ----------------------------------------------------------------------------


@SETTINGS
@given(graph=layer_graphs())
def test_layer_graph_round_trips(tmp_path: Path, graph: LayerGraph) -> None:
    path = tmp_path / "graph.json"
    save_graph(graph, path)
    loaded = load_graph(path)
    # A relative file spec is read against the graph's folder (shared/spec.py); everything else as written.
    assert loaded == graph.model_copy(update={"spec": graph.spec.anchored(tmp_path)})
    assert loaded.structure_hash() == graph.structure_hash()
    assert path.read_text() == dump_json(graph)
    save_graph(loaded, tmp_path / "again.json")
    assert load_graph(tmp_path / "again.json") == loaded  # once anchored, a spec stays as it is
    (tmp_path / "again.json").unlink()
    assert no_temp_files(tmp_path)


@SETTINGS
@given(graph=layer_graphs())
def test_layer_graph_is_networkx_node_link(graph: LayerGraph) -> None:
    # The contract: networkx reads the file as it is.
    g = nx.node_link_graph(json.loads(dump_json(graph)), edges="edges")
    assert sorted(map(str, g.nodes)) == sorted(n.id for n in graph.nodes)
    assert g.number_of_edges() == len(graph.edges)
    assert nx.is_directed_acyclic_graph(g)
    first = graph.nodes[0]
    assert g.nodes[first.id]["forward_ms"] == first.forward_ms


@SETTINGS
@given(plan=plans())
def test_plan_round_trips(tmp_path: Path, plan: Plan) -> None:
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    loaded = load_plan(path)
    assert loaded == plan.model_copy(update={"spec": plan.spec.anchored(tmp_path)})
    assert path.read_text() == dump_json(plan)
    for rank in range(plan.world_size):
        s, replica = loaded.rank_stage(rank)
        assert loaded.stages[s].ranks[replica] == rank
    assert no_temp_files(tmp_path)


@SETTINGS
@given(df=profile_tables(), meta=table_meta)
def test_profile_table_round_trips(tmp_path: Path, df: pd.DataFrame, meta: dict[str, Any]) -> None:
    path = tmp_path / "profile.parquet"
    save_table(df, path, PROFILE_TABLE, meta)
    loaded, description = load_table(path, PROFILE_TABLE)
    pd.testing.assert_frame_equal(loaded, df)
    assert description["format"] == "pdprof.table/1"
    assert description["writer"]["toolchain"] == Writer().toolchain
    for key, value in meta.items():
        assert description[key] == value
    assert no_temp_files(tmp_path)


@SETTINGS
@given(df=run_metrics(), meta=table_meta)
def test_run_metrics_round_trip(tmp_path: Path, df: pd.DataFrame, meta: dict[str, Any]) -> None:
    path = tmp_path / "run.parquet"
    save_table(df, path, RUN_METRICS, meta)
    loaded, description = load_table(path, RUN_METRICS)
    pd.testing.assert_frame_equal(loaded, df)  # NaN losses compare equal here
    assert description["format"] == "pdrun.metrics/1"
    assert {k: description[k] for k in meta} == meta


def test_tables_are_not_interchangeable(tmp_path: Path) -> None:
    path = tmp_path / "run.parquet"
    save_table(pd.DataFrame({"step": [0, 1], "loss": [2.5, 2.0]}), path, RUN_METRICS, {})
    with pytest.raises(ArtifactError) as info:
        load_table(path, PROFILE_TABLE)
    assert (
        str(info.value)
        == f"{path}: metadata.pipedream.format: expected 'pdprof.table/1', got 'pdrun.metrics/1'"
    )


def test_writing_a_table_without_a_required_column_fails_before_touching_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.parquet"
    path.write_bytes(b"old")
    with pytest.raises(ArtifactError, match=r"columns\.loss: required column is missing"):
        save_table(pd.DataFrame({"step": [0]}), path, RUN_METRICS, {})
    assert path.read_bytes() == b"old"


# --- the format field, the writer, NaN ------------------------------------------------------


def _minimal_graph() -> dict[str, Any]:
    return {
        "format": "pdprof.graph/1",
        "batch_size": 2,
        "nodes": [
            {"id": "a", "forward_ms": 1, "backward_ms": 2, "activation_bytes": 4, "parameter_bytes": 8}
        ],
    }


def test_hand_written_minimal_graph_loads_with_defaults(tmp_path: Path) -> None:
    path = tmp_path / "g.json"
    path.write_text(json.dumps(_minimal_graph()))
    g = load_graph(path)
    assert g.nodes[0].saved_bytes == 0 and g.edges == [] and g.source == "pdprof"
    assert g.writer.toolchain == Writer().toolchain


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        ("pdprof.graph/2", "format: version 'pdprof.graph/2' is not supported by this toolchain"),
        ("pdplan.plan/1", "format: expected 'pdprof.graph/1', got 'pdplan.plan/1'"),
        (7, "format: expected 'pdprof.graph/1', got 7"),
    ],
)
def test_wrong_format_is_named(tmp_path: Path, fmt: Any, expected: str) -> None:
    path = tmp_path / "g.json"
    path.write_text(json.dumps({**_minimal_graph(), "format": fmt}))
    with pytest.raises(ArtifactError) as info:
        load_graph(path)
    assert str(info.value).startswith(f"{path}: {expected}")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_no_artifact_can_hold_nan_or_infinity(bad: float) -> None:
    # JSON cannot spell them (pydantic would write null), so an artifact holding one could
    # never be loaded back: refuse it when it is built, in every float field.
    with pytest.raises(ValueError, match="finite number"):
        Timing(method="x", warmup=0, repeats=1, ratio=bad)
    with pytest.raises(ValueError, match="finite number"):
        Prediction(time_per_minibatch_s=bad, data_parallel_time_per_minibatch_s=1)


def test_validator_errors_name_the_field_they_are_about(tmp_path: Path) -> None:
    data = _minimal_graph()
    data["nodes"].append(dict(data["nodes"][0]))
    path = tmp_path / "g.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ArtifactError) as info:
        load_graph(path)
    assert (info.value.field, info.value.expected) == ("nodes[1].id", "duplicate node id 'a' (also nodes[0])")


def test_odd_keys_are_quoted_so_the_error_stays_one_line(tmp_path: Path) -> None:
    path = tmp_path / "g.json"
    path.write_text(json.dumps({**_minimal_graph(), "bad\nkey": 1}))
    with pytest.raises(ArtifactError) as info:
        load_graph(path)
    assert str(info.value) == f'{path}: ["bad\\nkey"]: unknown field (a typo?)'


# --- atomic writes --------------------------------------------------------------------------


class _Boom(Exception):
    pass


def test_atomic_write_keeps_the_old_file_when_writing_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "plan.json"
    path.write_text("old contents\n")

    def failing_fsync(fd: int) -> None:
        raise _Boom("disk full")

    # A real failure inside the write (after the temporary file exists, before the rename).
    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(_Boom):
        atomic_write_bytes(path, b"new contents that never land\n")
    assert path.read_text() == "old contents\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_atomic_write_replaces_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    path.write_text("x" * 10_000)
    write_output('{"a": 1}', path)
    assert path.read_text() == '{"a": 1}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_writing_into_a_missing_directory_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        atomic_write_bytes(tmp_path / "nope" / "out.json", b"{}")


# --- the examples in docs/artifacts.md ------------------------------------------------------

DOC = Path(__file__).resolve().parent.parent / "docs" / "artifacts.md"


def test_the_documented_examples_load(tmp_path: Path) -> None:
    blocks = DOC.read_text().split("```json\n")[1:]
    docs = [json.loads(block.split("```")[0]) for block in blocks]
    assert [d["format"] for d in docs] == ["pdprof.graph/1", "pdplan.plan/1"]
    graph_path, plan_path = tmp_path / "graph.json", tmp_path / "plan.json"
    graph_path.write_text(json.dumps(docs[0]))
    plan_path.write_text(json.dumps(docs[1]))
    graph = load_graph(graph_path)
    assert [n.id for n in graph.nodes] == ["input", "fc1", "fc2"]
    plan = load_plan(plan_path)
    assert [s.ranks for s in plan.stages] == [[0, 1], [2], [3]]


@pytest.mark.parametrize(
    ("edit", "line"),
    [
        (
            lambda d: d["stages"][1].update(replicas=0),
            "plan.json: stages[1].replicas: Input should be greater than or equal to 1 (got 0)",
        ),
        (lambda d: d.update(colour=1), "plan.json: colour: unknown field (a typo?)"),
    ],
)
def test_the_documented_error_lines_are_what_users_see(tmp_path: Path, edit: Any, line: str) -> None:
    doc = json.loads(DOC.read_text().split("```json\n")[2].split("```")[0])
    edit(doc)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError) as info:
        load_plan(path)
    assert str(info.value) == str(tmp_path / line)
    assert line.split(": ", 1)[1] in DOC.read_text()  # the page shows the same message


@pytest.mark.parametrize(
    ("edit", "line"),
    [
        (lambda d: d.update(batch_size="64"), "batch_size: Input should be a valid integer (got '64')"),
        (lambda d: d.update(microbatches=4.0), "microbatches: Input should be a valid integer (got 4.0)"),
        (
            lambda d: d["stages"][0].update(replicas=True),
            "stages[0].replicas: Input should be a valid integer (got true)",
        ),
        (
            lambda d: d.update(vertical_sync="yes"),
            "vertical_sync: Input should be a valid boolean (got 'yes')",
        ),
        (
            lambda d: d.update(input_shape="garbage"),
            "input_shape: expected a shape: a list of whole numbers, or lists or objects of such (got 'garbage')",
        ),
        (
            lambda d: d.update(input_shape=[32.0, 20]),
            "input_shape: expected a shape: a list of whole numbers, or lists or objects of such (got [32.0, 20])",
        ),
    ],
)
def test_a_hand_edit_of_the_wrong_type_is_refused_not_coerced(tmp_path: Path, edit: Any, line: str) -> None:
    # Lax validation read "64" as 64 and true as 1 replica without a word: the plan that ran was not the
    # file's. A whole number in a float field stays valid (JSON writers differ on 1 vs 1.0).
    doc = json.loads(DOC.read_text().split("```json\n")[2].split("```")[0])
    doc["cluster"]["levels"][0]["bandwidth"] = 1000000000
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    assert load_plan(path).cluster is not None
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError) as info:
        load_plan(path)
    assert str(info.value) == f"{path}: {line}"


def test_nan_in_a_graph_is_named(tmp_path: Path) -> None:
    data = _minimal_graph()
    data["nodes"][0]["forward_ms"] = math.nan
    path = tmp_path / "graph.json"
    path.write_text(json.dumps(data))  # Python writes NaN, as many JSON writers do
    with pytest.raises(ArtifactError) as info:
        load_graph(path)
    assert str(info.value) == f"{path}: nodes[0].forward_ms: Input should be a finite number (got NaN)"


def test_a_full_disk_is_one_line_and_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    path = tmp_path / "graph.json"
    path.write_text("old\n")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(UserError) as info:
        atomic_write_bytes(path, b"new\n")
    assert str(info.value) == f"{path}: cannot write: No space left on device"
    assert path.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["graph.json"]


def test_writing_over_a_directory_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="cannot write: it is a directory"):
        atomic_write_bytes(tmp_path, b"{}")


def test_a_named_pipe_or_device_target_is_written_into_not_replaced(tmp_path: Path) -> None:
    # `-o /dev/null` as root turned the machine's /dev/null into a regular file: the rename meant for
    # regular files replaced the device node. A named pipe stands in for it here (no root needed).
    import stat
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    write_output('{"a": 1}', fifo)
    reader.join(timeout=10)
    assert got == [b'{"a": 1}\n']
    assert stat.S_ISFIFO(fifo.stat().st_mode)  # still the pipe
    assert is_special(
        Path("/dev/null")
    )  # the same path (not written here: a regression would break the host)


def test_a_symlinked_target_keeps_its_link(tmp_path: Path) -> None:
    real = tmp_path / "real.json"
    real.write_text("old\n")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_output("new", link)
    assert link.is_symlink() and real.read_text() == "new\n"
