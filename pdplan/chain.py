"""Every range of a chain of states solved exactly at every level, without listing predecessors.

When the states are totally ordered (a chain of layers, or the prefixes of one topological
order) every range ``(a..b]`` of positions is a stage candidate, and a hierarchy needs the
best time of every range at every inner level. PipeDream's recurrence (``partition.py``
quotes it) for one level and one start ``a`` is, with ``r`` replicas for the last stage:

    T[m](a, b) = min( single stage (a..b] on m,
                      min over r < m of  max( V_r(a, b),  2 O_b / (B r) if b is not the end ) )
    V_r(a, b)  = min over a < c < b of  max( U(a, c),  D(c, b) )
    U(a, c)    = max( T[m - r](a, c),  2 O_c / (B r) )              (anything, per start)
    D(c, b)    = (cost(c..b) + 4 (r-1) (P_b - P_c) / (B r)) / r    (the same for every start)

Listing every split ``c`` costs N^3 per (m, r). Two facts make it about N^2:

- Replace D by a *hull* E >= D that is nonincreasing in c and nondecreasing in b (the cost of
  the largest sub-range: ``hull(c, b) = max cost(c'..b')`` over ``c <= c' < b' <= b``). Where
  E = D nothing changes; the few ranges where D < E (at outer levels a short range can cost
  more than a longer one that contains it) are added back one by one. At the innermost
  level the cost is a difference of prefix sums, so E = D everywhere.
- With E monotone in c, a split c is beaten by any later c' with U(c') <= U(c), so
  ``min_c max(U(c), E(c, b)) = min_c max(Umin(c), E(c, b))`` with Umin the minimum of U over
  ``[c, b)``. Taking Umin over ``[c, end]`` instead (one reverse ``minimum.accumulate``, the
  same for every b) is right for every c whose minimum lies before b; those c form a prefix,
  on which Umin rises and E falls, so the best is at their crossing. The crossing for b is
  found for all b at once: a split c crosses from the first b where ``E(c, b) > Umin(c)``
  (one ``searchsorted`` per c) and that b grows with c, so a count gives it for every b.
  The c past that prefix (just after a bump of U) are tried one by one, or bisected over a
  sparse table of minima when the run is long (a comb of costly cuts).

Cost: about 25 passes over the N^2 / 2 ranges per (m, r) of each inner level, plus N
``searchsorted`` calls; the 2,000-layer chain on 8 x 8 x 16 takes 6-7 s of CPU and 1.2 GB.

The values are the recurrence's own (each is some split's max of terms, computed with the
same expressions as ``partition.solve``), so the tables equal the DP's; tests check that
against ``partition.solve`` on random chains with replicas, ``--straight`` and memory limits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from pdplan.antichain import FloatArray, IntArray, StateSpace
from pdplan.costs import allreduce_s
from pdplan.partition import INF, LevelSpec, Step

BoolArray = NDArray[np.bool_]


def is_chain(space: StateSpace) -> bool:
    """Whether every state's downset contains the previous one (the states are totally ordered)."""
    masks = space.masks
    return all(masks[i] & masks[i + 1] == masks[i] for i in range(len(masks) - 1))


@dataclass(frozen=True)
class Prefix:
    """Sums up to each position: position 0 is before the first state, position b after state b-1."""

    compute: FloatArray
    params: FloatArray
    acts: FloatArray
    outputs: FloatArray

    @property
    def n(self) -> int:
        """The number of states (positions run 0..n)."""
        return len(self.compute) - 1

    @staticmethod
    def of(space: StateSpace) -> Prefix:
        zero = np.zeros(1)
        return Prefix(
            np.concatenate([zero, space.compute_s]),
            np.concatenate([zero, space.parameter_bytes]),
            np.concatenate([zero, space.activation_bytes]),
            np.concatenate([zero, space.output_bytes]),
        )


