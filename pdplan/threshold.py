"""The same optimum for DAGs with too many states for pairs: search the bottleneck time directly.

For hundreds of thousands of antichain states (Inception-v3 has 221,564) the precedence
pairs ``k < j`` number in the billions, so the DP of ``partition.py`` cannot list them.
The optimum of PipeDream's recurrence (``partition.py`` quotes it) is a bottleneck: the
prefix ending at ``j`` fits on exactly ``m`` workers with every term at most ``t`` iff

    single stage (0..j] on m workers <= t,  or for some r < m and some predecessor k of j:
    k fits on m - r workers within t,  2 O[k] / (B r) <= t,  2 O[j] / (B r) <= t (j not last),
    and (X_j - X_k) / r <= t   with X = C + 4 (r-1) P / (B r)

and the last condition holds for some such k iff the largest ``X_k`` over them does. That
maximum over all predecessors is one sweep along the antichain DAG's moves (a predecessor
of j is a predecessor of one of j's immediate predecessors, or one of them), done level by
level with ``np.maximum.reduceat``, for every r at once. Each feasible ``t`` yields a plan
whose exact cost becomes the new upper bound; bisection stops when no plan is cheaper by
a relative 1e-9, so the answer is the DP's optimum to that precision. Single-level
clusters without a memory limit only; otherwise the planner searches a smaller space.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np
from numpy.typing import NDArray

from pdplan.antichain import FloatArray, StateSpace
from pdplan.costs import allreduce_s
from pdplan.partition import LevelSpec, Step

_REL = 1e-9


@dataclass
class _Block:
    """The moves into one popcount level, sorted by their destination's compute C."""

    src: NDArray[np.int64]
    heads: NDArray[np.int64]  # first edge of each destination
    dst: NDArray[np.int64]  # one per head
    c_dst: FloatArray  # C of each destination, ascending


def _blocks(space: StateSpace) -> list[_Block]:
    sizes = np.array([m.bit_count() for m in space.masks], dtype=np.int64)
    src, dst = space.move_src, space.move_dst
    c = space.compute_s
    # By level, then by C of the destination (ties by destination), so that the states a
    # bound C <= b keeps are a prefix of every block.
    order = np.lexsort((src, dst, c[dst], sizes[dst]))
    src, dst = src[order], dst[order]
    level = sizes[dst]
    out = []
    cuts = np.flatnonzero(np.r_[True, level[1:] != level[:-1], True])
    for a, b in pairwise(cuts.tolist()):
        d = dst[a:b]
        heads = np.flatnonzero(np.r_[True, d[1:] != d[:-1]])
        out.append(_Block(src[a:b], heads, d[heads], c[d[heads]]))
    return out


