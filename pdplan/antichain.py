"""The DP's states: antichains of the layer DAG, each standing for the downset it closes.

PipeDream (Narayanan et al., SOSP 2019, section 3.1 and the optimizer in its repository)
generates the states from the antichain of the first source by repeatedly advancing one
node of the *augmented* antichain to one of its successors. In terms of downsets that
move is: ``D -> D | ancestors*(s)`` for any node ``s`` outside ``D`` with a predecessor
inside ``D``, so we enumerate downsets as Python integers (one bit per node) with a
breadth-first search, carrying each state's maximal elements and sums incrementally
(no per-state pass over the graph). State ``k`` precedes state ``j`` in the antichain DAG
exactly when ``D_k`` is a proper subset of ``D_j``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from pdplan.narrow import widest_within
from pdplan.problem import Problem, compress_series
from pdplan.statecount import TooWide, pipedream_states

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]


@dataclass
class StateSpace:
    """States sorted so that subsets come first; per-state sums; the precedence pairs."""

    masks: list[int]  # downset of each state
    compute_s: FloatArray  # C[j]: sum of (forward + backward) / 1000 over the downset
    parameter_bytes: FloatArray  # P[j]
    activation_bytes: FloatArray  # A[j]
    output_bytes: FloatArray  # O[j]: activations of the augmented antichain (the cut)
    pair_k: IntArray  # every (k, j) with D_k a proper subset of D_j, grouped by j ascending
    pair_j: IntArray
    pair_start: IntArray  # pairs of j are pair_start[j]:pair_start[j + 1]
    search: str  # "antichain", "compressed" (antichains of the series-compressed DAG), "narrow" or "prefix"
    move_src: IntArray  # the antichain DAG's edges (moves), sorted by destination
    move_dst: IntArray

    @property
    def has_pairs(self) -> bool:
        return self.size < 2 or len(self.pair_k) > 0

    @property
    def size(self) -> int:
        return len(self.masks)

    @property
    def last(self) -> int:
        return len(self.masks) - 1

    def below(self, s: int) -> NDArray[np.bool_]:
        """Boolean mask over states: ``D_k`` a proper superset of ``D_s`` (k after s)."""
        sub = self.masks[s]
        return np.fromiter(((m & sub) == sub and m != sub for m in self.masks), dtype=bool, count=self.size)


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def _leaks(problem: Problem, anc: list[int], succ: list[int]) -> list[int]:
    """For node x: its ancestors with an edge leaving x's downset (they join x's augmented antichain)."""
    if "leaks" in problem.cache:
        return problem.cache["leaks"]
    n = problem.size
    inside = np.stack([_as_bool(a, n) for a in anc]).astype(np.float32)  # inside[x, p]: p in downset(x)
    edges = np.stack([_as_bool(m, n) for m in succ]).astype(np.float32)  # edges[p, o]: p -> o
    # leaving[x, p] > 0: p has a successor outside downset(x)
    leaving = (1.0 - inside) @ edges.T
    strict = inside.astype(bool)
    strict[np.arange(n), np.arange(n)] = False
    mask = strict & (leaving > 0.5)
    out = [_from_bool(row) for row in mask]
    problem.cache["leaks"] = out
    return out


def _from_bool(row: NDArray[np.bool_]) -> int:
    return int.from_bytes(np.packbits(row, bitorder="little").tobytes(), "little")


def enumerate_downsets(
    problem: Problem, max_states: int
) -> tuple[list[int], list[int], list[tuple[int, int]]] | None:
    """Reachable downsets, their maximal elements and the moves between them; None past ``max_states``."""
    anc = problem.ancestor_masks()
    succ = problem.successor_masks()
    start = anc[problem.first_source]
    index = {start: 0}
    masks = [start]
    maxima = [1 << problem.first_source]
    frontier = [0]
    fr = 0
    for v in _bits(start):
        fr |= succ[v]
    frontier[0] = fr & ~start
    moves: list[tuple[int, int]] = []
    q = 0
    while q < len(masks):
        d, top, fr = masks[q], maxima[q], frontier[q]
        for s in _bits(fr):
            d2 = d | anc[s]
            j = index.get(d2)
            if j is None:
                if len(masks) >= max_states:
                    return None
                j = len(masks)
                index[d2] = j
                masks.append(d2)
                maxima.append((top & ~anc[s]) | (1 << s))
                f2 = fr
                for v in _bits(d2 & ~d):
                    f2 |= succ[v]
                frontier.append(f2 & ~d2)
            moves.append((q, j))
        q += 1
    return masks, maxima, moves


def prefix_downsets(problem: Problem) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """The prefixes of the topological order (from the first source on) as the only states."""
    anc = problem.ancestor_masks()
    succ = problem.successor_masks()
    masks = [anc[problem.first_source]]
    maxima = [_maxima(masks[0], succ)]
    for v in range(problem.size):
        d = masks[-1]
        if not d >> v & 1:
            grown = d | anc[v]
            masks.append(grown)
            # A prefix grows by v alone (its predecessors come before it): v is maximal, and the maxima
            # below it no longer are, enumerate_downsets's rule. Reading every member of every prefix
            # instead was O(n^2) bit operations: 1.4 s of planning a 2,000-layer chain.
            single = grown == d | 1 << v
            maxima.append((maxima[-1] & ~anc[v]) | (1 << v) if single else _maxima(grown, succ))
    return masks, maxima, [(i, i + 1) for i in range(len(masks) - 1)]


def _maxima(d: int, succ: list[int]) -> int:
    """The members of downset ``d`` none of whose successors is in it."""
    return sum(1 << v for v in _bits(d) if not succ[v] & d)


# Key updates allowed to the state count that decides whether to enumerate (~3 us each).
COUNT_WORK = 1_000_000
# ``build_space``'s count not given: it counts itself, within COUNT_WORK.
UNCOUNTED = -1


def build_space(
    problem: Problem,
    max_states: int,
    max_pairs: int,
    pairless: bool = False,
    max_moves: int = 0,
    count: int | None = UNCOUNTED,
) -> tuple[Problem, StateSpace]:
    """The states to search, and the problem they are over, in this order of preference:

    1. all antichain states with their precedence pairs, when the pairs fit ``max_pairs``;
    2. with ``pairless`` (a solver that needs no pairs), all antichain states up to ``max_states``
       with at most ``max_moves`` moves between them (the bottleneck search sweeps the moves);
    3. the antichain states (with pairs) of the series-compressed DAG;
    4. ``narrow``: the series-compressed DAG's states with the narrowest cuts, as many as fit
       (with pairs, or ``NARROW_STATES`` for the pairless search), beside every prefix of a
       topological order, joined by their moves (so never worse than 5.);
    5. the prefixes of a topological order.

    ``count`` is ``pipedream_states(problem)`` when the caller has it (None: too wide to count).
    """
    found = _fitting(problem, max_states, max_pairs)
    if found is not None:
        return problem, _space(problem, *found, "antichain")
    # Counting first spares a breadth-first search that would stop at max_states anyway
    # (NASNet-Large: 1.4 s to count 5.8e12, against 3.5 s to list 500,000 and give up).
    if count == UNCOUNTED and pairless:
        count = pipedream_states(problem, COUNT_WORK)
    if pairless and (count or 0) <= max_states:
        every = enumerate_downsets(problem, max_states)
        if every is not None and len(every[2]) <= max_moves:
            return problem, _space(problem, *every, "antichain", with_pairs=False)
    small = compress_series(problem)
    found = _fitting(small, max_states, max_pairs)
    if found is not None:
        return small, _space(small, *found, "compressed")
    # NASNet's narrow states have about 8 moves each: a third of the sweep's budget (~10 s).
    cap = min(max_states, NARROW_STATES, max_moves // 24) if pairless else int((2 * max_pairs) ** 0.5)
    narrow = narrow_states(problem, cap, max_moves if pairless else max_pairs)
    if narrow is not None:
        return problem, _space(problem, *narrow, "narrow", with_pairs=not pairless)
    return problem, _space(problem, *prefix_downsets(problem), "prefix")


# The narrow search's size for the bottleneck search: NASNet-Large's 46,000 states (cuts of at
# most 6 nodes) and 300,000 moves plan in ~10 s; its optimum is reached from 5 nodes on.
NARROW_STATES = 60_000
# Key updates allowed to the frontier DP that lists them (~3 us each).
NARROW_WORK = 5_000_000


def narrow_states(problem: Problem, max_states: int, max_moves: int) -> Found | None:
    """The narrow states (``narrow.py``) of the series-compressed DAG and every prefix, on ``problem``.

    The states are those of ``compress_series(problem)`` whose cut has at most ``w`` nodes,
    ``w`` the largest that keeps them with the prefixes of a topological order within
    ``max_states``, expanded back to ``problem``'s nodes. The moves are PipeDream's between
    them: ``D -> D | ancestors*(s)`` for ``s`` a node of ``D``'s frontier or the last node of its
    series chain (a move of the compressed DAG), whenever both ends are states; so precedence
    is searched along such moves only (a pair of states joined by no chain of moves inside
    the set is not a stage). None when not even the narrowest fit, or the moves pass ``max_moves``.
    """
    prefixes = prefix_downsets(problem)[0]
    small = compress_series(problem)
    try:
        width, listed = widest_within(small, max_states - len(prefixes), NARROW_WORK)
    except TooWide:
        return None
    if width < 1:
        return None
    masks = list(dict.fromkeys(prefixes + _expanded(small, problem, listed)))
    members = _matrix(masks, problem.size).astype(bool)
    maxima = _masks_of(_maximal(problem, members))
    moves = _moves(problem, small, masks, members, max_moves)
    if moves is None:
        return None
    # Consecutive prefixes, whatever the DAG (with several sources one may add a whole branch).
    return masks, maxima, [*moves, *((i, i + 1) for i in range(len(prefixes) - 1))]


def _expanded(small: Problem, problem: Problem, masks: list[int]) -> list[int]:
    """Downsets of ``small`` (series-compressed) as downsets of ``problem``."""
    if not masks:
        return []
    node = {layer: v for v in range(problem.size) for layer in problem.layers_of(v)}
    group = np.zeros(problem.size, dtype=np.int64)
    for i in range(small.size):
        for layer in small.layers_of(i):
            group[node[layer]] = i
    return _masks_of(_matrix(masks, small.size).astype(bool)[:, group])


def _masks_of(rows: NDArray[np.bool_]) -> list[int]:
    packed = np.packbits(rows, axis=1, bitorder="little")
    return [int.from_bytes(row.tobytes(), "little") for row in packed]


def _maximal(problem: Problem, members: NDArray[np.bool_]) -> NDArray[np.bool_]:
    """Each state's maximal nodes: members with no successor inside (one column pass per edge)."""
    inner = np.zeros_like(members)
    for u in range(problem.size):
        for v in problem.succs[u]:
            inner[:, u] |= members[:, v]
    return members & ~inner


