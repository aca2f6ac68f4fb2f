"""bench.exhaustive: every partition of a graph with one topological order, ranked by the auto search's simulation."""

from __future__ import annotations

import math

from bench import exhaustive
from bench.bench_planner import synthetic_chain
from pdplan.build import PlanConfig, make_plan
from pdplan.problem import prepare_layers
from pdplan.report import with_simulation
from shared.graph import Edge, LayerGraph, Node


def _count(n: int, workers: int) -> int:
    # C(n-1, k-1) splits into k consecutive stages, C(workers-1, k-1) sharings of the workers among them.
    return sum(math.comb(n - 1, k - 1) * math.comb(workers - 1, k - 1) for k in range(1, workers + 1))


def _fastest(graph: LayerGraph, config: PlanConfig) -> float:
    """bench.exhaustive's fastest seconds per minibatch, having checked it listed every partition."""
    found = exhaustive.best(graph, config)
    assert found is not None
    seconds, listed = found
    assert listed == _count(prepare_layers(graph).size, config.workers[0])
    return seconds


def test_on_a_graph_auto_lists_whole_the_fastest_of_every_partition_is_auto_s_plan() -> None:
    graph = synthetic_chain(7, seed=3)
    config = PlanConfig(workers=(3,), bandwidths=(1e9,), schedule="auto")
    seconds = _fastest(graph, config)
    auto = make_plan(graph, config)
    assert auto.predicted is not None and auto.virtual_stages == 1
    assert auto.predicted.simulated_time_per_minibatch_s == seconds


def test_on_a_bigger_chain_no_single_chunk_plan_is_faster_than_the_fastest_of_every_partition() -> None:
    graph = synthetic_chain(14, seed=5)
    config = PlanConfig(workers=(4,), bandwidths=(1e9,), schedule="auto")
    seconds = _fastest(graph, config)
    paper = with_simulation(make_plan(graph, PlanConfig(workers=(4,), bandwidths=(1e9,))), graph)
    assert paper.predicted is not None and paper.predicted.simulated_time_per_minibatch_s is not None
    assert seconds <= paper.predicted.simulated_time_per_minibatch_s
    auto = make_plan(graph, config)
    assert auto.predicted is not None and auto.predicted.simulated_time_per_minibatch_s is not None
    if auto.virtual_stages == 1:  # interleaved chunks are not among the partitions listed
        assert seconds <= auto.predicted.simulated_time_per_minibatch_s


def test_partitions_are_not_listed_where_they_cannot_all_be() -> None:
    def node(name: str) -> Node:
        return Node(id=name, forward_ms=1.0, backward_ms=2.0, activation_bytes=1e6, parameter_bytes=1e6)

    # a -> b, a -> c, b -> d, c -> d: b and c come in either order.
    diamond = LayerGraph(
        source="diamond",
        batch_size=8,
        nodes=[
            Node(id="input", op="input", forward_ms=0, backward_ms=0, activation_bytes=0, parameter_bytes=0),
            *(node(n) for n in "abcd"),
        ],
        edges=[
            Edge(source=s, target=t)
            for s, t in (("input", "a"), ("a", "b"), ("a", "c"), ("b", "d"), ("c", "d"))
        ],
    )
    assert not exhaustive.unique_order(prepare_layers(diamond))
    assert exhaustive.best(diamond, PlanConfig(workers=(2,), bandwidths=(1e9,), schedule="auto")) is None
    chain = synthetic_chain(6)
    assert exhaustive.best(chain, PlanConfig(workers=(2, 2), bandwidths=(1e10, 1e9), schedule="auto")) is None
    assert exhaustive.best(chain, PlanConfig(workers=(8,), bandwidths=(1e9,), schedule="auto")) is None
