"""The chain solver (every range at every level in about N^2 per split) equals the pair DP exactly."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.bench_planner import synthetic_chain
from pdplan import chain
from pdplan.antichain import _space, build_space, prefix_downsets
from pdplan.build import PlanConfig, level_specs, make_plan
from pdplan.chain import Level, Prefix, is_chain, level_tables, plan_chain
from pdplan.hierarchy import plan_levels, range_tables
from pdplan.partition import LevelSpec
from pdplan.problem import prepare
from shared.graph import Edge, LayerGraph, Node, save_graph
from shared.plan import check_against_graph
from tests.subprocess_json import MAPPED, run_json

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def chains(draw: st.DrawFn, spiky: bool = False) -> LayerGraph:
    """Chains of up to 60 layers; small integer costs make ties (and hull dips) common.

    ``spiky``: a few very heavy layers and cuts that cost far more than the rest (runs of
    costly cuts make the long runs of splits that are bisected).
    """
    n = draw(st.integers(1, 60))
    compute = st.sampled_from([0, 1, 2, 3, 40, 300]) if spiky else st.integers(0, 20)
    acts = st.sampled_from([0, 1, 2, 10, 30, 400]) if spiky else st.integers(0, 8)
    nodes = [Node(id="in", op="input", forward_ms=0, backward_ms=0, activation_bytes=0, parameter_bytes=0)]
    edges = []
    prev = "in"
    for i in range(n):
        nodes.append(
            Node(
                id=f"n{i}",
                forward_ms=draw(compute),
                backward_ms=draw(st.integers(1, 20)),
                activation_bytes=draw(acts) * 1e6,
                parameter_bytes=draw(st.integers(0, 8)) * 2e6,
            )
        )
        edges.append(Edge(source=prev, target=f"n{i}"))
        prev = f"n{i}"
    return LayerGraph(batch_size=8, nodes=nodes, edges=edges)


clusters = st.sampled_from(
    [((2, 2), (1e9, 1e8)), ((3, 2), (1e10, 1e8)), ((4, 3), (1e9, 1e9)), ((2, 2, 2), (1e10, 1e9, 1e8)),
     ((3, 1, 2), (1e9, 1e8, 1e7)), ((1, 4), (1e9, 1e8)), ((4, 2, 3), (1e10, 1e9, 1e8))]
)  # fmt: skip


def _specs(
    workers: tuple[int, ...], bws: tuple[float, ...], memory: float | None, straight: bool
) -> list[LevelSpec]:
    config = PlanConfig(workers=workers, bandwidths=bws, memory=memory, straight=straight)
    return level_specs(config, config.levels())


def _spaces(graph: LayerGraph):  # type: ignore[no-untyped-def]
    problem = prepare(graph.to_networkx())
    _, with_pairs = build_space(problem, 10**6, 10**8)
    pairless = _space(problem, *prefix_downsets(problem), "antichain", with_pairs=False)
    return with_pairs, pairless


def _same(got: np.ndarray, want: np.ndarray) -> None:
    assert (np.isfinite(got) == np.isfinite(want)).all()
    fin = np.isfinite(want)
    assert np.allclose(got[fin], want[fin], rtol=1e-9, atol=0.0)


@SETTINGS
@given(chains(), clusters, st.sampled_from([None, 4e7, 1.2e8]), st.booleans())
def test_every_range_table_equals_the_pair_dp(graph, cluster, memory, straight):  # type: ignore[no-untyped-def]
    workers, bws = cluster
    specs = _specs(workers, bws, memory, straight)
    with_pairs, pairless = _spaces(graph)
    assert is_chain(pairless)
    want = range_tables(with_pairs, specs)
    pre = Prefix.of(pairless)
    n1 = pre.n + 1
    cost = np.full((n1, n1), np.inf)
    iu = np.triu_indices(n1, 1)
    cost[iu] = pre.compute[iu[1]] - pre.compute[iu[0]]
    for li, spec in enumerate(specs[:-1]):
        tables = level_tables(pre, Level.of(spec, cost), np.arange(pre.n, dtype=np.int64))
        # want[li][s + 1, j] is range (s..j] of states: positions (s + 1 .. j + 1].
        _same(tables[spec.workers][:, 1:], want[li][: pre.n])
        cost = np.vstack([tables[spec.workers], np.full((1, n1), np.inf)])


@SETTINGS
@given(
    st.booleans().flatmap(lambda spiky: chains(spiky)),
    clusters,
    st.sampled_from([None, 4e7, 1.2e8]),
    st.booleans(),
)
def test_optimum_and_layout_equal_the_pair_dp(graph, cluster, memory, straight):  # type: ignore[no-untyped-def]
    workers, bws = cluster
    specs = _specs(workers, bws, memory, straight)
    with_pairs, pairless = _spaces(graph)
    want = plan_levels(with_pairs, specs)
    got = plan_chain(pairless, specs)
    assert (want is None) == (got is None)
    if want is None or got is None:
        return
    assert math.isclose(got.time_s, want.time_s, rel_tol=1e-9), (got.time_s, want.time_s)
    # The same ties broken the same way: the very same stages on the very same ranks.
    assert [(a - 1, b - 1, ranks) for a, b, ranks in got.stages] == [
        (fs.start, fs.end, fs.ranks) for fs in want.stages
    ]
    if pairless.size > 1:  # what pdplan runs: plan_levels takes the chain solver without pairs
        through = plan_levels(pairless, specs)
        assert through is not None and through.stages == want.stages


def test_pdplan_plans_a_long_chain_exactly_on_three_levels() -> None:
    graph = synthetic_chain(300, seed=5)
    config = PlanConfig(workers=(4, 2, 4), bandwidths=(1e11, 1e10, 1e9))
    plan = make_plan(graph, config)
    check_against_graph(plan, graph)
    assert plan.predicted is not None and plan.predicted.search == "antichain"
    assert plan.predicted.states == 300
    assert sum(s.replicas for s in plan.stages) == 32
    _, pairless = _spaces(graph)
    found = plan_chain(pairless, level_specs(config, config.levels()))
    assert found is not None and plan.predicted.time_per_minibatch_s == found.time_s
    # Exact beats (or ties) the coarse search it replaces.
    coarse = make_plan(graph, PlanConfig(workers=(4, 2, 4), bandwidths=(1e11, 1e10, 1e9), max_range_work=1e6))
    assert coarse.predicted is not None and coarse.predicted.search == "coarse-prefix"
    assert plan.predicted.time_per_minibatch_s <= coarse.predicted.time_per_minibatch_s * (1 + 1e-12)


@SETTINGS
@given(
    st.booleans().flatmap(lambda spiky: chains(spiky)), clusters, st.sampled_from([None, 4e7]), st.booleans()
)
def test_bisected_tails_equal_the_pair_dp(graph, cluster, memory, straight):  # type: ignore[no-untyped-def]
    # Long runs of splits after a bump (a comb of costly cuts) are bisected; force it everywhere.
    workers, bws = cluster
    specs = _specs(workers, bws, memory, straight)
    with_pairs, pairless = _spaces(graph)
    want = plan_levels(with_pairs, specs)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chain, "_WALK", 0)
        got = plan_chain(pairless, specs)
    assert (want is None) == (got is None)
    if want is not None and got is not None:
        assert math.isclose(got.time_s, want.time_s, rel_tol=1e-9), (got.time_s, want.time_s)
        assert [(a - 1, b - 1, ranks) for a, b, ranks in got.stages] == [
            (fs.start, fs.end, fs.ranks) for fs in want.stages
        ]


class _Monotone:
    """Stands in for chain._Hulls: E(c, b) = X_b - X_c, falling in c and rising in b."""

    def __init__(self, x: np.ndarray) -> None:
        self.x = x

    def at(self, r: int, fac: int, c: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.where(c < b, self.x[b] - self.x[c], np.inf)


def test_bisected_tail_equals_walking_it() -> None:
    # The two ways of trying the splits after a bump (walk, bisect) on random runs: the same values.
    rng = np.random.default_rng(7)
    for _ in range(300):
        rows, width = int(rng.integers(1, 5)), int(rng.integers(2, 50))
        u = rng.choice([0.2, 1.0, 3.0, 9.0], size=(rows, width)) * rng.random((rows, width))
        hulls = _Monotone(np.cumsum(rng.choice([0.0, 0.1, 2.0], size=width) * rng.random(width)))
        b = np.arange(width)[None, :]
        length = np.minimum(rng.integers(0, width, size=(rows, width)), b)
        start = np.where(rng.random((rows, width)) < 0.5, np.inf, rng.random((rows, width)) * 5)
        walked, bisected = start.copy(), start.copy()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(chain, "_WALK", 10**9)
            chain._tail(hulls, u, walked, length, 0, 1, 0)  # type: ignore[arg-type]
            patch.setattr(chain, "_WALK", 0)
            chain._tail(hulls, u, bisected, length, 0, 1, 0)  # type: ignore[arg-type]
        assert np.array_equal(walked, bisected)


# In a fresh interpreter: plan a chain with the chain solver (the library call, or pdplan's
# command), then ask glibc how it serves a 30 MiB block. Its default mmap threshold starts at
# 128 KiB and only follows freed mapped blocks (none near 30 MiB here), so the block is mapped
# (mallinfo2's hblks grows); shared.malloc.steady_malloc pins the threshold at 32 MiB, and then
# the block comes from the heap.
_ALLOCATOR_PROBE = (
    MAPPED
    + """