def _moves(
    problem: Problem, small: Problem, masks: list[int], members: NDArray[np.bool_], max_moves: int
) -> list[tuple[int, int]] | None:
    anc = problem.ancestor_masks()
    reach = np.zeros_like(members)  # frontier: outside, with a predecessor inside
    for u in range(problem.size):
        for v in problem.succs[u]:
            reach[:, v] |= members[:, u]
    reach &= ~members
    # The last node of each series chain, from its first (the move that adds the whole chain).
    node = {layer: v for v in range(problem.size) for layer in problem.layers_of(v)}
    tail = list(range(problem.size))
    for i in range(small.size):
        chain = [node[layer] for layer in small.layers_of(i)]
        tail[chain[0]] = max(chain, key=lambda v: anc[v].bit_count())
    index = {m: i for i, m in enumerate(masks)}
    moves: list[tuple[int, int]] = []
    for k, row in enumerate(reach):
        d = masks[k]
        for s in np.flatnonzero(row).tolist():
            for t in {s, tail[s]}:
                j = index.get(d | anc[t])
                if j is not None:
                    moves.append((k, j))
        if len(moves) > max_moves:
            return None
    return moves


Found = tuple[list[int], list[int], list[tuple[int, int]]]


def states_space(problem: Problem, found: Found, search: str) -> StateSpace:
    """The state space (with pairs) of states found by ``fitting_states``."""
    return _space(problem, *found, search)


