"""PipeDream's dynamic program for one level of the cluster, vectorised over states and pairs.

The recurrence, from "PipeDream: Generalized Pipeline Parallelism for DNN Training"
(Narayanan et al., SOSP 2019, section 3.1), as its optimizer computes it
(``optimizer_graph_hierarchical.py``) and docs/pdplan.md states it:

    T(j, m) = min( single stage (0..j] replicated m times,
                   min over antichain-DAG predecessors k of j and replicas r < m of
                       max( T(k, m - r),
                            stage (k..j] with r replicas,
                            2 O[k] / (B r),
                            2 O[j] / (B r)  if j is not the last state ) )

    a stage with compute c, parameters p and r replicas takes (c + 4 (r-1) p / (B r)) / r
    (the all-reduce term is ``costs.allreduce_s``);
    in the single-stage term at an outer level the all-reduce is further divided by the
    number of workers inside one unit of that level.

With a memory limit M a stage with r replicas is refused when
``ceil(W_after / r) * (activation + parameter bytes of the stage) > M``, W_after being the
workers after it; ``--straight`` allows one replica per stage only.

Instead of the reference's cubic Python loops, each worker count ``m`` is one pass of
numpy over every precedence pair (k, j) for each ``r``, and the minimum over the
predecessors of every ``j`` is one ``np.minimum.reduceat``. Tables hold ``inf`` where the
reference holds ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from pdplan.antichain import FloatArray, IntArray, StateSpace
from pdplan.costs import allreduce_s

INF = float("inf")


@dataclass(frozen=True)
class LevelSpec:
    """One level as the DP sees it: units, bandwidth between them, workers inside one unit."""

    workers: int
    bandwidth: float
    within: int = 1
    memory: float | None = None
    straight: bool = False


@dataclass
class RangeCosts:
    """The compute of each range the DP may form, for one start state ``s`` (-1: the beginning).

    ``single[j]`` is the compute of (s..j]; ``pair[p]`` that of (k..j] for the selected pairs.
    At the innermost level these are differences of C; at outer levels they are the best
    times of the level inside.
    """

    start: int
    states: NDArray[np.bool_]  # which j lie after the start
    single: FloatArray
    pairs: IntArray  # indices into the space's pair arrays
    pair: FloatArray


def innermost_costs(space: StateSpace, start: int) -> RangeCosts:
    """Ranges starting at ``start`` costed by C differences (the innermost level)."""
    if start < 0:
        after = np.ones(space.size, dtype=bool)
        base = 0.0
        pairs = np.arange(len(space.pair_k), dtype=np.int64)
    else:
        after = space.below(start)
        base = float(space.compute_s[start])
        pairs = np.flatnonzero(after[space.pair_k]).astype(np.int64)
    single = np.where(after, space.compute_s - base, INF)
    pair = space.compute_s[space.pair_j[pairs]] - space.compute_s[space.pair_k[pairs]]
    return RangeCosts(start=start, states=after, single=single, pairs=pairs, pair=pair)


def table_costs(space: StateSpace, start: int, inner: FloatArray) -> RangeCosts:
    """Ranges starting at ``start`` costed by ``inner[s + 1, j]``, the level inside's best times."""
    base = innermost_costs(space, start)
    single = inner[start + 1].copy()
    single[~base.states] = INF
    pair = inner[space.pair_k[base.pairs] + 1, space.pair_j[base.pairs]]
    return RangeCosts(start=start, states=base.states, single=single, pairs=base.pairs, pair=pair)


