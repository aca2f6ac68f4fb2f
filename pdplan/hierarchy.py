"""Solving a hierarchical cluster level by level, innermost first, and laying out the ranks.

As in the paper's optimizer: the innermost level is solved for every range of states on
the workers of one server; its best time for each range becomes the compute time of that
range at the next level, where one "worker" is a whole server; the outermost level is
solved once, from the first state to the last. The solution is then unfolded from the
outside in: a range given ``r`` units at one level is planned inside each unit by the level
below, and the stage's replicas sit on consecutive ranks of the units it was given.
Over totally ordered states given without precedence pairs, ``chain.py`` does the same
(every range, exactly) in about N^2 steps per worker split instead of N^3.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdplan.antichain import FloatArray, StateSpace
from pdplan.chain import is_chain, plan_chain
from pdplan.partition import INF, LevelSpec, RangeCosts, Step, backtrack, innermost_costs, solve, table_costs
from pdplan.threshold import ThresholdSolver


@dataclass(frozen=True)
class FlatStage:
    """A stage of the final plan: states (start..end] and the ranks that run it."""

    start: int
    end: int
    ranks: tuple[int, ...]


@dataclass
class Solution:
    """The optimum and the stages behind it, first to last."""

    time_s: float
    stages: list[FlatStage]


def _costs(space: StateSpace, level: int, start: int, inner: list[FloatArray]) -> RangeCosts:
    return innermost_costs(space, start) if level == 0 else table_costs(space, start, inner[level - 1])


def range_tables(space: StateSpace, levels: list[LevelSpec]) -> list[FloatArray]:
    """For every level but the last: ``best[s + 1, j]``, the time of range (s..j] on all its workers."""
    out: list[FloatArray] = []
    for li, level in enumerate(levels[:-1]):
        best = np.full((space.size + 1, space.size), INF)
        for s in range(-1, space.size - 1):
            table = solve(space, level, _costs(space, li, s, out))
            best[s + 1] = table[:, level.workers]
        out.append(best)
    return out


def plan_levels(space: StateSpace, levels: list[LevelSpec]) -> Solution | None:
    """Solve ``levels`` (innermost first) and unfold the optimum; None when nothing fits."""
    if not space.has_pairs and len(levels) > 1 and is_chain(space):
        # A hierarchy over totally ordered states: every range at every level (chain.py).
        found_chain = plan_chain(space, levels)
        if found_chain is None:
            return None
        chain_stages = [FlatStage(a - 1, b - 1, ranks) for a, b, ranks in found_chain.stages]
        return Solution(time_s=found_chain.time_s, stages=chain_stages)
    if not space.has_pairs:
        # Too many states to list their pairs: the bottleneck search (one level only).
        if len(levels) != 1:
            raise ValueError("a state space without pairs is solved for one level only")
        found = ThresholdSolver(space, levels[0]).solve()
        if found is None:
            return None
        flat: list[FlatStage] = []
        _unfold(space, levels, [], 0, found[1], [0], 1, flat)
        return Solution(time_s=found[0], stages=flat)
    inner = range_tables(space, levels)
    top = len(levels) - 1
    costs = _costs(space, top, -1, inner)
    table = solve(space, levels[top], costs)
    best = float(table[space.last, levels[top].workers])
    if not np.isfinite(best):
        return None
    stages: list[FlatStage] = []
    unit = 1
    for level in levels[:-1]:
        unit *= level.workers
    steps = backtrack(space, levels[top], costs, table, space.last)
    _unfold(space, levels, inner, top, steps, [0], unit, stages)
    return Solution(time_s=best, stages=stages)


def _unfold(
    space: StateSpace,
    levels: list[LevelSpec],
    inner: list[FloatArray],
    level: int,
    steps: list[Step],
    bases: list[int],
    unit: int,
    out: list[FlatStage],
) -> None:
    used = 0
    for step in steps:
        ranks_bases = [b + (used + u) * unit for b in bases for u in range(step.replicas)]
        used += step.replicas
        if level == 0:
            out.append(FlatStage(step.start, step.end, tuple(sorted(ranks_bases))))
            continue
        below = levels[level - 1]
        costs = _costs(space, level - 1, step.start, inner)
        table = solve(space, below, costs)
        sub = backtrack(space, below, costs, table, step.end)
        _unfold(space, levels, inner, level - 1, sub, ranks_bases, unit // below.workers, out)