@dataclass
class Level:
    """One level's range costs (``cost[a, b]`` for a < b, inf elsewhere) and their monotone hull."""

    spec: LevelSpec
    cost: FloatArray
    hull: FloatArray
    bad_c: IntArray  # ranges whose cost is below the hull, ordered by b
    bad_b: IntArray

    @staticmethod
    def of(spec: LevelSpec, cost: FloatArray) -> Level:
        n1 = cost.shape[0]
        valid = np.arange(n1)[None, :] > np.arange(n1)[:, None]
        # Largest cost over the sub-ranges: along b (ends <= b), then along a (starts >= a).
        hull = np.maximum.accumulate(np.where(valid, cost, -INF), axis=1)
        hull = np.maximum.accumulate(hull[::-1], axis=0)[::-1]
        hull = np.where(valid, hull, INF)
        bad_b, bad_c = np.nonzero((cost < hull).T)
        return Level(spec, cost, hull, bad_c.astype(np.int64), bad_b.astype(np.int64))


def chain_work(states: int, workers: tuple[int, ...], straight: bool) -> float:
    """About how many pair-steps (the unit of build.py's budgets, ~1e8/s) solving takes.

    Each (m, r) of an inner level costs about six pair-steps per range (measured: the
    2,000-state chain on 8 x 8 x 16 takes a few seconds); the outer level about N^2 per
    worker count. With ``--straight`` a range shorter than its workers cannot be planned,
    so at outer levels nearly every range is below its hull and is tried one by one (cubic).
    """
    ranges = states * states / 2
    splits = sum(w * (w - 1) / 2 for w in workers[:-1])
    work = 6 * ranges * splits + states * states * workers[-1]
    if straight and len(workers) > 1:
        work *= states
    return work


