"""The DP equals brute force over every partition of small random chains and DAGs.

The brute force is written independently of pdplan: it lists every sequence of downsets
(every convex split into stages) and every way to give the workers to those stages, and
costs each with the recurrence's terms as docs/pdplan.md states them.
"""

from __future__ import annotations

import itertools
import math

import networkx as nx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdplan.build import PlanConfig, dp_partition, make_plan
from shared.errors import PlanError
from shared.graph import Edge, LayerGraph, Node
from shared.plan import check_against_graph

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _graph(costs, edges):
    nodes = [Node(id="in", op="input", forward_ms=0, backward_ms=0, activation_bytes=0, parameter_bytes=0)]
    for i, (f, b, a, p) in enumerate(costs):
        nodes.append(Node(id=f"n{i}", forward_ms=f, backward_ms=b, activation_bytes=a, parameter_bytes=p))
    es = [Edge(source="in", target="n0")] + [Edge(source=f"n{u}", target=f"n{v}") for u, v in edges]
    return LayerGraph(batch_size=4, nodes=nodes, edges=es)


def _downsets(n, edges):
    """Every downset that contains node 0 (all reachable, node 0 being the only source)."""
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    g.add_edges_from(edges)
    out = []
    for bits in range(1, 1 << n):
        members = {v for v in range(n) if bits >> v & 1}
        if 0 in members and all(set(g.predecessors(v)) <= members for v in members):
            out.append(frozenset(members))
    return g, sorted(out, key=len)


def _cut(g, d, act):
    """Activations of the augmented antichain of downset d."""
    top = [x for x in d if not set(g.successors(x)) & d]
    aug = set(top)
    for x in top:
        below = nx.ancestors(g, x) | {x}
        for p in nx.ancestors(g, x):
            if any(o not in below for o in g.successors(p)):
                aug.add(p)
    return sum(act[v] for v in aug)


def _compositions(total, parts):
    for cut in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cut, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def _best(g, states, costs, levels, memory, straight, transfers=True):
    """min over every split and replica assignment, levels nested as DESIGN.md says."""
    comp = [(f + b) / 1000 for f, b, _, _ in costs]
    act = [a for _, _, a, _ in costs]
    par = [p for _, _, _, p in costs]
    full = states[-1]
    cut = {d: _cut(g, d, act) for d in states}

    def solve(level, start, end):
        n_units, bw = levels[level]
        within = levels[level - 1][0] if level > 0 else 1
        chains = [c for c in _chains(states, start, end)]
        best = math.inf
        for chain in chains:
            parts = len(chain) - 1
            for reps in _compositions(n_units, parts) if parts <= n_units else []:
                if straight and any(r != 1 for r in reps):
                    continue
                worst, used = 0.0, 0
                for i in range(parts):
                    lo, hi, r = chain[i], chain[i + 1], reps[i]
                    used += r
                    nodes = hi - lo
                    p = sum(par[v] for v in nodes)
                    y = p + sum(act[v] for v in nodes)
                    if memory is not None and math.ceil((n_units - used) / r) * y > memory:
                        worst = math.inf
                        break
                    c = solve(level - 1, lo, hi) if level > 0 else sum(comp[v] for v in nodes)
                    allreduce = 4 * (r - 1) * p / (bw * r)
                    if i == 0:
                        worst = max(worst, (c + allreduce / within) / r)
                    else:
                        t = (c + allreduce) / r
                        if transfers:
                            t = max(t, 2 * cut[lo] / (bw * r))
                        if transfers and hi != full:
                            t = max(t, 2 * cut[hi] / (bw * r))
                        worst = max(worst, t)
                best = min(best, worst)
        return best

    return solve(len(levels) - 1, frozenset(), full)


def _chains(states, start, end):
    """Every strictly growing sequence of states from start to end."""
    inner = [d for d in states if start < d < end]

    def extend(prefix):
        yield [*prefix, end]
        for d in inner:
            if prefix[-1] < d:
                yield from extend([*prefix, d])

    yield from extend([start])


costs_st = st.tuples(
    st.integers(1, 30),
    st.integers(1, 30),
    st.integers(0, 4).map(lambda x: x * 1e6),
    st.integers(0, 4).map(lambda x: x * 2e6),
)


