"""Plans that do not fit: refused on load or against their graph, each message naming stage and layer.

The graph is a diamond with a skip (``input -> a -> {b, c} -> d -> head``), the shape where
a hand-edited stage most easily stops being convex. Every refusal is checked both in
process and through ``pdplan validate PLAN --graph GRAPH`` (exit 2, exactly that line).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from pdplan.cli import main as pdplan_main
from shared.errors import ArtifactError, PlanError
from shared.graph import Edge, LayerGraph, Node, save_graph
from shared.plan import Plan, Stage, check_against_graph, load_plan, save_plan

LAYERS = ["input", "a", "b", "c", "d", "head"]
EDGES = [("input", "a"), ("a", "b"), ("a", "c"), ("b", "d"), ("c", "d"), ("d", "head")]


def diamond(edges: list[tuple[str, str]] = EDGES, layers: list[str] = LAYERS) -> LayerGraph:
    return LayerGraph(
        batch_size=4,
        nodes=[
            Node(
                id=n,
                op="input" if n == "input" else "call_module",
                forward_ms=1,
                backward_ms=2,
                activation_bytes=64,
                parameter_bytes=16,
            )
            for n in layers
        ],
        edges=[Edge(source=s, target=t, bytes=64) for s, t in edges],
    )


def plan_doc(
    stages: list[dict[str, Any]], graph: LayerGraph | None = None, world_size: int | None = None
) -> dict[str, Any]:
    """A plan as a person would edit it: plain JSON, no validation on the way."""
    return {
        "format": "pdplan.plan/1",
        "graph_hash": (graph or diamond()).structure_hash(),
        "batch_size": 4,
        "world_size": world_size if world_size is not None else sum(len(s["ranks"]) for s in stages),
        "stages": [{"replicas": len(s["ranks"]), **s} for s in stages],
    }


GOOD = [
    {"layers": ["input", "a"], "ranks": [0]},
    {"layers": ["b", "c"], "replicas": 2, "ranks": [1, 2]},
    {"layers": ["d", "head"], "ranks": [3]},
]


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    graph = tmp_path / "graph.json"
    save_graph(diamond(), graph)
    return tmp_path / "plan.json", graph


def validate_cli(plan: Path, graph: Path) -> tuple[int, list[str]]:
    result = CliRunner().invoke(pdplan_main, ["validate", str(plan), "--graph", str(graph)])
    return result.exit_code, result.stderr.splitlines()


def test_a_fitting_plan_is_accepted(files: tuple[Path, Path]) -> None:
    plan, graph = files
    plan.write_text(json.dumps(plan_doc(GOOD)))
    check_against_graph(load_plan(plan), diamond(), str(plan), world_size=4)
    code, lines = validate_cli(plan, graph)
    assert code == 0
    assert lines == [f"ok: {plan}: 3 stages on 4 ranks cover all 6 layers of {graph}"]


# --- refused against the graph (PlanError) --------------------------------------------------

AGAINST_GRAPH = {
    "another model": (
        GOOD,
        diamond(layers=[*LAYERS[:-1], "classifier"], edges=[*EDGES[:-1], ("d", "classifier")]),
        "graph_hash: the plan was made for another graph (sha256:{plan_hash}...), this one is sha256:{graph_hash}... "
        "(stages[2] holds layer 'head', which this graph does not have); re-run pdplan on this graph",
    ),
    "same layers, other edges": (
        GOOD,
        diamond(edges=[*EDGES, ("input", "d")]),
        "graph_hash: the plan was made for another graph (sha256:{plan_hash}...), this one is sha256:{graph_hash}... "
        "(the layers match but the edges between them differ); re-run pdplan on this graph",
    ),
    "missing layer": (
        [
            {"layers": ["input", "a"], "ranks": [0]},
            {"layers": ["b"], "ranks": [1]},
            {"layers": ["d", "head"], "ranks": [2]},
        ],
        None,
        "stages: layer 'c' is in no stage (its neighbours are in stage(s) [0, 2]); every layer needs one",
    ),
    "renamed layer": (
        [
            {"layers": ["input", "a"], "ranks": [0]},
            {"layers": ["b", "C"], "ranks": [1]},
            {"layers": ["d", "head"], "ranks": [2]},
        ],
        None,
        "stages[1].layers: layer 'C' (stage 1) is not in the graph",
    ),
    "non-convex stage": (
        # stage 0 holds d, which needs b and c from stage 1: a path leaves stage 0 and comes back.
        [
            {"layers": ["input", "a", "d"], "ranks": [0]},
            {"layers": ["b", "c"], "ranks": [1]},
            {"layers": ["head"], "ranks": [2]},
        ],
        None,
        "stages[0]: not convex: layer 'd' (stage 0) feeds from 'b' in the later stage 1; stages must follow the data flow",
    ),
}


@pytest.mark.parametrize("case", list(AGAINST_GRAPH))
def test_plans_that_do_not_fit_the_graph(files: tuple[Path, Path], case: str) -> None:
    stages, other, template = AGAINST_GRAPH[case]
    plan, graph = files
    graph_model = other if other is not None else diamond()
    # "another model": the plan was made (hash and all) for the diamond; validated against another graph.
    plan.write_text(json.dumps(plan_doc(stages)))
    save_graph(graph_model, graph)
    expected = f"{plan}: " + template.format(
        plan_hash=diamond().structure_hash()[7:19], graph_hash=graph_model.structure_hash()[7:19]
    )
    with pytest.raises(PlanError) as info:
        check_against_graph(load_plan(plan), graph_model, str(plan))
    assert str(info.value) == expected
    assert validate_cli(plan, graph) == (2, [f"pdplan: error: {expected}"])


def test_more_ranks_than_the_launcher_provides() -> None:
    plan = Plan.model_validate(plan_doc(GOOD))
    with pytest.raises(PlanError) as info:
        check_against_graph(plan, diamond(), "plan.json", world_size=2)
    assert str(info.value) == (
        "plan.json: world_size: the plan needs 4 ranks (stages[2] ends with rank 3, layer 'head'), "
        "but the launcher provides 2"
    )


# --- refused on load (ArtifactError): the plan contradicts itself ----------------------------

ON_LOAD = {
    "duplicated layer": (
        [
            {"layers": ["input", "a", "b"], "ranks": [0]},
            {"layers": ["b", "c"], "ranks": [1]},
            {"layers": ["d", "head"], "ranks": [2]},
        ],
        None,
        "stages[1].layers: layer 'b' is in stage 0 and stage 1",
    ),
    "layer twice in a stage": (
        [{"layers": ["input", "a", "a"], "ranks": [0]}, {"layers": ["b", "c", "d", "head"], "ranks": [1]}],
        None,
        "stages[0].layers: layer 'a' is twice in stage 0",
    ),
    "replicas without ranks": (
        [
            {"layers": ["input", "a"], "replicas": 2, "ranks": [0]},
            {"layers": ["b", "c", "d", "head"], "ranks": [1]},
        ],
        None,
        "stages[0].ranks: stage 0 (layers 'input' .. 'a' (2)) has replicas=2 but 1 ranks [0]; give one rank per replica",
    ),
    "rank shared by two stages": (
        [{"layers": ["input", "a", "b", "c"], "ranks": [0]}, {"layers": ["d", "head"], "ranks": [0]}],
        1,
        "stages[1].ranks: rank 0 of stage 1 (layers 'd' .. 'head' (2)) also runs stage 0; a rank runs one stage",
    ),
    "rank outside the world": (
        [{"layers": ["input", "a", "b", "c"], "ranks": [0]}, {"layers": ["d", "head"], "ranks": [5]}],
        2,
        "stages[1].ranks: rank 5 of stage 1 (layers 'd' .. 'head' (2)) is outside 0..1 (world_size=2)",
    ),
    "world size larger than the stages": (
        GOOD,
        6,
        "world_size: 6 ranks, but the stages run 4; no stage runs rank(s) [4, 5]",
    ),
}


@pytest.mark.parametrize("case", list(ON_LOAD))
def test_plans_that_contradict_themselves(files: tuple[Path, Path], case: str) -> None:
    stages, world_size, message = ON_LOAD[case]
    plan, graph = files
    plan.write_text(json.dumps(plan_doc(stages, world_size=world_size)))
    with pytest.raises(ArtifactError) as info:
        load_plan(plan)
    assert str(info.value) == f"{plan}: {message}"
    assert validate_cli(plan, graph) == (2, [f"pdplan: error: {plan}: {message}"])


def test_a_huge_world_size_is_refused_at_once(tmp_path: Path) -> None:
    # world_size comes from the file: checking it must not enumerate 10**12 ranks.
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(plan_doc(GOOD, world_size=10**12)))
    start = time.perf_counter()
    with pytest.raises(
        ArtifactError,
        match=r"world_size: 1000000000000 ranks, but the stages run 4; no stage runs rank\(s\) \[4, 5, 6\] \.\.\.",
    ):
        load_plan(plan)
    assert time.perf_counter() - start < 5.0  # enumerating 10**12 ranks would take hours


def test_a_saved_plan_passes_and_a_hand_edit_is_caught(tmp_path: Path) -> None:
    graph = diamond()
    plan = Plan(
        graph_hash=graph.structure_hash(),
        batch_size=4,
        world_size=3,
        stages=[
            Stage(layers=["input", "a", "b"], ranks=[0]),
            Stage(layers=["c", "d"], ranks=[1]),
            Stage(layers=["head"], ranks=[2]),
        ],
    )
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    check_against_graph(load_plan(path), graph, str(path))
    # A person moves 'c' into the last stage by hand: 'd' (stage 1) now feeds from a later stage.
    doc = json.loads(path.read_text())
    doc["stages"][1]["layers"] = ["d"]
    doc["stages"][2]["layers"] = ["c", "head"]
    path.write_text(json.dumps(doc, indent=2))
    with pytest.raises(
        PlanError, match=r"stages\[1\]: not convex: layer 'd' \(stage 1\) feeds from 'c' in the later stage 2"
    ):
        check_against_graph(load_plan(path), graph, str(path))


def test_pdplan_validate_as_a_real_command(files: tuple[Path, Path]) -> None:
    plan, graph = files
    plan.write_text(json.dumps(plan_doc(ON_LOAD["duplicated layer"][0])))
    done = subprocess.run(
        [str(Path(sys.executable).parent / "pdplan"), "validate", str(plan), "--graph", str(graph)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"pdplan: error: {plan}: stages[1].layers: layer 'b' is in stage 0 and stage 1"
    ]
