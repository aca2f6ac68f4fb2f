"""Fuzzing every loader with broken inputs: each ends in one line naming the file, never a traceback.

Each loader (layer graph, plan, profile table, run metrics, PipeDream profile) is fed at
least 1,000 inputs made by mutating valid artifacts (dropped fields, wrong types, negative
numbers, NaN/inf, duplicate ids, cycles, wrong format versions, truncated or random
bytes). Every input must either load (a mutation can leave it valid) or raise our
``ArtifactError``/``UserError`` whose message is one line starting with the file's name
and naming a field whenever the input is the right kind of document. Any other exception
fails the test. The model/dataset/loss specs are fuzzed in tests/test_specs.py; the
command-line path (exit status 2, one stderr line, no partial output file) is checked at
the end with click's CliRunner.
"""

from __future__ import annotations

import copy
import io
import json
import math
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdplan.cli import main as pdplan_main
from pdprof.cli import main as pdprof_main
from pdprof.pipedream_import import parse_pipedream
from pdrun.cli import main as pdrun_main
from shared.errors import ArtifactError, UserError
from shared.graph import Edge, LayerGraph, Node, Timing, load_graph
from shared.io import read_text
from shared.plan import (
    Cluster,
    Level,
    Plan,
    Prediction,
    Stage,
    StagePrediction,
    check_against_graph,
    load_plan,
)
from shared.spec import RunSpec
from shared.tables import PROFILE_TABLE, RUN_METRICS, TableFormat, load_table, table_bytes
from tests.conftest import PROFILES

PER_LOADER = 1000  # the issue asks for at least this many inputs per loader
FUZZ = settings(
    max_examples=PER_LOADER,
    deadline=None,
    database=None,  # a fixed count per run, not replays of old failures on top
    suppress_health_check=list(HealthCheck),
)

BAD_VALUES: list[Any] = [
    None, True, False, "", "x", "\n", "sha256:zz", -1, -0.5, 0, 10**30, -(10**30), 1e308,
    math.nan, math.inf, -math.inf, [], [1], ["a", "a"], {}, {"a": 1},
]  # fmt: skip

# --- the check every input goes through -----------------------------------------------------


def outcome(load: Callable[[Path], object], path: Path, data: bytes, fmt: str | None) -> str:
    """Load ``path``; "ok", or "error" after checking the error is our clear one-liner."""
    path.write_bytes(data)
    try:
        load(path)
    except UserError as exc:
        text = str(exc)
        assert text.strip(), "an empty error message"
        assert "\n" not in text and "\r" not in text, f"not one line: {text!r}"
        assert text.startswith(f"{path}: "), f"does not name the file: {text!r}"
        assert isinstance(exc, ArtifactError), f"expected an ArtifactError, got {type(exc).__name__}: {text}"
        assert exc.expected.strip(), f"says nothing about what was expected: {text!r}"
        if fmt is not None and _is_document_of(data, fmt):
            # The right kind of document, broken inside: the message must point at a field.
            assert exc.field, f"names no field: {text!r}"
        return "error"
    return "ok"


def _is_document_of(data: bytes, fmt: str) -> bool:
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and doc.get("format") == fmt


def fuzz_loader(
    load: Callable[[Path], object],
    path: Path,
    inputs: st.SearchStrategy[bytes],
    fmt: str | None,
    *,
    at_least_errors: float,
    examples: int = PER_LOADER,
) -> None:
    """Feed ``load`` ``examples`` inputs drawn from ``inputs``, each judged by :func:`outcome` at ``path``."""
    seen: Counter[str] = Counter()

    @settings(FUZZ, max_examples=examples)
    @given(data=inputs)
    def check(data: bytes) -> None:
        seen[outcome(load, path, data, fmt)] += 1

    check()
    total = sum(seen.values())
    assert total >= examples, f"only {total} inputs were tried"
    # Most mutations break the artifact; if almost none is refused, the mutations are not biting.
    assert seen["error"] >= at_least_errors * total, dict(seen)