def memory_factor(total: int, m: int, r: int) -> int:
    # ceil((N - m) / r), as partition.py: the minibatches a stage keeps in flight.
    return -(-(total - m) // r)


def stage_time(
    pre: Prefix, level: Level, values: FloatArray, c: IntArray, b: IntArray, r: int, fac: int
) -> FloatArray:
    """``(values + 4 (r-1) (P_b - P_c) / (B r)) / r`` for ranges (c..b], inf where memory refuses it."""
    spec = level.spec
    dp = pre.params[b] - pre.params[c]
    out = (values + allreduce_s(dp, r, spec.bandwidth)) / r
    if spec.memory is not None:
        dy = dp + pre.acts[b] - pre.acts[c]
        out = np.where(fac * dy > spec.memory, INF, out)
    return np.asarray(out, dtype=np.float64)


def single_time(pre: Prefix, level: Level, rows: IntArray, m: int) -> FloatArray:
    """The whole range (a..b] as one stage on m units (inf where not allowed), rows by start a."""
    spec = level.spec
    n1 = pre.n + 1
    if spec.straight and m > 1:
        return np.full((len(rows), n1), INF)
    a = rows[:, None]
    contiguous = len(rows) and rows[-1] - rows[0] == len(rows) - 1
    where = slice(int(rows[0]), int(rows[-1]) + 1) if contiguous else rows
    dp = pre.params[None, :] - pre.params[a]
    allreduce = allreduce_s(dp, m, spec.bandwidth) / spec.within
    out = (level.cost[where] + allreduce) / m  # cost is inf unless a < b
    if spec.memory is not None:
        dy = (pre.params + pre.acts)[None, :] - (pre.params[a] + pre.acts[a])
        out = np.where(memory_factor(spec.workers, m, m) * dy > spec.memory, INF, out)
    return np.asarray(out, dtype=np.float64)


def level_tables(pre: Prefix, level: Level, rows: IntArray) -> list[FloatArray]:
    """``T[m][i, b]``: the best time of (rows[i]..b] on m units, m = 1..N (index 0 unused).

    ``rows`` must be ascending.
    """
    spec = level.spec
    hulls = _Hulls(pre, level, dense=len(rows) > 32)
    tables = [np.zeros((0, 0))]
    for m in range(1, spec.workers + 1):
        best = single_time(pre, level, rows, m)
        for r in range(1, min(m, 2) if spec.straight else m):
            np.minimum(best, _last_stage(pre, level, hulls, rows, tables[m - r], m, r), out=best)
        tables.append(best)
    return tables


class _Hulls:
    """E: the stage time of a range with its cost replaced by the hull, per (r, memory factor).

    Kept as dense matrices when many starts are solved (every entry is read), else computed
    where needed. Either way with stage_time's expression, so the values are the same.
    """

    def __init__(self, pre: Prefix, level: Level, dense: bool) -> None:
        self.pre, self.level, self.dense = pre, level, dense
        self.dp = pre.params[None, :] - pre.params[:, None] if dense else None
        self.dy: FloatArray | None = None  # stashed bytes of every range, for --memory
        self.by_r: dict[int, FloatArray] = {}
        self.last: tuple[int, int, FloatArray] | None = None

    def matrix(self, r: int, fac: int) -> FloatArray:
        spec = self.level.spec
        assert self.dp is not None
        e = self.by_r.get(r)
        if e is None:
            e = (self.level.hull + allreduce_s(self.dp, r, spec.bandwidth)) / r
            self.by_r[r] = e
        if spec.memory is None:
            return e
        if self.last is not None and self.last[:2] == (r, fac):
            return self.last[2]
        if self.dy is None:
            self.dy = (self.dp + self.pre.acts[None, :]) - self.pre.acts[:, None]
        masked = np.where(fac * self.dy > spec.memory, INF, e)
        self.last = (r, fac, masked)
        return masked

    def at(self, r: int, fac: int, c: IntArray, b: IntArray) -> FloatArray:
        if self.dense:
            n1 = self.pre.n + 1
            return np.asarray(self.matrix(r, fac).ravel()[c * n1 + b], dtype=np.float64)
        return stage_time(self.pre, self.level, self.level.hull[c, b], c, b, r, fac)


_BLOCK = 256  # starts per block: each block works on the columns after its first start only


def _counts_up_to(x: IntArray, width: int) -> IntArray:
    """``out[i, b] = #{c : x[i, c] <= b}`` for b in 0..width-1 (x in 0..width)."""
    rows = x.shape[0]
    # bincount ignores order: ravel in memory order (x may be a transposed view).
    flat = (np.arange(rows, dtype=np.int64)[:, None] * (width + 1) + x).ravel(order="K")
    counts = np.bincount(flat, minlength=rows * (width + 1)).reshape(rows, width + 1)
    return np.cumsum(counts[:, :width], axis=1)


def _last_stage(
    pre: Prefix, level: Level, hulls: _Hulls, rows: IntArray, prev: FloatArray, m: int, r: int
) -> FloatArray:
    """``max(V_r(a, b), 2 O_b / (B r))`` for every row's start a and every end b."""
    spec = level.spec
    n, n1 = pre.n, pre.n + 1
    fac = memory_factor(spec.workers, m, r)
    o = 2.0 * pre.outputs / (spec.bandwidth * r)
    o_out = np.where(np.arange(n1) == n, 0.0, o)
    # low[c]: the minimum of u over [c, end], per block (the columns after its first start),
    # and the same laid out by c for the crossings.
    low_t = np.empty((n1, len(rows)))
    blocks = [(i, min(i + _BLOCK, len(rows)), int(rows[i])) for i in range(0, len(rows), _BLOCK)]
    us, lows = [], []
    for i0, i1, a0 in blocks:
        us.append(np.maximum(prev[i0:i1, a0:], o[None, a0:]))  # prev is inf up to the start
        # Kept right to left (contiguous, for gathers); lows[k][:, ::-1] is low itself.
        lows.append(np.minimum.accumulate(us[-1][:, ::-1], axis=1))
        low_t[a0:, i0:i1] = lows[-1][:, ::-1].T
    pos = _crossings(pre, hulls, rows, low_t, r, fac)
    out = np.empty(prev.shape)
    for (i0, i1, a0), ub, rev in zip(blocks, us, lows, strict=True):
        out[i0:i1, :a0] = INF
        # Local columns: j stands for position a0 + j. Cells with b <= a come out inf by
        # themselves (no split lies before their cut), so nothing below masks them.
        width = n1 - a0
        cols = np.arange(width, dtype=np.int64)
        first = (rows[i0:i1] - a0 + 1)[:, None]
        lb = rev[:, ::-1]
        # low[c] is u's minimum over [c, b) too when it is attained before b, i.e. when some
        # record (u[j] <= low[j]) lies in [c, b): for c up to the last record before b.
        # cut[b]: one past that record; the splits from it to b are tried one by one.
        cut = np.zeros(ub.shape, dtype=np.int64)
        cut[:, 1:] = np.maximum.accumulate(np.where(ub[:, :-1] <= lb[:, :-1], cols[1:], 0), axis=1)
        # cross: how many c have low[c] < E(c, b); they form a prefix (every c <= a < b counts).
        cross = _counts_up_to((pos[a0:, i0:i1] - a0).T, width)
        k1 = np.minimum(cross, cut) - 1  # the last crossed split before the cut
        if hulls.dense:
            flat = k1 * n1 + (a0 * n1 + a0 + cols)
            e_k1 = hulls.matrix(r, fac).ravel()[flat]
        else:
            e_k1 = hulls.at(r, fac, a0 + k1, a0 + cols)
        best = np.where(k1 >= first, e_k1, INF)
        nxt = np.maximum(k1 + 1, first)
        rowbase = (np.arange(i1 - i0, dtype=np.int64) * width + width - 1)[:, None]
        from_low = rev.ravel()[rowbase - np.minimum(nxt, width - 1)]
        np.minimum(best, np.where(nxt < cut, from_low, INF), out=best)
        _tail(hulls, ub, best, cols - np.maximum(cut, first), a0, r, fac)
        _below_hull(pre, level, ub, best, a0, r, fac)
        out[i0:i1, a0:] = np.maximum(best, o_out[a0:])
    return out


def _crossings(pre: Prefix, hulls: _Hulls, rows: IntArray, low_t: FloatArray, r: int, fac: int) -> IntArray:
    """``pos[c, i]``: the first b > c with E(c, b) > low_t[c, i] (n + 1 if none; c + 1 for c <= start)."""
    n, n1 = pre.n, pre.n + 1
    # found[c, i] = pos - (c + 1): how many b after c keep E(c, b) <= low[i, c].
    found = np.zeros((n1, len(rows)), dtype=np.int64)
    if hulls.dense:
        # One searchsorted per c over E(c, .), which rises with b, for the starts before c,
        # shortest range first: the queries then mostly rise, which searchsorted is fast on.
        # Laid out by c so that each c's queries and answers are contiguous.
        e = hulls.matrix(r, fac)
        before = np.searchsorted(rows, np.arange(n1), side="left")
        for c in range(1, n):
            k = int(before[c])
            if k:
                found[c, k - 1 :: -1] = e[c, c + 1 :].searchsorted(low_t[c, k - 1 :: -1], side="right")
    else:
        # Few starts: a bisection for every (start, c) at once.
        ii, cc = np.nonzero((np.arange(n1)[None, :] > rows[:, None]) & (np.arange(n1)[None, :] < n))
        q = low_t[cc, ii]
        lo, hi = cc + 1, np.full(len(cc), n1)
        while True:
            act = np.flatnonzero(lo < hi)
            if not len(act):
                break
            mid = (lo[act] + hi[act]) // 2
            above = hulls.at(r, fac, cc[act], mid) > q[act]
            hi[act] = np.where(above, mid, hi[act])
            lo[act] = np.where(above, lo[act], mid + 1)
        found[cc, ii] = lo - cc - 1
    found += np.arange(1, n1 + 1, dtype=np.int64)[:, None]
    return found


def _tail(
    hulls: _Hulls, u: FloatArray, best: FloatArray, length: IntArray, a0: int, r: int, fac: int
) -> None:
    """The splits c in [b - length, b) (local columns), after a bump of u.

    Short runs are tried one by one (a split's value is at least E(c, b), which only grows as
    c moves left, so the walk stops once that reaches the best found). Long runs (a comb of
    costly cuts) are bisected: over such a run ending at b, u's minimum over [c, b) rises
    with c and E(c, b) falls, so their crossing is the best split.
    """
    width = best.shape[1]
    idx = np.flatnonzero(length > 0)
    if not len(idx):
        return
    if int(length.flat[idx].max()) > _WALK:
        _bisect_tail(hulls, u, best, length, idx, a0, r, fac)
        return
    t = 1
    while len(idx):
        i, b = np.divmod(idx, width)
        c = b - t
        e = hulls.at(r, fac, a0 + c, a0 + b)
        now = best.flat[idx]
        best.flat[idx] = np.minimum(now, np.maximum(u[i, c], e))
        t += 1
        idx = idx[(length.flat[idx] >= t) & (e < now)]


_WALK = 16  # tails longer than this are bisected


def _run_min(
    table: FloatArray, plane: int, span_of: IntArray, base: IntArray, c: IntArray, b: IntArray
) -> FloatArray:
    """The minimum of u[i, c..b-1] from the sparse table (two overlapping power-of-two spans)."""
    p = span_of[b - c]
    at = p * plane + base
    return np.asarray(np.minimum(table[at + c], table[at + b - (1 << p)]), dtype=np.float64)


def _bisect_tail(
    hulls: _Hulls, u: FloatArray, best: FloatArray, length: IntArray, idx: IntArray, a0: int, r: int, fac: int
) -> None:
    rows, width = u.shape
    span_of = np.zeros(width + 1, dtype=np.int64)  # floor(log2(k)) for k = 1..width
    span_of[1:] = np.floor(np.log2(np.arange(1, width + 1))).astype(np.int64)
    longest = int(length.flat[idx].max())
    # mins[p][i, j]: the minimum of u[i, j .. j + 2^p - 1] (a sparse table, as deep as needed).
    mins = [u]
    span = 1
    while 2 * span <= longest:
        last = mins[-1]
        step = last.copy()
        np.minimum(last[:, :-span], last[:, span:], out=step[:, :-span])
        mins.append(step)
        span *= 2
    table = np.stack(mins).ravel()
    i, b = np.divmod(idx, width)
    base = i * width
    start = b - length.flat[idx]
    lo, hi = start.copy(), b.copy()  # the first c whose run minimum is not below E(c, b)
    while True:
        act = np.flatnonzero(lo < hi)
        if not len(act):
            break
        mid = (lo[act] + hi[act]) // 2
        below = _run_min(table, rows * width, span_of, base[act], mid, b[act]) < hulls.at(
            r, fac, a0 + mid, a0 + b[act]
        )
        lo[act] = np.where(below, mid + 1, lo[act])
        hi[act] = np.where(below, hi[act], mid)
    found = np.full(len(idx), INF)
    crossed = lo - 1 >= start  # the last split still below E: its value is E
    found[crossed] = hulls.at(r, fac, a0 + lo[crossed] - 1, a0 + b[crossed])
    after = lo < b  # the first one past the crossing: its value is the run minimum
    run = _run_min(table, rows * width, span_of, base, np.minimum(lo, b - 1), b)
    found = np.minimum(found, np.where(after, run, INF))
    best.flat[idx] = np.minimum(best.flat[idx], found)


def _below_hull(
    pre: Prefix, level: Level, u: FloatArray, best: FloatArray, a0: int, r: int, fac: int
) -> None:
    """The splits whose stage costs less than its hull, each tried for every start (local columns)."""
    keep = level.bad_c > a0
    if not keep.any():
        return
    c, b = level.bad_c[keep], level.bad_b[keep]
    d = stage_time(pre, level, level.cost[c, b], c, b, r, fac)
    vals = np.maximum(u[:, c - a0], d[None, :])
    heads = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])
    ends = b[heads] - a0
    best[:, ends] = np.minimum(best[:, ends], np.minimum.reduceat(vals, heads, axis=1))