def fitting_states(problem: Problem, max_states: int, max_pairs: int) -> Found | None:
    """All antichain states when their pairs fit ``max_pairs``, else None."""
    return _fitting(problem, max_states, max_pairs)


def _fitting(problem: Problem, max_states: int, max_pairs: int) -> Found | None:
    # Stop enumerating as soon as the pairs could no longer fit.
    cap = min(max_states, int((2 * max_pairs) ** 0.5) + 2)
    found = enumerate_downsets(problem, cap)
    if found is None or _pair_estimate(found[0]) > max_pairs:
        return None
    return found


def _pair_estimate(masks: list[int]) -> int:
    # An upper bound is enough to refuse: at most every pair of states is ordered.
    return len(masks) * (len(masks) - 1) // 2


def coarse_prefix_space(problem: Problem, keep: int) -> StateSpace:
    """At most ``keep`` prefixes of a topological order, evenly spaced in compute, the last included.

    For deep hierarchies on long graphs, where solving every range at every inner level
    (cubic in the states) would take too long: a restricted, still valid search.
    """
    masks, maxima, _ = prefix_downsets(problem)
    comp = np.array(problem.compute_s)
    totals = np.array([float(comp[_as_bool(d, problem.size)].sum()) for d in masks])
    if len(masks) > keep:
        targets = np.linspace(0.0, totals[-1], keep)
        picked = sorted(set(np.searchsorted(totals, targets[1:], side="left").tolist()) | {len(masks) - 1})
        masks = [masks[i] for i in picked]
        maxima = [maxima[i] for i in picked]
    return _space(problem, masks, maxima, [(i, i + 1) for i in range(len(masks) - 1)], "coarse-prefix")


