"""Every PipeDream profile plans into a valid plan whose stated prediction is its stages' cost."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pdplan.build import PlanConfig, make_plan
from pdplan.report import recost
from pdprof.pipedream_import import parse_pipedream
from shared.errors import PlanError
from shared.graph import LayerGraph
from shared.plan import check_against_graph

PROFILES = Path(__file__).resolve().parent.parent / "profiles"
# The two largest are planned once below (they take seconds each, not milliseconds).
BIG = {"inception_v3", "nasnetamobile", "nasnetalarge"}
NAMES = sorted(p.stem for p in PROFILES.glob("*.txt") if p.stem not in BIG)
_CACHE: dict[str, LayerGraph] = {}


def _graph(name: str) -> LayerGraph:
    if name not in _CACHE:
        path = PROFILES / f"{name}.txt"
        _CACHE[name] = parse_pipedream(path.read_text(), str(path))
    return _CACHE[name]


def _check(graph: LayerGraph, config: PlanConfig) -> float:
    plan = make_plan(graph, config)
    check_against_graph(plan, graph)
    assert plan.predicted is not None
    assert sum(s.replicas for s in plan.stages) == plan.world_size == math.prod(config.workers)
    assert plan.in_flight == math.ceil(plan.world_size / plan.stages[0].replicas)
    if config.straight:
        assert all(s.replicas == 1 for s in plan.stages)
    _, bottleneck, dp_time = recost(plan, graph)
    assert math.isclose(plan.predicted.data_parallel_time_per_minibatch_s, dp_time, rel_tol=1e-9)
    if len(config.workers) == 1:
        # One level: the stages, costed again from the graph, give exactly the DP's optimum.
        assert math.isclose(bottleneck, plan.predicted.time_per_minibatch_s, rel_tol=1e-9)
    if config.memory is not None:
        assert all(s.predicted is not None and s.predicted.memory_bytes <= config.memory for s in plan.stages)
    return plan.predicted.time_per_minibatch_s


@pytest.mark.parametrize("name", NAMES)
def test_profile_plans(name: str) -> None:
    graph = _graph(name)
    for workers in (4, 8, 16):
        for bandwidth in (1e9, 1e10):
            assert _check(graph, PlanConfig(workers=(workers,), bandwidths=(bandwidth,))) > 0
    straight = _check(graph, PlanConfig(workers=(4,), bandwidths=(1e9,), straight=True))
    replicated = _check(graph, PlanConfig(workers=(4,), bandwidths=(1e9,)))
    assert replicated <= straight * (1 + 1e-12)  # replication is a superset of straight pipelines


@pytest.mark.parametrize("name", NAMES)
def test_profile_memory_limit(name: str) -> None:
    graph = _graph(name)
    free = make_plan(graph, PlanConfig(workers=(8,), bandwidths=(1e9,)))
    worst = max(s.predicted.memory_bytes for s in free.stages if s.predicted is not None)
    limit = max(worst * 0.5, 1.0)
    try:
        limited = _check(graph, PlanConfig(workers=(8,), bandwidths=(1e9,), memory=limit))
    except PlanError as exc:
        assert "--memory" in str(exc)
        return
    assert free.predicted is not None and limited >= free.predicted.time_per_minibatch_s * (1 - 1e-12)


@pytest.mark.parametrize("name", ["alexnet", "vgg16", "resnet18"])
@pytest.mark.parametrize("workers", [(4, 2), (4, 4), (8, 2)])
def test_profile_two_levels(name: str, workers: tuple[int, int]) -> None:
    _check(_graph(name), PlanConfig(workers=workers, bandwidths=(1e10, 1e9)))


@pytest.mark.parametrize(("name", "search"), [("inception_v3", "compressed"), ("nasnetamobile", "narrow")])
def test_big_profiles_plan(name: str, search: str) -> None:
    # Capped at 50,000 states to stay fast here; bench/bench_planner.py plans Inception-v3 over
    # all its 221,564 antichain states.
    plan = make_plan(_graph(name), PlanConfig(workers=(16,), bandwidths=(1e9,), max_states=50_000))
    check_against_graph(plan, _graph(name))
    assert plan.predicted is not None and plan.predicted.search == search
    _, bottleneck, _ = recost(plan, _graph(name))
    assert math.isclose(bottleneck, plan.predicted.time_per_minibatch_s, rel_tol=1e-9)


def test_hierarchy_keeps_replicas_on_consecutive_ranks_of_a_server() -> None:
    plan = make_plan(_graph("vgg16"), PlanConfig(workers=(4, 4), bandwidths=(1e10, 1e9)))
    for stage in plan.stages:
        by_server: dict[int, list[int]] = {}
        for rank in stage.ranks:
            by_server.setdefault(rank // 4, []).append(rank)
        sizes = {len(ranks) for ranks in by_server.values()}
        assert len(sizes) == 1  # the same slots in every server the stage spans
        for ranks in by_server.values():
            assert ranks == list(range(ranks[0], ranks[0] + len(ranks)))


def test_long_chain_on_three_levels_plans_coarsely_and_validly() -> None:
    from bench.bench_planner import synthetic_chain

    graph = synthetic_chain(400, seed=3)
    config = PlanConfig(
        workers=(4, 2, 4), bandwidths=(1e11, 1e10, 1e9), max_range_work=1e6, max_coarse_work=2e6
    )
    plan = make_plan(graph, config)
    check_against_graph(plan, graph)
    assert plan.predicted is not None and plan.predicted.search == "coarse-prefix"
    assert plan.predicted.states is not None and plan.predicted.states < 400
    assert sum(s.replicas for s in plan.stages) == 32