def _memory_factor(total: int, m: int, r: int) -> int:
    # ceil((N - m) / r): the minibatches a stage keeps in flight, W_after = N - m.
    return -(-(total - m) // r)


def solve(space: StateSpace, level: LevelSpec, costs: RangeCosts) -> FloatArray:
    """``T[j, m]`` for every state j after the start and m = 1..N workers (column 0 unused)."""
    n_workers, bw = level.workers, level.bandwidth
    size = space.size
    s = costs.start
    p_base = 0.0 if s < 0 else float(space.parameter_bytes[s])
    y_base = 0.0 if s < 0 else float(space.parameter_bytes[s] + space.activation_bytes[s])
    single_p = space.parameter_bytes - p_base
    single_y = space.parameter_bytes + space.activation_bytes - y_base
    pk = space.pair_k[costs.pairs]
    pj = space.pair_j[costs.pairs]
    dp = space.parameter_bytes[pj] - space.parameter_bytes[pk]
    dy = dp + space.activation_bytes[pj] - space.activation_bytes[pk]
    o_in = space.output_bytes[pk]
    o_out = np.where(pj != space.last, space.output_bytes[pj], 0.0)
    # reduceat needs the first pair of every j that has pairs.
    if len(pj):
        heads = np.flatnonzero(np.r_[True, pj[1:] != pj[:-1]])
        owners = pj[heads]
    else:
        heads = owners = np.zeros(0, dtype=np.int64)
    table = np.full((size, n_workers + 1), INF)
    for m in range(1, n_workers + 1):
        col = table[:, m]
        if not level.straight or m == 1:
            allreduce = allreduce_s(single_p, m, bw) / level.within
            single = (costs.single + allreduce) / m
            if level.memory is not None:
                single = np.where(_memory_factor(n_workers, m, m) * single_y > level.memory, INF, single)
            col[:] = np.where(costs.states, single, INF)
        if len(heads) == 0:
            continue
        for r in range(1, (2 if level.straight else m)):
            prev = table[:, m - r]
            stage = (costs.pair + allreduce_s(dp, r, bw)) / r
            vals = np.maximum(prev[pk], stage)
            np.maximum(vals, 2.0 * np.maximum(o_in, o_out) / (bw * r), out=vals)
            if level.memory is not None:
                vals[_memory_factor(n_workers, m, r) * dy > level.memory] = INF
            best = np.minimum.reduceat(vals, heads)
            np.minimum.at(col, owners, best)
    return table


@dataclass(frozen=True)
class Step:
    """One stage of a level's solution: states (k..j] with r units (k = start for the first)."""

    start: int
    end: int
    replicas: int


def backtrack(
    space: StateSpace, level: LevelSpec, costs: RangeCosts, table: FloatArray, end: int
) -> list[Step]:
    """The stages behind ``table[end, N]``, first to last (ties: the single stage, then small r)."""
    n_workers, bw = level.workers, level.bandwidth
    s = costs.start
    p_base = 0.0 if s < 0 else float(space.parameter_bytes[s])
    steps: list[Step] = []
    j, m = end, n_workers
    pair_pos = {int(p): i for i, p in enumerate(costs.pairs)}
    while True:
        target = table[j, m]
        if not np.isfinite(target):
            raise AssertionError(f"backtrack from an infeasible entry T[{j}, {m}]")
        tol = abs(target) * 1e-12
        allreduce = allreduce_s(space.parameter_bytes[j] - p_base, m, bw) / level.within
        single = (costs.single[j] + allreduce) / m
        if (
            (not level.straight or m == 1)
            and abs(single - target) <= tol
            and _single_fits(space, level, s, j, m)
        ):
            steps.append(Step(s, j, m))
            break
        found = None
        for r in range(1, (2 if level.straight else m)):
            lo, hi = int(space.pair_start[j]), int(space.pair_start[j + 1])
            for p in range(lo, hi):
                i = pair_pos.get(p)
                if i is None:
                    continue
                k = int(space.pair_k[p])
                dp = space.parameter_bytes[j] - space.parameter_bytes[k]
                dy = dp + space.activation_bytes[j] - space.activation_bytes[k]
                if level.memory is not None and _memory_factor(n_workers, m, r) * dy > level.memory:
                    continue
                o_out = space.output_bytes[j] if j != space.last else 0.0
                val = max(
                    table[k, m - r],
                    (costs.pair[i] + allreduce_s(dp, r, bw)) / r,
                    2.0 * max(space.output_bytes[k], o_out) / (bw * r),
                )
                if abs(val - target) <= tol:
                    found = (k, r)
                    break
            if found is not None:
                break
        if found is None:
            raise AssertionError(f"backtrack found no choice for T[{j}, {m}] = {target}")
        k, r = found
        steps.append(Step(k, j, r))
        j, m = k, m - r
    steps.reverse()
    return steps


def _single_fits(space: StateSpace, level: LevelSpec, s: int, j: int, m: int) -> bool:
    if level.memory is None:
        return True
    y = space.parameter_bytes[j] + space.activation_bytes[j]
    if s >= 0:
        y -= space.parameter_bytes[s] + space.activation_bytes[s]
    return bool(_memory_factor(level.workers, m, m) * y <= level.memory)