def _matrix(masks: list[int], n: int) -> NDArray[np.float32]:
    """Rows of 0/1: state j's members (float32, for matrix products)."""
    width = (n + 7) // 8 or 1
    raw = np.frombuffer(b"".join(m.to_bytes(width, "little") for m in masks), dtype=np.uint8)
    bits = np.unpackbits(raw.reshape(len(masks), width), axis=1, bitorder="little")[:, :n]
    return bits.astype(np.float32)


def _sums(matrix: NDArray[np.float32], values: list[float]) -> FloatArray:
    # Exact in float64: a 0/1 row times the values, summed in float64 (not float32 BLAS).
    out = np.empty(matrix.shape[0])
    vals = np.array(values, dtype=np.float64)
    step = 65536
    for i in range(0, matrix.shape[0], step):
        out[i : i + step] = matrix[i : i + step].astype(np.float64) @ vals
    return out


def _space(
    problem: Problem,
    masks: list[int],
    maxima: list[int],
    moves: list[tuple[int, int]],
    search: str,
    with_pairs: bool = True,
) -> StateSpace:
    anc = problem.ancestor_masks()
    succ = problem.successor_masks()
    leak = _leaks(problem, anc, succ)
    order = sorted(range(len(masks)), key=lambda i: (masks[i].bit_count(), i))
    rank = {old: new for new, old in enumerate(order)}
    masks = [masks[i] for i in order]
    maxima = [maxima[i] for i in order]
    n, size = problem.size, len(masks)
    members = _matrix(masks, n)
    augmented = []
    for top in maxima:
        aug = top
        for x in _bits(top):
            aug |= leak[x]
        augmented.append(aug)
    move_src = np.array([rank[a] for a, _ in moves], dtype=np.int64)
    move_dst = np.array([rank[b] for _, b in moves], dtype=np.int64)
    by_dst = np.lexsort((move_src, move_dst))
    move_src, move_dst = move_src[by_dst], move_dst[by_dst]
    space = StateSpace(
        masks=masks,
        compute_s=_sums(members, problem.compute_s),
        parameter_bytes=_sums(members, problem.parameter_bytes),
        activation_bytes=_sums(members, problem.activation_bytes),
        output_bytes=_sums(_matrix(augmented, n), problem.outputs()),
        pair_k=np.zeros(0, dtype=np.int64),
        pair_j=np.zeros(0, dtype=np.int64),
        pair_start=np.zeros(size + 1, dtype=np.int64),
        search=search,
        move_src=move_src,
        move_dst=move_dst,
    )
    if with_pairs:
        _add_pairs(space)
    return space


def _add_pairs(space: StateSpace) -> None:
    """Precedence: k before j when D_k is a proper subset of D_j; along the moves, as state bit sets."""
    size = space.size
    preds: list[list[int]] = [[] for _ in range(size)]
    for a, b in zip(space.move_src.tolist(), space.move_dst.tolist(), strict=True):
        preds[b].append(a)
    below: list[int] = [0] * size
    ks: list[NDArray[np.int64]] = []
    for j in range(size):
        acc = 0
        for p in preds[j]:
            acc |= below[p] | (1 << p)
        below[j] = acc
        ks.append(_bit_indices(acc, size))
    counts = np.array([len(k) for k in ks], dtype=np.int64)
    np.cumsum(counts, out=space.pair_start[1:])
    space.pair_k = (np.concatenate(ks) if ks else np.zeros(0)).astype(np.int64)
    space.pair_j = np.repeat(np.arange(size, dtype=np.int64), counts)


def _as_bool(mask: int, n: int) -> NDArray[np.bool_]:
    raw = np.frombuffer(mask.to_bytes((n + 7) // 8 or 1, "little"), dtype=np.uint8)
    return np.unpackbits(raw, bitorder="little")[:n].astype(bool)


def _bit_indices(mask: int, n: int) -> NDArray[np.int64]:
    if not mask:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(_as_bool(mask, n)).astype(np.int64)


def cut_bytes(problem: Problem, downset: int) -> float:
    """O of a downset: the output bytes of its augmented antichain (what crosses the cut)."""
    anc = problem.ancestor_masks()
    succ = problem.successor_masks()
    leak = _leaks(problem, anc, succ)
    top = sum(1 << v for v in _bits(downset) if not succ[v] & downset)
    aug = top
    for x in _bits(top):
        aug |= leak[x]
    out = problem.outputs()
    return float(sum(out[v] for v in _bits(aug)))
