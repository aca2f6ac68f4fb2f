"""The bottleneck search (for state spaces too large for pairs) finds the DP's optimum."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdplan.antichain import _space, build_space, enumerate_downsets
from pdplan.build import PlanConfig, make_plan
from pdplan.hierarchy import plan_levels
from pdplan.partition import LevelSpec
from pdplan.problem import Problem, prepare
from pdplan.threshold import ThresholdSolver
from pdprof.pipedream_import import parse_pipedream
from shared.graph import Edge, LayerGraph, Node
from shared.plan import check_against_graph

PROFILES = Path(__file__).resolve().parent.parent / "profiles"


def _both(graph: LayerGraph, level: LevelSpec) -> tuple[float, float]:
    problem = prepare(graph.to_networkx())
    _, with_pairs = build_space(problem, 10**6, 10**8)
    exact = plan_levels(with_pairs, [level])
    found = enumerate_downsets(problem, 10**6)
    assert found is not None
    pairless = _space(problem, *found, "antichain", with_pairs=False)
    solved = ThresholdSolver(pairless, level).solve()
    assert (exact is None) == (solved is None)
    if exact is None or solved is None:
        return math.nan, math.nan
    return exact.time_s, solved[0]


@st.composite
def dags(draw):
    n = draw(st.integers(2, 9))
    nodes = [Node(id="in", op="input", forward_ms=0, backward_ms=0, activation_bytes=0, parameter_bytes=0)]
    edges = [Edge(source="in", target="n0")]
    for v in range(n):
        nodes.append(
            Node(
                id=f"n{v}",
                forward_ms=draw(st.integers(1, 40)),
                backward_ms=draw(st.integers(1, 40)),
                activation_bytes=draw(st.integers(0, 5)) * 1e6,
                parameter_bytes=draw(st.integers(0, 5)) * 3e6,
            )
        )
        if v:
            for u in draw(st.sets(st.integers(0, v - 1), min_size=1, max_size=min(3, v))):
                edges.append(Edge(source=f"n{u}", target=f"n{v}"))
    return LayerGraph(batch_size=8, nodes=nodes, edges=edges)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags(), st.integers(1, 6), st.sampled_from([1e7, 1e8, 1e9]), st.booleans())
def test_threshold_equals_pairs_dp_on_random_dags(graph, workers, bandwidth, straight):
    exact, found = _both(graph, LevelSpec(workers, bandwidth, straight=straight))
    if not math.isnan(exact):
        assert math.isclose(found, exact, rel_tol=1e-8), (found, exact)


@pytest.mark.parametrize("name", ["densenet121", "inception_v3_compressed", "gnmt"])
@pytest.mark.parametrize("straight", [False, True])
def test_threshold_equals_pairs_dp_on_profiles(name: str, straight: bool) -> None:
    path = PROFILES / f"{name}.txt"
    graph = parse_pipedream(path.read_text(), str(path))
    exact, found = _both(graph, LevelSpec(16 if not straight else 8, 1e9, straight=straight))
    assert math.isclose(found, exact, rel_tol=1e-8), (found, exact)


def test_pdplan_takes_the_bottleneck_search_past_the_pair_limit() -> None:
    path = PROFILES / "inception_v3_compressed.txt"
    graph = parse_pipedream(path.read_text(), str(path))
    small = make_plan(graph, PlanConfig(workers=(16,), bandwidths=(1e9,), max_pairs=1000))
    full = make_plan(graph, PlanConfig(workers=(16,), bandwidths=(1e9,)))
    check_against_graph(small, graph)
    assert small.predicted is not None and full.predicted is not None
    assert small.predicted.search == full.predicted.search == "antichain"
    assert small.predicted.states == full.predicted.states == 1646
    assert math.isclose(
        small.predicted.time_per_minibatch_s, full.predicted.time_per_minibatch_s, rel_tol=1e-8
    )


@pytest.mark.parametrize("activation", [5e-324, 1e-310, 0.0])
def test_bisection_ends_when_the_optimum_is_subnormal_or_zero(activation: float) -> None:
    # Zero compute makes the lower bound 0. A two-stage pipeline whose only cost is a
    # subnormal transfer (or nothing) beats replicating one parameter: the search must
    # reach that optimum exactly and stop (halving from 0 used to loop forever once 0 itself
    # was infeasible and the upper bound was the smallest subnormal).
    problem = Problem(
        ids=["a", "b"],
        compute_s=[0.0, 0.0],
        parameter_bytes=[1.0, 0.0],
        activation_bytes=[activation, 0.0],
        preds=[[], [0]],
        succs=[[1], []],
        first_source=0,
    )
    found = enumerate_downsets(problem, 100)
    assert found is not None
    solver = ThresholdSolver(
        _space(problem, *found, "antichain", with_pairs=False), LevelSpec(2, 2.0, 1, None, False)
    )
    solved = solver.solve()
    assert solved is not None
    assert solved[0] == 2 * activation / 2.0
    assert [st.replicas for st in solved[1]] == [1, 1]
    assert solver.tests <= 70