def backtrack(pre: Prefix, level: Level, tables: list[FloatArray], row: int, a: int, b: int) -> list[Step]:
    """The stages (positions c..b with r units) behind ``tables[N][row, b]``, first to last.

    Ties go as in ``partition.backtrack``: the single stage, then fewer replicas, then the
    earliest split.
    """
    spec = level.spec
    bw = spec.bandwidth
    m = spec.workers
    steps: list[Step] = []
    rows = np.array([a], dtype=np.int64)
    while True:
        target = float(tables[m][row, b])
        if not np.isfinite(target):
            raise AssertionError(f"chain backtrack from an infeasible entry ({a}..{b}] on {m}")
        tol = abs(target) * 1e-12
        single = float(single_time(pre, level, rows, m)[0, b])
        if abs(single - target) <= tol:
            steps.append(Step(a, b, m))
            break
        found = None
        cs = np.arange(a + 1, b, dtype=np.int64)
        for r in (1,) if spec.straight else range(1, m):
            if r >= m or not len(cs):
                continue
            fac = memory_factor(spec.workers, m, r)
            o = 2.0 * pre.outputs / (bw * r)
            vals = np.maximum(tables[m - r][row, cs], o[cs])
            vals = np.maximum(
                vals, stage_time(pre, level, level.cost[cs, b], cs, np.full(len(cs), b), r, fac)
            )
            vals = np.maximum(vals, o[b] if b != pre.n else 0.0)
            hit = np.flatnonzero(np.abs(vals - target) <= tol)
            if len(hit):
                found = (int(cs[hit[0]]), r)
                break
        if found is None:
            raise AssertionError(f"chain backtrack found no split for ({a}..{b}] on {m}: {target}")
        c, r = found
        steps.append(Step(c, b, r))
        b, m = c, m - r
    steps.reverse()
    return steps