def _bit_midpoint(lo: float, hi: float) -> float:
    """The float halfway between two non-negative floats in their bit patterns (as ordered).

    A geometric mean for normal numbers, and still a halving of what is left to search when
    ``lo`` is 0 or either is subnormal, where ``sqrt(lo * hi)`` underflows.
    """
    a, b = np.array([lo, hi], dtype=np.float64).view(np.int64).tolist()
    return float(np.array([(a + b) // 2], dtype=np.int64).view(np.float64)[0])


class ThresholdSolver:
    """Bottleneck search over all antichain states of one level (no memory limit)."""

    def __init__(self, space: StateSpace, level: LevelSpec) -> None:
        assert level.memory is None and level.within == 1
        self.space, self.level = space, level
        self.blocks = _blocks(space)
        n, bw = level.workers, level.bandwidth
        r = np.arange(1, n + 1, dtype=np.float64)
        # X[:, r - 1] = C + 4 (r-1) P / (B r)
        self.x = space.compute_s[:, None] + allreduce_s(space.parameter_bytes[:, None], r, bw)
        self.o = 2.0 * space.output_bytes[:, None] / (bw * r)  # 2 O / (B r)
        self.single = self.x / r  # (C + 4 (m-1) P / (B m)) / m
        self.is_last = np.zeros(space.size, dtype=bool)
        self.is_last[space.last] = True

    def feasible(self, t: float) -> NDArray[np.bool_]:
        """``F[j, m]``: the prefix ending at j fits on exactly m workers with every term <= t."""
        n, size = self.level.workers, self.space.size
        fits = np.zeros((size, n + 1), dtype=bool)
        o_ok = self.o <= t
        out_ok = o_ok | self.is_last[:, None]
        for m in range(1, n + 1):
            col = fits[:, m]
            if not self.level.straight or m == 1:
                col |= self.single[:, m - 1] <= t
            rs = np.array([1] if self.level.straight else list(range(1, m)), dtype=np.int64)
            if m == 1 or len(rs) == 0:
                continue
            # T(j, m) >= C_j / m (every stage takes at least its compute over its replicas), so
            # only states with C_j <= m t can fit; they are closed under predecessors.
            bound = m * t * (1 + 1e-9)
            allowed = fits[:, m - rs] & o_ok[:, rs - 1]
            # with_self[k]: the largest X over k's predecessors in the allowed set, and k itself.
            with_self = np.where(allowed, self.x[:, rs - 1], -np.inf)
            best = np.full((size, len(rs)), -np.inf)
            for blk in self.blocks:
                nh = int(np.searchsorted(blk.c_dst, bound, side="right"))
                if nh == 0:
                    continue
                end = int(blk.heads[nh]) if nh < len(blk.heads) else len(blk.src)
                dst = blk.dst[:nh]
                best[dst] = np.maximum.reduceat(with_self[blk.src[:end]], blk.heads[:nh], axis=0)
                with_self[dst] = np.maximum(with_self[dst], best[dst])
            ok = (best >= self.x[:, rs - 1] - rs * t) & out_ok[:, rs - 1]
            col |= ok.any(axis=1)
        return fits

    def extract(self, fits: NDArray[np.bool_], t: float) -> list[Step]:
        """A plan whose every term is at most ``t`` (``fits`` from ``feasible(t)``)."""
        space, n = self.space, self.level.workers
        pop = np.array([m.bit_count() for m in space.masks], dtype=np.int64)
        steps: list[Step] = []
        j, m = space.last, n
        while True:
            if (not self.level.straight or m == 1) and self.single[j, m - 1] <= t:
                steps.append(Step(-1, j, m))
                break
            found = None
            for r in [1] if self.level.straight else range(1, m):
                if not (self.o[j, r - 1] <= t or j == space.last):
                    continue
                cand = np.flatnonzero(
                    fits[:, m - r]
                    & (self.o[:, r - 1] <= t)
                    & (self.x[:, r - 1] >= self.x[j, r - 1] - r * t)
                    & (pop < pop[j])
                )
                mask = space.masks[j]
                for k in cand[np.argsort(-self.x[cand, r - 1], kind="stable")].tolist():
                    if space.masks[k] & mask == space.masks[k]:
                        found = (k, r)
                        break
                if found is not None:
                    break
            if found is None:
                raise AssertionError(f"threshold: no choice behind F[{j}, {m}] at t={t}")
            k, r = found
            steps.append(Step(k, j, r))
            j, m = k, m - r
        steps.reverse()
        return steps

    def cost(self, steps: list[Step]) -> float:
        """The recurrence's value of one plan (the max of its terms)."""
        space, bw = self.space, self.level.bandwidth
        worst = 0.0
        for i, st in enumerate(steps):
            r = st.replicas
            if i == 0:
                worst = max(worst, float(self.single[st.end, r - 1]))
                continue
            k, j = st.start, st.end
            dc = space.compute_s[j] - space.compute_s[k]
            dp = space.parameter_bytes[j] - space.parameter_bytes[k]
            stage = (dc + allreduce_s(dp, r, bw)) / r
            terms = [stage, 2.0 * space.output_bytes[k] / (bw * r)]
            if j != space.last:
                terms.append(2.0 * space.output_bytes[j] / (bw * r))
            worst = max(worst, *map(float, terms))
        return worst

    def solve(self) -> tuple[float, list[Step]] | None:
        """The optimum and its stages, or None when no layout exists (straight, too few layers)."""
        top = float(np.max(self.single)) + float(np.max(self.x)) + float(np.max(self.o)) + 1.0
        fits = self.feasible(top)
        if not fits[self.space.last, self.level.workers]:
            return None
        steps = self.extract(fits, top)
        hi = self.cost(steps)
        # T >= C_last / N: every stage takes at least its compute over its replicas.
        lo = float(self.space.compute_s[self.space.last]) / self.level.workers * (1 - 1e-9)
        lo = lo if lo > 0 else 0.0  # not -0.0: the midpoints read the sign bit
        self.tests = 0
        # ``feasible`` tests ``X_k >= X_j - r t`` while ``cost`` sums the stage's own terms,
        # so once t nears the rounding of X (or the costs are subnormal) the two can disagree
        # by more than t: a "feasible" t whose plan costs more. The close step below would
        # then creep down by _REL / 2 a test, and a halving from lo = 0 would walk ~1,075
        # times through the subnormals, so after such a test only bit midpoints are tried:
        # at most 64 more, whatever the scale.
        trusted, zero_tried = True, lo > 0
        while hi > lo * (1 + _REL):
            if trusted and hi <= lo * (1 + 1e-6):
                # Close: ask for a plan just below the best one; none means it is optimal.
                mid = hi * (1 - _REL / 2)
            else:
                mid = _bit_midpoint(lo, hi)
            if mid <= lo:  # lo and hi are adjacent floats
                if zero_tried:
                    break
                mid, zero_tried = 0.0, True  # lo = 0 is only a bound: an optimum of 0 is tested
            self.tests += 1
            fits = self.feasible(mid)
            if fits[self.space.last, self.level.workers]:
                cand = self.extract(fits, mid)
                value = self.cost(cand)
                if value <= hi:
                    steps = cand
                trusted = trusted and value <= mid * (1 + _REL)
                # The plan's own terms may exceed mid by an ulp of rounding; mid bounds the optimum.
                hi = min(value, mid) if value > mid else value
            else:
                lo = mid
        return self.cost(steps), steps
