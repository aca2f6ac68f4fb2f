"""The narrow states are exactly the states with a narrow cut, and searching them is sound.

``narrow_downsets`` is checked against ``enumerate_downsets`` filtered by a cut computed
here; the narrow search (``antichain.narrow_states``) against the exact, prefix and
compressed searches with the bottleneck solver: never better than the exact optimum (its
stages are real), never worse than the prefixes or, when every compressed state fits, the
compressed DAG's states (it holds their moves).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdplan.antichain import (
    StateSpace,
    _space,
    build_space,
    enumerate_downsets,
    narrow_states,
    prefix_downsets,
)
from pdplan.narrow import narrow_downsets, widest_within, width_counts
from pdplan.partition import LevelSpec
from pdplan.problem import Problem, compress_series, prepare
from pdplan.statecount import count_states
from pdplan.threshold import ThresholdSolver
from pdprof.pipedream_import import parse_pipedream

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw: st.DrawFn, single_source: bool = False) -> Problem:
    """Random DAGs over nodes 0..n-1 (edges go up), node 0 the first source, random costs."""
    n = draw(st.integers(2 if single_source else 1, 10))
    density = draw(st.floats(0.1, 0.6))
    edges = {(u, v) for v in range(1, n) for u in range(v) if draw(st.floats(0, 1)) < density}
    # Mostly one source, as in PipeDream's profiles; sometimes a second one.
    for v in range(1, n):
        if not any(b == v for _, b in edges) and (single_source or draw(st.integers(0, 4))):
            edges.add((draw(st.integers(0, v - 1)), v))
    preds: list[list[int]] = [[] for _ in range(n)]
    succs: list[list[int]] = [[] for _ in range(n)]
    for u, v in sorted(edges):
        preds[v].append(u)
        succs[u].append(v)
    costs = st.lists(st.floats(0.0, 10.0), min_size=n, max_size=n)
    return Problem(
        ids=[f"n{v}" for v in range(n)],
        compute_s=draw(costs),
        parameter_bytes=[x * 1e6 for x in draw(costs)],
        activation_bytes=[x * 1e6 for x in draw(costs)],
        preds=preds,
        succs=succs,
        first_source=0,
    )


def _cut(problem: Problem, d: int) -> int:
    """Nodes of ``d`` with a successor outside it or with none inside (its maximal nodes)."""
    inside = [v for v in range(problem.size) if d >> v & 1]
    return sum(1 for v in inside if not problem.succs[v] or any(not d >> s & 1 for s in problem.succs[v]))


@SETTINGS
@given(problems(), st.integers(0, 6))
def test_narrow_downsets_are_the_states_with_a_narrow_cut(problem: Problem, width: int) -> None:
    every = enumerate_downsets(problem, 10_000)
    assert every is not None
    assert sorted(narrow_downsets(problem, width)) == sorted(m for m in every[0] if _cut(problem, m) <= width)
    counts = width_counts(problem, problem.size)
    assert counts == [sum(1 for m in every[0] if _cut(problem, m) == w) for w in range(problem.size + 1)]
    assert sum(counts) == count_states(problem).states


@SETTINGS
@given(problems(), st.integers(0, 40))
def test_widest_within_takes_the_widest_bound_that_fits(problem: Problem, budget: int) -> None:
    counts = width_counts(problem, problem.size)
    totals = list(itertools.accumulate(counts))
    width, masks = widest_within(problem, budget)
    if width < 0:
        assert totals[0] > budget and masks == []
        return
    upto = totals[min(width, problem.size)]
    assert len(masks) == upto <= budget
    # One node wider would pass the budget, unless every state is in already.
    assert upto == totals[-1] or totals[width + 1] > budget


@SETTINGS
@given(problems())
def test_the_prefixes_maxima_are_the_members_with_no_successor_inside(problem: Problem) -> None:
    """prefix_downsets grows each prefix's maxima from the last one's: the same as reading every member."""
    masks, maxima, moves = prefix_downsets(problem)
    succ = problem.successor_masks()
    for d, top in zip(masks, maxima, strict=True):
        assert top == sum(1 << v for v in range(problem.size) if d >> v & 1 and not succ[v] & d)
    assert moves == [(i, i + 1) for i in range(len(masks) - 1)]
    assert masks[-1] == (1 << problem.size) - 1  # the last prefix is the whole graph


def _optimum(problem: Problem, space: StateSpace, workers: int) -> float:
    found = ThresholdSolver(space, LevelSpec(workers, 1e9, 1, None, False)).solve()
    assert found is not None
    return found[0]


def _check_moves(space: StateSpace) -> None:
    for k, j in zip(space.move_src.tolist(), space.move_dst.tolist(), strict=True):
        assert space.masks[k] & space.masks[j] == space.masks[k] != space.masks[j]


@SETTINGS
@given(problems(single_source=True), st.integers(1, 6), st.integers(0, 30))
def test_narrow_search_lies_between_the_exact_and_the_smaller_searches(
    problem: Problem, workers: int, extra: int
) -> None:
    every = enumerate_downsets(problem, 10_000)
    assert every is not None
    exact = _optimum(problem, _space(problem, *every, "antichain", with_pairs=False), workers)
    prefixes = prefix_downsets(problem)
    prefix = _optimum(problem, _space(problem, *prefixes, "prefix", with_pairs=False), workers)
    small = compress_series(problem)
    listed = enumerate_downsets(small, 10_000)
    assert listed is not None
    compressed = _optimum(small, _space(small, *listed, "compressed", with_pairs=False), workers)
    tol = 1 + 1e-9
    for cap, bound in ((len(prefixes[0]) + extra, prefix), (10**6, min(prefix, compressed))):
        found = narrow_states(problem, cap, 10**9)
        if found is None:  # not even the narrowest cuts fit beside the prefixes
            assert cap < 10**6
            continue
        space = _space(problem, *found, "narrow", with_pairs=False)
        _check_moves(space)
        assert space.size <= cap
        narrow = _optimum(problem, space, workers)
        assert exact <= narrow * tol and narrow <= bound * tol
        if cap == 10**6:  # every compressed state is in: so is every move between them
            moves = set(zip(space.move_src.tolist(), space.move_dst.tolist(), strict=True))
            index = {m: i for i, m in enumerate(space.masks)}
            wide = [_expand(small, problem, m) for m in listed[0]]
            assert {(index[wide[k]], index[wide[j]]) for k, j in listed[2]} <= moves


def _expand(small: Problem, problem: Problem, mask: int) -> int:
    node = {layer: v for v in range(problem.size) for layer in problem.layers_of(v)}
    return sum(1 << node[layer] for i in range(small.size) if mask >> i & 1 for layer in small.layers_of(i))


def _profile(profiles_dir: Path, name: str) -> Problem:
    path = profiles_dir / f"{name}.txt"
    return prepare(parse_pipedream(path.read_text(), str(path)).to_networkx())


def test_nasnet_mobile_narrow_search_beats_the_prefixes(profiles_dir: Path) -> None:
    problem = _profile(profiles_dir, "nasnetamobile")
    # Past every exact search: the narrow one, with the states its cuts of <= 5 nodes give.
    used, space = build_space(problem, max_states=10_000, max_pairs=1_000, pairless=True, max_moves=10**7)
    assert used is problem and space.search == "narrow"
    assert 8_044 < space.size <= 10_000  # 8,044 compressed states of cut <= 5, the 920 prefixes
    _check_moves(space)
    prefix = _optimum(problem, _space(problem, *prefix_downsets(problem), "prefix", with_pairs=False), 16)
    narrow = _optimum(problem, space, 16)
    # 43.54 ms (the optimum over all 1.3 million compressed states) against 43.98 ms.
    assert math.isclose(narrow, 0.04354095199999998, rel_tol=1e-9)
    assert narrow < prefix * (1 - 5e-3)


def test_with_pairs_the_narrow_search_fits_the_pair_budget(profiles_dir: Path) -> None:
    problem = _profile(profiles_dir, "nasnetamobile")
    used, space = build_space(problem, max_states=500_000, max_pairs=4_000_000, pairless=False)
    assert used is problem and space.search == "narrow" and space.has_pairs
    assert space.size <= int((2 * 4_000_000) ** 0.5) and len(space.pair_k) <= 4_000_000


@pytest.mark.parametrize("name", ["resnext101", "inception_v3_compressed"])
def test_exact_searches_are_unchanged(profiles_dir: Path, name: str) -> None:
    _, space = build_space(_profile(profiles_dir, name), 500_000, 4_000_000, pairless=True, max_moves=10**7)
    assert space.search == "antichain" and space.size == count_states(_profile(profiles_dir, name)).states