@dataclass
class ChainPlan:
    """The optimum, and every innermost stage as (first position, last position, ranks)."""

    time_s: float
    stages: list[tuple[int, int, tuple[int, ...]]]


def plan_chain(space: StateSpace, specs: list[LevelSpec]) -> ChainPlan | None:
    """Solve ``specs`` (innermost first) over the chain ``space``; None when nothing fits.

    Thousands of multi-megabyte temporaries: under glibc's default malloc thresholds each is
    mapped afresh and its pages faulted in (a third of the time on the 2,000-layer chain).
    Fixing them is a process-wide choice, so it is the caller's (``pdplan``'s command calls
    ``shared.malloc.steady_malloc`` at its entry); this function leaves the allocator alone.
    """
    pre = Prefix.of(space)
    n, n1 = pre.n, pre.n + 1
    cost = np.full((n1, n1), INF)
    iu = np.triu_indices(n1, 1)
    cost[iu] = pre.compute[iu[1]] - pre.compute[iu[0]]
    levels: list[Level] = []
    tables: list[list[FloatArray]] = []
    starts = np.arange(n, dtype=np.int64)
    for spec in specs[:-1]:
        level = Level.of(spec, cost)
        t = level_tables(pre, level, starts)
        levels.append(level)
        tables.append(t)
        cost = np.vstack([t[spec.workers], np.full((1, n1), INF)])
    top = Level.of(specs[-1], cost)
    levels.append(top)
    tables.append(level_tables(pre, top, np.zeros(1, dtype=np.int64)))
    best = float(tables[-1][specs[-1].workers][0, n])
    if not np.isfinite(best):
        return None
    out: list[tuple[int, int, tuple[int, ...]]] = []
    unit = 1
    for spec in specs[:-1]:
        unit *= spec.workers
    _unfold(pre, levels, tables, len(specs) - 1, 0, n, [0], unit, out)
    return ChainPlan(best, out)


def _unfold(
    pre: Prefix,
    levels: list[Level],
    tables: list[list[FloatArray]],
    li: int,
    a: int,
    b: int,
    bases: list[int],
    unit: int,
    out: list[tuple[int, int, tuple[int, ...]]],
) -> None:
    # As hierarchy._unfold: a range given r units at one level is planned inside each unit by
    # the level below; a stage's replicas sit on the same consecutive slots of each unit.
    row = 0 if li == len(levels) - 1 else a
    steps = backtrack(pre, levels[li], tables[li], row, a, b)
    used = 0
    for step in steps:
        ranks = [base + (used + u) * unit for base in bases for u in range(step.replicas)]
        used += step.replicas
        if li == 0:
            out.append((step.start, step.end, tuple(sorted(ranks))))
        else:
            below = levels[li - 1].spec.workers
            _unfold(pre, levels, tables, li - 1, step.start, step.end, ranks, unit // below, out)