import json, sys
from shared import malloc

if sys.argv[1] == "library":
    from bench.bench_planner import synthetic_chain
    from pdplan.antichain import _space, prefix_downsets
    from pdplan.build import PlanConfig, level_specs
    from pdplan.chain import plan_chain
    from pdplan.problem import prepare

    problem = prepare(synthetic_chain(120, seed=5).to_networkx())
    pairless = _space(problem, *prefix_downsets(problem), "antichain", with_pairs=False)
    config = PlanConfig(workers=(2, 2, 2), bandwidths=(1e11, 1e10, 1e9))
    assert plan_chain(pairless, level_specs(config, config.levels())) is not None
else:
    from pdplan.cli import main

    sys.argv = ["pdplan", *sys.argv[2:]]
    try:
        main()
    except SystemExit as done:
        assert done.code in (0, None), done.code


print(json.dumps({"steady_flag": malloc.malloc_is_steady(), "mapped": mapped(30 << 20)}))
"""
)


def _allocator_after(*argv: str) -> dict[str, bool]:
    return run_json(_ALLOCATOR_PROBE, *argv)


def test_the_chain_solver_leaves_mallocs_settings_alone_and_pdplans_command_sets_them(tmp_path: Path) -> None:
    # A library call must not change process-wide allocator settings (plan_chain once called
    # steady_malloc itself); pdplan's command, the edge, still fixes them for the solver's speed.
    assert _allocator_after("library") == {"steady_flag": False, "mapped": True}
    graph, plan = tmp_path / "graph.json", tmp_path / "plan.json"
    save_graph(synthetic_chain(40, seed=5), graph)
    cli = [
        "cli",
        str(graph),
        "--workers",
        "2,2",
        "--bandwidth",
        "1e10,1e9",
        "--schedule",
        "1f1b",
        "-o",
        str(plan),
    ]
    assert _allocator_after(*cli) == {"steady_flag": True, "mapped": False}
    assert plan.exists()