def _pd_base(name: str, keep: int) -> str:
    """The first ``keep`` nodes of a real PipeDream profile and the edges among them."""
    text = (PROFILES / name).read_text()
    nodes = [line for line in text.splitlines() if line and not line.startswith("\t")][:keep]
    ids = {line.split(" -- ")[0] for line in nodes}
    edges = [
        line
        for line in text.splitlines()
        if line.startswith("\t") and all(p in ids for p in line.strip().split(" -- "))
    ]
    return "\n".join(nodes + edges) + "\n"


_PD_BASES = [_pd_base("alexnet.txt", 40), _pd_base("gnmt.txt", 30), _pd_base("resnet18.txt", 25)]


# --- mutating JSON documents ----------------------------------------------------------------


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield from _paths(value, (*prefix, i))


def _parent(doc: Any, path: tuple[Any, ...]) -> Any:
    for part in path[:-1]:
        doc = doc[part]
    return doc


@st.composite
def mutate_json(draw: st.DrawFn, doc: dict[str, Any], fmt: str) -> bytes:
    """``doc`` with one to three structural mutations, then maybe damaged as bytes."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        op = draw(
            st.sampled_from(["drop", "set", "negate", "duplicate", "cycle", "format", "extra", "swap_type"])
        )
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = _parent(doc, path)
        if op == "drop":
            del parent[path[-1]]
        elif op == "set":
            parent[path[-1]] = copy.deepcopy(draw(st.sampled_from(BAD_VALUES)))
        elif op == "negate":
            numbers = [p for p in paths if isinstance(_parent(doc, p)[p[-1]], (int, float))]
            if numbers:
                where = draw(st.sampled_from(numbers))
                value = _parent(doc, where)[where[-1]]
                _parent(doc, where)[where[-1]] = -abs(value) - draw(st.sampled_from([0, 1, 0.5]))
        elif op == "duplicate":
            lists = [p for p in paths if isinstance(_parent(doc, p)[p[-1]], list) and _parent(doc, p)[p[-1]]]
            if lists:
                where = draw(st.sampled_from(lists))
                items = _parent(doc, where)[where[-1]]
                items.append(copy.deepcopy(draw(st.sampled_from(items))))
        elif (
            op == "cycle"
            and doc.get("edges") is not None
            and isinstance(doc.get("nodes"), list)
            and doc["nodes"]
        ):
            ids = [n.get("id") for n in doc["nodes"] if isinstance(n, dict)]
            if ids:
                a, b = draw(st.sampled_from(ids)), draw(st.sampled_from(ids))
                if isinstance(doc["edges"], list):
                    doc["edges"] += [{"source": a, "target": b}, {"source": b, "target": a}]
        elif op == "format":
            doc["format"] = draw(
                st.sampled_from(
                    [
                        fmt.replace("/1", "/2"),
                        fmt.replace("/1", "/0"),
                        "pdprof.graph/1",
                        "pdplan.plan/1",
                        "",
                        1,
                    ]
                )
            )
        elif op == "extra" and isinstance(parent, dict):
            parent[draw(st.sampled_from(["colour", "Replicas", "a\nb", "\u00e9", ""]))] = 1
        elif op == "swap_type":
            value = parent[path[-1]]
            parent[path[-1]] = str(value) if not isinstance(value, str) else [value]
    text = json.dumps(doc, allow_nan=True)  # NaN/Infinity as Python writes them: a real-world mistake
    data = text.encode("utf-8")
    return draw(damage(data))


@st.composite
def damage(draw: st.DrawFn, data: bytes) -> bytes:
    """Usually ``data`` as it is; sometimes truncated, overwritten in places, or replaced."""
    how = draw(
        st.sampled_from(["keep"] * 6 + ["truncate", "overwrite", "random", "bom", "latin1", "huge", "deep"])
    )
    if how == "truncate" and data:
        return data[: draw(st.integers(0, len(data) - 1))]
    if how == "overwrite" and data:
        out = bytearray(data)
        for _ in range(draw(st.integers(1, 8))):
            out[draw(st.integers(0, len(out) - 1))] = draw(st.integers(0, 255))
        return bytes(out)
    if how == "random":
        return draw(st.binary(max_size=200))
    if how == "bom":
        return b"\xef\xbb\xbf" + data
    if how == "latin1":
        return data + "caf\u00e9".encode("latin-1")
    if how == "huge":  # a number of 5,000 digits where the first digit was
        at = next((i for i, c in enumerate(data) if chr(c).isdigit()), len(data))
        return data[:at] + b"9" * 5000 + data[at + 1 :]
    if how == "deep":  # nesting deeper than any parser's stack
        return b"[" * 100_000 + data + b"]" * 100_000
    return data


# Valid bases to mutate, built once: real PipeDream profiles, a graph with every optional
# field set, and plans of 1 to 4 stages (with replicas) over them. Drawing fresh valid
# artifacts for every input costs ~25 ms each; the round trips in test_artifacts.py cover
# that variety, and here the time goes into the mutations.


def _full_graph() -> LayerGraph:
    nodes = [
        Node(id="input", op="input", forward_ms=0, backward_ms=0, activation_bytes=3072, parameter_bytes=0),
        Node(
            id="blocks.0",
            op="group",
            target="Block",
            forward_ms=1.5,
            backward_ms=3.0,
            activation_bytes=4096,
            activation_parts=[2048.0, 2048.0],
            parameter_bytes=1e6,
            saved_bytes=8192,
            output_shape=[[8, 64], [8, 64]],
            members=["blocks.0.fc1", "blocks.0.fc2"],
        ),
        Node(
            id="add",
            op="call_function",
            target="add",
            forward_ms=0.1,
            backward_ms=0.1,
            activation_bytes=2048,
            parameter_bytes=0,
        ),
        Node(
            id="head",
            target="head",
            forward_ms=0.5,
            backward_ms=1,
            activation_bytes=320,
            parameter_bytes=2580,
            output_shape=[8, 10],
        ),
    ]
    edges = [
        Edge(source="input", target="blocks.0", bytes=3072),
        Edge(source="blocks.0", target="add", bytes=2048),
        Edge(source="input", target="add", bytes=3072),
        Edge(source="add", target="head", bytes=2048),
    ]
    return LayerGraph(
        spec=RunSpec(
            model="zoo:resmlp", model_args={"width": 64, "depth": 1}, data="zoo:digits", loss="cross_entropy"
        ),
        batch_size=8,
        input_shape=[8, 64],
        threads=1,
        timing=Timing(method="perf_counter", warmup=2, repeats=5, step_ms=7.0, layer_sum_ms=6.7, ratio=0.96),
        graph={"note": "hand-built"},
        nodes=nodes,
        edges=edges,
    )


def _graph_bases() -> list[LayerGraph]:
    out = [_full_graph()]
    for name, keep in (("alexnet.txt", 40), ("gnmt.txt", 20), ("resnet18.txt", 15)):
        out.append(parse_pipedream(_pd_base(name, keep), name, batch_size=32))
    return out


def _plan_for(graph: LayerGraph, replicas: list[int], schedule: str) -> Plan:
    order = [str(n) for n in nx.topological_sort(graph.to_networkx())]
    k = len(replicas)
    chunks = [order[i * len(order) // k : (i + 1) * len(order) // k] for i in range(k)]
    stages, rank = [], 0
    for layers, r in zip(chunks, replicas, strict=True):
        prediction = StagePrediction(
            compute_s=0.01 * len(layers), allreduce_s=0.001 * (r - 1), time_s=0.01, memory_bytes=1e6
        )
        stages.append(
            Stage(layers=layers, replicas=r, ranks=list(range(rank, rank + r)), predicted=prediction)
        )
        rank += r
    return Plan(
        graph_hash=graph.structure_hash(),
        graph_source=graph.source,
        spec=graph.spec,
        batch_size=graph.batch_size,
        schedule=schedule,
        microbatches=4 if schedule != "1f1b" else 1,
        in_flight=max(1, rank // replicas[0]),
        world_size=rank,
        cluster=Cluster(levels=[Level(workers=rank, bandwidth=1e9)], memory_bytes=16e9),
        stages=stages,
        predicted=Prediction(
            time_per_minibatch_s=0.05, data_parallel_time_per_minibatch_s=0.08, bottleneck_stage=0
        ),
    )


def _doc(model: LayerGraph | Plan) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(model.model_dump_json())
    return doc


_GRAPHS = _graph_bases()
_GRAPH_DOCS = [_doc(g) for g in _GRAPHS]
_PLAN_DOCS = [
    _doc(_plan_for(g, replicas, schedule))
    for g in _GRAPHS
    for replicas, schedule in (
        ([1], "1f1b"),
        ([1, 1], "gpipe"),
        ([2, 1, 1], "1f1b"),
        ([1, 3, 1, 2], "1f1b-flush"),
    )
]


@st.composite
def graph_inputs(draw: st.DrawFn) -> bytes:
    return draw(mutate_json(draw(st.sampled_from(_GRAPH_DOCS)), "pdprof.graph/1"))


@st.composite
def plan_inputs(draw: st.DrawFn) -> bytes:
    return draw(mutate_json(draw(st.sampled_from(_PLAN_DOCS)), "pdplan.plan/1"))


def test_bases_are_valid(tmp_path: Path) -> None:
    for i, doc in enumerate(_GRAPH_DOCS + _PLAN_DOCS):
        path = tmp_path / f"{i}.json"
        path.write_text(json.dumps(doc))
        assert outcome(load_graph if "nodes" in doc else load_plan, path, path.read_bytes(), None) == "ok"
    for doc in _PLAN_DOCS:
        graph = next(g for g in _GRAPHS if g.structure_hash() == doc["graph_hash"])
        check_against_graph(Plan.model_validate(doc), graph)


def test_layer_graph_loader_fuzz(tmp_path: Path) -> None:
    fuzz_loader(load_graph, tmp_path / "graph.json", graph_inputs(), "pdprof.graph/1", at_least_errors=0.6)


def test_plan_loader_fuzz(tmp_path: Path) -> None:
    fuzz_loader(load_plan, tmp_path / "plan.json", plan_inputs(), "pdplan.plan/1", at_least_errors=0.6)


# --- mutating Parquet tables ----------------------------------------------------------------


def _raw_parquet(df: pd.DataFrame, metadata: bytes | None, duplicate: str | None = None) -> bytes:
    """Parquet bytes written directly with pyarrow: no checks of ours on the way out."""
    table = pa.Table.from_pandas(df, preserve_index=False)
    if duplicate is not None and duplicate in table.column_names:
        table = table.append_column(duplicate, table.column(duplicate))
    meta = dict(table.schema.metadata or {})
    meta.pop(b"pipedream", None)
    if metadata is not None:
        meta[b"pipedream"] = metadata
    table = table.replace_schema_metadata(meta)
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def _profile_frame(rows: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "layer": [f"layers.{i // 2}" for i in range(rows)],
            "phase": ["forward" if i % 2 == 0 else "backward" for i in range(rows)],
            "repeat": np.arange(rows, dtype="int64") % 5,
            "ms": rng.gamma(2.0, 0.5, rows),
            "activation_bytes": rng.integers(0, 2**30, rows),
        }
    )


def _metrics_frame(rows: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "step": np.arange(rows, dtype="int64"),
            "rank": np.zeros(rows, dtype="int64"),
            "loss": 2.3 * np.exp(-0.01 * np.arange(rows)) + rng.normal(0, 0.01, rows),
            "samples_per_s": rng.uniform(100, 200, rows),
        }
    )


_FRAMES = {
    PROFILE_TABLE.name: [_profile_frame(rows, seed) for seed, rows in enumerate((1, 2, 7, 40))],
    RUN_METRICS.name: [_metrics_frame(rows, seed) for seed, rows in enumerate((1, 3, 10, 50))],
}


_TABLES = {
    name: [pa.Table.from_pandas(df, preserve_index=False) for df in frames]
    for name, frames in _FRAMES.items()
}
_RETYPED: dict[str, Callable[[int], pa.Array]] = {
    "str": lambda n: pa.array(["x"] * n),
    "float": lambda n: pa.array([1.5] * n),
    "bool": lambda n: pa.array([True] * n),
    "binary": lambda n: pa.array([b"\x00"] * n),
    "null": lambda n: pa.nulls(n),
}


@st.composite
def table_inputs(draw: st.DrawFn, fmt: TableFormat) -> bytes:
    """A valid table with a column dropped, retyped, duplicated or holding a bad value, or bad metadata.

    Mutated as Arrow tables (pandas' conversion costs ~4 ms a table), then written by
    pyarrow directly: none of our checks on the way out.
    """
    table = draw(st.sampled_from(_TABLES[fmt.name]))
    description: Any = {"format": fmt.name, "writer": {"toolchain": "0.1.0", "torch": None}}
    for _ in range(draw(st.integers(1, 2))):
        op = draw(
            st.sampled_from(["drop", "retype", "negative", "nan", "null", "duplicate", "meta", "keep_valid"])
        )
        column = draw(st.sampled_from(list(fmt.columns)))
        names = table.column_names
        if names.count(column) != 1:  # dropped, or duplicated by an earlier mutation
            continue
        at = names.index(column)
        if op == "drop":
            table = table.drop_columns([column])
        elif op == "retype":
            table = table.set_column(
                at, column, _RETYPED[draw(st.sampled_from(sorted(_RETYPED)))](table.num_rows)
            )
        elif op in ("negative", "nan", "null"):
            value = {
                "negative": -draw(st.sampled_from([1, 2.5, 1e300])),
                "nan": draw(st.sampled_from([math.nan, math.inf, -math.inf])),
                "null": None,
            }[op]
            values = table.column(column).to_pylist()
            values[draw(st.integers(0, len(values) - 1))] = value
            try:
                table = table.set_column(at, column, pa.array(values))
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                table = table.set_column(at, column, pa.array([str(v) for v in values]))
        elif op == "duplicate":
            table = table.append_column(column, table.column(column))
        elif op == "meta":
            description = draw(
                st.sampled_from(
                    [
                        None,
                        b"not json",
                        b"\xff\xfe",
                        [1, 2],
                        {"format": fmt.name.replace("/1", "/2")},
                        {"format": "pdrun.metrics/1" if fmt is PROFILE_TABLE else "pdprof.table/1"},
                        {"writer": {}},
                    ]
                )
            )
    meta = dict(table.schema.metadata or {})
    meta.pop(b"pipedream", None)
    if isinstance(description, bytes):
        meta[b"pipedream"] = description
    elif description is not None:
        meta[b"pipedream"] = json.dumps(description).encode("utf-8")
    buf = io.BytesIO()
    pq.write_table(table.replace_schema_metadata(meta), buf)
    return draw(damage(buf.getvalue()))


def test_profile_table_loader_fuzz(tmp_path: Path) -> None:
    fuzz_loader(
        lambda p: load_table(p, PROFILE_TABLE),
        tmp_path / "profile.parquet",
        table_inputs(PROFILE_TABLE),
        None,
        at_least_errors=0.6,
    )


def test_run_metrics_loader_fuzz(tmp_path: Path) -> None:
    # The same loader as the profile table (load_table) with the other format: fewer inputs here.
    fuzz_loader(
        lambda p: load_table(p, RUN_METRICS),
        tmp_path / "run.parquet",
        table_inputs(RUN_METRICS),
        None,
        at_least_errors=0.5,
        examples=400,
    )


def test_table_value_errors_name_column_and_row(tmp_path: Path) -> None:
    df = pd.DataFrame(
        {"layer": ["a", "b"], "phase": ["forward", "forward"], "repeat": [0, 1], "ms": [1.0, -2.0]}
    )
    path = tmp_path / "p.parquet"
    path.write_bytes(_raw_parquet(df, json.dumps({"format": "pdprof.table/1"}).encode()))
    with pytest.raises(ArtifactError) as info:
        load_table(path, PROFILE_TABLE)
    assert str(info.value) == f"{path}: columns.ms[1]: expected a number >= 0, got -2.0"
    df["ms"] = [math.inf, 1.0]
    path.write_bytes(_raw_parquet(df, json.dumps({"format": "pdprof.table/1"}).encode()))
    with pytest.raises(ArtifactError, match=r"columns\.ms\[0\]: expected a finite number, got inf"):
        load_table(path, PROFILE_TABLE)
    df["ms"] = [1.0, 1.0]
    df["layer"] = ["a", None]
    path.write_bytes(_raw_parquet(df, json.dumps({"format": "pdprof.table/1"}).encode()))
    with pytest.raises(ArtifactError, match=r"columns\.layer\[1\]: expected a string, got None"):
        load_table(path, PROFILE_TABLE)
    # Our own writer refuses the same table, so a bad table never reaches a file.
    with pytest.raises(ArtifactError, match=r"columns\.layer\[1\]"):
        table_bytes(df, PROFILE_TABLE, {})


# --- mutating PipeDream profiles ------------------------------------------------------------

_PD_TOKENS = ["-1", "nan", "inf", "1e400", "", "abc", "0x10", "[1; x]", "[1", "1,5"]


@st.composite
def pipedream_inputs(draw: st.DrawFn) -> bytes:
    lines = draw(st.sampled_from(_PD_BASES)).splitlines()
    for _ in range(draw(st.integers(1, 3))):
        op = draw(
            st.sampled_from(
                ["drop", "duplicate", "number", "separator", "key", "unknown_edge", "reverse_edge", "garbage"]
            )
        )
        i = draw(st.integers(0, len(lines) - 1)) if lines else 0
        if not lines:
            break
        line = lines[i]
        if op == "drop":
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, line)
        elif op == "number" and "=" in line:
            key = draw(
                st.sampled_from(
                    ["forward_compute_time=", "backward_compute_time=", "activation_size=", "parameter_size="]
                )
            )
            head, sep, tail = line.partition(key)
            if sep:
                rest = tail.split(",", 1)
                lines[i] = (
                    head + sep + draw(st.sampled_from(_PD_TOKENS)) + ("," + rest[1] if len(rest) > 1 else "")
                )
        elif op == "separator":
            lines[i] = line.replace(" -- ", draw(st.sampled_from([" - ", "--", " -- -- ", "\t"])), 1)
        elif op == "key":
            lines[i] = line.replace("compute_time", draw(st.sampled_from(["time", "Compute_Time"])), 1)
        elif op == "unknown_edge":
            lines.append(f"\tnode{draw(st.integers(0, 5000))} -- node99999")
        elif op == "reverse_edge" and line.startswith("\t"):
            a, _, b = line.strip().partition(" -- ")
            lines.append(f"\t{b} -- {a}")  # a cycle
        elif op == "garbage":
            lines[i] = draw(st.text(max_size=40))
    return draw(damage("\n".join(lines).encode("utf-8")))


def _load_pipedream(path: Path) -> object:
    return parse_pipedream(read_text(path, "a PipeDream profile"), str(path))


def test_pipedream_and_table_bases_are_valid(tmp_path: Path) -> None:
    for base in _PD_BASES:
        graph = parse_pipedream(base, "base.txt")
        assert len(graph.nodes) >= 20 and graph.edges
    for fmt in (PROFILE_TABLE, RUN_METRICS):
        for df in _FRAMES[fmt.name]:
            path = tmp_path / "t.parquet"
            path.write_bytes(table_bytes(df, fmt, {}))
            pd.testing.assert_frame_equal(load_table(path, fmt)[0], df)


def test_pipedream_loader_fuzz(tmp_path: Path) -> None:
    fuzz_loader(_load_pipedream, tmp_path / "graph.txt", pipedream_inputs(), None, at_least_errors=0.5)


def test_pipedream_errors_name_line_and_field(tmp_path: Path) -> None:
    text = _PD_BASES[0].replace("forward_compute_time=0.539", "forward_compute_time=-1", 1)
    lineno = next(i for i, line in enumerate(text.splitlines(), 1) if "forward_compute_time=-1" in line)
    path = tmp_path / "graph.txt"
    path.write_text(text)
    with pytest.raises(ArtifactError) as info:
        _load_pipedream(path)
    assert str(info.value) == (
        f"{path}: line {lineno}: forward_compute_time: expected a finite non-negative number, got '-1'"
    )


# --- the command lines: exit status 2, one stderr line, no partial output --------------------

CLI_CASES = 75  # per command below; four commands, so a few hundred in all


def _cli_check(result: Any, allow_ok: bool) -> str:
    if result.exit_code == 0 and allow_ok:
        return "ok"
    assert result.exit_code == 2, (result.exit_code, result.stderr, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "error: " in lines[0] and "Traceback" not in result.stderr
    return "error"


def test_cli_show_and_run_refuse_broken_plans_with_one_line(tmp_path: Path) -> None:
    runner = CliRunner()
    seen: Counter[str] = Counter()

    @settings(FUZZ, max_examples=CLI_CASES)
    @given(data=plan_inputs())
    def check(data: bytes) -> None:
        path = tmp_path / "plan.json"
        path.write_bytes(data)
        seen[_cli_check(runner.invoke(pdplan_main, ["show", str(path)]), allow_ok=True)] += 1
        # pdrun gets the same bytes cut short, which no runtime could start from: refused before training.
        result = runner.invoke(pdrun_main, ["-"], input=data[: max(0, len(data) - 2)] or b"{")
        seen[_cli_check(result, allow_ok=False)] += 1

    check()
    assert sum(seen.values()) >= CLI_CASES and seen["error"] >= CLI_CASES // 2


def test_cli_validate_refuses_broken_graphs_with_one_line(tmp_path: Path) -> None:
    runner = CliRunner()
    plan = tmp_path / "plan.json"
    plan.write_text(
        Plan(
            graph_hash="sha256:" + "0" * 64,
            batch_size=1,
            world_size=1,
            stages=[Stage(layers=["x"], ranks=[0])],
        ).model_dump_json()
    )
    seen: Counter[str] = Counter()

    @settings(FUZZ, max_examples=CLI_CASES)
    @given(data=graph_inputs())
    def check(data: bytes) -> None:
        graph = tmp_path / "graph.json"
        graph.write_bytes(data)
        # Whether the graph loads or not, the plan is not for it: exit 2 with one line every time.
        seen[
            _cli_check(
                runner.invoke(pdplan_main, ["validate", str(plan), "--graph", str(graph)]), allow_ok=False
            )
        ] += 1

    check()
    assert seen["error"] >= CLI_CASES


def test_cli_import_pipedream_never_leaves_a_partial_output(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "out.json"
    seen: Counter[str] = Counter()

    @settings(FUZZ, max_examples=CLI_CASES)
    @given(data=pipedream_inputs(), existing=st.booleans())
    def check(data: bytes, existing: bool) -> None:
        src = tmp_path / "bad.txt"
        src.write_bytes(data)
        out.unlink(missing_ok=True)
        if existing:
            out.write_text("previous\n")
        result = runner.invoke(pdprof_main, ["import-pipedream", str(src), "-o", str(out)])
        kind = _cli_check(result, allow_ok=True)
        seen[kind] += 1
        if kind == "ok":
            assert load_graph(out).source == f"pipedream:{src}"
        elif existing:
            assert out.read_text() == "previous\n"  # an existing output is untouched
        else:
            assert not out.exists()
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == []

    check()
    assert seen["error"] >= CLI_CASES // 3


def test_cli_import_pipedream_example_from_the_issue(tmp_path: Path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text("node1 -- Conv -- forward_compute_time=x\n")
    out = tmp_path / "out.json"
    result = CliRunner().invoke(pdprof_main, ["import-pipedream", str(bad), "-o", str(out)])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"pdprof: error: {bad}: line 1: expected figures forward_compute_time=..., backward_compute_time=..., "
        "activation_size=..., parameter_size=...; got 'forward_compute_time=x'"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.txt"]


def test_pipedream_edge_errors_name_their_line(tmp_path: Path) -> None:
    path = tmp_path / "graph.txt"
    path.write_text(_PD_BASES[0] + "\tnode2 -- node404\n")
    lineno = len(_PD_BASES[0].splitlines()) + 1
    with pytest.raises(ArtifactError) as info:
        _load_pipedream(path)
    assert str(info.value) == f"{path}: line {lineno}: edge 'node2' -- 'node404': unknown node 'node404'"
    path.write_text(_PD_BASES[0] + "\tnode3 -- node2\n")  # node2 -> node3 is there already: a cycle
    with pytest.raises(ArtifactError, match=r"edges: the graph has a cycle through node[23] -> node[23]$"):
        _load_pipedream(path)


@pytest.mark.parametrize(
    ("tool", "argv"),
    [
        (pdprof_main, ["--model", "zoo:resmpl", "--data", "zoo:synthetic", "--batch-size", "2", "-o", "{out}/g.json", "--table", "{out}/p.parquet"]),
        (pdprof_main, ["import-pipedream", "{out}/bad.txt", "-o", "{out}/g.json"]),
        (pdrun_main, ["{out}/bad.json", "--steps", "1", "--metrics", "{out}/p.parquet", "--trace", "{out}/t.json"]),
    ],
)  # fmt: skip
def test_a_failing_command_leaves_existing_outputs_untouched(
    tmp_path: Path, tool: Any, argv: list[str]
) -> None:
    (tmp_path / "bad.txt").write_text("node1 -- Input -- forward_compute_time=0.000\n")
    (tmp_path / "bad.json").write_text('{"format": "pdplan.plan/1", "stages": []}')
    outputs = {name: f"previous {name}\n" for name in ("g.json", "p.parquet", "t.json")}
    for name, text in outputs.items():
        (tmp_path / name).write_text(text)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = CliRunner().invoke(tool, [a.format(out=tmp_path) for a in argv])
    # pdprof's progress bar (rich, transient) leaves a blank line on a stderr that is not a
    # terminal, before the error line: reported to its owner; the error itself is one line.
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("pd"), result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing new, no temporary file
    assert {name: (tmp_path / name).read_text() for name in outputs} == outputs


def test_an_output_into_a_missing_directory_is_one_line(tmp_path: Path) -> None:
    src = tmp_path / "graph.txt"
    src.write_text(_PD_BASES[0])
    result = CliRunner().invoke(
        pdprof_main, ["import-pipedream", str(src), "-o", str(tmp_path / "nope" / "g.json")]
    )
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"pdprof: error: {tmp_path}/nope/g.json: cannot write: directory {tmp_path}/nope does not exist"
    ]


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            b'{"format": "pdplan.plan/1", "world_size": ' + b"9" * 5000 + b"}",
            "not readable JSON: Exceeds the limit (4300 digits)",
        ),
        (b"[" * 100_000 + b"]" * 100_000, "JSON nested too deeply to read"),
        (
            json.dumps({**_PLAN_DOCS[0], "batch_size": 7})
            .replace('"batch_size": 7', '"batch_size": 1e999')
            .encode(),
            "batch_size: Input should be a valid integer (got Infinity)",  # an integer field, strictly
        ),
        (b"\xef\xbb\xbf{}", "format: required field is missing"),  # a byte-order mark is skipped
        (b"", "empty input"),
    ],
)
def test_json_edge_inputs_are_one_line(tmp_path: Path, data: bytes, expected: str) -> None:
    path = tmp_path / "plan.json"
    path.write_bytes(data)
    with pytest.raises(ArtifactError) as info:
        load_plan(path)
    assert str(info.value).startswith(f"{path}: ") and expected in str(info.value)
    assert outcome(load_plan, path, data, None) == "error"


def test_table_structure_errors_name_the_column(tmp_path: Path) -> None:
    df = pd.DataFrame({"layer": ["a"], "phase": ["forward"], "repeat": [0], "ms": [1.0]})
    meta = json.dumps({"format": "pdprof.table/1"}).encode()
    path = tmp_path / "p.parquet"
    path.write_bytes(_raw_parquet(df, meta, duplicate="ms"))
    with pytest.raises(ArtifactError) as info:
        load_table(path, PROFILE_TABLE)
    assert str(info.value) == f"{path}: columns.ms: column appears more than once"
    path.write_bytes(_raw_parquet(df.rename(columns={"ms": "m\ns"}), meta, duplicate="m\ns"))
    with pytest.raises(ArtifactError) as info:
        load_table(path, PROFILE_TABLE)
    assert str(info.value) == f'{path}: columns["m\\ns"]: column appears more than once'
    path.write_bytes(_raw_parquet(df, b"[" * 100_000))
    with pytest.raises(ArtifactError, match=r"metadata\.pipedream: not valid JSON"):
        load_table(path, PROFILE_TABLE)