def _check(costs, edges, workers, bandwidths, memory=None, straight=False, model="pipedream"):
    graph = _graph(costs, edges)
    g, states = _downsets(len(costs), edges)
    levels = list(zip(workers, bandwidths, strict=True))
    expected = _best(g, states, costs, levels, memory, straight, transfers=model == "pipedream")
    config = PlanConfig(
        workers=tuple(workers),
        bandwidths=tuple(bandwidths),
        memory=memory,
        straight=straight,
        cost_model=model,
    )
    if math.isinf(expected):
        return
    try:
        plan = make_plan(graph, config)
    except PlanError as exc:
        # The DP's answer is the paper's; the full memory model (pdplan.memory) may then refuse it.
        assert memory is not None and "no plan fits --memory" in str(exc), exc
        got = dp_partition(graph, config).time_s
        assert got is not None and math.isclose(got, expected, rel_tol=1e-9), (got, expected)
        return
    assert plan.predicted is not None
    assert memory is None or all(s.predicted.memory.total_bytes <= memory for s in plan.stages)
    got = plan.predicted.time_per_minibatch_s
    assert math.isclose(got, expected, rel_tol=1e-9), (got, expected)
    check_against_graph(plan, graph)
    assert sum(s.replicas for s in plan.stages) == math.prod(workers)


@SETTINGS
@given(st.lists(costs_st, min_size=1, max_size=6), st.integers(1, 4), st.sampled_from([1e7, 1e8, 1e9]))
def test_chain_equals_brute_force(costs, workers, bandwidth):
    edges = [(i, i + 1) for i in range(len(costs) - 1)]
    _check(costs, edges, [workers], [bandwidth])


@SETTINGS
@given(st.lists(costs_st, min_size=2, max_size=6), st.integers(2, 4))
def test_chain_straight_equals_brute_force(costs, workers):
    edges = [(i, i + 1) for i in range(len(costs) - 1)]
    _check(costs, edges, [workers], [1e8], straight=True)


@SETTINGS
@given(st.lists(costs_st, min_size=1, max_size=5), st.integers(2, 4), st.sampled_from([5e6, 2e7, 6e7]))
def test_chain_memory_limit_equals_brute_force(costs, workers, memory):
    edges = [(i, i + 1) for i in range(len(costs) - 1)]
    _check(costs, edges, [workers], [1e8], memory=memory)


@SETTINGS
@given(st.lists(costs_st, min_size=1, max_size=5), st.sampled_from([(2, 2), (3, 2), (2, 3)]))
def test_chain_two_levels_equals_brute_force(costs, workers):
    edges = [(i, i + 1) for i in range(len(costs) - 1)]
    _check(costs, edges, list(workers), [1e10, 1e9])


@st.composite
def dags(draw):
    n = draw(st.integers(2, 6))
    edges = set()
    for v in range(1, n):
        parents = draw(st.sets(st.integers(0, v - 1), min_size=1, max_size=min(2, v)))
        edges |= {(u, v) for u in parents}
    costs = draw(st.lists(costs_st, min_size=n, max_size=n))
    return costs, sorted(edges)


@SETTINGS
@given(dags(), st.integers(1, 4), st.sampled_from([1e7, 1e8]))
def test_dag_equals_brute_force(dag, workers, bandwidth):
    costs, edges = dag
    _check(costs, edges, [workers], [bandwidth])


@SETTINGS
@given(dags(), st.integers(2, 3), st.sampled_from([8e6, 3e7]))
def test_dag_straight_and_memory_equal_brute_force(dag, workers, memory):
    costs, edges = dag
    _check(costs, edges, [workers], [1e8], straight=True)
    _check(costs, edges, [workers], [1e8], memory=memory)


@SETTINGS
@given(dags(), st.integers(1, 4), st.sampled_from([1e7, 1e8]))
def test_compute_only_model_equals_brute_force(dag, workers, bandwidth):
    costs, edges = dag
    _check(costs, edges, [workers], [bandwidth], model="pipedream-compute")


@SETTINGS
@given(
    st.lists(costs_st, min_size=1, max_size=5),
    st.sampled_from([(2, 2), (3, 2), (2, 1, 2)]),
    st.sampled_from([None, 2e7]),
    st.booleans(),
)
def test_chain_solver_equals_brute_force(costs, workers, memory, straight):
    # chain.py (what pdplan runs on long chains with a hierarchy), called on the prefix states.
    from pdplan.antichain import _space, prefix_downsets
    from pdplan.build import level_specs
    from pdplan.chain import plan_chain
    from pdplan.problem import prepare

    edges = [(i, i + 1) for i in range(len(costs) - 1)]
    g, states = _downsets(len(costs), edges)
    bandwidths = [1e10, 1e9, 1e8][: len(workers)]
    expected = _best(g, states, costs, list(zip(workers, bandwidths, strict=True)), memory, straight)
    problem = prepare(_graph(costs, edges).to_networkx())
    space = _space(problem, *prefix_downsets(problem), "antichain", with_pairs=False)
    config = PlanConfig(
        workers=tuple(workers), bandwidths=tuple(bandwidths), memory=memory, straight=straight
    )
    found = plan_chain(space, level_specs(config, config.levels()))
    assert (found is None) == math.isinf(expected)
    if found is not None:
        assert math.isclose(found.time_s, expected, rel_tol=1e-9), (found.time_s, expected)
        assert sorted(r for _, _, ranks in found.stages for r in ranks) == list(range(math.prod(workers)))
