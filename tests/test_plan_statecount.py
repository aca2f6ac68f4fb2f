"""The counted states equal the enumerated ones: on random DAGs, on every subset, on the profiles.

Three independent sides: ``count_states`` (the frontier DP), ``enumerate_downsets`` (the
planner's breadth-first search with PipeDream's moves) and a brute force over every subset
of nodes that keeps the connected downsets containing the first source, with networkx.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdplan.antichain import enumerate_downsets
from pdplan.problem import Problem, prepare
from pdplan.statecount import TooWide, count_states, frontier_order, pipedream_states
from pdprof.pipedream_import import parse_pipedream

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _problem(n: int, edges: set[tuple[int, int]], first: int = 0) -> Problem:
    """A problem over nodes 0..n-1 (already topological: every edge goes up), zero costs."""
    preds: list[list[int]] = [[] for _ in range(n)]
    succs: list[list[int]] = [[] for _ in range(n)]
    for u, v in sorted(edges):
        preds[v].append(u)
        succs[u].append(v)
    zeros = [0.0] * n
    return Problem(
        ids=[f"n{v}" for v in range(n)],
        compute_s=zeros,
        parameter_bytes=zeros,
        activation_bytes=zeros,
        preds=preds,
        succs=succs,
        first_source=first,
    )


@st.composite
def dags(draw: st.DrawFn) -> tuple[int, set[tuple[int, int]], int]:
    n = draw(st.integers(1, 11))
    pairs = [(u, v) for v in range(n) for u in range(v)]
    density = draw(st.floats(0.05, 0.7))
    edges = {e for e in pairs if draw(st.floats(0, 1)) < density}
    sources = [v for v in range(n) if not any(b == v for _, b in edges)]
    return n, edges, draw(st.sampled_from(sources))


def _brute_force(n: int, edges: set[tuple[int, int]], first: int) -> int:
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    g.add_edges_from(edges)
    found = 0
    for bits in range(1 << n):
        members = {v for v in range(n) if bits >> v & 1}
        if first not in members or any(not set(g.predecessors(v)) <= members for v in members):
            continue
        found += nx.is_weakly_connected(g.subgraph(members))
    return found


@SETTINGS
@given(dags())
def test_count_equals_enumeration_and_brute_force(dag: tuple[int, set[tuple[int, int]], int]) -> None:
    n, edges, first = dag
    problem = _problem(n, edges, first)
    listed = enumerate_downsets(problem, 10_000)
    assert listed is not None
    assert count_states(problem).states == len(listed[0]) == _brute_force(n, edges, first)


@SETTINGS
@given(dags(), st.randoms(use_true_random=False))
def test_any_topological_order_gives_the_same_count(
    dag: tuple[int, set[tuple[int, int]], int], rng: random.Random
) -> None:
    n, edges, first = dag
    problem = _problem(n, edges, first)
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    g.add_edges_from(edges)
    weight = {v: (v != first, rng.random()) for v in range(n)}
    order = list(nx.lexicographical_topological_sort(g, key=weight.__getitem__))
    assert count_states(problem, order).states == count_states(problem).states


def test_greedy_order_is_topological_from_the_first_source() -> None:
    problem = _problem(6, {(0, 2), (1, 2), (2, 3), (2, 4), (3, 5), (4, 5)}, first=1)
    order = frontier_order(problem)
    assert order[0] == 1 and sorted(order) == list(range(6))
    place = {v: i for i, v in enumerate(order)}
    assert all(place[u] < place[v] for u in range(6) for v in problem.succs[u])
    with pytest.raises(ValueError, match="first source 1"):
        count_states(problem, [0, 1, 2, 3, 4, 5])


def test_second_source_joins_only_through_a_shared_successor() -> None:
    # f -> x <- s: {f}, {f, s, x}; {f, s} is not a state (s has no successor in it).
    assert count_states(_problem(3, {(0, 2), (1, 2)})).states == 2
    # s -> m alone: never reachable from f.
    assert count_states(_problem(3, {(1, 2)})).states == 1


def test_a_chain_has_its_prefixes() -> None:
    assert count_states(_problem(50, {(v, v + 1) for v in range(49)})).states == 50


def _profile(profiles_dir: Path, name: str) -> Problem:
    path = profiles_dir / f"{name}.txt"
    return prepare(parse_pipedream(path.read_text(), str(path)).to_networkx())


# As enumerated by enumerate_downsets (the figures the planner's benchmark has reported).
ENUMERATED = {"resnext101": 410, "densenet121": 430, "inception_v3_compressed": 1646, "gnmt_large": 1495}


@pytest.mark.parametrize("name", sorted(ENUMERATED))
def test_profiles_count_equals_enumeration(profiles_dir: Path, name: str) -> None:
    problem = _profile(profiles_dir, name)
    listed = enumerate_downsets(problem, 100_000)
    assert listed is not None and len(listed[0]) == ENUMERATED[name]
    assert count_states(problem).states == ENUMERATED[name]


def test_inception_v3_count(profiles_dir: Path) -> None:
    # Enumerating these takes the planner ~10 s; the count itself a few milliseconds.
    assert count_states(_profile(profiles_dir, "inception_v3")).states == 221_564


def _window(problem: Problem, start: int, stop: int) -> Problem:
    """The subproblem induced by nodes ``start..stop-1`` of the numbering, from ``start``.

    Windows cut through NASNet's cells, so most have several sources: the connectivity rule
    (a second source is a state only with a successor it shares with ``start``'s piece) counts.
    """
    edges = {(u - start, v - start) for v in range(start, stop) for u in problem.preds[v] if u >= start}
    return _problem(stop - start, edges, 0)


@pytest.mark.parametrize("name", ["nasnetamobile", "nasnetalarge"])
def test_nasnet_windows_count_equals_enumeration(profiles_dir: Path, name: str) -> None:
    # The whole DAG is far past enumeration; windows of its cells are not.
    problem = _profile(profiles_dir, name)
    for start, stop in ((0, 40), (300, 360), (600, 660), (problem.size - 60, problem.size)):
        sub = _window(problem, start, stop)
        listed = enumerate_downsets(sub, 200_000)
        assert listed is not None
        assert count_states(sub).states == len(listed[0])


def _all_downsets(problem: Problem) -> int:
    """Every downset (the empty one too), by another recursion: no frontier, no connectivity.

    For ``v`` the last node of a set ``S`` (maximal in it), a downset of ``S`` either leaves
    ``v`` out (a downset of ``S - v``) or holds ``v`` and its ancestors (``anc(v)`` plus a
    downset of ``S - anc(v)``), memoised on ``S``. With one source every nonempty downset is
    a PipeDream state, so this counts them independently of ``count_states``.
    """
    anc = problem.ancestor_masks()
    memo: dict[int, int] = {0: 1}
    pending = [(1 << problem.size) - 1]
    while pending:  # iterative, children first
        s = pending[-1]
        v = s.bit_length() - 1
        parts = (s & ~(1 << v), s & ~anc[v])
        missing = [c for c in parts if c not in memo]
        if missing:
            pending.extend(missing)
            continue
        memo[s] = memo[parts[0]] + memo[parts[1]]
        pending.pop()
    return memo[(1 << problem.size) - 1]


@SETTINGS
@given(dags())
def test_one_source_count_is_every_nonempty_downset(dag: tuple[int, set[tuple[int, int]], int]) -> None:
    n, edges, _ = dag
    edges = edges | {(0, v) for v in range(1, n) if not any(b == v for _, b in edges)}
    problem = _problem(n, edges)
    assert count_states(problem).states == _all_downsets(problem) - 1


# The exact counts: the frontier DP, two orders of it, and the recursion above all agree.
NASNET = {"nasnetamobile": 163_798_401_193, "nasnetalarge": 5_800_096_207_717}


@pytest.mark.parametrize("name", sorted(NASNET))
def test_nasnet_counts(profiles_dir: Path, name: str) -> None:
    problem = _profile(profiles_dir, name)
    counted = count_states(problem)
    assert counted.states == NASNET[name] == _all_downsets(problem) - 1
    assert counted.frontier <= 16  # the greedy order keeps NASNet's cells narrow
    assert count_states(problem, list(range(problem.size))).states == NASNET[name]  # the file's order


def test_counting_stops_past_its_budget() -> None:
    # 12 parallel chains of 3 between a fork and a join: 4^12 + 1 states, a frontier of 12.
    edges = {(0, 1 + 3 * c) for c in range(12)} | {
        (1 + 3 * c + i, 2 + 3 * c + i) for c in range(12) for i in range(2)
    }
    edges |= {(3 + 3 * c, 37) for c in range(12)}
    problem = _problem(38, edges)
    assert count_states(problem).states == 4**12 + 1
    assert pipedream_states(problem) == 4**12 + 1
    assert pipedream_states(problem, max_work=1000) is None
    with pytest.raises(TooWide, match="past 1000 key updates"):
        count_states(problem, max_work=1000)


def test_pdplan_reports_the_count_beside_its_search(profiles_dir: Path, tmp_path: Path) -> None:
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    graph, plan = tmp_path / "nasnet.json", tmp_path / "plan.json"
    steps = [
        [bin_dir / "pdprof", "import-pipedream", profiles_dir / "nasnetamobile.txt", "-o", graph],
        # The paper-cost DP alone: the count is the search's, whatever schedule search follows it.
        [
            bin_dir / "pdplan",
            graph,
            "--workers",
            "16",
            "--bandwidth",
            "1e9",
            "--schedule",
            "1f1b",
            "-o",
            plan,
        ],
        [bin_dir / "pdplan", "show", plan],
    ]
    done = [subprocess.run(step, capture_output=True, env=env, timeout=300, text=True) for step in steps]
    assert all(d.returncode == 0 for d in done), [d.stderr for d in done]
    predicted = json.loads(plan.read_text())["predicted"]
    assert predicted["antichain_states"] == NASNET["nasnetamobile"]
    searched = f"{predicted['states']} {predicted['search']} states of 163,798,401,193 antichain states"
    assert searched in done[1].stderr
    assert searched in done[2].stdout + done[2].stderr
